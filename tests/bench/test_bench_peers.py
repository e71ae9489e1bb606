"""The bench's peers in bf16: torch eager in bfloat16 and OpenVINO's bf16 hint on attnx's fp32
graph, timed by the harness's own worker; a bf16 sweep exports the fp32 graph once."""

from __future__ import annotations

import importlib.util

import pytest

from attnx.bench import BenchPlan
from attnx.bench._sweep import _export_lowerings
from tests.conftest import CONFIGS

needs_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino") is None, reason="openvino is not installed (pip install 'attnx[openvino]')"
)


@needs_openvino
@pytest.mark.parametrize(("backend", "dtype"), [("openvino", "bf16"), ("torch", "bf16"), ("ort-cpu", "bf16")])
def test_the_bench_worker_times_the_bf16_peers(exported, backend, dtype):
    """The harness's own worker (in-process here): torch eager bf16 and OpenVINO bf16 on the fp32
    graph are timed as the other backends are; ort-cpu has no bf16 form and is skipped."""
    from attnx.bench._worker import run_spec

    spec = {"kind": "case", "backend": backend, "attention": "ort-fused" if backend != "torch" else "sdpa",
            "dtype": dtype, "config": CONFIGS["self"].to_dict(), "batch": 1, "seq": 8, "mem_seq": None,
            "threads": 1, "repeat": 2, "warmup": 1, "weights_path": None, "seed": 0,
            "model_path": exported("self", "ort-fused")}  # fmt: skip
    result = run_spec(spec)
    if backend == "ort-cpu":
        assert result["status"] == "skipped" and "no bf16 form" in result["reason"]
        return
    if backend == "openvino" and result["status"] == "skipped":  # a CPU without bf16 compute (AVX2 only)
        assert "cannot run in bf16 here" in result["reason"], result
        return
    assert result["status"] == "ok", result
    assert len(result["times_ms"]) == 2 and all(t > 0 for t in result["times_ms"])


def test_a_bf16_sweep_reads_the_fp32_graph_exported_once(tmp_path, monkeypatch):
    import attnx.workflows

    calls = []
    monkeypatch.setattr(attnx.workflows, "export_model", lambda config, path, weights, **kw: calls.append(kw))
    plan = BenchPlan(
        CONFIGS["self"], backends=["openvino", "ort-cpu"], attentions=["ort-fused"], dtypes=["bf16", "fp32"]
    )
    models, failed = _export_lowerings(plan, plan.series(), {}, str(tmp_path), lambda *a: None, 0)
    assert [kw["dtype"] for kw in calls] == ["fp32"] and not failed
    assert models[("ort-fused", "bf16")] == models[("ort-fused", "fp32")]
