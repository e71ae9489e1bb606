"""The sweep's parts: the plan, the worker and its memory, the GEMM model, ratios, skips,
timeouts and Ctrl-C. Small models, short sequences, one thread, few repeats."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from attnx.bench import (
    BenchCase,
    BenchPlan,
    BenchReport,
    compare_lowerings,
    run_bench,
)
from attnx.bench._worker import run_spec, run_worker, time_stats, write_gemm_model
from attnx.errors import UsageError
from attnx.model import preset
from attnx.model.resources import estimate_case
from tests.conftest import CONFIGS

# the slow tier: benchmark runs
pytestmark = pytest.mark.slow

FAST = {"repeat": 2, "warmup": 1, "threads": 1}


# The plan --------------------------------------------------------------------------------------
def test_plan_series_default_and_filtered():
    plan = BenchPlan(CONFIGS["self"], backends=["torch", "ort-cpu"])
    assert plan.series() == [
        ("torch", "decomposed"), ("torch", "sdpa"),
        ("ort-cpu", "decomposed"), ("ort-cpu", "onnx"), ("ort-cpu", "ort-fused"),
    ]  # fmt: skip
    plan = BenchPlan(CONFIGS["self"], backends=["torch", "ort-cpu"], attentions=["sdpa", "onnx"])
    assert plan.series() == [("torch", "sdpa"), ("ort-cpu", "onnx")]


def test_plan_shapes_shortest_first_and_cross_memory_defaults_to_seq():
    assert BenchPlan(CONFIGS["self"], seqs=[64, 8], batches=[1, 2]).shapes() == [
        (1, 8, None), (2, 8, None), (1, 64, None), (2, 64, None)
    ]  # fmt: skip
    assert BenchPlan(CONFIGS["cross"], seqs=[4, 8]).shapes() == [(1, 4, 4), (1, 8, 8)]
    assert BenchPlan(CONFIGS["cross"], seqs=[4], mem_seqs=[3, 5]).shapes() == [(1, 4, 3), (1, 4, 5)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backends": ["tpu"]}, "unknown --backends value 'tpu'"),
        ({"backends": ["reference"]}, "unknown --backends value 'reference'"),
        ({"attentions": ["flash"]}, "unknown --attention value 'flash'"),
        ({"dtypes": ["int2"]}, "unknown --dtype value 'int2'"),
        ({"mem_seqs": [4]}, "--mem-seq is for cross-attention"),
        ({"seqs": []}, "--seq is empty"),
        ({"repeat": 0}, "--repeat"),
        ({"rounds": 0}, "--rounds"),
        ({"timeout_s": 0}, "--timeout must be positive"),
        ({"backends": ["torch"], "attentions": ["onnx"]}, "nothing to run"),
    ],
)
def test_plan_rejects_bad_values_with_one_clear_error(kwargs, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        BenchPlan(CONFIGS["self"], **kwargs).validate()


# Ratios and estimates ----------------------------------------------------------------------------
def _case(backend, attention, seq, median_ms, peak_mem_mb, first_ms=None):
    return BenchCase(
        backend, attention, "fp32", 1, seq, None, "ok", median_ms=median_ms, peak_mem_mb=peak_mem_mb, first_ms=first_ms
    )


def test_compare_lowerings_uses_the_better_torch_core_and_the_own_decomposed():
    cases = [
        _case("torch", "decomposed", 512, 40.0, 300.0),
        _case("torch", "sdpa", 512, 30.0, 280.0),
        _case("ort-cpu", "decomposed", 512, 15.0, 200.0),
        _case("ort-cpu", "ort-fused", 512, 10.0, 100.0),
        _case("ort-cpu", "decomposed", 8192, 8000.0, 9000.0, first_ms=20000.0),
        _case("ort-cpu", "ort-fused", 8192, 1000.0, 400.0, first_ms=1250.0),
        BenchCase("torch", "sdpa", "fp32", 1, 8192, None, "timeout"),
    ]
    ratios = {(r["seq"], r["baseline"]): r for r in compare_lowerings(cases)}
    assert set(ratios) == {(512, "torch eager"), (512, "ort-cpu/decomposed"), (8192, "ort-cpu/decomposed")}
    eager = ratios[(512, "torch eager")]
    assert eager["baseline_case"] == "torch/sdpa" and eager["speedup"] == pytest.approx(3.0)
    assert eager["memory_ratio"] == pytest.approx(2.8)
    long = ratios[(8192, "ort-cpu/decomposed")]
    assert long["speedup"] == pytest.approx(8.0) and long["memory_ratio"] == pytest.approx(22.5)
    assert long["first_call_speedup"] == pytest.approx(16.0)
    assert eager["first_call_speedup"] is None  # not measured: no ratio, not a made-up one


def test_first_call_is_the_first_warm_up_call_or_else_the_first_timed_one():
    stats = time_stats({"warmup_ms": [2000.0, 5000.0], "times_ms": [1100.0, 1000.0, 1200.0]})
    assert stats["first_ms"] == 2000.0 and stats["median_ms"] == 1100.0  # warm-up stays out of the median
    assert time_stats({"warmup_ms": [], "times_ms": [3.0, 1.0, 2.0]})["first_ms"] == 3.0  # --warmup 0


def test_estimate_matches_the_measured_peaks_of_the_cpu_baseline():
    # Measured on the large preset at seq 8192: decomposed 8.96 GB, Attention-23 8.7 GB,
    # MultiHeadAttention 0.38 GB peak RSS. The guard's estimate must be of that size.
    gb = 1024**3
    large = preset("large")
    assert 0.7 < estimate_case(large, "ort-cpu", "decomposed", 1, 8192, None, "fp32").total / (8.96 * gb) < 1.3
    assert 0.7 < estimate_case(large, "ort-cpu", "onnx", 1, 8192, None, "fp32").total / (8.7 * gb) < 1.3
    assert estimate_case(large, "ort-cpu", "ort-fused", 1, 8192, None, "fp32").total < 1 * gb


# The GEMM model and the worker -----------------------------------------------------------------
def test_gemm_model_is_a_real_matmul_at_attnx_ir_version(tmp_path):
    import onnx
    import onnxruntime as ort

    from attnx.model.contract import IR_VERSION

    path = str(tmp_path / "gemm.onnx")
    write_gemm_model(path, 8, 16, 4, "fp32")
    proto = onnx.load(path)
    assert proto.ir_version == IR_VERSION
    w = onnx.numpy_helper.to_array(proto.graph.initializer[0])
    a = np.random.default_rng(0).standard_normal((8, 16), dtype=np.float32)
    (y,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"a": a})
    np.testing.assert_allclose(y, a @ w, rtol=1e-5, atol=1e-5)


def gemm_spec(tmp_path, size: int, backend: str = "ort-cpu", repeat: int = 1, warmup: int = 0) -> dict:
    """A worker spec for a size^3 GEMM, its one-MatMul model written for the ort-* backends."""
    spec = {"kind": "gemm", "backend": backend, "dtype": "fp32", "m": size, "k": size, "n": size,
            "repeat": repeat, "warmup": warmup, "threads": 1}  # fmt: skip
    if backend.startswith("ort-"):
        spec["model_path"] = str(tmp_path / "gemm.onnx")
        write_gemm_model(spec["model_path"], size, size, size, "fp32")
    return spec


def test_worker_gemm_result(tmp_path):
    result = run_spec(gemm_spec(tmp_path, 32, repeat=3, warmup=2))
    assert result["status"] == "ok", result
    assert len(result["times_ms"]) == 3 and all(t > 0 for t in result["times_ms"])
    assert len(result["warmup_ms"]) == 2 and all(t > 0 for t in result["warmup_ms"])  # timed, kept apart
    assert result["threads"] == 1
    assert 0 < result["import_rss_mb"] <= result["load_rss_mb"] <= result["peak_rss_mb"]


def test_worker_reports_an_unavailable_backend_as_skipped_with_the_reason(tmp_path):
    result = run_spec(gemm_spec(tmp_path, 4, backend="ort-cuda"))
    if result["status"] == "ok":
        pytest.skip("the CUDA execution provider is usable here")
    assert result["status"] == "skipped" and "ort-cuda" in result["reason"]


def test_case_peak_memory_is_the_childs_own_not_the_parents(tmp_path):
    # Linux charges a child's ru_maxrss with the parent's RSS when it exec's from a vfork:
    # the worker must report its own high-water mark. Hold 400 MB here while it runs.
    ballast = np.ones(400 * 1024**2 // 8)
    result = run_worker(gemm_spec(tmp_path, 16), str(tmp_path), "gemm", timeout_s=120)
    assert result["status"] == "ok", result
    assert 10 < result["peak_rss_mb"] < 300  # onnxruntime and a 16x16 GEMM: tens of MB
    assert ballast.sum() > 0


def test_worker_past_its_budget_is_killed_and_reported_as_timeout(tmp_path):
    result = run_worker(
        gemm_spec(tmp_path, 4, backend="torch"), str(tmp_path), "slow", timeout_s=0.05
    )  # cannot even import torch in time
    assert result == {"status": "timeout", "reason": "ran past the 0.05 s budget per case (--timeout)"}


# Whole sweeps, small -------------------------------------------------------------------------------
def test_sweep_of_a_model_file_measures_ort_and_skips_torch_with_the_reason(exported, tmp_path):
    out = tmp_path / "b.json"
    plan = BenchPlan(CONFIGS["self"], backends=["ort-cpu", "torch"], seqs=[8, 16], model_path=exported("self"), **FAST)
    report = run_bench(plan, json_path=out)
    assert report.complete and not report.interrupted
    by = {(c.label, c.seq): c for c in report.cases}
    assert set(by) == {
        (label, seq) for label in ("ort-cpu/decomposed", "torch/decomposed", "torch/sdpa") for seq in (8, 16)
    }
    for seq in (8, 16):
        ort_case, torch_case = by[("ort-cpu/decomposed", seq)], by[("torch/sdpa", seq)]
        assert ort_case.status == "ok" and ort_case.attention == "decomposed" and ort_case.runs == 2
        assert ort_case.p10_ms <= ort_case.median_ms <= ort_case.p90_ms
        assert ort_case.first_ms == ort_case.warmup_ms[0] > 0 and len(ort_case.warmup_ms) == FAST["warmup"]
        assert ort_case.gflops == pytest.approx(ort_case.flops / (ort_case.median_ms * 1e-3) / 1e9)
        assert ort_case.roofline == pytest.approx(ort_case.gflops / ort_case.peak_gflops)
        assert torch_case.status == "skipped" and "--model gives only an ONNX file" in torch_case.reason
    data = json.loads(out.read_text())
    assert data["complete"] is True and len(data["cases"]) == 6
    assert BenchReport.from_dict(data).to_dict() == data  # the file round-trips
    # torch's GEMM ran (it is a different runtime), so the roofline of each backend is its own
    assert {g["backend"] for g in data["gemm"] if g["status"] == "ok"} == {"ort-cpu", "torch"}


def test_a_lowering_that_fails_to_export_is_skipped_with_the_reason(monkeypatch, tmp_path):
    import attnx.workflows

    real = attnx.workflows.export_model

    def export_model(config, out, weights=None, *, attention="decomposed", **kw):
        if attention == "onnx":
            raise RuntimeError("no Attention op today\nsecond line")
        return real(config, out, weights, attention=attention, **kw)

    monkeypatch.setattr(attnx.workflows, "export_model", export_model)
    # the suite's weights (seed 1, as tests.conftest.weights_for): the decomposed export reuses the registry's trace
    plan = BenchPlan(CONFIGS["self"], backends=["ort-cpu"], attentions=["decomposed", "onnx"], seqs=[8], seed=1, **FAST)
    report = run_bench(plan)
    by = {c.attention: c for c in report.cases}
    assert by["decomposed"].status == "ok"
    assert by["onnx"].status == "skipped"
    assert by["onnx"].reason == "export failed: RuntimeError: no Attention op today"


def test_rounds_rotate_the_cases_of_a_shape_and_keep_each_ones_lowest_median(monkeypatch):
    import attnx.bench._sweep as sweep

    order = []
    medians = iter([5.0, 9.0, 4.0, 8.0, 6.0, 7.0, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0])  # the order run below

    def run_case(plan, case, *args):  # the timing itself is the worker's (tested above): the rounds' logic here
        order.append((case.backend, case.seq))
        case.status, case.median_ms = "ok", next(medians)
        return False

    monkeypatch.setattr(sweep, "_run_case", run_case)
    plan = BenchPlan(CONFIGS["self"], backends=["ort-cpu", "torch"], seqs=[8, 16], rounds=3, **FAST)
    plan.attentions = ["decomposed"]
    report = run_bench(plan)
    # per shape, three rounds of both forms, the first form of a round rotating; shapes in turn
    assert order == [("ort-cpu", 8), ("torch", 8), ("torch", 8), ("ort-cpu", 8), ("ort-cpu", 8), ("torch", 8),
                     ("ort-cpu", 16), ("torch", 16), ("torch", 16), ("ort-cpu", 16), ("ort-cpu", 16), ("torch", 16)]
    assert [(c.backend, c.seq) for c in report.cases] == [("ort-cpu", 8), ("torch", 8), ("ort-cpu", 16), ("torch", 16)]
    assert [c.round_medians_ms for c in report.cases] == [[5.0, 8.0, 6.0], [9.0, 4.0, 7.0], [1.0, 3.0, 3.0],
                                                          [2.0, 3.0, 3.0]]  # fmt: skip
    assert [c.median_ms for c in report.cases] == [5.0, 4.0, 1.0, 2.0]  # each one's lowest


def test_ctrl_c_within_a_shape_keeps_the_cases_of_it_already_measured(tmp_path):
    out = tmp_path / "b.json"
    plan = BenchPlan(CONFIGS["self"], backends=["ort-cpu", "torch"], seqs=[8], rounds=2, **FAST)
    plan.attentions = ["decomposed"]
    calls = []

    def progress(done: int, total: int, message: str) -> None:
        calls.append(message)
        if "round 2/2" in message:  # both forms measured once; Ctrl-C as the second round starts
            raise KeyboardInterrupt

    report = run_bench(plan, json_path=out, progress=progress)
    assert report.interrupted
    data = json.loads(out.read_text())
    assert sorted(c["backend"] for c in data["cases"]) == ["ort-cpu", "torch"]
    assert all(c["status"] == "ok" and len(c["round_medians_ms"]) == 1 for c in data["cases"])


def test_after_a_timeout_the_longer_sequences_of_the_series_are_not_started(exported):
    plan = BenchPlan(CONFIGS["self"], backends=["ort-cpu"], seqs=[8, 16, 32], model_path=exported("self"), **FAST)
    plan.timeout_s = 0.01  # the GEMM and every case run past it
    report = run_bench(plan)
    assert [c.status for c in report.cases] == ["timeout", "skipped", "skipped"]
    assert report.cases[1].reason == "not run: seq 8 of this series timed out"
    assert report.gemm[0].status == "timeout" and report.peak_gflops is None


def test_the_memory_guard_skips_a_case_that_would_not_fit(exported):
    plan = BenchPlan(
        CONFIGS["self"], backends=["ort-cpu"], seqs=[8], model_path=exported("self"), max_mem_gb=1e-6, **FAST
    )
    (case,) = run_bench(plan).cases
    assert case.status == "skipped" and case.reason.startswith("not run: needs about")


def test_ctrl_c_keeps_what_was_measured(exported, tmp_path):
    out = tmp_path / "b.json"
    plan = BenchPlan(CONFIGS["self"], backends=["ort-cpu"], seqs=[8, 16, 32], model_path=exported("self"), **FAST)

    pressed = []

    def progress(done: int, total: int, message: str) -> None:
        if done == 1 and not pressed:  # as if Ctrl-C came while the second case was starting
            pressed.append(message)
            raise KeyboardInterrupt

    report = run_bench(plan, json_path=out, progress=progress)
    assert report.interrupted and not report.complete
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and [c["seq"] for c in data["cases"]] == [8]
    assert data["cases"][0]["status"] == "ok"
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]
