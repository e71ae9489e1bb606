"""The speed-accuracy frontier (issue 12): every measured CPU case gets its rel RMS error against
the float64 module, the quantized forms run on ONNX Runtime only, and the frontier is marked."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from attnx.bench._plan import BenchCase, BenchReport
from attnx.cli import main
from attnx.commands.bench import frontier_lines

# the slow tier: benchmark runs
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    json_path = tmp_path_factory.mktemp("frontier") / "f.json"
    args = ["bench", "--preset", "tiny", "--seq", "16", "--backends", "torch,ort-cpu", "--attention",
            "sdpa,ort-fused", "--dtype", "fp32,int8", "--threads", "1", "--repeat", "2", "--warmup", "1",
            "--json", str(json_path)]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(args)
    return rc, out.getvalue(), json.loads(json_path.read_text())


def test_every_measured_case_has_its_rel_rms_error(sweep):
    rc, out, data = sweep
    assert rc == 0
    cases = {(c["backend"], c["dtype"]): c for c in data["cases"]}
    for key in (("torch", "fp32"), ("ort-cpu", "fp32")):
        assert cases[key]["status"] == "ok" and cases[key]["rel_rms"] < 1e-5  # float32 against float64
    int8 = cases[("ort-cpu", "int8")]
    assert int8["status"] == "ok" and 1e-4 < int8["rel_rms"] < 0.05  # quantized: ~1%, not float32's 1e-7
    assert cases[("torch", "int8")]["status"] == "skipped" and "ONNX Runtime" in cases[("torch", "int8")]["reason"]
    assert "frontier, batch 1 seq 16:" in out and "rel_rms" in out


def test_the_frontier_marks_the_forms_no_other_beats_on_both():
    def case(name, ms, err):
        c = BenchCase(name, "ort-fused", "int8", 1, 512, None, "ok", median_ms=ms)
        c.rel_rms = err
        return c

    report = BenchReport(meta={})
    report.cases = [case("fast", 1.0, 1e-2), case("exact", 2.0, 1e-6), case("worse", 3.0, 1e-2)]
    lines = [line for line in frontier_lines(report) if "/ort-fused" in line]
    rows = {next(w for w in line.split() if "/" in w): line.startswith("*") for line in lines}
    assert rows == {"fast/ort-fused": True, "exact/ort-fused": True, "worse/ort-fused": False}
