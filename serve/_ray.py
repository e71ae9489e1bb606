"""attnx serve --ray: replicas of a verified package on Ray Serve, behind one endpoint.

Each replica is a Ray Serve deployment's replica (`@serve.deployment` with `@serve.ingress`, as Ray Serve's own docs
serve a FastAPI app) whose ASGI app is attnx.serve's own (create_app over a Service built by load_service): the API
is the one `attnx serve` answers without Ray, route for route. The app is built where the replica lands, once the
replica verified and loaded the package (Ray Serve's `__serve_build_asgi_app__`), so no replica answers before its
own checks passed.

- The package: read from the same absolute path on every node that holds a replica (a local cluster, a shared
  filesystem, or the same copy at the same path on each machine); nothing is shipped. Each replica runs attnx
  verify's checks where it lands (every file's sha256, the golden generations replayed), so a node whose copy
  differs fails by name instead of serving something else.
- Ready: serve.run returns once every replica's constructor returned, that is once every replica verified; only
  then is the endpoint announced. A replica that fails to verify is not retried (the checks are deterministic): the
  deployment fails, the app is deleted and the command exits 1 naming the check.
- Placement: `--replica-cpus` is each replica's num_cpus (Ray places it on a node with that many free CPUs) and
  its onnxruntime intra-op threads.
- Ends: SIGTERM (attnx._signals' watcher) deletes the Serve app, whose replicas get `grace_s` for the requests
  they hold (Serve's graceful shutdown, then each replica closes its engine loop); a local cluster this command
  started is shut down with it.

Imported by `attnx serve --ray` alone: `attnx serve` without it never imports Ray.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

from attnx import errors
from attnx._ray import RayConnection, first_line
from attnx._signals import on_interrupt
from attnx.errors import AttnxError, CheckFailed, UsageError
from attnx.runtimes.engine_loop import PREFILL_CHUNK

__all__ = ["APP_NAME", "need_ray", "serve_on_ray"]

log = logging.getLogger(__name__)

APP_NAME = "attnx"  # the Serve application's name on the cluster
INSTALL_HINT = "pip install 'attnx[serve-ray]'"
SHUTDOWN_MARGIN_S = 20.0  # past the grace period: the time deleting the app and stopping a local cluster may take
# Ray Serve's own settings for a local cluster this command starts (a user's own values are kept). Serve's
# controller kills an HTTP proxy that is not ready within 5 s, and serve.start then fails with ActorDiedError; a
# loaded host starts it slower than that (b0b5735 says how it was seen). serve.start itself waits up to 60 s for
# the proxy; so may the check.
LOCAL_SERVE_SETTINGS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}


def need_ray() -> None:
    """UsageError with the install hint where Ray is not installed (Ray Serve's own packages: _import_serve)."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError(f"attnx serve --ray needs Ray Serve, which this installation lacks: {INSTALL_HINT}")


def _import_serve() -> tuple[Any, Any]:
    """(ray, ray.serve), or UsageError with the install hint (Ray without its serve extra lacks what Serve needs)."""
    need_ray()
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise UsageError(f"attnx serve --ray needs Ray Serve, which this installation lacks ({e}): "
                         f"{INSTALL_HINT}") from None  # fmt: skip
    return ray, serve


def serve_on_ray(package: str, address: str, *, replicas: int = 1, replica_cpus: float = 1.0,
                 host: str = "127.0.0.1", port: int = 8000, provider: str = "cpu", max_batch: int | None = None,
                 max_queue: int = 64, max_model_len: int | None = None, prefill_chunk: int | None = PREFILL_CHUNK,
                 name: str | None = None, grace_s: float = 30.0, progress: Callable[[str], None] = lambda _m: None,
                 on_listening: Callable[[str], None] = lambda _url: None) -> int:  # fmt: skip
    """Deploy `replicas` replicas of the package on the Ray cluster at `address` ("local": one started here for the
    command; "auto"; HOST:PORT), behind Ray Serve's HTTP endpoint at host:port, and serve until a signal ends the
    process (the module doc). CheckFailed when a replica fails to verify, UsageError for a cluster not reached."""
    need_ray()
    package = os.path.abspath(package)  # the path every node reads
    if address == "local" and not os.path.isdir(package):
        raise UsageError(f"{package}: no such package folder")
    if port == 0:
        port = _free_port(host)  # Serve's proxy takes a number: a free one on this machine (a local cluster's)
    cluster = _Cluster(address)  # the address checked before any Ray work
    name = name or os.path.basename(package)
    options = {"provider": provider, "max_batch": max_batch, "max_queue": max_queue, "max_model_len": max_model_len,
               "prefill_chunk": prefill_chunk, "name": name, "grace_s": grace_s}  # fmt: skip
    deployed = False

    def shut_down(interrupted: bool = True) -> str:
        """Delete the app (its replicas drain for up to grace_s), stop a local cluster: the note for the line. On a
        signal it runs in the watcher's thread, which removes the cluster's folder itself (and holds the lock that
        forgetting it would take)."""
        if deployed:
            with contextlib.suppress(Exception):
                cluster.serve.delete(APP_NAME, _blocking=True)
        cluster.close(remove_folder=not interrupted)
        return f"the Serve app and its {replicas} replicas shut down" + (", the local Ray cluster stopped"
                                                                         if address == "local" else "")  # fmt: skip

    with on_interrupt(shut_down, limit_s=grace_s + SHUTDOWN_MARGIN_S):
        try:
            ray, serve = cluster.start()
            from attnx.serve._replica import PackageReplica  # Ray Serve imported, in Ray's environment

            progress(f"Ray cluster {address}: {_cpus(ray)} CPUs; deploying {replicas} replicas of {package} "
                     f"({replica_cpus:g} CPUs each), each verifying it where it lands")  # fmt: skip
            _start_serve(ray, serve, address, host, port)
            if address != "local" and APP_NAME in serve.status().applications:  # serve.run would replace it
                raise UsageError(f"--ray {address}: the cluster already serves an app named {APP_NAME!r} (another "
                                 "attnx serve --ray); a cluster holds one")  # fmt: skip
            replica = serve.deployment(PackageReplica, name="package").options(
                num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus},
                max_ongoing_requests=(max_batch or 16) + max_queue,  # the replica's own queue answers 429 past it
                max_constructor_retry_count=1,  # a failed verify fails again: said at once, not retried 20 times
                graceful_shutdown_timeout_s=grace_s, graceful_shutdown_wait_loop_s=min(grace_s, 1.0) or 0.1,
            )  # fmt: skip
            deployed = True
            try:
                serve.run(replica.bind(package, options, max(1, int(replica_cpus))), name=APP_NAME, route_prefix="/")
            except RuntimeError as e:  # Serve says the deployment failed; its status holds the replica's error
                raise _replica_failure(str(e), _deployment_messages(serve)) from None
            progress(f"verified and loaded: {replicas} replicas")
            on_listening(f"http://{host if ':' not in host else f'[{host}]'}:{port}")
            while True:  # the replicas serve; the watcher ends the process on a signal
                time.sleep(3600)
        except BaseException:
            shut_down(interrupted=False)
            raise


def _start_serve(ray: Any, serve: Any, address: str, host: str, port: int) -> None:
    """Ray Serve's controller and HTTP proxy at host:port; UsageError naming why not (a proxy killed or not ready in
    time is the machine's or the cluster's state, as a cluster that cannot start is: RayConnection.init)."""
    try:
        serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    except (TimeoutError, ray.exceptions.RayError) as e:
        where = "Ray could not start on this machine" if address == "local" else "Ray Serve could not start there"
        raise UsageError(f"--ray {address}: {where}: Serve's HTTP proxy did not start ({type(e).__name__}: "
                         f"{first_line(e)})") from None  # fmt: skip


def _deployment_messages(serve: Any) -> str:
    """What Serve's status says of the app's deployments (a failed replica's traceback among it)."""
    try:
        app = serve.status().applications[APP_NAME]
    except Exception:  # noqa: BLE001 - the status is a detail of an error already being reported
        return ""
    return "\n".join([app.message, *(d.message for d in app.deployments.values())])


def _replica_failure(error: str, status: str) -> AttnxError:
    """The error a failed deployment gives, as attnx says it: the replica's own attnx error where its traceback
    holds one (CheckFailed naming the check: exit 1; a UsageError such as a folder that is no package: exit 2),
    else Serve's words (exit 1)."""
    for line in status.splitlines():
        found = re.match(r"\s*attnx\.errors\.(\w+): (.+)", line)
        kind = getattr(errors, found.group(1), None) if found else None
        if isinstance(kind, type) and issubclass(kind, AttnxError):
            return (UsageError if issubclass(kind, UsageError) else CheckFailed)(f"a replica: {found.group(2)}")
    last = next((line.strip() for line in reversed(status.splitlines()) if line.strip()), "")
    return CheckFailed(f"the Serve deployment failed: {error}" + (f" ({last[:500]})" if last else ""))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("0.0.0.0", "::") else "127.0.0.1", 0))
        return s.getsockname()[1]


def _cpus(ray: Any) -> str:
    return f"{ray.cluster_resources().get('CPU', 0):g}"


class _Cluster:
    """The Ray connection of the command (attnx._ray.RayConnection: a local cluster started, and stopped, here, or
    an existing one joined) and Ray Serve on it."""

    def __init__(self, address: str) -> None:
        self.connection = RayConnection(address)
        self.ray: Any = None
        self.serve: Any = None

    def start(self) -> tuple[Any, Any]:
        """(ray, ray.serve), connected."""
        self.connection.prepare(LOCAL_SERVE_SETTINGS)
        self.ray, self.serve = _import_serve()
        self.connection.init(self.ray)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines are not the command's
        return self.ray, self.serve

    def close(self, remove_folder: bool = True) -> None:
        """Stop Serve on a local cluster, and the cluster; leave an existing cluster (and its Serve) running."""
        if self.ray is not None and self.connection.local and self.ray.is_initialized():
            with contextlib.suppress(Exception):
                self.serve.shutdown()
        self.connection.close(self.ray, remove_folder)
