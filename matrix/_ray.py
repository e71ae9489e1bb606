"""The Ray executor: each case a Ray task placed on a node that has the resources it requires.

ray is imported inside this module's functions only: the local path (attnx matrix without
--ray) never imports it, and attnx works without it installed (the `ray` extra).

- Placement: a case asks for one CPU (or the plan's requirement of its backend: "CPU", "GPU" and
  custom resources such as {"cpu_amx": 1}); a bench case also holds the node's BENCH_SLOT, which
  a node declares once (`ray start --resources '{"attnx_bench_slot": 1}'`): at most one timed
  case per node at a time.
- Content: package files, exported models, audited models and their checkpoints go into the
  object store in parts of at most PART_BYTES, once per sha256; the task writes them into the
  node's cache, checking every name and hash (attnx.matrix._content).
- Faults: a task whose Ray worker dies, or whose case process is killed (CaseKilled), is retried
  by Ray (max_retries, retry_exceptions) and then reported lost with the reason; a case no node
  can hold (its resources exist on no node of the cluster) is cancelled after the plan's
  unschedulable_timeout_s and reported unschedulable, naming what is missing.
- Ctrl-C cancels every task (force: their workers and case processes end) and returns; in the
  CLI's process the signal watcher cancels them (attnx._signals), for at most CANCEL_LIMIT_S.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from attnx._io import Staging
from attnx._ray import RayConnection
from attnx._signals import on_interrupt
from attnx.errors import UsageError
from attnx.matrix._content import bundle_parts, cache_root, files_bundle, materialize, package_bundle, part_digests
from attnx.matrix._plan import BENCH_SLOT, MatrixPlan
from attnx.matrix._report import MatrixReport
from attnx.matrix._worker import CaseKilled, host_info, run_case_process

__all__ = ["RayExecutor", "feasible", "placement", "run_on_node"]

logger = logging.getLogger(__name__)
CANCEL_LIMIT_S = 10.0  # how long an interrupt waits for Ray to cancel the tasks and stop


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError(
            "attnx matrix --ray needs Ray, which this installation lacks: pip install 'attnx[ray]'"
        ) from None
    return ray


def run_on_node(spec: dict[str, Any], bundles: dict[str, Any], blobs: dict[str, Any], timeout_s: float
                ) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The Ray task: fetch the case's files by content, run the case in a process of its own,
    return (result, host). Raises CaseKilled when that process is killed (Ray retries it)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    spec = dict(spec)

    def fetch(digest: str) -> bytes:
        return ray.get(blobs[digest])

    if "package" in bundles:
        folder = materialize(bundles["package"], fetch)
        spec["package"] = folder
        if bundles.get("package_model"):
            spec["model_path"] = os.path.join(folder, bundles["package_model"])
    if "model" in bundles:
        folder = materialize(bundles["model"], fetch)
        spec["model_path"] = os.path.join(folder, bundles["model_name"])
    if "checkpoint" in bundles:
        spec["checkpoint"] = materialize(bundles["checkpoint"], fetch)
    # The case's folder is a stage of attnx._io: removed when the task ends, and the one a killed
    # worker left is removed by the next case on this node (its process is provably gone).
    os.makedirs(cache_root(), mode=0o700, exist_ok=True)
    with Staging(os.path.join(cache_root(), "case"), folder=True) as stage:
        name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in spec["id"])
        result = run_case_process(spec, stage.path(), name, timeout_s)
    result["worker_pid"] = os.getpid()
    return result, host_info(node_id)


def placement(case: Any) -> tuple[dict[str, float], dict[str, Any]]:
    """(every resource the case needs, the task options that ask Ray for them)."""
    custom = dict(case.requires)
    cpus = custom.pop("CPU", 1.0)
    gpus = custom.pop("GPU", 0.0)
    if case.timed:
        custom[BENCH_SLOT] = 1.0
    need = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **custom}
    options = {"num_cpus": cpus, "num_gpus": gpus, "resources": custom}
    return need, options


def feasible(need: dict[str, float], nodes: dict[str, dict[str, Any]]) -> bool:
    """Whether any alive node has, in all, every resource of `need`."""
    return any(all(n["resources"].get(k, 0.0) >= v for k, v in need.items()) for n in nodes.values())


def _nodes(ray: Any) -> dict[str, dict[str, Any]]:
    return {
        n["NodeID"]: {"address": n.get("NodeManagerAddress"), "hostname": n.get("NodeManagerHostname"),
                      "resources": {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:")}}
        for n in ray.nodes() if n.get("Alive")
    }  # fmt: skip


def _missing(need: dict[str, float], nodes: dict[str, dict[str, Any]]) -> str:
    have: dict[str, float] = {}
    for n in nodes.values():
        for k, v in n["resources"].items():
            have[k] = max(have.get(k, 0.0), v)
    short = [f"{k}: {v:g} (the most any node has: {have.get(k, 0):g})" for k, v in need.items() if have.get(k, 0) < v]
    hint = (f"; a node takes bench cases when started with --resources '{{\"{BENCH_SLOT}\": 1}}'"
            if any(k == BENCH_SLOT for k, v in need.items() if have.get(k, 0) < v) else "")  # fmt: skip
    return f"no node of the cluster ({len(nodes)} alive) has {', '.join(short)}{hint}"


def _lost_or_failed(ray: Any, error: BaseException, retries: int) -> dict[str, Any]:
    """The result of a task that raised: lost when its process or worker died (after Ray's
    retries), failed when the task itself refused to run (a file that did not match its hash)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:500]
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = getattr(error, "cause", None)
        if isinstance(cause, CaseKilled):
            return {"status": "lost", "reason": f"{cause} (and in each of Ray's {retries} retries)"}
        if cause is not None:
            return {"status": "fail", "reason": f"{type(cause).__name__}: {cause}"}
    what = type(error).__name__
    return {"status": "lost", "reason": f"{what}: its Ray worker or node died, {retries} retries used: {first}"}


class RayExecutor:
    """Runs the cases as Ray tasks on the cluster at `address`: "local" (a cluster started on
    this machine for the run, with one bench slot), "auto" (the cluster `ray start` runs on this
    machine), HOST:PORT (the cluster's GCS), or ray://HOST:PORT (Ray Client, needs ray[client])."""

    def __init__(self, address: str, poll_s: float = 0.5) -> None:
        if importlib.util.find_spec("ray") is None:
            _import_ray()  # the one error saying what to install
        self.connection = RayConnection(address)  # the address checked before any work
        self.address = address
        self.poll_s = poll_s

    def describe(self) -> str:
        return f"ray {self.address}"

    def run(self, items: list[Any], plan: MatrixPlan, report: MatrixReport,
            on_result: Callable[[Any, dict[str, Any], dict[str, Any] | None], None]) -> None:  # fmt: skip
        self.connection.prepare()  # a local cluster's token, before ray is imported (attnx._ray)
        ray = _import_ray()
        pending: dict[Any, tuple[Any, float, dict[str, float]]] = {}

        def cancel() -> None:
            """Ctrl-C in the CLI's process (attnx._signals' watcher, for at most CANCEL_LIMIT_S):
            nothing of ours keeps running on the cluster, and a local cluster stops."""
            for ref in list(pending):
                ray.cancel(ref, force=True)
            ray.shutdown()

        stack = contextlib.ExitStack()
        stack.enter_context(on_interrupt(cancel, limit_s=CANCEL_LIMIT_S))
        try:
            self.connection.init(ray, resources={BENCH_SLOT: 1})
            nodes = _nodes(ray)
            report.nodes.update(nodes)
            task = ray.remote(run_on_node)
            blobs: dict[str, Any] = {}

            def put(bundle: dict[str, Any], paths: dict[str, str]) -> None:
                for name in bundle["files"]:  # a part at a time: a data file larger than this machine's memory too
                    for digest, data in bundle_parts(bundle, name, paths[name], skip=blobs.__contains__):
                        blobs[digest] = ray.put(data)
                        del data

            bundled: dict[str, dict[str, Any]] = {}
            for item in items:
                bundles: dict[str, Any] = {}
                if item.package_root:
                    if item.package_root not in bundled:
                        bundled[item.package_root] = package_bundle(item.package_root, item.package_manifest)
                        put(bundled[item.package_root], {n: os.path.join(item.package_root, n)
                                                         for n in bundled[item.package_root]["files"]})  # fmt: skip
                    bundles["package"] = bundled[item.package_root]
                    bundles["package_model"] = item.package_model
                if item.model_files:
                    key = item.model_files[0]
                    if key not in bundled:
                        bundled[key] = files_bundle(item.model_files)
                        put(bundled[key], {os.path.basename(p): p for p in item.model_files})
                    bundles["model"] = bundled[key]
                    bundles["model_name"] = os.path.basename(key)
                if item.checkpoint_files:
                    key = f"checkpoint:{item.checkpoint_root}"
                    if key not in bundled:
                        bundled[key] = files_bundle(item.checkpoint_files)
                        put(bundled[key], {os.path.basename(p): p for p in item.checkpoint_files})
                    bundles["checkpoint"] = bundled[key]
                need, options = placement(item.case)
                needed = {d: blobs[d] for b in (bundles.get("package"), bundles.get("model"), bundles.get("checkpoint"))
                          if b for d in part_digests(b)}  # fmt: skip
                ref = task.options(**options, max_retries=plan.retries, retry_exceptions=[CaseKilled]).remote(
                    item.spec, bundles, needed, plan.timeout_s
                )
                item.attempts = None
                pending[ref] = (item, time.monotonic(), need)
            checked = time.monotonic()
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.poll_s)
                for ref in ready:
                    item, _, _ = pending.pop(ref)
                    try:
                        result, host = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        result, host = _lost_or_failed(ray, e, plan.retries), None
                    on_result(item, result, host)
                now = time.monotonic()
                if now - checked >= 2.0:  # nodes join and leave: judge feasibility on the live ones
                    nodes, checked = _nodes(ray), now
                    report.nodes.update(nodes)
                for ref, (item, submitted, need) in list(pending.items()):
                    if now - submitted >= plan.unschedulable_timeout_s and not feasible(need, nodes):
                        ray.cancel(ref, force=False)
                        del pending[ref]
                        reason = f"{_missing(need, nodes)}; waited {plan.unschedulable_timeout_s:g} s"
                        on_result(item, {"status": "unschedulable", "reason": reason}, None)
        except BaseException:
            for ref in pending:  # Ctrl-C: nothing of ours keeps running on the cluster
                try:
                    ray.cancel(ref, force=True)
                except Exception:
                    logger.debug("cancel failed", exc_info=True)
            raise
        finally:
            stack.close()
            self.connection.close(ray)
