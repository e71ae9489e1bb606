"""int8/int4 step models (issue 13, deliverable 8): the projections of the step model quantized by
the full-sequence forms' pass, with the same metadata, and held step by step to the quantized
error model (prefill, then single-token steps, against the reference's float full forward); a
fault in a quantized initializer fails it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from attnx.errors import UsageError
from attnx.export import build_step_model
from attnx.model.config import AttentionConfig
from attnx.model.contract import DTYPE_KEY, IO_DTYPE_KEY, QUANT_KEY, describe
from attnx.model.tolerance import problem_size
from attnx.model.weights import init_weights
from attnx.runtimes import ModelSource
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.decode import empty_cache, make_decode_inputs, run_buffer_parity, run_decode_parity
from attnx.workflows._export import export_model

GQA = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, key_padding_mask=True, kv_cache=True)
PLAIN = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True)  # the buffer form's
STEPS = {"prefills": (0, 5), "steps": 4, "batch": 2}


@pytest.fixture(scope="module")
def step_models(tmp_path_factory):
    """step_models(config, attention, form, dtype) -> path: exported (and so validated), cached."""
    root = tmp_path_factory.mktemp("quant-step")
    cache: dict = {}

    def get(config, attention, form, dtype):
        key = (id(config), attention, form, dtype)
        if key not in cache:
            cache[key] = str(root / f"{len(cache)}-{attention}-{form}-{dtype}.onnx")
            export_model(config, cache[key], init_weights(config, 0), attention=attention, dtype=dtype,
                         decode_form=form)  # fmt: skip
        return cache[key]

    return get


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("attention", ["decomposed", "onnx", "ort-fused"])
def test_growing_form_decode_parity(step_models, attention, dtype):
    path = step_models(GQA, attention, "growing", dtype)
    meta = describe(path).metadata
    record = json.loads(meta[QUANT_KEY])  # the full-sequence forms' record, every projection found
    assert meta[DTYPE_KEY] == dtype and meta[IO_DTYPE_KEY] == "fp32" and record["dtype"] == dtype
    assert sorted(record["projections"]) == ["k", "out", "q", "v"]
    openvino = backend_unavailable_reason("openvino") is None and attention != "ort-fused"  # its fused step: refused
    runtimes = ["ort-cpu", "openvino"] if openvino else ["ort-cpu"]
    report = run_decode_parity(ModelSource(GQA, init_weights(GQA, 0), path, dtype), [*runtimes, "torch"], **STEPS)
    assert report.passed, [c.reason for c in report.cases if c.status != "pass"]
    assert all(c.dtype == "fp32" for c in report.cases if c.backend == "torch")  # the float module, fp32's rule
    for backend in runtimes:  # openvino: its own quantization of the inputs, its own tolerance rows
        cases = [c for c in report.cases if c.backend == backend]
        assert [c.prefill for c in cases] == [0, 5] and all(c.dtype == dtype and c.status == "pass" for c in cases)
        # the quantization is really there: far above float32's error, far below 100%
        assert all(1e-4 < c.rel_rms < (0.05 if dtype == "int8" else 0.3) for c in cases), backend


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_buffer_form_decode_parity(step_models, dtype):
    """The buffer form's packed q/k/v MatMul is one quantized projection ("qkv")."""
    path = step_models(PLAIN, "ort-fused", "buffer", dtype)
    assert sorted(json.loads(describe(path).metadata[QUANT_KEY])["projections"]) == ["out", "qkv"]
    report = run_buffer_parity(ModelSource(PLAIN, init_weights(PLAIN, 0), path, dtype), "ort-cpu", **STEPS)
    assert report.passed and len(report.cases) == 2, [c.reason for c in report.cases]
    assert all(1e-4 < c.rel_rms < (0.05 if dtype == "int8" else 0.3) for c in report.cases)


@pytest.mark.parametrize("core", ["grouped-mha", "switch"])
def test_buffer_form_cores_quantized(tmp_path, core):
    """int8 projections outside the core: the grouped and auto cores (an If whose branches read the
    quantized qkv projection's output) decode as the default core does."""
    path = str(tmp_path / "buffer.onnx")
    onnx.save(build_step_model(PLAIN, init_weights(PLAIN, 0), "ort-fused", "buffer", "int8", buffer_core=core), path)
    assert sorted(json.loads(describe(path).metadata[QUANT_KEY])["projections"]) == ["out", "qkv"]
    report = run_buffer_parity(ModelSource(PLAIN, init_weights(PLAIN, 0), path, "int8"), "ort-cpu", **STEPS)
    assert report.passed and len(report.cases) == 2, [c.reason for c in report.cases]


def _scale_times_two(path, out, role):
    model = onnx.load(path)
    node = next(n for n in model.graph.node if n.name.startswith(f"{role}_proj"))
    scale = next(i for i in model.graph.initializer if i.name == node.input[2])
    scale.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(scale) * 2).astype(np.float32), scale.name))
    onnx.save(model, out)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("role", ["v", "k"])
def test_scale_fault_fails(step_models, tmp_path, dtype, role):
    """Scales x2 on v's (or k's) quantized weights: y, or the cache itself, leaves the error model."""
    bad = str(tmp_path / "bad.onnx")
    _scale_times_two(step_models(GQA, "ort-fused", "growing", dtype), bad, role)
    report = run_decode_parity(ModelSource(GQA, init_weights(GQA, 0), bad, dtype), ["ort-cpu"], **STEPS)
    assert [c.status for c in report.cases] == ["fail", "fail"]


def test_buffer_form_scale_fault_fails(step_models, tmp_path):
    bad = str(tmp_path / "bad.onnx")
    _scale_times_two(step_models(PLAIN, "ort-fused", "buffer", "int8"), bad, "qkv")
    report = run_buffer_parity(ModelSource(PLAIN, init_weights(PLAIN, 0), bad, "int8"), "ort-cpu", **STEPS)
    assert [c.status for c in report.cases] == ["fail", "fail"]


def test_quantized_decode_parity_needs_the_quantized_file(step_models):
    with pytest.raises(UsageError, match="needs the quantized step model"):
        run_decode_parity(ModelSource(GQA, init_weights(GQA, 0), None, "int8"), ["ort-cpu"], **STEPS)
    fp32 = step_models(GQA, "ort-fused", "growing", "fp32")
    with pytest.raises(UsageError, match="is not an int8 model"):
        run_decode_parity(ModelSource(GQA, init_weights(GQA, 0), fp32, "int8"), ["ort-cpu"], **STEPS)


def test_problem_size_of_a_step_masks_over_positions():
    """The error model's statistics of a step (past P, S new tokens) equal those of the full
    forward's last S queries: the keys/values of past and new tokens, key j hidden from query i
    when j > P + i, and the key padding mask over total_seq."""
    c, w = GQA, init_weights(GQA, 0)
    feeds = make_decode_inputs(c, 2, 9, seed=3)
    pk, pv = empty_cache(c, 2)
    full = problem_size(c, w, {**feeds, "past_key": pk, "past_value": pv}, activations=True)
    x = feeds["x"]
    k = (x[:, :6] @ w["k_proj.weight"].T + w["k_proj.bias"]).reshape(2, 6, 2, -1).transpose(0, 2, 1, 3)
    v = (x[:, :6] @ w["v_proj.weight"].T + w["v_proj.bias"]).reshape(2, 6, 2, -1).transpose(0, 2, 1, 3)
    step = problem_size(c, w, {"x": x[:, 6:], "past_key": k, "past_value": v, "key_padding_mask":
                               feeds["key_padding_mask"]}, activations=True)  # fmt: skip
    assert step.k == full.k and step.score_rms > 0
    # z (the attention output) of the last 3 queries: the full forward's, recomputed by hand (a
    # causal mask without the past offset would hide keys 1..8 from the step's first query)
    z_full = _z(c, w, feeds)[:, 6:]
    rms, lo, hi, row_peak = step.activation("z")
    assert rms == pytest.approx(float(np.sqrt(np.mean(z_full.astype(np.float64) ** 2))), rel=1e-5)
    assert (lo, hi) == pytest.approx((float(z_full.min()), float(z_full.max())), rel=1e-5)
    peaks = np.abs(z_full.astype(np.float64)).max(axis=-1)  # each query's largest |z|: int8's row scale
    assert row_peak == pytest.approx(float(np.sqrt(np.mean(peaks**2))), rel=1e-5)
    # x: the step's own new tokens
    assert step.activation("x")[0] == pytest.approx(float(np.sqrt(np.mean(x[:, 6:].astype(np.float64) ** 2))))


def _z(c, w, feeds):
    """The attention output over every position, float64, straight from the formula."""
    x = feeds["x"].astype(np.float64)
    B, T = x.shape[:2]
    q = (x @ w["q_proj.weight"].T + w["q_proj.bias"]).reshape(B, T, c.n_heads, -1).transpose(0, 2, 1, 3)
    k = (x @ w["k_proj.weight"].T + w["k_proj.bias"]).reshape(B, T, c.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = (x @ w["v_proj.weight"].T + w["v_proj.bias"]).reshape(B, T, c.n_kv_heads, -1).transpose(0, 2, 1, 3)
    hidden = np.triu(np.ones((T, T), bool), 1)[None] | feeds["key_padding_mask"][:, None, :]
    z = np.zeros((B, c.n_heads, T, c.v_head_dim))
    for n in range(c.n_heads):
        s = q[:, n] @ k[:, n // c.group_size].transpose(0, 2, 1) * c.softmax_scale
        s = np.where(hidden, -np.inf, s)
        peak = np.max(s, -1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(peak), peak, 0))
        tot = p.sum(-1, keepdims=True)
        z[:, n] = np.where(tot > 0, p / np.where(tot > 0, tot, 1), 0) @ v[:, n // c.group_size]
    return z.transpose(0, 2, 1, 3).reshape(B, T, -1)


def test_build_step_model_int8_weights_only_change():
    """Quantizing leaves the step model's I/O and the attention core as they were."""
    w = init_weights(PLAIN, 0)
    f32, q8 = (
        build_step_model(PLAIN, w, "ort-fused", "buffer"),
        build_step_model(PLAIN, w, "ort-fused", "buffer", "int8"),
    )
    assert [i.name for i in f32.graph.input] == [i.name for i in q8.graph.input]
    assert [o.name for o in f32.graph.output] == [o.name for o in q8.graph.output]
    assert q8.ir_version == f32.ir_version
    ops, before = [n.op_type for n in q8.graph.node], [n.op_type for n in f32.graph.node]
    assert ops.count("DynamicQuantizeMatMul") == 2 and "MatMul" not in ops and before.count("MatMul") == 2
    core = {"MultiHeadAttention", "GroupQueryAttention"} & set(before)
    assert core and core <= set(ops) and set(before) - {"MatMul"} <= set(ops)  # the rest as it was


@pytest.mark.parametrize(("config", "dtype", "form", "core"), [(GQA, "int8", "growing", "gqa"),
                                                                (PLAIN, "int4", "buffer", "switch")])  # fmt: skip
def test_quantized_step_package(tmp_path, capsys, config, dtype, form, core):
    """attnx build --dtype int8|int4 of a step model: the quantized model, its decode parity and the
    golden decode replayed by verify under the quantized error model (the manifest's quantization);
    a golden step off by the bound's scale fails the replay."""
    import hashlib

    from attnx.cli import main
    from attnx.runtimes.package import verify_package
    from attnx.workflows import write_npz

    cfg = tmp_path / "kv.json"
    cfg.write_text(config.to_json())
    out = tmp_path / "pkg"
    args = ["build", "--config", str(cfg), "--dtype", dtype, "--attention", "ort-fused", "--decode-form", form,
            "--buffer-core", core, "--provider", "cpu", "--out", str(out)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == dtype and manifest["quantization"]["bits"] == {"int8": 8, "int4": 4}[dtype]
    assert manifest["golden"][0]["problem_size"]["activations"]  # the error model's input statistics
    report = verify_package(out)
    checks = [c for c in report.checks if c.name.startswith("golden-decode-0.npz ")]
    assert report.passed and len(checks) == 3 and all(c.stats["max_abs"] > 1e-4 for c in checks)  # int error, not fp32's
    with np.load(out / "golden-decode-0.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["y"][:, -1] += 3 * checks[0].stats["atol"]  # the last step, 3x its bound away
    write_npz(out / "golden-decode-0.npz", arrays)
    data = (out / "golden-decode-0.npz").read_bytes()
    manifest["files"]["golden-decode-0.npz"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (out / "manifest.json").write_text(text)
    (out / "manifest.sha256").write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  manifest.json\n")
    failed = [c.name for c in verify_package(out).checks if not c]
    assert failed == ["golden-decode-0.npz y"]
