"""Export of the modern-LLM layers: the decomposed full-sequence graph with a position_ids input, its
metadata and describe(); what a lowering cannot express refused by name before any work (exit 2 on
the CLI). The onnx and ort-fused graphs: tests/export/test_llm_lowerings.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from attnx.cli import main
from attnx.errors import UsageError
from attnx.export import build_model, export_onnx
from attnx.export.passes import convert_precision
from attnx.model import reference_attention
from attnx.model.contract import describe
from attnx.model.inputs import make_inputs
from attnx.workflows import export_model
from tests.conftest import LLM_CONFIGS, weights_for


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name", [n for n, c in LLM_CONFIGS.items() if c.rope is not None])
def test_llm_export_takes_position_ids_and_describes_itself(exported, name):
    config = LLM_CONFIGS[name]
    path = exported(name)
    proto = onnx.load(path)
    inputs = {v.name: (v.type.tensor_type.elem_type, _dims(v)) for v in proto.graph.input}
    assert inputs["position_ids"] == (onnx.TensorProto.INT64, ["batch", "seq"])
    assert list(inputs) == [s.name for s in config.inputs()]
    info = describe(path)
    assert info.config == config and info.lowering == "decomposed"
    shown = info.to_dict()["config"]  # what `attnx inspect` prints
    assert shown["rope"] == config.rope.to_dict()
    assert {k: shown[k] for k in ("sliding_window", "softcap", "sinks")} == {
        "sliding_window": config.sliding_window, "softcap": config.softcap, "sinks": config.sinks}  # fmt: skip
    ops = {n.op_type for n in proto.graph.node}
    assert {"Cos", "Sin", "Softmax"} <= ops and "Attention" not in ops
    # the positions are read per element: a left-padded batch element matches the reference
    feeds = make_inputs(config, 3, 10, seed=3, position_offset=100)
    (y,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(["y"], feeds)
    ref = reference_attention(config, weights_for(name), **feeds)
    assert np.abs(y - ref).max() < 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention": "onnx"}, r"Attention \(opset 23\) does not express sinks"),
        ({"attention": "ort-fused"}, r"GroupQueryAttention needs a head_dim that is a multiple of 8"),
        ({"dtype": "bf16", "kv_cache": True}, "--dtype bf16: no attnx graph computes in bfloat16"),
        ({"dtype": "fp16", "kv_cache": True, "attention": "decomposed", "keep_io_fp32": True},
         "--keep-io-fp32 is for the full-sequence model"),
        ({"dtype": "bf16"}, "--dtype bf16"),
        ({"kv_cache": True, "attention": "ort-fused"}, "a multiple of 8"),
        ({"kv_cache": True, "attention": "onnx"}, r"Attention \(opset 23\) does not express sinks"),
        ({"kv_cache": True, "attention": "measure"}, "--attention measure does not measure step models"),
    ],
)
def test_other_forms_are_refused_before_any_work(tmp_path, change, message):
    config = LLM_CONFIGS["llm"]
    if change.pop("kv_cache", False):
        config = dataclasses.replace(config, kv_cache=True)
    out = tmp_path / "m.onnx"
    with pytest.raises(UsageError, match=message):
        export_model(config, out, **change)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_graph_layer_refuses_too(exported):
    config = LLM_CONFIGS["llama"]
    with pytest.raises(UsageError, match="is written by attnx.export.build_model"):
        export_onnx(config, attention="onnx")
    for attention in ("ort-fused-packed", "ort-attention"):
        with pytest.raises(UsageError, match=f"--attention {attention} cannot build .* does not express grouped_heads, rope"):
            build_model(config, weights_for("llama"), attention)
    half = convert_precision(ir.load(exported("llama")), "fp16").model  # its rotary angle kept float32
    assert half.metadata_props["attnx.dtype"] == "fp16"


def test_cli_refusal_exits_2(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(LLM_CONFIGS["llm"].to_dict()))
    assert main(["export", "--config", str(path), "--attention", "onnx", "--out", str(tmp_path / "m.onnx")]) == 2
    assert "Attention (opset 23) does not express sinks" in capsys.readouterr().err
