"""One matrix case in a process of its own: `python -c WORKER_MAIN SPEC.json RESULT.json`, and
run_case_process(), the parent's side (the local pool's thread or the Ray task on a node).

The case runs attnx's own code, nothing re-implemented: parity through
attnx.runtimes.parity.run_parity, verify through attnx.runtimes.package.verify_package, bench
through the bench worker's run_spec (attnx.bench._worker: warm-up, timed calls, peak memory),
audit through attnx.workflows.audit_model (one block on one backend: `attnx audit MODEL
--layers I --backends B`, whose verdict is the case's).
Every agreement figure comes from the one comparator (attnx.runtimes.compare). A case whose
process dies (a crash in native code, a kill) cannot take the driver down: the parent sees the
signal and reports it (the caller retries, then reports the case lost).

SPEC (JSON): job, backend, lowering, dtype, batch, seq, mem_seq, seed, and per job: config (dict)
and model_path (ort-*) for parity; package (a folder) and provider for verify; the bench worker's
case spec fields for bench (config, attention, model_path, repeat, warmup, threads); model_path,
checkpoint (a folder or None) and layer for audit.
RESULT (JSON): status "pass" | "fail" | "skipped", reason, stats (the comparator's: max_abs,
max_rel, mean_abs, p99_abs, cosine, needed_atol, atol, rtol), bench (median_ms, p10_ms, p90_ms,
first_ms, runs, peak_rss_mb), checks (verify), audit (the block's BlockAudit.to_dict() with its
line, the model's unread nodes and skipped backends, and the paths the case read).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from attnx._io import write_json_atomic
from attnx._signals import child_process
from attnx.bench._worker import run_spec, time_stats
from attnx.errors import AttnxError, ProviderUnavailable
from attnx.model import AttentionConfig, init_weights
from attnx.model.contract import provider_of_backend
from attnx.runtimes import ModelSource
from attnx.runtimes.package import load, verify_package
from attnx.runtimes.parity import run_parity

__all__ = ["WORKER_MAIN", "CaseKilled", "host_info", "main", "run_case", "run_case_process"]

WORKER_MAIN = "import sys; from attnx.matrix._worker import main; sys.exit(main())"
logger = logging.getLogger(__name__)


class CaseKilled(Exception):
    """The case's process died from a signal (killed, crashed): the case has no result. Ray
    retries a task that raises it (retry_exceptions); the local pool does the same."""


# In the case process ---------------------------------------------------------------------------
def _parity(spec: dict[str, Any]) -> dict[str, Any]:
    config = AttentionConfig.from_dict(spec["config"])
    source = ModelSource(config, init_weights(config, spec["seed"]), spec.get("model_path"), spec["dtype"])
    backends = [spec["backend"]]
    mem = [spec["mem_seq"]] if spec["mem_seq"] else None
    report = run_parity(source, backends, batches=[spec["batch"]], seqs=[spec["seq"]], mem_seqs=mem, seed=spec["seed"])
    (case,) = report.cases
    stats = {k: getattr(case, k) for k in ("max_abs", "max_rel", "mean_abs", "p99_abs", "cosine", "needed_atol",
                                          "atol", "rtol")}  # fmt: skip
    out = {"status": case.status, "reason": case.reason, "stats": None if case.status == "skipped" else stats}
    if case.localisation:  # a failing case says where it diverges (docs/concepts/localisation.md)
        out["localisation"] = case.localisation
        out["reason"] = f"{case.reason}; {case.localisation['line']}"
    return out


def _verify(spec: dict[str, Any]) -> dict[str, Any]:
    try:
        report = verify_package(spec["package"], spec["provider"])
    except ProviderUnavailable as e:
        return {"status": "skipped", "reason": str(e)}
    golden = [c for c in report.checks if c.stats is not None]
    # The golden output furthest from passing: the largest share of its tolerance it needs.
    worst = max(golden, key=lambda c: (c.stats["needed_atol"] or float("inf")) / max(c.stats["atol"], 1e-300),
                default=None)  # fmt: skip
    failed = report.failures()
    return {
        "status": "pass" if report.passed else "fail",
        "reason": "; ".join(f"{c.name}: {c.detail}" for c in failed)[:2000] or None,
        "stats": worst.stats if worst else None,
        "checks": [c.to_dict() for c in report.checks],
        "notes": report.notes,
    }


def _bench(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("package"):  # a package's model is timed only once its files have their hashes
        with load(spec["package"], provider_of_backend(spec["backend"]).name, check_files=True):
            pass
    worker_spec = {
        "kind": "case", "backend": spec["backend"], "attention": spec["lowering"], "dtype": spec["dtype"],
        "config": spec["config"], "batch": spec["batch"], "seq": spec["seq"], "mem_seq": spec["mem_seq"],
        "threads": spec.get("threads") or os.cpu_count() or 1, "repeat": spec["repeat"], "warmup": spec["warmup"],
        "seed": spec["seed"], "weights_path": None, "model_path": spec.get("model_path"),
    }  # fmt: skip
    result = run_spec(worker_spec)
    status = {"ok": "pass", "skipped": "skipped"}.get(result["status"], "fail")
    out: dict[str, Any] = {"status": status, "reason": result.get("reason"), "stats": None}
    if result["status"] == "ok":
        t = time_stats(result)
        out["bench"] = {
            **{k: t[k] for k in ("median_ms", "p10_ms", "p90_ms", "first_ms", "runs")},
            "peak_rss_mb": result.get("peak_rss_mb"),
            "threads": worker_spec["threads"],
            "timed": result.get("timed"),
        }
    return out


def _audit(spec: dict[str, Any]) -> dict[str, Any]:
    from attnx.workflows import audit_model  # onnx-ir: only in an audit case's process

    report = audit_model(spec["model_path"], checkpoint=spec.get("checkpoint"), layers=[spec["layer"]],
                         backends=[spec["backend"]])  # fmt: skip
    (block,) = report.blocks
    worst = block.worst()
    audit = {**block.to_dict(), "line": block.line(), "unread": report.unread, "skipped": report.skipped,
             "model": report.model, "checkpoint": report.checkpoint}  # fmt: skip
    if not block.checks and not block.findings and not block.not_checked and report.skipped:
        return {"status": "skipped", "reason": "; ".join(report.skipped), "stats": None, "audit": audit}
    # the verdict of `attnx audit MODEL --layers I`: the block passes and every attention node was read
    passed = block.passed and not report.unread
    reasons = [*block.findings, *block.not_checked, *(f"not read: {u}" for u in report.unread)]
    stats = None
    if worst is not None:
        stats = {**worst.stats(), "atol": worst.atol, "rtol": worst.rtol}
    return {"status": "pass" if passed else "fail", "reason": "; ".join(reasons)[:2000] or None, "stats": stats,
            "audit": audit}  # fmt: skip


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """The case's result (never raises for a backend that cannot run or a check that fails:
    those are results). An error of attnx's own (a bad package, a model that will not load) is a
    failed case with its message."""
    start = time.perf_counter()
    try:
        result = {"parity": _parity, "verify": _verify, "bench": _bench, "audit": _audit}[spec["job"]](spec)
    except ProviderUnavailable as e:
        result = {"status": "skipped", "reason": str(e)}
    except AttnxError as e:
        result = {"status": "fail", "reason": f"{type(e).__name__}: {e}"}
    except Exception as e:
        logger.debug("case failed", exc_info=True)
        first = str(e).strip().splitlines()
        result = {"status": "fail", "reason": f"{type(e).__name__}: {first[0] if first else ''}".rstrip(": ")}
    result["seconds"] = round(time.perf_counter() - start, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -c 'from attnx.matrix._worker import main; main()' SPEC.json RESULT.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    write_json_atomic(argv[1], run_case(spec))
    return 0


# The parent's side --------------------------------------------------------------------------------
def run_case_process(spec: dict[str, Any], workdir: str, name: str, timeout_s: float,
                     running: Any = None) -> dict[str, Any]:  # fmt: skip
    """Run one case in a process of its own and return its result. A process past timeout_s is
    killed (a failed case, saying so); one killed by a signal raises CaseKilled (the caller
    retries it). `running`, a set, holds the live process while it runs (the local pool kills
    what it holds on Ctrl-C)."""
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    result_path = os.path.join(workdir, f"{name}.result.json")
    log_path = os.path.join(workdir, f"{name}.log")
    with contextlib.suppress(FileNotFoundError):
        os.remove(result_path)  # a retry must not read the result of an attempt before it
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-c", WORKER_MAIN, spec_path, result_path]
    started = time.time()
    # A child that ends with its parent (attnx._signals.child_process): a session of its own, so a
    # Ctrl-C at the terminal reaches the driver, which stops the case itself (a case process must
    # not die of it first and be reported failed); SIGKILL when the parent (a Ray worker, the
    # driver) dies; killed when the block leaves early (Ctrl-C, a cancelled task).
    with open(log_path, "wb") as log, child_process(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                                    stderr=subprocess.STDOUT) as proc:  # fmt: skip
        if running is not None:
            running.add(proc)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"status": "fail", "reason": f"ran past the plan's timeout_s of {timeout_s:g} s: killed"}
        finally:
            if running is not None:
                running.discard(proc)
    if returncode == 0 and os.path.exists(result_path):
        with open(result_path, encoding="utf-8") as f:
            result = json.load(f)
        result["span"] = [started, time.time()]  # when the case's process ran (epoch seconds)
        return result
    with open(log_path, encoding="utf-8", errors="replace") as f:
        tail = [line.strip() for line in f.read().splitlines() if line.strip()][-1:]
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
        raise CaseKilled(f"the case process was killed by {sig}" + (f": {tail[0]}" if tail else ""))
    return {"status": "fail", "reason": f"the case process exited with status {returncode}"
            + (f": {tail[0][:500]}" if tail else "")}  # fmt: skip


def _gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("attnx", "onnxruntime-gpu", "onnxruntime", "torch", "numpy", "onnx", "ray"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


_KERNEL_FLAGS = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}


def host_info(node_id: str) -> dict[str, Any]:
    """Where a case ran: the host's name, CPU model and the flags that decide kernels, GPUs,
    the versions of the libraries that compute (read from their metadata, nothing imported)."""
    cpu, flags = platform.processor() or None, set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("model name") and cpu in (None, "", platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    versions = _versions()
    return {
        "hostname": socket.gethostname(),
        "node_id": node_id,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_flags": sorted(flags & _KERNEL_FLAGS),
        "gpus": _gpus(),
        "onnxruntime": versions.get("onnxruntime-gpu") or versions.get("onnxruntime"),
        "torch": versions.get("torch"),
        "versions": versions,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def case_job_spec(case: Any, plan: Any, source: Any) -> dict[str, Any]:
    """The worker's SPEC for a CaseSpec (paths of models and packages are filled in where the
    case runs)."""
    spec: dict[str, Any] = {
        "id": case.id, "job": case.job, "backend": case.backend, "lowering": case.lowering, "dtype": case.dtype,
        "batch": case.batch, "seq": case.seq, "mem_seq": case.mem_seq, "seed": plan.seed,
        "config": source.config.to_dict() if source.config is not None else None,
    }  # fmt: skip
    if case.job == "audit":
        spec["layer"] = case.layer
    if case.job == "verify":
        spec["provider"] = provider_of_backend(case.backend).name
    if case.job == "bench":
        axes = plan.jobs["bench"]
        spec.update(repeat=axes.repeat, warmup=axes.warmup, threads=axes.threads)
    return spec


if __name__ == "__main__":
    sys.exit(main())
