"""The replica of `attnx serve --ray` (attnx.serve._ray): a Ray Serve deployment whose ASGI app is attnx.serve's own.

As Ray Serve's docs serve a FastAPI app (`@serve.deployment` over `@serve.ingress`), with the app built where the
replica lands (Serve's `__serve_build_asgi_app__`, called once the constructor returned): the constructor verifies
and loads the package (attnx.serve.server.load_service), then create_app serves it, route for route the API of
`attnx serve` without Ray. Every answer carries REPLICA_HEADER, the replica's id, so the load spread is visible.

Imports Ray Serve at the top: imported by attnx.serve._ray once Ray's environment is set, and by the replicas.
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from attnx.runtimes.base import THREADS_ENV
from attnx.serve.api import create_app
from attnx.serve.server import load_service

__all__ = ["REPLICA_HEADER", "PackageReplica"]

REPLICA_HEADER = "x-attnx-replica"


class _ReplicaHeader:
    """ASGI middleware: every response carries REPLICA_HEADER (the replica that answered)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(),
                                                                                 self.replica)]}  # fmt: skip
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class PackageReplica:
    """One replica: the package verified and loaded where it landed (load_service), served by create_app.

    package: the absolute path every node reads; options: load_service's keywords and `grace_s` (the time the
    engine loop gives the requests it holds when Serve stops the replica); threads: onnxruntime's threads."""

    def __init__(self, package: str, options: dict[str, Any], threads: int) -> None:
        os.environ[THREADS_ENV] = str(threads)  # the replica's CPUs: read when its sessions are made
        options = dict(options)
        self.grace_s = float(options.pop("grace_s"))
        self.service = load_service(package, **options)  # CheckFailed naming the check: the deployment fails
        self.replica = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.service)
        app.add_middleware(_ReplicaHeader, replica=self.replica)
        return app

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine loop failed is replaced."""
        if self.service.loop.failure is not None:
            raise RuntimeError(f"the engine loop failed: {self.service.loop.failure}")

    def __del__(self) -> None:  # Serve's graceful shutdown waited for the requests in flight first
        service = getattr(self, "service", None)
        if service is not None:
            self.service = None
            service.close(self.grace_s)
