"""bench/gpu_check.py, the script a GPU session runs once: its arguments, budget, FLOP
arithmetic, result files, junit parsing and import shim, run here without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from attnx.bench import gpu_check
from attnx.bench.gpu_check import Budget, ResultFile, bench_plan, parse_args, parse_junit, summarize_times, tflops


# Arguments ---------------------------------------------------------------------------------------
def test_defaults_cover_the_issue():
    args = parse_args([])
    assert args.steps == ("pytest", "parity", "bench")
    assert args.presets == ("large", "gpt3")
    assert args.seqs == (512, 1024, 2048, 4096, 8192, 16384)
    assert args.peak_tflops == 790.0 and args.budget_s < 600  # inside one device call
    assert parse_args(["--quick"]).seqs == (512, 2048)
    assert parse_args(["--quick", "--seqs", "64"]).seqs == (64,)
    assert parse_args(["--steps", "bench", "--presets", "tiny"]).steps == ("bench",)


@pytest.mark.parametrize(
    "argv",
    [["--steps", "pytest,train"], ["--seqs", "0"], ["--seqs", "a,b"], ["--presets", "huge"], ["--repeat", "0"],
     ["--budget-s", "0"], ["--device-id", "-1"]],
)  # fmt: skip
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


# Budget --------------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_budget_and_step_budgets():
    clock = FakeClock()
    budget = Budget(540, clock)
    clock.now += 100
    assert budget.elapsed_s == 100 and budget.left_s == 440
    assert budget.allows(440) and not budget.allows(441)
    step = budget.sub(200, reserve_s=150)
    assert step.total_s == 200
    clock.now += 300  # 140 s left overall
    assert budget.sub(200, reserve_s=150).total_s == 0  # the reserve is the bench's
    assert budget.sub(100).total_s == 100 and budget.sub(500).total_s == 140
    assert step.left_s == -100 and not step.allows(0)


# FLOPs ---------------------------------------------------------------------------------------------
def test_flops_of_the_plan_match_a_hand_count():
    cases = bench_plan(["large", "gpt3"], [16384, 512])
    assert [(c.preset, c.backend, c.seq) for c in cases[:4]] == [
        ("large", "ort-cuda", 512), ("large", "torch-cuda", 512), ("large", "ort-cuda", 16384),
        ("large", "torch-cuda", 16384)]  # fmt: skip
    assert {(c.backend, c.attention, c.dtype, c.batch) for c in cases} == {
        ("ort-cuda", "ort-fused", "fp16", 1), ("torch-cuda", "sdpa", "fp16", 1)}  # fmt: skip
    flops = {(c.preset, c.seq): c.flops for c in cases}
    # large, seq 512: q, k, v and out projections 4 * 2*512*1024*1024, scores and weighted
    # sum 2 * 2*16*512*512*64.
    assert flops[("large", 512)] == 4 * 2 * 512 * 1024 * 1024 + 2 * 2 * 16 * 512 * 512 * 64 == 5_368_709_120
    # gpt3, seq 16384: d_model 12288 = 96 heads of 128.
    assert flops[("gpt3", 16384)] == 4 * 2 * 16384 * 12288**2 + 2 * 2 * 96 * 16384**2 * 128 == 32_985_348_833_280


def test_tflops_and_time_summary():
    assert tflops(5_368_709_120, 1e-3) == pytest.approx(5.36870912)
    with pytest.raises(ValueError):
        tflops(1, 0.0)
    s = summarize_times([4.0, 1.0, 3.0, 2.0], flops=790_000_000_000, peak_tflops=790.0)
    assert s["median_ms"] == 2.5 and s["min_ms"] == 1.0 and s["p90_ms"] == 4.0
    assert s["tflops"] == pytest.approx(316.0) and s["fraction_of_peak"] == pytest.approx(0.4)
    with pytest.raises(ValueError):
        summarize_times([], 1, 1.0)


# Result files --------------------------------------------------------------------------------------
def test_result_file_is_written_whole_and_copied(tmp_path):
    out, copy = tmp_path / "results", tmp_path / "OUT"
    results = ResultFile(str(out), str(copy), "20260101T000000Z")
    results.data["steps"]["bench"] = {"cases": [gpu_check.BenchCase("large", "ort-cuda", "ort-fused", "fp16", 1, 512,
                                                                    5)]}  # fmt: skip
    results.save()
    for folder in (out, copy):
        assert os.listdir(folder) == ["gpu_check-20260101T000000Z.json"]
        data = json.loads((folder / "gpu_check-20260101T000000Z.json").read_text())
        assert data["schema"] == "attnx.gpu_check/1" and data["steps"]["bench"]["cases"][0]["status"] == "pending"
    assert results.side_path("pytest.log") == str(out / "gpu_check-20260101T000000Z-pytest.log")
    same = ResultFile(str(out), str(out), "x")
    assert same.copy_to is None


def test_result_file_refuses_non_finite_numbers(tmp_path):
    results = ResultFile(str(tmp_path), None, "x")
    results.data["bad"] = float("nan")
    with pytest.raises(ValueError):
        results.save()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".json")]


JUNIT = textwrap.dedent(
    """\
    <?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
    skipped="1" tests="3"><testcase classname="tests.runtimes.test_gpu_parity" name="test_a" time="0.1"/>
    <testcase classname="tests.runtimes.test_gpu_parity" name="test_b[fp16]" time="0.2"><failure
    message="AssertionError: max_abs 0.3">trace</failure></testcase><testcase classname="tests.runtimes.test_ort_cuda"
    name="test_c" time="0"><skipped type="pytest.skip" message="backend 'ort-cuda' is unavailable: x">skip
    </skipped></testcase></testsuite></testsuites>"""
)


def test_parse_junit_counts_and_names_what_did_not_pass():
    got = parse_junit(JUNIT)
    assert {k: got[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1}  # fmt: skip
    assert got["not_passed"] == [
        {"test": "tests.runtimes.test_gpu_parity::test_b[fp16]", "outcome": "failed",
         "message": "AssertionError: max_abs 0.3"},
        {"test": "tests.runtimes.test_ort_cuda::test_c", "outcome": "skipped",
         "message": "backend 'ort-cuda' is unavailable: x"},
    ]  # fmt: skip


def test_pytest_step_is_skipped_when_the_budget_is_spent(tmp_path):
    clock = FakeClock()
    budget = Budget(10, clock)
    got = gpu_check.run_pytest(ResultFile(str(tmp_path), None, "x"), budget, 200)
    assert got["status"] == "skipped" and "time budget" in got["reason"]


# Import shim and the whole script without a GPU --------------------------------------------------------
def test_import_shim_makes_attnx_importable_without_an_install(tmp_path):
    """Run in a child whose editable-install finder is removed: the shim alone must serve
    attnx and its mapped subpackages (model, export, runtimes, bench)."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "").lower()]
        sys.path_importer_cache.clear()
        try:
            import attnx.runtimes
        except ImportError:
            pass
        else:
            sys.exit("attnx is still importable: the test would prove nothing")
        import importlib.util
        spec = importlib.util.spec_from_file_location("gpu_check", {gpu_check.__file__!r})
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = mod
        spec.loader.exec_module(mod)
        how = mod.ensure_importable({gpu_check.REPO_ROOT!r}, {str(tmp_path / "shim")!r})
        import attnx.runtimes.cuda, attnx.bench._flops, attnx.model.config, attnx.export
        print(how)
        print(attnx.runtimes.cuda.__file__)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    how, path = proc.stdout.split("\n")[:2]
    assert how == f"path shim at {tmp_path / 'shim'}" and path == str(
        tmp_path / "shim" / "attnx" / "runtimes" / "cuda.py"
    )


def test_ensure_importable_leaves_an_install_alone():
    assert gpu_check.ensure_importable() == "installed"


def test_script_without_a_gpu_reports_why_and_fails(tmp_path, capsys):
    from attnx.runtimes.cuda import ort_cuda_unavailable_reason
    from attnx.runtimes.torch_runner import torch_cuda_unavailable_reason

    if ort_cuda_unavailable_reason() is None or torch_cuda_unavailable_reason() is None:
        pytest.skip("a GPU backend runs here: this is the no-GPU path")
    code = gpu_check.main(["--steps", "parity,bench", "--out-dir", str(tmp_path), "--copy-to", "", "--quick"])
    assert code == 1  # nothing was checked: never a green run
    (path,) = tmp_path.glob("gpu_check-*.json")
    data = json.loads(path.read_text())
    assert data["passed"] is False and data["import"] == "installed"
    assert data["environment"]["unavailable"]["ort-cuda"] == ort_cuda_unavailable_reason()
    assert data["steps"]["parity"]["status"] == "skipped" and "ort-cuda: backend" in data["steps"]["parity"]["reason"]
    assert data["steps"]["bench"] == {"status": "skipped", "reason": f"torch-cuda: {torch_cuda_unavailable_reason()}"}
    assert "results:" in capsys.readouterr().out


def test_dry_run_writes_the_plan_and_environment(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--out-dir", str(tmp_path), "--copy-to", "", "--presets", "large"]) == 0
    (path,) = tmp_path.glob("gpu_check-*.json")
    data = json.loads(path.read_text())
    assert data["plan"]["bench_cases"] == 12 and data["steps"] == {}
    assert set(data["environment"]["unavailable"]) == {"ort-cuda", "torch-cuda"}
    assert "TFLOP" in capsys.readouterr().out


def test_a_step_that_raises_is_recorded_and_the_run_goes_on(tmp_path):
    results = ResultFile(str(tmp_path), None, "x")
    results.data["steps"]["parity"] = {"status": "running", "runs": [{"model": "large"}]}

    def broken() -> dict:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    step = gpu_check._guarded(results, "parity", broken)
    assert (
        step["status"] == "failed"
        and step["reason"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert step["runs"] == [{"model": "large"}]  # what the step recorded before it broke is kept
    saved = json.loads(open(results.path, encoding="utf-8").read())
    assert saved["steps"]["parity"]["status"] == "failed" and saved["steps"]["parity"]["traceback"]
    assert gpu_check._guarded(results, "bench", lambda: {"status": "done"}) == {"status": "done"}
