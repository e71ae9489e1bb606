"""The GPU check: what a session with a GPU runs once on the device machine.

From the repository root on the GPU machine, one line (it installs nothing; a missing
`attnx` install is bridged with a path shim in a temporary folder):

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py

Results come back under $OUT (the device tool's output folder) when it is set, and are
always written under bench/results/: gpu_check-<time>.json, gpu_check-<time>-pytest.log and
-junit.xml. With the device tool, run it with timeout_s 600: the script keeps to
--budget-s (default 540 s) by skipping what no longer fits, and rewrites the JSON after
every step and every case, so a run cut short still returns what it measured.

Steps, in order of value:
1. environment: torch, CUDA, the GPU, onnxruntime and why each GPU backend can or cannot
   run here (a real session and a real allocation, never get_available_providers()).
2. pytest -m cuda: the GPU tests (runners, IOBinding from torch CUDA tensors, CUDA
   graphs, the causal-alignment trap, the ort-cuda and torch-cuda parity matrices).
3. parity: the `large` preset (d_model 1024, 16 heads), plain and causal, through ort-cuda
   with each lowering (decomposed, onnx, ort-fused) and torch-cuda, in float32 and
   float16, against the float64 reference, with the full statistics (max/mean/p99 error,
   cosine, the atol that would have been needed) that the tolerance table is judged by.
4. bench: ort-cuda float16 with the ort-fused lowering (com.microsoft MultiHeadAttention,
   ORT's flash kernel) against torch-cuda float16 with SDPA, for the `large` and `gpt3`
   presets, seq 512 to 16384, batch 1. Inputs and outputs stay on the GPU (IOBinding from
   torch tensors; no host copy in the timed call); each call is timed to its end on the
   device. Achieved TFLOP/s (attnx.bench's FLOP model) against --peak-tflops (default 790:
   the H200's fp16 dense matrix rate, as measured on these machines).

Note for the device machine of this workplace: its image ships `onnxruntime` (CPU only),
not onnxruntime-gpu, so without more ort-cuda is reported unavailable there with that
reason and the torch-cuda side still runs. onnxruntime-gpu's wheel (about 250 MB) is over
what one call carries (64 MiB): bench/device_wheel.sh sends it in chunks over several
calls to a warm machine and installs it into /tmp/site (see that script and the README).

`python3 bench/gpu_check.py --dry-run` prints the plan and writes the environment alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "DEFAULT_SEQS",
    "DEFAULT_PRESETS",
    "H200_FP16_DENSE_TFLOPS",
    "STEPS",
    "Budget",
    "BenchCase",
    "ResultFile",
    "parse_args",
    "bench_plan",
    "tflops",
    "summarize_times",
    "parse_junit",
    "ensure_importable",
    "main",
]

logger = logging.getLogger(__name__)

SCHEMA = "attnx.gpu_check/1"
STEPS = ("pytest", "parity", "bench")
DEFAULT_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_PRESETS = ("large", "gpt3")
QUICK_SEQS = (512, 2048)
# The H200's float16 dense matrix rate as measured on the device machines here (an 8192^3
# bf16 product through PyTorch ran at 769-798 TFLOP/s); the datasheet's dense figure is
# about 990. Achieved rates are reported as a fraction of this one.
H200_FP16_DENSE_TFLOPS = 790.0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, AttentionConfig keyword overrides of the `large` preset) for the parity step.
PARITY_MODELS = (("large", {}), ("large-causal", {"causal": True}))
PARITY_LOWERINGS = ("decomposed", "onnx", "ort-fused")
PARITY_DTYPES = ("fp32", "fp16")
PARITY_SEQS = (1, 7, 128, 515)
PARITY_BATCHES = (2,)
# Step time limits (s): pytest and parity may not eat the benchmark's share.
PYTEST_LIMIT_S, PARITY_LIMIT_S, BENCH_RESERVE_S = 200.0, 150.0, 150.0


# Arguments -------------------------------------------------------------------------------------
def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check", description="attnx GPU check: GPU tests, parity and benchmark")
    p.add_argument("--steps", type=_names, default=STEPS, help=f"which steps (default {','.join(STEPS)})")
    p.add_argument("--presets", type=_names, default=DEFAULT_PRESETS, help="benchmark presets (default large,gpt3)")
    p.add_argument("--seqs", type=_positive_ints, default=None, help="benchmark sequence lengths (default 512..16384)")
    p.add_argument("--repeat", type=int, default=10, help="timed calls per case (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument(
        "--peak-tflops", type=float, default=H200_FP16_DENSE_TFLOPS, help="the rate achieved TFLOP/s are a fraction of"
    )
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run (default 540)")
    p.add_argument("--pytest-timeout-s", type=float, default=PYTEST_LIMIT_S, help="most time pytest -m cuda may take")
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "bench", "results"))
    p.add_argument("--copy-to", default=os.environ.get("OUT"), help="also copy the results here (default $OUT)")
    p.add_argument("--quick", action="store_true", help=f"benchmark seq {','.join(map(str, QUICK_SEQS))} only")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write the environment, run nothing")
    return p  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown step {unknown[0]!r} (known: {', '.join(STEPS)})")
    if args.seqs is None:
        args.seqs = QUICK_SEQS if args.quick else DEFAULT_SEQS
    if args.repeat < 1 or args.warmup < 0:
        parser.error("--repeat must be at least 1 and --warmup at least 0")
    if not args.budget_s > 0 or not args.peak_tflops > 0 or not args.pytest_timeout_s > 0:
        parser.error("--budget-s, --pytest-timeout-s and --peak-tflops must be positive")
    if args.device_id < 0:
        parser.error("--device-id must be non-negative")
    known_presets = ("tiny", "base", "large", "gpt3")
    bad = [p for p in args.presets if p not in known_presets]
    if bad:
        parser.error(f"unknown preset {bad[0]!r} (known: {', '.join(known_presets)})")
    return args


# Time --------------------------------------------------------------------------------------------
class Budget:
    """The run's wall-clock allowance. clock is injectable for tests."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.start = clock()
        self.total_s = total_s

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.start

    @property
    def left_s(self) -> float:
        return self.total_s - self.elapsed_s

    def allows(self, estimate_s: float) -> bool:
        """Whether work expected to take estimate_s still fits."""
        return self.left_s >= estimate_s

    def sub(self, limit_s: float, reserve_s: float = 0.0) -> Budget:
        """A budget for one step: at most limit_s, and never into the last reserve_s of
        this one (kept for the steps after it)."""
        return Budget(max(0.0, min(limit_s, self.left_s - reserve_s)), self.clock)


# Results -----------------------------------------------------------------------------------------
class ResultFile:
    """The run's JSON, rewritten atomically after every step and case, and copied to a
    second folder (the device tool's $OUT) each time, so a run cut short returns it."""

    def __init__(self, out_dir: str, copy_to: str | None, stamp: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.copy_to = copy_to if copy_to and os.path.abspath(copy_to) != os.path.abspath(out_dir) else None
        self.stem = f"gpu_check-{stamp}"
        self.path = os.path.join(out_dir, self.stem + ".json")
        self.data: dict[str, Any] = {"schema": SCHEMA, "steps": {}}

    def side_path(self, suffix: str) -> str:
        """A companion file (pytest log, junit XML) named after the JSON."""
        return os.path.join(self.out_dir, f"{self.stem}-{suffix}")

    def save(self) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=2, default=_json_default, allow_nan=False)
            f.write("\n")
        os.replace(tmp, self.path)
        self.publish(self.path)

    def publish(self, path: str) -> None:
        if self.copy_to is None or not os.path.exists(path):
            return
        try:
            os.makedirs(self.copy_to, exist_ok=True)
            shutil.copyfile(path, os.path.join(self.copy_to, os.path.basename(path)))
        except OSError as e:  # the results stay under out_dir
            logger.warning("cannot copy %s to %s: %s", path, self.copy_to, e)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


# Arithmetic -----------------------------------------------------------------------------------------
def tflops(flops: int, seconds: float) -> float:
    """TFLOP/s of `flops` done in `seconds`."""
    if not seconds > 0:
        raise ValueError(f"a time must be positive, got {seconds}")
    return flops / seconds / 1e12


def summarize_times(times_ms: Sequence[float], flops: int, peak_tflops: float) -> dict[str, float]:
    """median/min/p90 milliseconds, and TFLOP/s at the median and its fraction of the peak."""
    if not times_ms:
        raise ValueError("no timed calls")
    ordered = sorted(times_ms)
    median = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    rate = tflops(flops, median / 1e3)
    return {
        "median_ms": median,
        "min_ms": ordered[0],
        "p90_ms": p90,
        "tflops": rate,
        "fraction_of_peak": rate / peak_tflops,
    }


@dataclasses.dataclass
class BenchCase:
    preset: str
    backend: str  # "ort-cuda" | "torch-cuda"
    attention: str  # "ort-fused" | "sdpa"
    dtype: str
    batch: int
    seq: int
    flops: int
    status: str = "pending"  # "ok" | "skipped" | "failed" | "pending"
    reason: str | None = None
    times_ms: list[float] | None = None
    median_ms: float | None = None
    min_ms: float | None = None
    p90_ms: float | None = None
    tflops: float | None = None
    fraction_of_peak: float | None = None
    gpu_peak_mb: float | None = None


BENCH_SERIES = (("ort-cuda", "ort-fused"), ("torch-cuda", "sdpa"))


def bench_plan(presets: Sequence[str], seqs: Sequence[int], batch: int = 1, dtype: str = "fp16") -> list[BenchCase]:
    """Every preset x seq x backend, each preset's seqs shortest first with both backends at
    one length before the next: a run cut short still compares the two."""
    from attnx.bench._flops import attention_flops
    from attnx.model.config import preset as get_preset

    cases = []
    for name in presets:
        config = get_preset(name)
        for seq in sorted(set(seqs)):
            for backend, attention in BENCH_SERIES:
                cases.append(
                    BenchCase(name, backend, attention, dtype, batch, seq, attention_flops(config, batch, seq))
                )
    return cases


# pytest ---------------------------------------------------------------------------------------------
def parse_junit(xml_text: str) -> dict[str, Any]:
    """Counts and the not-passed cases from pytest's junit XML."""
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out: dict[str, Any] = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "not_passed": []}
    for suite in suites:
        for case in suite.iter("testcase"):
            out["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            for kind, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
                child = case.find(kind)
                if child is not None:
                    out[key] += 1
                    text = (child.get("message") or child.text or "").strip()
                    out["not_passed"].append({"test": name, "outcome": key, "message": text[:500]})
                    break
            else:
                out["passed"] += 1
    return out


def run_pytest(results: ResultFile, budget: Budget, timeout_s: float) -> dict[str, Any]:
    timeout = min(timeout_s, budget.left_s)
    if timeout < 30:
        return {"status": "skipped", "reason": f"time budget: {budget.left_s:.0f} s left"}
    log_path, junit_path = results.side_path("pytest.log"), results.side_path("junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={junit_path}", "tests"]  # fmt: skip
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout, env=_child_env())  # fmt: skip
            status, rc = "done", proc.returncode
        except subprocess.TimeoutExpired:
            status, rc = "timeout", None
    out: dict[str, Any] = {"status": status, "returncode": rc, "seconds": time.monotonic() - start,
                           "command": " ".join(cmd[1:]), "log": os.path.basename(log_path)}  # fmt: skip
    if os.path.exists(junit_path):
        with open(junit_path, encoding="utf-8") as f:
            out.update(parse_junit(f.read()))
        results.publish(junit_path)
    results.publish(log_path)
    # pytest exit 0: all passed; 5: nothing collected. A run where every cuda test skipped
    # has passed nothing: say so instead of calling it green.
    out["passed_all"] = rc == 0 and out.get("passed", 0) > 0 and out.get("failed", 0) == 0
    return out


# Import path -----------------------------------------------------------------------------------------
_SHIM_PACKAGES = {"model": "model", "export": "export", "runtimes": "runtimes", "bench": "bench"}


def ensure_importable(repo_root: str = REPO_ROOT, shim_root: str | None = None) -> str:
    """Make `attnx` importable from this checkout: "installed" when it already is, else a
    folder of symbolic links laid out as the installed package (what pyproject's
    package-dir mapping does), put first on sys.path and PYTHONPATH. Installs nothing."""
    try:
        import attnx.runtimes.cuda  # noqa: F401

        return "installed"
    except ImportError:
        pass
    shim_root = shim_root or tempfile.mkdtemp(prefix="attnx-shim-")
    pkg = os.path.join(shim_root, "attnx")
    os.makedirs(pkg, exist_ok=True)
    src = os.path.join(repo_root, "attnx")
    for entry in os.listdir(src):
        if entry.endswith(".py") or (os.path.isdir(os.path.join(src, entry)) and entry != "__pycache__"):
            _link(os.path.join(src, entry), os.path.join(pkg, entry))
    for name, folder in _SHIM_PACKAGES.items():
        _link(os.path.join(repo_root, folder), os.path.join(pkg, name))
    for path in (repo_root, shim_root):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([shim_root, repo_root, os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    for name in [m for m in sys.modules if m == "attnx" or m.startswith("attnx.")]:
        del sys.modules[name]  # a failed partial import must not shadow the shim
    return f"path shim at {shim_root}"


def _link(target: str, link: str) -> None:
    if not os.path.lexists(link):
        os.symlink(target, link)


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


# Environment -----------------------------------------------------------------------------------------
def environment(device_id: int) -> dict[str, Any]:
    """What ran where: versions, the GPU, and each GPU backend's availability with ORT's or
    torch's own reason."""
    import platform

    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(), "host": platform.node()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available() and device_id < torch.cuda.device_count():
            props = torch.cuda.get_device_properties(device_id)
            env["gpu"] = {"name": props.name, "memory_gb": round(props.total_memory / 1024**3, 1),
                          "multiprocessors": props.multi_processor_count,
                          "capability": f"{props.major}.{props.minor}"}  # fmt: skip
    except ImportError:
        env["torch"] = None
    try:
        import onnxruntime as ort

        info = getattr(getattr(ort, "capi", None), "build_and_package_info", None)
        env["onnxruntime"] = {"version": ort.__version__, "package": getattr(info, "package_name", None),
                              "cuda_version": getattr(info, "cuda_version", None),
                              "providers_listed": ort.get_available_providers()}  # fmt: skip
    except ImportError:
        env["onnxruntime"] = None
    from attnx.runtimes.cuda import ort_cuda_unavailable_reason
    from attnx.runtimes.torch_runner import torch_cuda_unavailable_reason

    env["unavailable"] = {
        "ort-cuda": ort_cuda_unavailable_reason(device_id),
        "torch-cuda": torch_cuda_unavailable_reason(device_id),
    }
    return env


# Parity ---------------------------------------------------------------------------------------------
def run_parity_matrix(results: ResultFile, budget: Budget, unavailable: dict[str, str | None]) -> dict:
    """The `large` preset, plain and causal, per lowering and dtype, through every GPU
    backend that can run (on device 0, the backends' default), against the float64
    reference."""
    import dataclasses as dc

    from attnx.export import export_model
    from attnx.model import init_weights
    from attnx.model.config import preset
    from attnx.runtimes import ModelSource
    from attnx.runtimes.parity import run_parity

    step: dict[str, Any] = {"status": "running", "seqs": list(PARITY_SEQS), "runs": []}
    results.data["steps"]["parity"] = step
    usable = [b for b, reason in unavailable.items() if reason is None]
    if not usable:
        step.update(status="skipped", reason="; ".join(f"{b}: {r}" for b, r in unavailable.items()))
        return step
    with tempfile.TemporaryDirectory(prefix="attnx-gpu-parity-") as tmp:
        for name, overrides in PARITY_MODELS:
            config = dc.replace(preset("large"), **overrides)
            weights = init_weights(config, seed=0)
            for dtype in PARITY_DTYPES:
                if "torch-cuda" in usable:
                    _parity_run(step, results, budget, name, "module", dtype, ModelSource(config, weights, None, dtype),
                                ["torch-cuda"], run_parity)  # fmt: skip
                if "ort-cuda" not in usable:
                    continue
                for lowering in PARITY_LOWERINGS:
                    if not budget.allows(90):
                        step["runs"].append({"model": name, "lowering": lowering, "dtype": dtype,
                                             "status": "skipped", "reason": "time budget"})  # fmt: skip
                        continue
                    path = os.path.join(tmp, f"{name}-{lowering}-{dtype}.onnx")
                    try:
                        export_model(config, path, weights, attention=lowering, dtype=dtype, validate=False)
                    except Exception as e:  # an export failure is a result of this matrix
                        step["runs"].append({"model": name, "lowering": lowering, "dtype": dtype, "status": "failed",
                                             "reason": f"export: {type(e).__name__}: {_first_line(e)}"})  # fmt: skip
                        results.save()
                        continue
                    _parity_run(step, results, budget, name, lowering, dtype, ModelSource(config, weights, path, dtype),
                                ["ort-cuda"], run_parity)  # fmt: skip
    runs = step["runs"]
    step["passed"] = (
        bool(runs)
        and all(r.get("passed") for r in runs if r["status"] == "done")
        and not any(r["status"] == "failed" for r in runs)
    )
    step["status"] = "done"
    return step


def _parity_run(step, results, budget, name, lowering, dtype, source, backends, run_parity) -> None:
    entry: dict[str, Any] = {"model": name, "lowering": lowering, "dtype": dtype, "backends": backends}
    if not budget.allows(30):
        entry.update(status="skipped", reason="time budget")
    else:
        start = time.monotonic()
        try:
            report = run_parity(source, backends, batches=PARITY_BATCHES, seqs=PARITY_SEQS)
            entry.update(status="done", passed=report.passed, seconds=time.monotonic() - start, report=report.to_dict())
        except Exception as e:
            entry.update(status="failed", reason=f"{type(e).__name__}: {_first_line(e)}")
    step["runs"].append(entry)
    results.save()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


# Benchmark ----------------------------------------------------------------------------------------------
def run_benchmark(
    results: ResultFile, budget: Budget, args: argparse.Namespace, unavailable: dict[str, str | None]
) -> dict:
    import torch

    from attnx.export import export_model
    from attnx.model import init_weights
    from attnx.model.config import preset
    from attnx.runtimes import ModelSource
    from attnx.runtimes.cuda import CudaOptions
    from attnx.runtimes.ort_runner import OrtCudaRunner
    from attnx.runtimes.torch_runner import TorchCudaRunner

    cases = bench_plan(args.presets, args.seqs)
    step: dict[str, Any] = {"status": "running", "peak_tflops": args.peak_tflops, "repeat": args.repeat,
                            "warmup": args.warmup, "timed": "run_on_device: torch CUDA tensors in and out, "
                            "synchronized after each call", "checks": [], "cases": cases}  # fmt: skip
    results.data["steps"]["bench"] = step
    for case in cases:
        if unavailable.get(case.backend):
            case.status, case.reason = "skipped", unavailable[case.backend]
    device = f"cuda:{args.device_id}"
    for name in args.presets:
        todo = [c for c in cases if c.preset == name and c.status == "pending"]
        if not todo:
            continue
        if not budget.allows(60):
            for c in todo:
                c.status, c.reason = "skipped", "time budget"
            results.save()
            continue
        config = preset(name)
        weights = init_weights(config, seed=0)
        runners: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="attnx-gpu-bench-") as tmp:
            try:
                if any(c.backend == "torch-cuda" for c in todo):
                    # torch as shipped: half-precision reductions allowed (its default), as ORT's
                    # cuBLAS calls allow them too; parity runs switch them off.
                    runners["torch-cuda"] = TorchCudaRunner(
                        ModelSource(config, weights, None, "fp16"),
                        device_id=args.device_id,
                        attention="sdpa",
                        reduced_precision_reduction=True,
                    ).load()
                if any(c.backend == "ort-cuda" for c in todo):
                    path = os.path.join(tmp, f"{name}-ort-fused-fp16.onnx")
                    export_model(config, path, weights, attention="ort-fused", dtype="fp16", validate=False)
                    runners["ort-cuda"] = OrtCudaRunner(
                        ModelSource(config, None, path, "fp16"), options=CudaOptions(device_id=args.device_id)
                    ).load()
            except Exception as e:  # a preset that cannot be set up is a result for its cases
                for c in todo:
                    if c.backend not in runners:
                        c.status, c.reason = "failed", f"setup: {type(e).__name__}: {_first_line(e)}"
            del weights
            try:
                _bench_preset(torch, device, name, config, todo, runners, step, budget, args, results)
            finally:
                for runner in runners.values():
                    runner.close()
                runners.clear()
                torch.cuda.empty_cache()
    step["status"] = "done"
    return step


def _bench_preset(torch, device, name, config, todo, runners, step, budget, args, results) -> None:
    checked = False
    for case in todo:
        if case.status != "pending":
            continue
        runner = runners.get(case.backend)
        if runner is None:
            case.status, case.reason = "failed", case.reason or "runner not loaded"
            continue
        if not budget.allows(20):
            case.status, case.reason = "skipped", "time budget"
            results.save()
            continue
        gen = torch.Generator(device=device).manual_seed(case.seq)
        x = torch.randn(case.batch, case.seq, config.d_model, device=device, dtype=torch.float16, generator=gen)
        try:
            if not checked and len(runners) == 2:
                step["checks"].append(_compare_backends(torch, name, case.seq, runners, x))
                checked = True
            call = _bench_call(torch, case.backend, runner, x)
            torch.cuda.reset_peak_memory_stats(device)
            times = _time_calls(torch, call, args.warmup, args.repeat)
            case.times_ms = times
            for key, value in summarize_times(times, case.flops, args.peak_tflops).items():
                setattr(case, key, value)
            if case.backend == "torch-cuda":  # torch's allocator: ORT's arena is not in it
                case.gpu_peak_mb = torch.cuda.max_memory_allocated(device) / 1024**2
            case.status = "ok"
        except Exception as e:  # out of memory at a long sequence is a result, not the end
            case.status, case.reason = "failed", f"{type(e).__name__}: {_first_line(e)}"
            torch.cuda.empty_cache()
        results.save()


def _bench_call(torch, backend: str, runner: Any, x: Any) -> Callable[[], Any]:
    if backend == "ort-cuda":
        y = torch.empty_like(x)  # ORT writes y into it: no copy out

        def call() -> Any:
            return runner.run_on_device({"x": x}, out={"y": y})

        return call

    def call_torch() -> Any:
        return runner.run_on_device({"x": x})

    return call_torch


def _time_calls(torch, call: Callable[[], Any], warmup: int, repeat: int) -> list[float]:
    """Milliseconds of each call, timed to its end on the device."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _compare_backends(torch, name: str, seq: int, runners: dict[str, Any], x: Any) -> dict[str, Any]:
    """ort-cuda against torch-cuda on one input: the benchmark compares two computations
    of the same model, not two arbitrary kernels."""
    y_ort = torch.empty_like(x)
    runners["ort-cuda"].run_on_device({"x": x}, out={"y": y_ort})
    y_torch = runners["torch-cuda"].run_on_device({"x": x})["y"]
    torch.cuda.synchronize()
    a, b = y_ort.double(), y_torch.double()
    diff = (a - b).abs()
    rms = float(b.pow(2).mean().sqrt())
    cosine = float((a * b).sum() / (a.norm() * b.norm()))
    max_abs = float(diff.max())
    return {"preset": name, "seq": seq, "max_abs": _finite(max_abs), "rms_ref": _finite(rms),
            "max_abs_over_rms": _finite(max_abs / rms) if rms else None, "cosine": _finite(cosine),
            "finite": math.isfinite(max_abs)}  # fmt: skip


# Main -----------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    budget = Budget(args.budget_s)
    started = datetime.datetime.now(datetime.timezone.utc)
    results = ResultFile(args.out_dir, args.copy_to, started.strftime("%Y%m%dT%H%M%SZ"))
    results.data.update(started=started.isoformat(), argv=list(sys.argv[1:] if argv is None else argv),
                        budget_s=args.budget_s, peak_tflops=args.peak_tflops)  # fmt: skip
    results.data["import"] = ensure_importable()
    logger.info("environment")
    env = environment(args.device_id)
    results.data["environment"] = env
    unavailable = env["unavailable"]
    for backend, reason in unavailable.items():
        logger.info("%s: %s", backend, "available" if reason is None else reason)
    plan = bench_plan(args.presets, args.seqs) if "bench" in args.steps else []
    results.data["plan"] = {"steps": list(args.steps), "bench_cases": len(plan), "presets": list(args.presets),
                            "seqs": list(args.seqs)}  # fmt: skip
    results.save()
    if args.dry_run:
        print(json.dumps(results.data["plan"], indent=2))
        for case in plan:
            print(f"  {case.preset:6s} {case.backend:10s} {case.attention:9s} seq={case.seq:6d} "
                  f"{case.flops / 1e12:8.3f} TFLOP")  # fmt: skip
        return 0
    ok = True
    reserve = BENCH_RESERVE_S if "bench" in args.steps else 0.0
    if "pytest" in args.steps:
        logger.info("pytest -m cuda")
        step_budget = budget.sub(args.pytest_timeout_s, reserve_s=reserve)
        step = _guarded(results, "pytest", lambda: run_pytest(results, step_budget, args.pytest_timeout_s))
        ok &= bool(step.get("passed_all"))
    if "parity" in args.steps:
        logger.info("parity matrix")
        step_budget = budget.sub(PARITY_LIMIT_S, reserve_s=reserve)
        step = _guarded(results, "parity", lambda: run_parity_matrix(results, step_budget, unavailable))
        ok &= step.get("status") == "done" and bool(step.get("passed"))
    if "bench" in args.steps:
        if unavailable["torch-cuda"] is not None:  # the timing loop synchronizes through torch
            results.data["steps"]["bench"] = {"status": "skipped", "reason": f"torch-cuda: {unavailable['torch-cuda']}"}
        else:
            logger.info("benchmark")
            step = _guarded(results, "bench", lambda: run_benchmark(results, budget, args, unavailable))
            ok &= step.get("status") == "done"
        results.save()
    results.data.update(finished=datetime.datetime.now(datetime.timezone.utc).isoformat(), elapsed_s=budget.elapsed_s,
                        passed=ok)  # fmt: skip
    results.save()
    _print_summary(results.data)
    print(f"results: {results.path}" + (f" (copied to {results.copy_to})" if results.copy_to else ""))
    return 0 if ok else 1


def _guarded(results: ResultFile, name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one step; an error it did not expect ends that step (recorded with its traceback's
    last lines), not the run: the steps after it still get their time."""
    try:
        step = run()
    except Exception as e:
        import traceback

        logger.exception("step %s failed", name)
        step = results.data["steps"].get(name) or {}
        step.update(status="failed", reason=f"{type(e).__name__}: {_first_line(e)}",
                    traceback=traceback.format_exc().splitlines()[-8:])  # fmt: skip
    results.data["steps"][name] = step
    results.save()
    return step


def _print_summary(data: dict[str, Any]) -> None:
    steps = data.get("steps", {})
    py = steps.get("pytest")
    if py:
        print(f"pytest -m cuda: {py.get('status')} rc={py.get('returncode')} passed={py.get('passed')} "
              f"failed={py.get('failed')} errors={py.get('errors')} skipped={py.get('skipped')}")  # fmt: skip
    par = steps.get("parity")
    if par:
        print(f"parity: {par.get('status')} passed={par.get('passed')} {par.get('reason') or ''}".rstrip())
        for run in par.get("runs", []):
            print(f"  {run['model']:12s} {run['lowering']:10s} {run['dtype']}: {run['status']} "
                  f"{'' if run.get('passed') is None else ('PASS' if run['passed'] else 'FAIL')} {run.get('reason') or ''}")  # fmt: skip
    bench = steps.get("bench")
    if bench:
        print(f"bench: {bench.get('status')} {bench.get('reason') or ''}".rstrip())
        for c in bench.get("cases", []):
            c = c if isinstance(c, dict) else dataclasses.asdict(c)
            rate = f"{c['tflops']:7.1f} TFLOP/s ({100 * c['fraction_of_peak']:4.1f}%)" if c.get("tflops") else ""
            med = f"{c['median_ms']:9.3f} ms" if c.get("median_ms") else ""
            print(f"  {c['preset']:6s} {c['backend']:10s} seq={c['seq']:6d} {c['status']:8s} {med} {rate} "
                  f"{c.get('reason') or ''}".rstrip())  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
