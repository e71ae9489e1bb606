"""attnx optimize of a model attnx wrote (a whole model with one block: attnx.workflows.optimize_model): what it
writes, what it prints, and its refusals (exit 1 nothing written, exit 2 on bad input)."""

from __future__ import annotations

import json
import os

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from attnx.cli import main
from attnx.export.passes import count_ops
from attnx.model import reference_attention
from attnx.model.contract import IR_VERSION
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays
from attnx.workflows import _optimize, optimize_model
from tests.conftest import CONFIGS, weights_for

MHA = "com.microsoft.MultiHeadAttention"


def _meta(path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def test_optimize_writes_a_fused_model_and_reports(exported, tmp_path, capsys):
    name = "causal_kpm"
    out = tmp_path / "fused.onnx"
    assert main(["optimize", exported(name), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "core mha: com.microsoft.MultiHeadAttention, written from the registry (causal, key_padding_mask)" in printed
    assert f"optimize PASSED: 1 of 1 block(s) rewritten; wrote {out}" in printed
    assert printed.count("pass: y[batch=") >= 3  # one proof against the input per shape
    assert onnx.load(str(out)).ir_version == IR_VERSION
    assert _meta(out)["attnx.attention"] == "ort-fused"
    assert count_ops(ir.load(str(out))).get(MHA) == 1
    # The written file, by path, agrees with the formula (batch 3's element 1: all keys hidden).
    import onnxruntime as ort

    config, weights = CONFIGS[name], weights_for(name)
    feeds = make_inputs(config, 3, 23, seed=4)
    (y,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(["y"], feeds)
    ref = reference_attention(config, weights, **feeds)
    assert compare_arrays("y", y, ref, tolerance_for("fp32"), problem_size(config, weights, feeds))


def _corrupt_q_weight(model) -> None:
    """As a faulty emitter would: scale the q projection's weight feeding the fused op."""
    from onnx import numpy_helper

    (weight,) = [t for t in model.graph.initializer if t.name == "q_proj.weight.T"]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.5, weight.name))


def _break_the_lowering(monkeypatch) -> None:
    """optimize writes its lowering with an emitter that now corrupts the model it returns."""
    real = _optimize.lower

    def faulty_lower(*args, **kwargs):
        result = real(*args, **kwargs)
        _corrupt_q_weight(result.model)
        return result

    monkeypatch.setattr(_optimize, "lower", faulty_lower)


def test_optimize_refuses_a_model_that_fails_parity(exported, tmp_path, capsys, monkeypatch):
    _break_the_lowering(monkeypatch)
    out = tmp_path / "broken.onnx"
    assert main(["optimize", exported("cross_kpm"), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "FAIL: y[" in printed and "optimize FAILED" in printed and "nothing written" in printed
    assert os.listdir(tmp_path) == []  # no OUT, no data file, no staging folder left behind


def test_optimize_api_reports_the_failed_proof_and_writes_nothing(exported, tmp_path, monkeypatch):
    _break_the_lowering(monkeypatch)
    report = optimize_model(exported("self"), str(tmp_path / "x.onnx"))
    assert not report.passed and not report.written
    assert any(not p and p.subject.startswith("y[") and p.needed_atol is not None for p in report.proofs)
    assert os.listdir(tmp_path) == []


def test_optimize_exits_2_on_a_file_that_is_not_an_onnx_model(tmp_path, capsys):
    bad = tmp_path / "notes.onnx"
    bad.write_bytes(b"this is not a protobuf \x00\xff\x13 at all")
    assert main(["optimize", str(bad), "--out", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert "is not an ONNX model" in err and "Traceback" not in err
    assert main(["optimize", str(tmp_path / "missing.onnx"), "--out", str(tmp_path / "o.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["notes.onnx"]


def test_optimize_exits_2_on_a_model_attnx_did_not_write_with_no_attention(tmp_path, capsys):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )  # fmt: skip
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, ir_version=IR_VERSION), str(path))
    assert main(["optimize", str(path), "--out", str(tmp_path / "o.onnx")]) == 2
    assert "no attention block found (a model attnx did not write" in capsys.readouterr().err
    assert not (tmp_path / "o.onnx").exists()


def test_optimize_exits_2_on_bad_output_paths(exported, tmp_path, capsys):
    src = exported("self")
    assert main(["optimize", src, "--out", src]) == 2
    assert "--out must differ from the input model" in capsys.readouterr().err
    assert main(["optimize", src, "--out", str(tmp_path / "no" / "such" / "o.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_optimize_cuda_unavailable_exits_2(exported, tmp_path, capsys):
    from attnx.errors import ProviderUnavailable
    from attnx.runtimes import ModelSource, create_runner

    try:
        with create_runner("ort-cuda", ModelSource(CONFIGS["self"], None, exported("self"))):
            pytest.skip("the CUDA execution provider works here")
    except ProviderUnavailable:
        pass
    assert main(["optimize", exported("self"), "--out", str(tmp_path / "o.onnx"), "--provider", "cuda"]) == 2
    assert "'ort-cuda' is unavailable" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_optimize_auto_fp16_records_choice(exported, tmp_path, capsys):
    out = tmp_path / "auto.onnx"
    args = ["optimize", exported("kpm"), "--out", str(out), "--attention", "measure", "--auto-seq", "16"]
    assert main([*args, "--dtype", "fp16", "--keep-io-fp32"]) == 0
    printed = capsys.readouterr().out
    assert "auto on cpu, batch 1 seq 16: chose" in printed
    meta = _meta(out)
    auto = json.loads(meta["attnx.auto"])
    assert meta["attnx.attention"] == auto["choice"] and meta["attnx.dtype"] == "fp16"
    assert auto["times_ms"] and all(s == "pass" or s.startswith(("fails", "not")) for s in auto["status"].values())
    proto = onnx.load(str(out))
    assert proto.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # fp32 I/O kept
    assert any(t.data_type == TensorProto.FLOAT16 for t in proto.graph.initializer)


def test_optimize_keeps_an_fp16_model_fp16_and_refuses_fp32(exported, tmp_path, capsys):
    src = exported("cross_kpm", "decomposed", "fp16")
    assert main(["optimize", src, "--out", str(tmp_path / "o.onnx"), "--dtype", "fp32"]) == 2
    assert "cannot be optimized back to fp32" in capsys.readouterr().err
    out = tmp_path / "f16.onnx"
    assert main(["optimize", src, "--out", str(out)]) == 0
    assert _meta(out)["attnx.attention"] == "ort-fused"
    assert onnx.load(str(out)).graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    printed = capsys.readouterr().out
    assert "written in the ort-fused lowering (fp16): core mha: com.microsoft.MultiHeadAttention" in printed


@pytest.mark.slow
def test_export_large_preset_ort_fused(tmp_path, capsys):
    """The issue's acceptance command: one MultiHeadAttention node, any batch and length."""
    import onnxruntime as ort

    from attnx.model import init_weights, preset

    out = tmp_path / "m.onnx"
    assert main(["export", "--preset", "large", "--attention", "ort-fused", "--out", str(out)]) == 0
    assert count_ops(ir.load(str(out))).get(MHA) == 1
    config, weights = preset("large"), init_weights(preset("large"), 0)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch, seq in [(1, 1), (2, 65)]:
        feeds = make_inputs(config, batch, seq, seed=seq)
        (y,) = session.run(["y"], feeds)
        ref = reference_attention(config, weights, **feeds)
        assert compare_arrays("y", y, ref, tolerance_for("fp32"), problem_size(config, weights, feeds))
