"""The `openvino` backend (OpenVINO's own runtime on attnx's ONNX graphs) and the bf16 runs:
the torch module in bfloat16 and OpenVINO's bf16 precision hint on the fp32 graph."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from attnx.errors import ProviderUnavailable, UsageError
from attnx.model import contract, reference_attention
from attnx.model.contract import IR_VERSION
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.compare import compare_arrays
from attnx.runtimes.parity import run_parity
from tests.conftest import CONFIGS, weights_for

needs_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino") is None, reason="openvino is not installed (pip install 'attnx[openvino]')"
)
MATRIX = {"batches": (1, 3), "seqs": (1, 7, 128)}


def _lowered(exported, tmp_path, name: str, attention: str) -> str:
    """`name` in lowering `attention`: the shared export, or written from the registry."""
    if attention in ("decomposed", "onnx", "ort-fused"):
        return exported(name, attention)
    from attnx.workflows import lower

    result = lower(CONFIGS[name], weights_for(name), attention=attention)
    assert result.lowering == attention
    path = str(tmp_path / f"{name}-{attention}.onnx")
    onnx.save(result.model, path)
    return path


@needs_openvino
@pytest.mark.parametrize("name", list(CONFIGS))
def test_openvino_passes_the_parity_matrix_in_fp32_and_bf16(exported, name):
    """Self, cross, causal, key padding (a fully masked row in every batch of 3), v_head_dim !=
    head_dim: OpenVINO f32 under the fp32 row and OpenVINO bf16 (on the same fp32 graph) beside
    the torch module in bfloat16 under the bf16 row; ort-cpu has no bf16 form and says so. The
    matrix's order (seq 1, 7, then 128 on one runner) is what OpenVINO's runtime cache gets wrong
    on plain self-attention (the runner's doc): with the cache on, "self" fails here."""
    config = CONFIGS[name]
    mem = {"mem_seqs": (5,)} if config.cross else {}
    path = exported(name)
    fp32 = run_parity(ModelSource(config, weights_for(name), path), ["openvino"], **MATRIX, **mem)
    assert fp32.passed, [c.reason for c in fp32.cases if c.status != "pass"]
    assert {(c.dtype, c.precision) for c in fp32.cases} == {("fp32", "fp32")}
    bf16 = run_parity(ModelSource(config, weights_for(name), path, "bf16"), ["torch", "openvino", "ort-cpu"],
                      **MATRIX, **mem)  # fmt: skip
    assert bf16.passed, [c.reason for c in bf16.cases if c.status == "fail"]
    by = {b: [c for c in bf16.cases if c.backend == b] for b in ("torch", "openvino", "ort-cpu")}
    if by["openvino"][0].status == "skipped":  # a CPU without bf16 instructions: OpenVINO compiles f32
        assert "cannot run in bf16 here" in by["openvino"][0].reason
        del by["openvino"]
    for backend in ("torch", "openvino"):
        if backend not in by:
            continue
        assert {(c.status, c.dtype, c.precision) for c in by[backend]} == {("pass", "bf16", "bf16")}
        # really bf16: at the largest case the error is beyond what the fp32 row allows
        worst = max(by[backend], key=lambda c: c.max_abs)
        assert worst.max_abs > worst.atol * tolerance_for("fp32").rtol / tolerance_for("bf16").rtol
    assert {c.status for c in by["ort-cpu"]} == {"skipped"}
    assert "no bf16 form" in by["ort-cpu"][0].reason


@needs_openvino
@pytest.mark.parametrize("attention", ["decomposed", "onnx", "ort-fused", "ort-fused-packed", "ort-attention"])
def test_openvino_reads_every_lowering(exported, tmp_path, attention):
    name = "kpm"
    config, weights = CONFIGS[name], weights_for(name)
    with create_runner("openvino", ModelSource(model_path=_lowered(exported, tmp_path, name, attention))) as r:
        assert r.lowering == attention and r.precision == "fp32"
        for i, (batch, seq) in enumerate([(3, 7), (2, 33)]):
            feeds = make_inputs(config, batch, seq, seed=i)
            y = r.run(feeds)["y"]
            cmp = compare_arrays("y", y, reference_attention(config, weights, **feeds), tolerance_for("fp32"),
                                 problem_size(config, weights, feeds))  # fmt: skip
            assert cmp, cmp


@needs_openvino
def test_precision_and_threads_are_set_and_read_back(exported):
    import openvino as ov

    path = exported("kpm")
    # This machine's default may be bf16 (AMX, AVX-512 BF16): the runner never takes it.
    with create_runner("openvino", ModelSource(model_path=path), threads=1) as r:
        assert r.precision == "fp32"
        assert r.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
        assert int(r.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 32  # set, whatever the default
        assert int(r.compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    runner = create_runner("openvino", ModelSource(model_path=path), precision="bf16")
    try:
        runner.load()
        assert runner.precision == "bf16" and runner.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.bf16
    except ProviderUnavailable as e:  # a CPU without bf16 compute (AVX2 only): OpenVINO compiles f32, refused
        assert "cannot run in bf16 here" in str(e) and "computes in fp32" in str(e)
    finally:
        runner.close()
    # fp16: where the CPU has no float16 compute OpenVINO compiles bf16 (or f32 without bf16), refused
    runner = create_runner("openvino", ModelSource(model_path=path), precision="fp16")
    try:
        runner.load()
        assert runner.precision == "fp16"
    except ProviderUnavailable as e:
        assert "cannot run in fp16 here" in str(e) and ("computes in bf16" in str(e) or "computes in fp32" in str(e))
    finally:
        runner.close()


@needs_openvino
def test_a_compiled_precision_that_differs_is_an_error(exported):
    import openvino as ov

    runner = create_runner("openvino", ModelSource(model_path=exported("kpm")))
    runner.load()

    class Compiled:  # what a plugin that ignored the hint would report
        def get_property(self, key):
            return ov.Type.bf16

    real, runner.compiled = runner.compiled, Compiled()
    with pytest.raises(ProviderUnavailable, match=r"cannot run in fp32 here: asked INFERENCE_PRECISION_HINT=f32, "
                                                  r"the compiled model computes in bf16"):  # fmt: skip
        runner.check_compiled()

    class OtherGroups:  # the precision asked for, but its own groups for the quantized inputs
        def get_property(self, key):
            return {"INFERENCE_PRECISION_HINT": ov.Type.f32, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 64}[key]

    runner.compiled = OtherGroups()
    with pytest.raises(ProviderUnavailable, match=r"asked DYNAMIC_QUANTIZATION_GROUP_SIZE=32, the compiled model uses 64"):
        runner.check_compiled()
    runner.compiled = real
    runner.close()


@needs_openvino
def test_a_model_openvino_cannot_read_names_the_lowering(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])
    node = helper.make_node("NoSuchAttention", ["x"], ["y"], domain="attnx.test")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]), ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("attnx.test", 1)])  # fmt: skip
    path = tmp_path / "unknown.onnx"
    onnx.save(model, path)
    with pytest.raises(
        ProviderUnavailable, match=r"cannot run the decomposed lowering: OpenVINO .*: .*NoSuchAttention"
    ):
        create_runner("openvino", ModelSource(model_path=str(path))).load()


@needs_openvino
def test_ort_attention_with_a_custom_scale_is_refused(exported, tmp_path):
    """OpenVINO 2026.4.1 ignores com.microsoft.Attention's scale: causal_kpm (scale 0.2) would be
    off by 0.1, so that model is refused by name; its ort-fused lowering runs."""
    path = _lowered(exported, tmp_path, "causal_kpm", "ort-attention")
    with pytest.raises(ProviderUnavailable, match=r"ort-attention lowering of this model: OpenVINO ignores "
                                                  r"com.microsoft.Attention's scale attribute \(0.2 here"):  # fmt: skip
        create_runner("openvino", ModelSource(model_path=path)).load()
    report = run_parity(ModelSource(CONFIGS["causal_kpm"], weights_for("causal_kpm"), exported("causal_kpm", "ort-fused")),
                        ["openvino"], batches=(3,), seqs=(7,))  # fmt: skip
    assert report.passed


def test_options_are_checked_before_loading():
    with pytest.raises(UsageError, match=r"computes in fp32, bf16, fp16 .* not 'int8'"):
        create_runner("openvino", ModelSource(model_path="m.onnx"), precision="int8")
    with pytest.raises(UsageError, match="threads must be a positive integer"):
        create_runner("openvino", ModelSource(model_path="m.onnx"), threads=0)
    # a quantized form runs in fp32 (its float part): a bf16 core on it has no tolerance row
    with pytest.raises(UsageError, match=r"runs attnx's int8 form in fp32 \(its float part\), not bf16"):
        create_runner("openvino", ModelSource(model_path="m.onnx", dtype="int8"), precision="bf16")
    # a parity run in a dtype openvino has no form for: skipped with the reason, not an error
    runner = create_runner("openvino", ModelSource(model_path="m.onnx", dtype="fp64"))
    if backend_unavailable_reason("openvino") is None:
        with pytest.raises(ProviderUnavailable, match="has no fp64 form: it computes in fp32, bf16, fp16"):
            runner.load()


def test_without_openvino_the_backend_is_skipped_with_the_extra(exported, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "openvino" else real(n, *a))
    reason = backend_unavailable_reason("openvino")
    assert "openvino is not installed" in reason and "attnx[openvino]" in reason
    report = run_parity(ModelSource(CONFIGS["self"], weights_for("self"), exported("self")), ["openvino", "ort-cpu"],
                        batches=(1,), seqs=(3,))  # fmt: skip
    assert report.passed and {c.backend: c.status for c in report.cases} == {"openvino": "skipped", "ort-cpu": "pass"}


def test_torch_bf16_takes_float32_feeds_and_returns_float32(exported):
    config, weights = CONFIGS["cross_kpm"], weights_for("cross_kpm")
    feeds = make_inputs(config, 3, 7, 5)
    with create_runner("torch", ModelSource(config, weights, None, "bf16")) as r:
        assert {p.dtype for p in r.module.parameters()} == {__import__("torch").bfloat16}
        assert [s.dtype for s in r.inputs] == ["fp32", "fp32", "bool"] and r.precision == "bf16"
        y = r.run(feeds)["y"]
    assert y.dtype == np.float32
    ref = reference_attention(config, weights, **feeds)
    size = problem_size(config, weights, feeds)
    assert compare_arrays("y", y, ref, tolerance_for("bf16"), size)
    assert not compare_arrays("y", y, ref, tolerance_for("fp32"), size)  # computed in bf16, not float32


@needs_openvino
def test_cli_parity_in_bf16_lists_what_each_backend_computed_in(tmp_path, capsys):
    from attnx.cli import main

    out = tmp_path / "p.json"
    argv = ["parity", "--preset", "tiny", "--dtype", "bf16", "--backends", "reference,torch,ort-cpu,openvino",
            "--batch", "3", "--seq", "7", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    cases = {c["backend"]: c for c in __import__("json").loads(out.read_text())["cases"]}
    if cases["openvino"]["status"] == "skipped":  # a CPU without bf16 compute: the refusal is the skip's reason
        assert "cannot run in bf16 here" in cases["openvino"]["reason"] and "computed in: torch bf16" in printed
    else:
        assert "computed in: torch bf16, openvino bf16" in printed
        assert cases["openvino"]["precision"] == "bf16" and cases["openvino"]["dtype"] == "bf16"
    assert "skipped ort-cpu: " in printed
    assert cases["reference"]["status"] == "pass"  # the reference is still checked against torch in float64


def test_the_contract_names_runtime_dtypes_and_model_file_backends():
    assert contract.RUNTIME_DTYPES == ("bf16",) and contract.OPENVINO in contract.BACKEND_NAMES
    assert contract.graph_dtype("bf16") == "fp32" and contract.graph_dtype("fp16") == "fp16"
    assert contract.host_dtype("bf16") == "fp32" and contract.host_dtype("fp16") == "fp16"
    assert [b for b in contract.BACKEND_NAMES if contract.runs_onnx_model(b)] == ["ort-cpu", "ort-cuda", "openvino"]
