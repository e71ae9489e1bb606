"""The driver: the plan's cases, what they need prepared (one export per source, lowering and
dtype), an executor to run them (a local process pool, or Ray: attnx.matrix._ray), and the
report rewritten after every finished case.

An executor runs WorkItems and calls on_result(item, result, host) in the driver's thread for
each finished one: result is the case worker's RESULT (attnx.matrix._worker), or a status the
executor decided (lost, unschedulable) with its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from attnx._io import check_output_parent, output_lock, write_json_atomic
from attnx._signals import on_interrupt
from attnx.errors import UsageError
from attnx.matrix._plan import CaseSpec, MatrixPlan, Source
from attnx.matrix._report import MatrixReport, host_key
from attnx.matrix._worker import CaseKilled, case_job_spec, host_info, run_case_process
from attnx.model.contract import provider_of_backend

__all__ = ["LocalExecutor", "Progress", "WorkItem", "run_matrix"]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

# The width of the int8 models a plan exports (attnx.model.int8): 7, safe on every host a plan runs on.
MATRIX_INT8_BITS = 7


@dataclasses.dataclass
class WorkItem:
    """A case with its worker SPEC and the files it needs: an exported model or a model to audit
    (model_files, the model first), an audit's checkpoint (checkpoint_root, checkpoint_files) or a
    package (package_root; package_model names its model for a bench case)."""

    case: CaseSpec
    spec: dict[str, Any]
    model_files: list[str] | None = None
    package_root: str | None = None
    package_manifest: dict[str, Any] | None = None
    package_model: str | None = None
    checkpoint_root: str | None = None
    checkpoint_files: list[str] | None = None
    attempts: int = 0


# The local pool ------------------------------------------------------------------------------------
class LocalExecutor:
    """Runs the cases on this machine, each in a process of its own, `jobs` at a time; the timed
    (bench) cases afterwards, one at a time with nothing else running. A case whose process is
    killed is run again, up to the plan's retries, then reported lost. Ray is never imported."""

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs or os.cpu_count() or 1
        self.running: set[subprocess.Popen] = set()
        self.stopping = threading.Event()

    def describe(self) -> str:
        return f"local ({self.jobs} processes)"

    def _one(self, item: WorkItem, plan: MatrixPlan, workdir: str) -> dict[str, Any]:
        spec = dict(item.spec)
        if item.model_files:
            spec["model_path"] = item.model_files[0]
        if item.checkpoint_root:
            spec["checkpoint"] = item.checkpoint_root
        if item.package_root:
            spec["package"] = item.package_root
            if item.package_model:
                spec["model_path"] = os.path.join(item.package_root, item.package_model)
        reasons = []
        for attempt in range(plan.retries + 1):
            if self.stopping.is_set():
                raise KeyboardInterrupt
            item.attempts = attempt + 1
            try:
                return run_case_process(spec, workdir, f"case-{id(item)}-{attempt}", plan.timeout_s, self.running)
            except CaseKilled as e:
                reasons.append(str(e))
        return {"status": "lost", "reason": f"{reasons[-1]} ({len(reasons)} attempts, {plan.retries} retries)"}

    def run(self, items: list[WorkItem], plan: MatrixPlan, report: MatrixReport,
            on_result: Callable[[WorkItem, dict[str, Any], dict[str, Any]], None]) -> None:  # fmt: skip
        host = host_info("local")
        untimed = [i for i in items if not i.case.timed]
        timed = [i for i in items if i.case.timed]
        with tempfile.TemporaryDirectory(prefix="attnx-matrix-") as workdir:
            pool = ThreadPoolExecutor(max_workers=self.jobs)
            try:
                futures = {pool.submit(self._one, item, plan, workdir): item for item in untimed}
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    for fut in done:
                        on_result(futures[fut], fut.result(), host)
                for item in timed:  # alone: nothing else runs beside a timed case
                    on_result(item, self._one(item, plan, workdir), host)
            except BaseException:
                self.stopping.set()
                for proc in list(self.running):
                    with contextlib.suppress(OSError):
                        proc.kill()
                raise
            finally:
                pool.shutdown(wait=True, cancel_futures=True)


# Preparing -----------------------------------------------------------------------------------------
def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def _attnx_version() -> str:
    try:
        return version("attnx")
    except PackageNotFoundError:
        return "unknown"


def _export(plan: MatrixPlan, source: Source, lowering: str, dtype: str, models_dir: str,
            progress: Progress) -> list[str]:  # fmt: skip
    """The model of `source` at `lowering` and `dtype` (seeded weights): exported once into
    models_dir, reused while its key file says it is the same export."""
    base = os.path.join(models_dir, f"{_slug(source.label)}-{lowering}-{dtype}")
    path, key_path = base + ".onnx", base + ".key.json"
    # int8 at 7 bits, never the exporting host's auto: a plan's models run on every host of the cluster, and
    # 8-bit weights run only on a CPU with VNNI (attnx.model.int8)
    quant = {"int8_bits": MATRIX_INT8_BITS} if dtype == "int8" else {}
    key = {"config": source.config.to_dict(), "lowering": lowering, "dtype": dtype, "seed": plan.seed,
           "attnx": _attnx_version(), **quant}  # fmt: skip
    with contextlib.suppress(OSError, ValueError), open(key_path, encoding="utf-8") as f:
        if json.load(f) == key and os.path.isfile(path):
            return [p for p in (path, path + ".data") if os.path.isfile(p)]
    # onnx-ir, onnxscript and torch: imported only when a plan needs a model exported
    from attnx.workflows import export_model

    progress(f"exporting {source.label} with the {lowering} lowering ({dtype})")
    export_model(source.config, path, None, seed=plan.seed, attention=lowering, dtype=dtype, validate=False, **quant)
    write_json_atomic(key_path, key)
    return [p for p in (path, path + ".data") if os.path.isfile(p)]


def _package_model(manifest: dict[str, Any], backend: str) -> str | None:
    provider = provider_of_backend(backend)
    return next((m["file"] for m in manifest["models"] if provider and provider.name in m["providers"]), None)


def _prepare(plan: MatrixPlan, cases: list[CaseSpec], out: str, progress: Progress
             ) -> tuple[list[WorkItem], list[tuple[CaseSpec, str]]]:  # fmt: skip
    """(work items, cases that cannot run with the reason: their model did not export)."""
    items, failed = [], []
    exported: dict[tuple, list[str] | str] = {}
    models_dir = os.path.join(out, "models")
    for case in cases:
        source = plan.source(case.source)
        item = WorkItem(case, case_job_spec(case, plan, source))
        if case.job == "audit":  # the model's files as the plan listed them (each checked inside its folder)
            item.model_files = list(source.files)
            if source.checkpoint:
                item.checkpoint_root, item.checkpoint_files = source.checkpoint, list(source.checkpoint_files)
        elif source.kind == "package":
            item.package_root, item.package_manifest = source.path, source.manifest
            if case.job == "bench":
                item.package_model = _package_model(source.manifest, case.backend)
                if item.package_model is None:
                    failed.append((case, f"the package has no model for {case.backend}"))
                    continue
        elif provider_of_backend(case.backend) is not None:
            key = (source.label, case.lowering, case.dtype)
            if key not in exported:
                os.makedirs(models_dir, exist_ok=True)
                try:
                    exported[key] = _export(plan, source, case.lowering, case.dtype, models_dir, progress)
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # noqa: BLE001 (a lowering that does not export: its cases are skipped, with why)
                    first = str(e).strip().splitlines()
                    exported[key] = f"export failed: {type(e).__name__}: {first[0] if first else ''}"
            if isinstance(exported[key], str):
                failed.append((case, exported[key]))
                continue
            item.model_files = exported[key]
        items.append(item)
    return items, failed


# The driver ----------------------------------------------------------------------------------------
def run_matrix(plan: MatrixPlan, out: str | os.PathLike[str], executor: Any, *, resume: bool = False,
               progress: Progress | None = None) -> MatrixReport:  # fmt: skip
    """Run the plan's cases with `executor` into out/report.json and out/report.md (rewritten
    after every finished case). With resume, the finished cases of out/report.json (pass, fail,
    skipped) are kept and not run again. Ctrl-C stops the run and returns the report with
    interrupted True; every finished case is in it. (In the CLI's process the signal watcher
    writes that report, kills the case processes and ends the process: attnx._signals.)"""
    say = progress or (lambda message: None)
    out = os.path.abspath(os.fspath(out))
    check_output_parent(out, "--out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out!r} is a file, not a folder")
    os.makedirs(out, exist_ok=True)
    report_path = os.path.join(out, "report.json")
    with output_lock(report_path):
        report = MatrixReport(plan, executor.describe(), out)
        if os.path.exists(report_path):
            if not resume:
                raise UsageError(f"{report_path!r} exists: --resume continues it, or choose another --out")
            kept = report.resume_from(report_path)
            say(f"resuming: {kept} finished cases kept from {report_path}")
        cases = [c for c in plan.cases() if c.id not in report.cases]
        total, start = len(report.order), time.perf_counter()
        say(f"{len(cases)} of {total} cases to run ({executor.describe()})")

        def record(case: CaseSpec, result: dict[str, Any], host: dict[str, Any] | None, attempts: int) -> None:
            report.add({
                **case.to_dict(),
                "status": result["status"],
                "reason": result.get("reason"),
                "stats": result.get("stats"),
                "bench": result.get("bench"),
                **({k: result[k] for k in ("checks", "localisation", "audit", "worker_pid", "span") if k in result}),
                "host": host,
                "attempts": attempts,
                "seconds": result.get("seconds"),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            })  # fmt: skip
            report.write()
            say(f"{len(report.cases)}/{total} {result['status']} {case.id} on {host_key(host)}")

        def keep_finished() -> str:
            """What Ctrl-C keeps in the CLI's process (attnx._signals ends it from its watcher
            while the driver's threads may still run; a report changed under it is retried):
            the finished cases, the report marked interrupted; the running ones are dropped."""
            report.interrupted = True
            report.write()
            return f"kept {len(report.cases)} finished cases in {report_path} (--resume continues)"

        try:
            with on_interrupt(keep_finished):
                items, failed = _prepare(plan, cases, out, say)
                for case, reason in failed:
                    record(case, {"status": "skipped", "reason": reason}, host_info("local"), 0)
                report.write()
                if items:
                    executor.run(items, plan, report, lambda item, result, host: record(item.case, result, host,
                                                                                        item.attempts))  # fmt: skip
            report.complete = len(report.cases) == total
        except KeyboardInterrupt as e:  # Ctrl-C in a library caller: the caller re-raises it (exit 130)
            report.interrupted, report.interrupt = True, e
        finally:
            report.write()
        say(f"{'interrupted' if report.interrupted else 'done'} after {time.perf_counter() - start:.1f} s")
    return report
