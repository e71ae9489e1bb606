"""`attnx bench` end to end: one small sweep over every backend, its table, JSON and plot;
then the errors that must come before any measuring."""

from __future__ import annotations

import contextlib
import io
import json
import re
import struct

import pytest

from attnx.cli import main

# the slow tier: benchmark runs
pytestmark = pytest.mark.slow

RECORD_FIELDS = {
    "backend", "attention", "dtype", "batch", "seq", "mem_seq", "median_ms", "p10_ms", "p90_ms",
    "first_ms", "tokens_per_s", "gflops", "roofline", "peak_mem_mb",
}  # fmt: skip


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One sequence length: each measured case is a worker process of its own (torch's import each), and the
    sweep over lengths and batches is tests/bench/test_bench_sweep.py's; here every backend and lowering once."""
    root = tmp_path_factory.mktemp("bench")
    json_path, png_path = root / "b.json", root / "b.png"
    args = ["bench", "--preset", "tiny", "--seq", "16", "--backends", "torch,ort-cpu,ort-cuda,torch-cuda",
            "--attention", "decomposed,sdpa", "--threads", "1", "--repeat", "2", "--warmup", "1",
            "--json", str(json_path), "--plot", str(png_path)]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(args)
    return rc, out.getvalue(), json.loads(json_path.read_text()), png_path


def test_exits_0_and_every_record_has_the_fields(sweep):
    rc, _, data, _ = sweep
    assert rc == 0
    assert data["complete"] is True and data["interrupted"] is False
    assert isinstance(data["peak_gflops"], float) and data["peak_gflops"] > 0
    assert data["settings"]["threads"] == 1
    for case in data["cases"]:
        assert RECORD_FIELDS <= set(case), case
        assert case["mem_seq"] is None  # self-attention


def test_measured_cases_are_consistent(sweep):
    _, _, data, _ = sweep
    ok = [c for c in data["cases"] if c["status"] == "ok"]
    assert {(c["backend"], c["attention"], c["seq"]) for c in ok} >= {
        (b, a, s) for b, a in (("torch", "decomposed"), ("torch", "sdpa"), ("ort-cpu", "decomposed")) for s in (16,)
    }
    peaks = {g["backend"]: g["gflops"] for g in data["gemm"] if g["status"] == "ok"}
    for c in ok:
        assert c["runs"] == 2 and c["threads"] == 1
        assert c["p10_ms"] <= c["median_ms"] <= c["p90_ms"]
        assert c["tokens_per_s"] == pytest.approx(c["batch"] * c["seq"] / (c["median_ms"] * 1e-3))
        assert c["roofline"] == pytest.approx(c["gflops"] / peaks[c["backend"]])  # its own runtime's limit
        assert c["peak_mem_mb"] >= c["load_rss_mb"] > 0
    assert data["peak_gflops"] == max(peaks.values())


def test_unavailable_backends_are_listed_as_skipped_with_their_reason(sweep):
    _, printed, data, _ = sweep
    for backend in ("ort-cuda", "torch-cuda"):
        cases = [c for c in data["cases"] if c["backend"] == backend]
        if any(c["status"] == "ok" for c in cases):
            continue  # a usable GPU here
        assert cases and all(c["status"] == "skipped" and "unavailable" in c["reason"] for c in cases)
        assert any(line.split()[:1] == [backend] and line.endswith("skipped") for line in printed.splitlines())
        assert f"skipped {backend}/" in printed and f"backend '{backend}' is unavailable" in printed


def test_table_is_aligned(sweep):
    _, printed, _, _ = sweep
    lines = printed.splitlines()
    header, rule = lines[0], lines[1]
    assert header.split()[:5] == ["backend", "attention", "dtype", "batch", "seq"] and "roofline" in header
    table = lines[: lines.index("")]
    spans = [(m.start(), m.end()) for m in re.finditer("-+", rule)]
    assert len(spans) == len(header.split())
    for row in table[2:]:  # every cell inside its column, columns two spaces apart
        for start, end in spans:
            assert row[start:end].strip(), (row, start)
            assert row[max(start - 2, 0) : start].strip() == "" and row[end : end + 2].strip() == "", row
        assert row[spans[-1][0] :].strip() in ("ok", "skipped")


def test_plot_is_a_png_of_readable_size(sweep):
    _, _, _, png = sweep
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width >= 1000 and height >= 500


def test_missing_matplotlib_is_said_before_any_measuring(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    rc = main(["bench", "--preset", "tiny", "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    assert rc == 2
    assert "pip install 'attnx[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "missing.onnx"], "--model 'missing.onnx' does not exist"),
        (["--preset", "tiny", "--plot", "b.jpg"], "must end in .png"),
        (["--preset", "tiny", "--json", "no/such/dir/b.json"], "does not exist"),
        (["--preset", "tiny", "--backends", "gpu"], "unknown --backends value 'gpu'"),
        (["--preset", "tiny", "--dtype", "int2"], "unknown --dtype value 'int2'"),
    ],
)
def test_bad_usage_exits_2_with_one_line(args, message, capsys):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_model_file_errors(exported, capsys):
    model = exported("self")
    assert main(["bench", "--model", model, "--weights", "w.safetensors"]) == 2
    assert "--weights does not go with --model" in capsys.readouterr().err
    assert main(["bench", "--model", model, "--dtype", "fp16"]) == 2
    assert "--dtype fp16 contradicts the model" in capsys.readouterr().err
