"""serve_package: what `attnx serve` runs. The package is verified (attnx verify's checks: its files' hashes, its
golden generations replayed), loaded, its engine loop started, and only then does the server listen (uvicorn).

SIGTERM (or Ctrl-C) in the attnx process: attnx._signals' watcher runs drain(): /health and new requests answer
503, the requests accepted are served for up to `grace_s` seconds, the rest end with finish_reason "abort", their
last events are sent, and the process ends with 143 (130 for Ctrl-C) as every attnx command does. uvicorn's own
signal handlers are not installed (they would take SIGTERM from the watcher)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from attnx._signals import on_interrupt
from attnx.errors import CheckFailed, UsageError
from attnx.runtimes.engine_loop import PREFILL_CHUNK, EngineLoop
from attnx.runtimes.model_package import GenerativeModel, engine_for
from attnx.runtimes.package import load, verify_package
from attnx.serve.api import create_app
from attnx.serve.serving import Service

__all__ = ["drain", "load_service", "serve_package"]

FLUSH_S = 5.0  # after the loop closed: the time the last events of the answers in progress get to be sent


def load_service(package: str, *, provider: str = "cpu", max_batch: int | None = None, max_queue: int = 64,
                 max_model_len: int | None = None, prefill_chunk: int | None = PREFILL_CHUNK, name: str | None = None,
                 progress: Callable[[str], None] = lambda _m: None) -> Service:  # fmt: skip
    """The package verified on `provider` (CheckFailed naming what failed), loaded, its engine loop started."""
    report = verify_package(package, provider, progress)
    failed = report.failures()
    if failed:
        raise CheckFailed(f"{package}: verify failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    progress(f"verified: {len(report.checks)} checks passed")
    model = load(package, provider, check_files=False)  # its files were hashed a moment ago
    if not isinstance(model, GenerativeModel):
        model.close()
        raise UsageError(f"{package!r} holds one attention layer (attnx build --preset/--config): attnx serve serves "
                         "a whole model's package (attnx build --model)")  # fmt: skip
    try:
        loop = EngineLoop(engine_for(model.runner, model.manifest, max_batch), max_queue=max_queue,
                          max_len=max_model_len, prefill_chunk=prefill_chunk)  # fmt: skip
        name = name or os.path.basename(os.path.realpath(package))
        return Service(loop, name, model.text, model=model).start()
    except BaseException:
        model.close()
        raise


def drain(service: Service, grace_s: float) -> str:
    """Stop accepting, serve what was accepted for up to grace_s seconds, end the rest ("abort"), and give the
    answers in progress FLUSH_S seconds to send their last events: a line saying what happened."""
    running = service.loop.running + service.loop.waiting
    start = time.monotonic()
    service.close(grace_s)
    deadline = time.monotonic() + FLUSH_S
    while service.answering and time.monotonic() < deadline:
        time.sleep(0.01)
    aborted = service.finished["abort"]
    return (f"{running} requests in progress drained in {time.monotonic() - start:.1f} s "
            f"({int(aborted)} ended at the {grace_s:g} s grace period, finish_reason abort)")  # fmt: skip


def serve_package(package: str, *, host: str = "127.0.0.1", port: int = 8000, provider: str = "cpu",
                  max_batch: int | None = None, max_queue: int = 64, max_model_len: int | None = None,
                  prefill_chunk: int | None = PREFILL_CHUNK, name: str | None = None, grace_s: float = 30.0,
                  progress: Callable[[str], None] = lambda _m: None,
                  on_listening: Callable[[str], None] = lambda _url: None) -> int:  # fmt: skip
    """Verify, load and serve the package until a signal ends the process (the module doc); 0 if uvicorn stops."""
    import uvicorn

    sock = _bind(host, port)  # first: a port in use is said before the package is verified
    try:
        service = load_service(package, provider=provider, max_batch=max_batch, max_queue=max_queue,
                               max_model_len=max_model_len, prefill_chunk=prefill_chunk, name=name,
                               progress=progress)  # fmt: skip
    except BaseException:
        sock.close()
        raise
    config = uvicorn.Config(create_app(service), host=host, port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=grace_s)  # fmt: skip

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # attnx._signals' watcher owns SIGINT and SIGTERM
            yield

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()
                on_listening(f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}")

    try:
        sock.listen(2048)  # once verified and loaded
        with sock, on_interrupt(lambda: drain(service, grace_s)):
            Server(config).run(sockets=[sock])
    finally:
        service.close(0.0)
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening (UsageError naming why not: a port in use, a host not here)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise UsageError(f"--host {host}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
