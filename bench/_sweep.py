"""The sweep: backends x lowerings x shapes, each case timed in a process of its own.

Order of work: one GEMM per backend and dtype (the roofline, and the probe that tells a
backend that cannot run here), one export per ORT lowering and dtype (reused by every
shape), then the cases from the shortest sequence up, every backend at one length before
the next length, so that a sweep stopped early still compares the backends. The JSON file
is rewritten (atomically) after every case: Ctrl-C keeps what was measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import itertools
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from attnx._signals import on_interrupt
from attnx.bench._costs import attention_flops, gemm_flops, gemm_shape
from attnx.bench._plan import BenchCase, BenchPlan, BenchReport, GemmResult
from attnx.bench._worker import run_worker, time_stats, write_gemm_model
from attnx.model import init_weights, load_weights
from attnx.model.contract import (
    backend_device,
    float_dtype,
    graph_dtype,
    host_dtype,
    quantized_form_unavailable,
    runs_onnx_model,
)
from attnx.model.inputs import make_inputs
from attnx.model.resources import (
    GB,
    available_memory_bytes,
    check_memory,
    estimate_case,
    estimate_export,
    meminfo_bytes,
)
from attnx.model.tolerance import ProblemSize, reduction_length, tolerance_for
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.compare import compare_arrays

__all__ = ["run_bench", "machine_info", "Progress"]

logger = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]  # (cases done, cases in all, what is happening)


def run_bench(
    plan: BenchPlan,
    json_path: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    meta: dict[str, Any] | None = None,
) -> BenchReport:
    """Measure every case of the plan. The report (and json_path, rewritten after each case)
    holds what was measured; Ctrl-C stops the sweep and returns it with interrupted True (in the
    CLI's process the signal watcher writes that JSON instead, and ends the process)."""
    plan.validate()
    say = progress or (lambda done, total, message: None)
    series = plan.series()
    if not plan.model_path:  # the sweep holds the weights to export each lowering: refuse now what cannot fit
        check_memory(estimate_export(plan.config, [], what="the weights and one export"), plan.max_mem_gb)
    # A weights file is read (and checked) now, before anything is measured or written.
    weights = load_weights(plan.weights_path, plan.config) if plan.weights_path else None
    shapes = plan.shapes()
    total = len(series) * len(shapes) * len(plan.dtypes)
    report = BenchReport(meta={**_meta(plan), **(meta or {})})

    def save() -> None:
        if json_path is not None:
            report.write_json(json_path)

    pending: list[BenchCase] = []  # the cases measured at the shape in progress, not yet in the report

    def keep_measured() -> str | None:
        """What Ctrl-C keeps in the CLI's process (attnx._signals ends it from its watcher, while
        this thread may still run: read as a snapshot): every measured case, interrupted."""
        if json_path is None:
            return None
        cases = list(report.cases)
        cases += [c for c in list(pending) if all(c is not k for k in cases)]
        dataclasses.replace(report, cases=cases, complete=False, interrupted=True).write_json(json_path)
        return f"kept {len(cases)} measured cases in {os.fspath(json_path)}"

    with tempfile.TemporaryDirectory(prefix="attnx-bench-") as workdir, on_interrupt(keep_measured):
        try:
            unavailable = _measure_gemms(plan, report, workdir, say, total)
            save()
            models, export_failed = _export_lowerings(plan, series, unavailable, workdir, say, total, weights)
            del weights
            _measure_cases(plan, report, series, shapes, unavailable, models, export_failed, workdir, say, total, save,
                           pending)  # fmt: skip
            say(len(report.cases), total, "rel RMS error of each case against the float64 module")
            _measure_accuracy(plan, report, workdir)
            report.complete = True
        except KeyboardInterrupt:
            logger.info("interrupted: keeping %d measured cases", len(report.cases))
            report.interrupted = True
        save()
    say(len(report.cases), total, "done" if report.complete else "interrupted")
    return report


def _meta(plan: BenchPlan) -> dict[str, Any]:
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "preset": plan.preset,
            "config": plan.config.to_dict(),
            "weights": plan.weights_path or f"seeded (seed {plan.seed})",
            "model_path": plan.model_path,
        },
        "settings": {
            "backends": list(plan.backends),
            "attentions": list(plan.attentions) if plan.attentions is not None else None,
            "batches": list(plan.batches),
            "seqs": list(plan.seqs),
            "mem_seqs": list(plan.mem_seqs) if plan.mem_seqs else None,
            "dtypes": list(plan.dtypes),
            "repeat": plan.repeat,
            "warmup": plan.warmup,
            "threads": plan.threads,
            "timeout_s": plan.timeout_s,
            "max_mem_gb": plan.max_mem_gb,
            "gemm_shape": list(gemm_shape(plan.config)),
        },
        "flop_model": (
            "2*b*t*d_model*N*head_dim (q) + 2*b*s*kv_dim*N*(head_dim+v_head_dim) (k, v) "
            "+ 2*b*N*t*s*(head_dim+v_head_dim) (scores, weighted sum) + 2*b*t*N*v_head_dim*d_model (output)"
        ),
        "machine": machine_info(),
    }


def machine_info() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    total_mem = meminfo_bytes("MemTotal")
    versions = {}
    for pkg in ("torch", "onnxruntime-gpu", "onnxruntime", "numpy"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(total_mem / 1024**3, 1) if total_mem else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _measure_gemms(plan: BenchPlan, report: BenchReport, workdir: str, say: Progress, total: int) -> dict[tuple, str]:
    """One GEMM per backend and dtype. Returns {(backend, dtype): reason} for the backends that
    cannot run here, found by the GEMM's own runner."""
    m, k, n = gemm_shape(plan.config)
    unavailable: dict[tuple, str] = {}
    for backend, dtype in itertools.product(plan.backends, plan.dtypes):
        if (reason := quantized_form_unavailable(backend, dtype)) is not None:
            # issue 12: the quantized forms are ONNX graphs; a backend that runs none (torch) skips them
            unavailable[(backend, dtype)] = reason
            report.gemm.append(GemmResult(backend, dtype, m, k, n, "skipped", unavailable[(backend, dtype)]))
            continue
        say(0, total, f"GEMM {m}x{k}x{n} {dtype} on {backend}")
        spec: dict[str, Any] = {
            "kind": "gemm", "backend": backend, "dtype": dtype, "m": m, "k": k, "n": n,
            "threads": plan.threads, "repeat": max(plan.repeat, 10), "warmup": max(plan.warmup, 2),
        }  # fmt: skip
        if runs_onnx_model(backend):  # a bf16 run reads the fp32 graph (graph_dtype)
            gemm_dtype = float_dtype(graph_dtype(dtype))  # a quantized form's roofline: the float32 GEMM
            spec["model_path"] = os.path.join(workdir, f"gemm-{gemm_dtype}.onnx")
            if not os.path.exists(spec["model_path"]):
                write_gemm_model(spec["model_path"], m, k, n, gemm_dtype)
        result = run_worker(spec, workdir, f"gemm-{backend}-{dtype}", plan.timeout_s)
        g = GemmResult(
            backend,
            dtype,
            m,
            k,
            n,
            result["status"],
            result.get("reason"),
            threads=plan.threads,
            timed=result.get("timed"),
        )
        if result["status"] == "ok":
            stats = time_stats(result)
            g.median_ms, g.runs = stats["median_ms"], stats["runs"]
            g.gflops = gemm_flops(m, k, n) / (g.median_ms * 1e-3) / 1e9
            g.peak_rss_mb = result.get("peak_rss_mb")
        elif result["status"] == "skipped":
            unavailable[(backend, dtype)] = result["reason"]
        else:
            logger.info("GEMM on %s (%s) %s: %s", backend, dtype, result["status"], result.get("reason"))
        report.gemm.append(g)
    return unavailable


def _export_lowerings(
    plan: BenchPlan,
    series: list[tuple[str, str]],
    unavailable: dict[tuple, str],
    workdir: str,
    say: Progress,
    total: int,
    weights: Any = None,
) -> tuple[dict[tuple, str], dict[tuple, str]]:
    """Export each ORT lowering once per dtype, for the ORT backends that can run here (with
    `weights`, or the plan's seeded ones).
    Returns ({(lowering, dtype): path}, {(lowering, dtype): why the export failed})."""
    models: dict[tuple, str] = {}
    failed: dict[tuple, str] = {}
    wanted = sorted(
        {
            (attention, dtype)
            for (backend, attention), dtype in itertools.product(series, plan.dtypes)
            if runs_onnx_model(backend) and (backend, dtype) not in unavailable
        }
    )
    if plan.model_path:
        return {key: plan.model_path for key in wanted}, failed
    for attention, dtype in wanted:
        # onnx-ir and onnxscript: imported when a sweep exports, never in a case's worker process
        from attnx.workflows import export_model

        path = os.path.join(workdir, f"model-{attention}-{graph_dtype(dtype)}.onnx")
        if (attention, graph_dtype(dtype)) in models:  # bf16 runs the fp32 graph: exported once
            models[(attention, dtype)] = path
            continue
        if (attention, graph_dtype(dtype)) in failed:
            failed[(attention, dtype)] = failed[(attention, graph_dtype(dtype))]
            continue
        if weights is None:
            weights = init_weights(plan.config, plan.seed)
        say(0, total, f"exporting the {attention} lowering ({graph_dtype(dtype)})")
        try:
            export_model(plan.config, path, weights, attention=attention, dtype=graph_dtype(dtype), validate=False)
            models[(attention, dtype)] = models[(attention, graph_dtype(dtype))] = path
        except Exception as e:  # noqa: BLE001 - a lowering that cannot be built yet is a skipped series, not a crash
            text = str(e).strip()
            failed[(attention, dtype)] = f"export failed: {type(e).__name__}: {text.splitlines()[0] if text else ''}"
            failed[(attention, graph_dtype(dtype))] = failed[(attention, dtype)]
            logger.info("%s lowering (%s): %s", attention, dtype, failed[(attention, dtype)])
    return models, failed


def _measure_cases(
    plan: BenchPlan,
    report: BenchReport,
    series: list[tuple[str, str]],
    shapes: list[tuple[int, int, int | None]],
    unavailable: dict[tuple, str],
    models: dict[tuple, str],
    export_failed: dict[tuple, str],
    workdir: str,
    say: Progress,
    total: int,
    save: Callable[[], None],
    pending: list[BenchCase] | None = None,
) -> None:
    """Each shape's cases, every runnable form per round. `pending` holds, at every moment, the
    cases of the shape in progress measured so far (what an interrupt keeps of that shape)."""
    pending = [] if pending is None else pending
    peaks = {(g.backend, g.dtype): g.gflops for g in report.gemm if g.status == "ok"}
    # (backend, attention, dtype, batch, mem_seq) -> the seq at which that series timed out or
    # was killed: longer sequences of it are not started (they would only do so again).
    stopped: dict[tuple, str] = {}
    for batch, seq, mem_seq in shapes:  # every form at one shape before the next shape
        group: list[BenchCase] = []
        for dtype, (backend, attention) in itertools.product(plan.dtypes, series):
            case = BenchCase(backend, attention, dtype, batch, seq, mem_seq, "skipped", threads=plan.threads)
            case.flops = attention_flops(plan.config, batch, seq, mem_seq)
            case.reason = _skip_reason(plan, case, unavailable, models, export_failed,
                                       stopped.get((backend, attention, dtype, batch, mem_seq)))  # fmt: skip
            group.append(case)
        base = len(report.cases)  # a case's index in the report names its output file (_measure_accuracy)
        runnable = [i for i, case in enumerate(group) if case.reason is None]
        best: dict[int, BenchCase] = {}  # each case's round with the lowest median (or its failure)
        halted: set[int] = set()  # timed out or killed: not again, nor its series' longer sequences
        try:
            for r in range(plan.rounds):
                # Rounds rotate the order, so that no form is always timed first (or last) of a shape
                # and a slow spell of the machine is not all one form's: the lowest median is kept.
                shift = r % len(runnable) if runnable else 0
                for i in runnable[shift:] + runnable[:shift]:
                    if i in best and best[i].status != "ok":
                        continue  # a round failed: that is the case's result
                    case = dataclasses.replace(group[i])
                    rounds = f" (round {r + 1}/{plan.rounds})" if plan.rounds > 1 else ""
                    say(base + len(best), total, f"{case.label} {case.dtype} batch {batch} seq {seq}{rounds}")
                    if _run_case(plan, case, models, workdir, base + i, peaks.get((case.backend, case.dtype))):
                        halted.add(i)
                    if case.status != "ok":
                        best[i] = case
                        pending[:] = [best[j] for j in sorted(best)]
                        continue
                    medians = [*(best[i].round_medians_ms or []), case.median_ms] if i in best else [case.median_ms]
                    if i not in best or case.median_ms < best[i].median_ms:
                        best[i] = case
                    best[i].round_medians_ms = medians
                    pending[:] = [best[j] for j in sorted(best)]
        except KeyboardInterrupt:  # keep what this shape measured so far
            report.cases.extend(best[i] for i in sorted(best))
            save()
            raise
        for i, case in enumerate(group):
            case = best.get(i, case)
            if i in halted:
                what = "timed out" if case.status == "timeout" else "was killed"
                stopped[(case.backend, case.attention, case.dtype, batch, mem_seq)] = (
                    f"not run: seq {seq} of this series {what}"
                )
            report.cases.append(case)
            save()
        pending.clear()


def _skip_reason(
    plan: BenchPlan,
    case: BenchCase,
    unavailable: dict[tuple, str],
    models: dict[tuple, str],
    export_failed: dict[tuple, str],
    stopped: str | None,
) -> str | None:
    backend, attention, dtype = case.backend, case.attention, case.dtype
    if (backend, dtype) in unavailable:
        return unavailable[(backend, dtype)]
    if not runs_onnx_model(backend) and plan.model_path:
        return (
            "torch runs the attnx module from a config and weights; "
            "--model gives only an ONNX file (use --preset or --config)"
        )
    if runs_onnx_model(backend) and (attention, dtype) not in models:
        return export_failed.get((attention, dtype), "no model for this lowering")
    if stopped:
        return stopped
    if backend_device(backend) != "cuda":  # the guard is for host memory; a GPU case fails on its own
        need = estimate_case(plan.config, backend, attention, case.batch, case.seq, case.mem_seq, dtype).total
        limit = plan.max_mem_gb * GB if plan.max_mem_gb else available_memory_bytes()
        if limit is not None and need > limit:
            return (
                f"not run: needs about {need / 1024**3:.1f} GB, {limit / 1024**3:.1f} GB "
                f"{'allowed (--max-mem-gb)' if plan.max_mem_gb else 'available'}"
            )
    return None


def _run_case(
    plan: BenchPlan, case: BenchCase, models: dict[tuple, str], workdir: str, index: int, peak: float | None
) -> bool:
    """Measure one case into `case`. True when it timed out or was killed: the longer
    sequences of its series would only do the same."""
    spec: dict[str, Any] = {
        "kind": "case", "backend": case.backend, "attention": case.attention, "dtype": case.dtype,
        "config": plan.config.to_dict(), "batch": case.batch, "seq": case.seq, "mem_seq": case.mem_seq,
        "threads": plan.threads, "repeat": plan.repeat, "warmup": plan.warmup,
        "weights_path": plan.weights_path, "seed": plan.seed,
        "model_path": models.get((case.attention, case.dtype)),
        "output_path": os.path.join(workdir, f"case{index}-y.npy") if backend_device(case.backend) != "cuda" else None,
    }  # fmt: skip
    result = run_worker(spec, workdir, f"case{index}", plan.timeout_s)
    case.status, case.reason = result["status"], result.get("reason")
    for key in ("peak_rss_mb", "import_rss_mb", "load_rss_mb", "load_s", "timed"):
        setattr(case, key, result.get(key))
    if case.status != "ok":
        return case.status == "timeout" or bool(result.get("killed"))
    for key, value in time_stats(result).items():
        setattr(case, key, value)
    seconds = case.median_ms * 1e-3
    case.tokens_per_s = case.batch * case.seq / seconds
    case.gflops = case.flops / seconds / 1e9
    case.peak_gflops = peak
    case.roofline = case.gflops / peak if peak else None
    if backend_device(case.backend) == "cuda":
        case.peak_mem_mb, case.mem_kind = result.get("gpu_peak_mb"), result.get("gpu_mem_kind")
    else:
        case.peak_mem_mb, case.mem_kind = case.peak_rss_mb, "peak RSS of the case process (VmHWM)"
    return False


# Accuracy (issue 12) -------------------------------------------------------------------------------
def _measure_accuracy(plan: BenchPlan, report: BenchReport, workdir: str) -> None:
    """Each measured CPU case's rel RMS error (attnx.runtimes.compare) against the attnx module run
    in float64 by torch on the same inputs (the worker's make_inputs), one reference per shape and
    input dtype. Not for --model (no weights) or where torch is missing: rel_rms stays None."""
    if plan.model_path or importlib.util.find_spec("torch") is None:
        return
    weights = (
        load_weights(plan.weights_path, plan.config) if plan.weights_path else init_weights(plan.config, plan.seed)
    )
    refs: dict[tuple, Any] = {}
    with create_runner("torch", ModelSource(plan.config, weights, None, "fp64"), core="sdpa") as module:
        for index, case in enumerate(report.cases):
            path = os.path.join(workdir, f"case{index}-y.npy")
            if case.status != "ok" or not os.path.exists(path):
                continue
            key = (case.batch, case.seq, case.mem_seq, host_dtype(case.dtype))
            feeds = make_inputs(plan.config, case.batch, case.seq, case.mem_seq, key[3])
            if key not in refs:
                f64 = {n: v.astype(np.float64) if v.dtype.kind == "f" else v for n, v in feeds.items()}
                refs = {key: module.run(f64)["y"]}  # one shape held at a time
            size = ProblemSize(reduction_length(plan.config, case.mem_seq or case.seq))
            case.rel_rms = compare_arrays("y", np.load(path), refs[key], tolerance_for("fp32"), size).rel_rms
            os.remove(path)
