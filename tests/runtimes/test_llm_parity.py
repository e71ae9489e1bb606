"""Parity of the modern-LLM layers (rope, window, softcap, q/k norms, sinks) exported as the decomposed
graph: reference (checked against the float64 torch module), torch, ort-cpu and openvino on
left-padded batches with Hugging Face's position_ids, and a long context at position 8192; a graph
with a planted fault fails."""

from __future__ import annotations

import dataclasses

import onnx
import pytest

from attnx.export import build_model
from attnx.runtimes import ModelSource
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.parity import run_parity
from tests.conftest import LLM_CONFIGS, weights_for

TESTED_BACKENDS = ["reference", "torch", "ort-cpu", "openvino"]


def _ran(report, backend: str) -> list:
    return [c for c in report.cases if c.backend == backend and c.status != "skipped"]


@pytest.mark.parametrize(("name", "offset"), [("llm", 0), ("llama", 8192)])
def test_llm_parity_on_every_backend(exported, name, offset):
    config = LLM_CONFIGS[name]
    source = ModelSource(config, weights_for(name), exported(name))
    report = run_parity(source, TESTED_BACKENDS, batches=(1, 3), seqs=(1, 7, 33), position_offset=offset)
    failed = [c for c in report.cases if c.status == "fail"]
    assert report.passed and not failed, failed[0].reason if failed else report.summary()
    for backend in ("reference", "torch", "ort-cpu"):
        assert len(_ran(report, backend)) == 6, backend
    if backend_unavailable_reason("openvino") is None:
        assert len(_ran(report, "openvino")) == 6
    if offset:  # the long context: the rope term of the tolerance is what it is sized from, and holds
        ort = _ran(report, "ort-cpu")
        assert all(c.max_abs < 0.1 * c.atol for c in ort), [(c.max_abs, c.atol) for c in ort]


@pytest.mark.slow
def test_a_graph_with_a_planted_window_fault_fails(tmp_path):
    """A graph whose window is one token wider than the config's: parity against the config fails."""
    config = LLM_CONFIGS["llm"]
    wrong = dataclasses.replace(config, sliding_window=config.sliding_window + 1)
    # written by the registry's decomposed core, the trace's twin (tests/export/test_decomposed_builders.py): a trace
    # of the wrong config cost 5-8 s of CPU and plants the same window; the verdict is the point (localise="off")
    path = tmp_path / "wrong.onnx"
    onnx.save(build_model(wrong, weights_for("llm"), "decomposed"), path)
    report = run_parity(ModelSource(config, weights_for("llm"), str(path)), ["ort-cpu"], batches=(3,), seqs=(9,),
                        localise="off")  # fmt: skip
    assert not report.passed and report.cases[0].status == "fail"
