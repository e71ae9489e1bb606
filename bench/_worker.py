"""One benchmark case in a process of its own: `python -m attnx.bench._worker SPEC.json RESULT.json`,
and run_worker(), the parent's side: it starts the process and reads its result.

A fresh process per case makes the peak memory honest: what one case allocated cannot
hide behind, or be charged to, another. The peak is the process's own high-water mark of
resident memory (VmHWM), read here at the end, and not the parent's ru_maxrss of the
child: Linux charges a child's maxrss with the RSS of the address space it exec'd from,
which under vfork/posix_spawn is the parent's (a sweep that exported the gpt3 preset would
see gigabytes in every case).

SPEC (JSON): kind "case" or "gemm"; backend; dtype; threads; repeat; warmup; and
  case: attention (the lowering of an ort-* model, or the torch module's core), config (dict), batch, seq, mem_seq, model_path (ort-*) or
        weights_path / seed (torch*)
  gemm: m, k, n, model_path (ort-*: a one-MatMul ONNX file)
RESULT (JSON): status "ok" | "skipped" | "failed", reason, times_ms (each timed call),
  warmup_ms (each warm-up call, the first call after loading first),
  peak_rss_mb, import_rss_mb, load_rss_mb, gpu_peak_mb, gpu_mem_kind, load_s, threads,
  timed (which call was timed, and where its inputs and outputs were).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from attnx._io import write_json_atomic
from attnx._signals import child_process
from attnx.errors import ProviderUnavailable
from attnx.model import AttentionConfig, init_weights, load_weights
from attnx.model.contract import DTYPES, IR_VERSION, OPENVINO, backend_device, host_dtype, numpy_dtype, runs_onnx_model
from attnx.model.inputs import make_inputs
from attnx.runtimes import RUNNERS, ModelSource
from attnx.runtimes.torch_runner import torch_cuda_unavailable_reason

__all__ = ["run_spec", "main", "rss_mb", "run_worker", "time_stats", "write_gemm_model", "time_calls"]

WORKER_MAIN = "import sys; from attnx.bench._worker import main; sys.exit(main())"

logger = logging.getLogger(__name__)


def rss_mb(field: str = "VmHWM") -> float | None:
    """This process's resident memory in MB: VmHWM (peak) or VmRSS (now), from /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    if field == "VmHWM":  # no /proc (macOS): ru_maxrss is bytes there, kB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 1024**2 if sys.platform == "darwin" else peak / 1024
    return None


def time_calls(
    fn: Callable[[], Any], repeat: int, warmup: int, sync: Callable[[], None]
) -> tuple[list[float], list[float]]:
    """(warm-up, timed): milliseconds of each of `warmup` calls and then of `repeat` calls;
    sync() waits for the device, so that a GPU call is timed to its end and not to its
    launch. The warm-up calls are timed too, not counted in the statistics: the first call
    after loading (ONNX Runtime's perf test calls it "first inference") is where a runtime
    grows its memory arena and plans its buffers, which is what a deployment's first
    request pays."""
    warm_up, times = [], []
    for i in range(warmup + repeat):
        start = time.perf_counter()
        fn()
        sync()
        (warm_up if i < warmup else times).append((time.perf_counter() - start) * 1e3)
    return warm_up, times


def _import_runtime(backend: str) -> None:
    """Import the backend's library first, so that import_rss_mb is the interpreter, numpy,
    attnx and the runtime library (torch's far larger than ONNX Runtime's: measurements/facts.md)
    before any model is loaded."""
    try:
        if backend == OPENVINO:
            reason = RUNNERS[OPENVINO].unavailable_reason()  # names the extra that installs it
            if reason is not None:
                raise ProviderUnavailable(reason)
            import openvino  # noqa: F401
        elif runs_onnx_model(backend):
            import onnxruntime  # noqa: F401
        else:
            import torch  # noqa: F401
    except ImportError as e:
        raise ProviderUnavailable(f"backend {backend!r} is unavailable: {e}") from None


def _no_sync() -> None:
    pass


def _torch_setup(spec: dict[str, Any]) -> Any:
    import torch

    torch.set_num_threads(spec["threads"])
    return torch


def _ort_call(spec: dict[str, Any], config: Any, feeds: dict[str, Any], result: dict[str, Any]) -> tuple:
    """(call, sync, runner) through an ORT backend or openvino (its precision: the spec's dtype,
    bf16 on the fp32 graph), the runner loaded. On ort-cuda the call
    is run_on_device (IOBinding, outputs left on the GPU; ORT synchronises its stream at the
    end of the run), with the inputs already on the GPU where torch can put them there."""
    source = ModelSource(config=config, model_path=spec["model_path"], dtype=spec["dtype"])
    runner = RUNNERS[spec["backend"]](source, threads=spec["threads"])
    _load(runner, result)
    if backend_device(spec["backend"]) != "cuda":
        result["timed"] = "Runner.run: numpy in, numpy out"
        return (lambda: runner.run(feeds)), _no_sync, runner
    torch = _cuda_torch()
    if torch is not None:
        feeds = {k: torch.from_numpy(v).to("cuda") for k, v in feeds.items()}
        result["timed"] = "run_on_device: inputs bound from torch CUDA tensors, outputs left on the GPU"
        return (lambda: runner.run_on_device(feeds)), torch.cuda.synchronize, runner
    result["timed"] = "run_on_device: numpy inputs (one host-to-device copy per call), outputs left on the GPU"
    return (lambda: runner.run_on_device(feeds)), _no_sync, runner


def _cuda_torch() -> Any:
    """torch, where it is installed with a usable CUDA device; else None."""
    if torch_cuda_unavailable_reason() is not None:
        return None
    import torch

    return torch


def _load(runner: Any, result: dict[str, Any]) -> None:
    start = time.perf_counter()
    runner.load()
    result["load_s"] = time.perf_counter() - start


def _case(spec: dict[str, Any], result: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[], None], Any]:
    """(call, sync, runner) for one attention case; the runner is loaded."""
    config = AttentionConfig.from_dict(spec["config"])
    backend = spec["backend"]
    feeds: dict[str, Any] = make_inputs(config, spec["batch"], spec["seq"], spec["mem_seq"], spec["dtype"])
    if runs_onnx_model(backend):
        return _ort_call(spec, config, feeds, result)
    torch = _torch_setup(spec)
    weights = (
        load_weights(spec["weights_path"], config) if spec.get("weights_path") else init_weights(config, spec["seed"])
    )
    runner = RUNNERS[backend](ModelSource(config, weights, None, spec["dtype"]), core=spec["attention"])
    _load(runner, result)
    if backend_device(backend) != "cuda":
        result["timed"] = "Runner.run: numpy in, numpy out (views of torch tensors on the CPU)"
        return (lambda: runner.run(feeds)), _no_sync, runner
    runner.run(feeds)  # feeds checked once, through the public call
    feeds = {k: torch.from_numpy(v).to(runner.device) for k, v in feeds.items()}
    result["timed"] = "TorchRunner.forward: inputs and output on the GPU, then torch.cuda.synchronize"
    return (lambda: runner.forward(feeds)), torch.cuda.synchronize, runner


def _gemm(spec: dict[str, Any], result: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[], None], Any]:
    """(call, sync, runner-or-None) for the m x k x n GEMM through the backend's runtime."""
    m, k, n = spec["m"], spec["k"], spec["n"]
    backend = spec["backend"]
    rng = np.random.Generator(np.random.PCG64(0))
    a = rng.standard_normal((m, k), dtype=np.float32).astype(numpy_dtype(host_dtype(spec["dtype"])))
    if runs_onnx_model(backend):
        return _ort_call(spec, None, {"a": a}, result)

    torch = _torch_setup(spec)
    device, sync = "cpu", _no_sync
    if backend == "torch-cuda":
        reason = torch_cuda_unavailable_reason()
        if reason is not None:
            raise ProviderUnavailable(f"backend 'torch-cuda' is unavailable: {reason}")
        torch.backends.cuda.matmul.allow_tf32 = False  # a float32 limit, as torch-cuda runs the cases
        device, sync = "cuda", torch.cuda.synchronize
    compute = getattr(torch, DTYPES[spec["dtype"]].torch)  # bf16: float32 host arrays, cast here
    ta = torch.from_numpy(a).to(device, compute)
    # [n, k] and F.linear: the call the module's projections make (nn.Linear), which on a
    # CPU torch with MKL is faster than matmul with a [k, n] operand.
    w = rng.standard_normal((n, k), dtype=np.float32).astype(numpy_dtype(host_dtype(spec["dtype"])))
    tw = torch.from_numpy(w).to(device, compute)
    result["timed"] = "torch.nn.functional.linear"
    return (lambda: torch.nn.functional.linear(ta, tw)), sync, None


def _gpu_memory(spec: dict[str, Any], result: dict[str, Any]) -> None:
    backend = spec["backend"]
    if backend == "torch-cuda":
        import torch

        result["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 1024**2
        result["gpu_mem_kind"] = "torch allocator peak (max_memory_allocated)"
    elif backend == "ort-cuda":
        # ORT has no API for its arena's peak; the arena keeps what it grew to (by default
        # it does not shrink), so the device memory the process holds after the runs is
        # its high-water mark, CUDA context included.
        result["gpu_peak_mb"] = _nvidia_smi_process_mb(os.getpid())
        result["gpu_mem_kind"] = (
            "device memory held by the process after the runs (nvidia-smi; ORT arena + CUDA context)"
        )


def _nvidia_smi_process_mb(pid: int) -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return float(fields[1])  # MiB
    return None


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one case or GEMM as the spec says and return its RESULT dict (never raises for a
    backend that is unavailable or a call that fails: those are results too)."""
    result: dict[str, Any] = {"status": "ok", "reason": None, "threads": spec["threads"]}
    runner = None
    try:
        _import_runtime(spec["backend"])
        result["import_rss_mb"] = rss_mb("VmRSS")
        fn, sync, runner = (_case if spec["kind"] == "case" else _gemm)(spec, result)
        result["load_rss_mb"] = rss_mb("VmRSS")
        result["warmup_ms"], result["times_ms"] = time_calls(fn, spec["repeat"], spec["warmup"], sync)
        _gpu_memory(spec, result)
        if spec.get("output_path"):  # issue 12: y once more, untimed, for the sweep's accuracy check
            out = fn()
            if isinstance(out, dict) and "y" in out:
                np.save(spec["output_path"], np.asarray(out["y"], dtype=np.float32))
    except ProviderUnavailable as e:
        result.update(status="skipped", reason=str(e))
    except Exception as e:  # a failed case is a result, with its reason
        logger.debug("case failed", exc_info=True)
        text = str(e).strip()
        result.update(
            status="failed", reason=f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
        )
    finally:
        if runner is not None:
            runner.close()
    result["peak_rss_mb"] = rss_mb("VmHWM")
    return result


# The parent's side ---------------------------------------------------------------------------
def run_worker(spec: dict[str, Any], workdir: str, name: str, timeout_s: float) -> dict[str, Any]:
    """Run one spec in a worker process (main() of this module) and return its result. A worker that
    passes timeout_s is killed (status "timeout"); one that dies without a result (killed by
    the kernel for memory, a crash in native code) is "failed" with what it last printed."""
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    result_path = os.path.join(workdir, f"{name}.result.json")
    log_path = os.path.join(workdir, f"{name}.log")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    # main() by import, not `-m`: the package's own import of this module (the parent's side,
    # through attnx.bench) would otherwise run it a second time as __main__.
    cmd = [sys.executable, "-c", WORKER_MAIN, spec_path, result_path]
    # A child that ends with attnx (attnx._signals): Ctrl-C drops the case, the worker never outlives us.
    with open(log_path, "wb") as log, child_process(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT) as proc:  # fmt: skip
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"status": "timeout", "reason": f"ran past the {timeout_s:g} s budget per case (--timeout)"}
    if os.path.exists(result_path):
        with open(result_path, encoding="utf-8") as f:
            return json.load(f)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        tail = [line.strip() for line in f.read().splitlines() if line.strip()][-1:]
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
        why = f"killed by {sig}" + (" (out of memory?)" if returncode == -signal.SIGKILL else "")
    else:
        why = f"exited with status {returncode}"
    return {"status": "failed", "reason": why + (f": {tail[0]}" if tail else ""), "killed": returncode < 0}


def time_stats(result: dict[str, Any]) -> dict[str, Any]:
    """A worker result's timings as the report's statistics (first call, median, p10/p90)."""
    times = np.asarray(result["times_ms"], dtype=np.float64)
    warm_up = [float(t) for t in result.get("warmup_ms") or []]
    return {
        "first_ms": (warm_up or [float(times[0])])[0],
        "warmup_ms": warm_up,
        "median_ms": float(np.median(times)),
        "p10_ms": float(np.percentile(times, 10)),
        "p90_ms": float(np.percentile(times, 90)),
        "runs": len(times),
        "times_ms": [float(t) for t in times],
    }


def write_gemm_model(path: str, m: int, k: int, n: int, dtype: str) -> None:
    """A one-MatMul ONNX model: a [m, k] input times a constant [k, n] weight, as a
    projection is. Written at attnx's IR version so the pinned onnxruntime reads it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    elem = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}[dtype]
    rng = np.random.Generator(np.random.PCG64(1))
    weight = rng.standard_normal((k, n), dtype=np.float32).astype(numpy_dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        "attnx_gemm",
        [helper.make_tensor_value_info("a", elem, [m, k])],
        [helper.make_tensor_value_info("y", elem, [m, n])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="attnx bench")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    onnx.save(model, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m attnx.bench._worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    result = run_spec(spec)
    write_json_atomic(argv[1], result)
    return 0 if result["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
