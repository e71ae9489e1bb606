"""The int8 and int4 forms: the pass replaces the four projections (found by the names every attnx graph
gives their weights), records its parameters in the metadata, and the probe still reads the lowering and
the weights of a quantized model."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from attnx.errors import UsageError
from attnx.export import build_model, export_onnx, qk_weights, save_model, v_weights
from attnx.export.passes import convert_precision
from attnx.export.passes.quantize import INT8_WEIGHT_MAX
from attnx.model.contract import IR_VERSION, MS_DOMAIN, QUANT_KEY, describe
from attnx.runtimes import ModelSource, create_runner
from attnx.workflows import export_model
from tests.conftest import CONFIGS, weights_for

OPS = {"int8": f"{MS_DOMAIN}.DynamicQuantizeMatMul", "int4": f"{MS_DOMAIN}.MatMulNBits"}


def quantize(name, attention, dtype, tmp_path, **options):
    """`name` in `attention` and `dtype`: the torch export and its passes (decomposed), or written from
    the registry (attnx.export.build_model); saved, its path."""
    config, weights = CONFIGS[name], weights_for(name)
    if attention == "decomposed":
        model = convert_precision(export_onnx(config, weights), dtype, **options).model
    else:
        model = ir.from_proto(build_model(config, weights, attention, "full", dtype, **options))
    out = str(tmp_path / f"{name}-{attention}-{dtype}.onnx")
    save_model(model, out)
    return out


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("key", [("cross_kpm", "ort-fused"), ("causal", "decomposed")])
def test_the_four_projections_are_quantized_and_recorded(key, dtype, tmp_path):
    name, attention = key
    path = quantize(name, attention, dtype, tmp_path)
    info = describe(path)
    assert info.lowering == attention  # the probe reads the core of a quantized graph
    assert info.dtype == dtype and info.io_dtype == "fp32"
    assert info.operators[OPS[dtype]] == 4
    assert info.operators.get("MatMul", 0) == (2 if attention == "decomposed" else 0)  # q.k and p.v stay float
    assert info.ir_version == IR_VERSION and info.opsets[MS_DOMAIN] == 1
    record = json.loads(info.metadata[QUANT_KEY])
    assert record["dtype"] == dtype and record["op"] == OPS[dtype]
    assert set(record["projections"]) == {"q", "k", "v", "out"}
    assert record["block_size"] == (32 if dtype == "int4" else None)
    assert record["per_channel"] == (dtype == "int8")
    assert info.quantization == record and "quantization" in info.to_dict()
    # int8's row scales: one per distinct projection input (x, memory for cross-attention, z)
    inputs = 3 if CONFIGS[name].cross else 2
    row_maxes = [n for n in ir.load(path).graph if n.op_type == "ReduceMax" and n.outputs[0].name.endswith("/row_max")]
    assert len(row_maxes) == (inputs if dtype == "int8" else 0)
    assert ("per row" in record["activations"]) == (dtype == "int8")
    with create_runner("ort-cpu", ModelSource(model_path=path, dtype=dtype)) as runner:  # loads in the pinned ORT
        assert runner.inputs[0].dtype == "fp32"


def test_int8_quantizes_each_row_of_its_input_on_its_own_scale(tmp_path):
    """A token 1000x larger than the rest leaves their error as it was: the input is quantized per
    row (per tensor, the large row's range would round every other row to a few steps)."""
    k, n = 64, 32
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n)).astype(np.float32) / 8
    x = ir.Value(name="x", shape=ir.Shape([2, 5, k]), type=ir.TensorType(ir.DataType.FLOAT))
    weight = ir.Value(name="q_proj.weight.T", shape=ir.Shape([k, n]), type=ir.TensorType(ir.DataType.FLOAT),
                      const_value=ir.tensor(w, name="q_proj.weight.T"))  # fmt: skip
    node = ir.node("MatMul", [x, weight], name="proj")
    node.outputs[0].name, node.outputs[0].shape = "y", ir.Shape([2, 5, n])
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=[weight], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=IR_VERSION)
    from attnx.export.passes import QuantizeProjections

    QuantizeProjections("int8")(model)
    path = str(tmp_path / "one.onnx")
    save_model(model, path)
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = rng.standard_normal((2, 5, k)).astype(np.float32)
    feed[0, 2] *= 1000  # one loud token
    feed[1, 4] = 0  # and a silent one: 0 / FLT_MIN, not a NaN
    y = session.run(None, {"x": feed})[0]
    ref = feed.astype(np.float64) @ w
    rel = np.sqrt(np.mean((y - ref) ** 2, axis=-1) / np.maximum(np.mean(ref**2, axis=-1), 1e-300))
    assert np.all(np.isfinite(y)) and np.all(y[1, 4] == 0)
    quiet = np.delete(rel.reshape(-1), [2, 9])  # every other row keeps int8's ~1% error
    assert rel[0, 2] < 0.05 and quiet.max() < 0.05, rel


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_dequantized_weights_are_within_half_a_step(dtype, tmp_path):
    """The probe reads the weights a quantized node computes with: every one within half its
    step of the float weight (the error model's premise), and the recorded step is the scales'."""
    name = "cross_kpm"  # kv_dim 40: int4's last block of k and v is padded
    path = quantize(name, "ort-fused", dtype, tmp_path, block_size=16)
    model = ir.load(path)
    got = {**qk_weights(model), **v_weights(model)}
    record = json.loads(model.metadata_props[QUANT_KEY])
    want = weights_for(name)
    for role in ("q", "k", "v"):
        w, ref = got[f"{role}_proj.weight"], want[f"{role}_proj.weight"]
        assert w.shape == ref.shape
        err = np.abs(w - ref)
        step = record["projections"][role]["step_rms"]
        assert 0 < err.max() and float(np.sqrt(np.mean(err**2))) <= step / np.sqrt(12) * 1.3
        limit = np.abs(ref).max(axis=1, keepdims=True) / INT8_WEIGHT_MAX if dtype == "int8" else None
        if limit is not None:
            assert (err <= limit / 2 * (1 + 1e-5)).all()


def test_int4_parameters_are_recorded_and_checked(tmp_path):
    path = quantize("self", "ort-fused", "int4", tmp_path, block_size=16, accuracy_level=0)
    record = describe(path).quantization
    assert (record["block_size"], record["accuracy_level"], record["activations"]) == (16, 0, "none")
    with pytest.raises(UsageError, match="block-size"):
        quantize("self", "ort-fused", "int4", tmp_path, block_size=24)


def test_bf16_is_refused_saying_where_it_runs(tmp_path):
    with pytest.raises(UsageError, match="OpenVINO") as e:
        export_model(CONFIGS["self"], tmp_path / "m.onnx", dtype="bf16")
    assert "fp32" in str(e.value) and not (tmp_path / "m.onnx").exists()


def test_ort_attention_is_not_quantized():
    """com.microsoft Attention holds its q/k/v weights: the registry builds it in float only."""
    with pytest.raises(UsageError, match="com.microsoft.Attention .* is not built in int8"):
        build_model(CONFIGS["self"], weights_for("self"), "ort-attention", "full", "int8")
