"""The GPU check (python -m attnx.bench.gpu_check): a generic script over attnx parity and attnx
bench. Its whole path runs here on the CPU backends (ort-cpu, torch) with a tiny model; on a
machine without a GPU its default backends are reported with their own reasons."""

from __future__ import annotations

import json

import pytest

from attnx.bench import gpu_check
from attnx.runtimes.base import backend_unavailable_reason

# the slow tier: the whole GPU check on the CPU backends
pytestmark = pytest.mark.slow


def test_defaults_are_the_gpu_backends_and_the_issue_matrix():
    args = gpu_check.parse_args(["--out", "d"])
    assert args.backends == ("ort-cuda", "torch-cuda")
    assert args.presets == ("large", "gpt3") and args.seqs == (512, 1024, 2048, 4096, 8192, 16384)
    assert args.dtypes == ("fp32", "fp16") and args.parity_preset == "large"
    assert args.steps == ("parity", "decode", "bench") and args.decode_preset == "large-gqa"
    assert gpu_check.parse_args(["--out", "d", "--quick"]).seqs == (512, 2048)


@pytest.mark.parametrize(
    "argv",
    [[], ["--out", "d", "--backends", "reference"], ["--out", "d", "--presets", "huge"], ["--out", "d", "--seqs", "0"],
     ["--out", "d", "--dtypes", "int8"], ["--out", "d", "--steps", "train"], ["--out", "d", "--repeat", "0"],
     ["--out", "d", "--decode-preset", "huge"]],
)  # fmt: skip
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        gpu_check.parse_args(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_whole_check_on_the_cpu_backends(tmp_path, capsys):
    out = tmp_path / "results"  # created by the check
    argv = ["--out", str(out), "--backends", "ort-cpu,torch", "--presets", "tiny", "--seqs", "16",
            "--parity-preset", "tiny", "--parity-seqs", "1,9", "--dtypes", "fp32", "--repeat", "2", "--warmup", "1",
            "--decode-preset", "tiny"]  # fmt: skip
    assert gpu_check.main(argv) == 0
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["passed"] is True and data["unavailable"] == {"ort-cpu": None, "torch": None}
    assert data["machine"]["cpu_count"] >= 1
    runs = data["steps"]["parity"]["runs"]
    # the module on torch, each lowering on ort-cpu, for the plain and the causal model
    assert [(r["model"], r["lowering"], r["backends"]) for r in runs] == [
        (model, lowering, ["torch"] if lowering == "module" else ["ort-cpu"])
        for model in ("tiny", "tiny-causal") for lowering in ("module", "decomposed", "onnx", "ort-fused")
    ]  # fmt: skip
    for run in runs:  # the comparator's statistics, against the float64 reference
        cases = run["report"]["cases"]
        assert run["passed"] and cases and all(c["status"] == "pass" and c["reference"] == "reference" for c in cases)
        assert all(0 <= c["needed_atol"] <= c["atol"] for c in cases)
    assert data["steps"]["decode"]["passed"] is True  # (its own test below)
    bench = data["steps"]["bench"]["presets"]["tiny"]
    assert bench["cases"] == {"ok": 2, "failed": 0, "timeout": 0, "skipped": 0}
    assert [r["baseline"] for r in bench["ratios"]] == ["torch eager"] and bench["ratios"][0]["speedup"] > 0
    report = json.loads((out / bench["file"]).read_text())
    assert {(c["backend"], c["attention"], c["dtype"]) for c in report["cases"]} == {
        ("ort-cpu", "ort-fused", "fp16"), ("torch", "sdpa", "fp16")}  # fmt: skip
    assert "results:" in capsys.readouterr().out


def test_without_the_gpu_backends_nothing_passes_and_each_says_why(tmp_path):
    reasons = {b: backend_unavailable_reason(b) for b in gpu_check.GPU_CHECK_BACKENDS}
    if all(r is None for r in reasons.values()):
        pytest.skip("the GPU backends run here: this is the path of a machine without them")
    code = gpu_check.main(["--out", str(tmp_path), "--steps", "bench", "--presets", "tiny", "--seqs", "8",
                           "--backends", ",".join(b for b, r in reasons.items() if r is not None)])  # fmt: skip
    assert code == 1  # nothing was checked: never a green run
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["passed"] is False
    assert data["steps"]["bench"]["status"] == "skipped"
    for backend, reason in reasons.items():
        if reason is not None:
            assert data["unavailable"][backend] == reason and f"{backend}: {reason}" in data["steps"]["bench"]["reason"]


def test_the_decode_step_on_the_cpu_backends(tmp_path, capsys):
    # the step model with rope, ort-fused: its growing form on every backend, its buffer form on ONNX
    # Runtime's, in fp32 and fp16 (what GroupQueryAttention takes on a GPU)
    argv = ["--out", str(tmp_path), "--steps", "decode", "--backends", "ort-cpu,torch", "--decode-preset", "tiny",
            "--dtypes", "fp32,fp16"]  # fmt: skip
    assert gpu_check.main(argv) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    step = data["steps"]["decode"]
    assert data["passed"] is True and step["passed"] is True and step["prefills"] == [0, 1, 37]
    assert [(r["lowering"], r["dtype"], r["backends"], r["status"]) for r in step["runs"]] == [
        ("ort-fused growing", "fp32", ["ort-cpu", "torch"], "done"),
        ("ort-fused growing", "fp16", ["ort-cpu", "torch"], "done"),
        ("ort-fused buffer", "fp32", ["ort-cpu"], "done"),
        ("decomposed buffer", "fp32", ["ort-cpu"], "done"),  # the decomposed core's own buffer form (7e36977)
        ("ort-fused buffer grouped-mha", "fp32", ["ort-cpu"], "done"),
        ("ort-fused buffer switch", "fp32", ["ort-cpu"], "done"),
        ("ort-fused buffer", "fp16", ["ort-cpu"], "done"),
        ("decomposed buffer", "fp16", ["ort-cpu"], "done"),
        ("ort-fused buffer grouped-mha", "fp16", ["ort-cpu"], "skipped"),  # the grouped cores: no fp16
        ("ort-fused buffer switch", "fp16", ["ort-cpu"], "skipped"),
    ]  # fmt: skip
    assert all("is not built in fp16" in r["reason"] for r in step["runs"] if r["status"] == "skipped")
    for run in [r for r in step["runs"] if r["status"] == "done"]:
        cases = run["report"]["cases"]
        assert {c["backend"] for c in cases} == set(run["backends"]) and {c["prefill"] for c in cases} == {0, 1, 37}
        assert all(c["status"] == "pass" and c["steps"] == 64 and c["dtype"] == run["dtype"] for c in cases)
    assert "decode: done passed=True" in capsys.readouterr().out
