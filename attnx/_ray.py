"""The Ray connection `attnx matrix --ray` and `attnx serve --ray` share: the address checked before any Ray work
(Ray itself retries an address where nothing listens for minutes); a local cluster started for the command alone,
or an existing cluster joined; closed as it was opened.

A local cluster's authentication token lives in the environment of this process (inherited by the cluster's
processes), set before ray is imported (its token loader reads it once): Ray's default for a new local cluster
writes a token to ~/.ray/auth_token, which turns token authentication on for every later Ray of this user. Its
folder is short (Ray's socket paths under it have a length limit) and tracked by attnx._signals, so an interrupt
removes it.

ray is imported by the callers, where --ray asks for it: this module never imports it.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import tempfile
from typing import Any
from urllib.parse import urlparse

from attnx._signals import critical, forget, reclaim, system_tempdir, track_folder
from attnx.errors import UsageError

__all__ = ["RayConnection", "check_address", "first_line"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_address(address: str) -> None:
    """UsageError unless `address` is local, auto, or HOST:PORT (ray://HOST:PORT) where something answers."""
    if not address:
        raise UsageError("--ray needs an address: local, auto, HOST:PORT or ray://HOST:PORT")
    if address in ("local", "auto"):
        return
    url = urlparse(address if "://" in address else f"x://{address}")
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None:
        raise UsageError(f"--ray {address!r}: give local, auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((url.hostname, port), timeout=10).close()
    except OSError as e:
        raise UsageError(f"--ray {address}: no Ray cluster answers there ({e})") from None


def first_line(e: BaseException) -> str:
    """A Ray error in one line: its message's first, else its type's name."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class RayConnection:
    """The command's connection to the cluster at `address` (the module doc): prepare() before ray is imported,
    init(ray) to start or join the cluster, close(ray) to leave it (a local cluster stopped, its folder removed)."""

    def __init__(self, address: str) -> None:
        check_address(address)
        self.address = address
        self.folder: str | None = None
        self._token: int | None = None
        self._env: dict[str, str] = {}

    @property
    def local(self) -> bool:
        return self.address == "local"

    def prepare(self, settings: dict[str, str] | None = None) -> None:
        """Before ray is imported: a local cluster's own token in the environment (unless the user set a mode), and
        `settings` (Ray's environment variables, for the processes of a local cluster this command starts: they
        inherit this process's environment), each where the user did not set it. Taken out again by close()."""
        if not self.local or self._env:
            return
        if "RAY_AUTH_MODE" not in os.environ:
            self._env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self._env.update({k: v for k, v in (settings or {}).items() if k not in os.environ})
        os.environ.update(self._env)

    def init(self, ray: Any, resources: dict[str, float] | None = None) -> None:
        """Start the local cluster (with `resources` declared on its node) or join the one at the address;
        UsageError naming why not. attnx's signal watcher owns SIGTERM again afterwards (ray.init sets its own)."""
        common = {"logging_level": logging.ERROR, "log_to_driver": False}
        if self.local:
            with critical():  # created and registered at once: an interrupt removes it
                self.folder = tempfile.mkdtemp(prefix="attnx-ray-", dir=system_tempdir())
                self._token = track_folder(self.folder)
            try:
                ray.init(address="local", resources=resources or {}, _temp_dir=self.folder,
                         _node_ip_address="127.0.0.1", include_dashboard=False, object_store_memory=256 * 1024**2,
                         **common)  # fmt: skip
            except (RuntimeError, ConnectionError, OSError) as e:
                raise UsageError(f"--ray local: Ray could not start on this machine: {e}") from None
        else:
            url = urlparse(self.address if "://" in self.address else f"x://{self.address}")
            extra = {"_node_ip_address": "127.0.0.1"} if url.hostname in LOOPBACK else {}
            try:
                ray.init(address=self.address, **common, **extra)
            except (ConnectionError, RuntimeError, ValueError, ImportError) as e:
                raise UsageError(f"--ray {self.address}: cannot connect to a Ray cluster there: {first_line(e)}") from None
        reclaim()

    def close(self, ray: Any | None, remove_folder: bool = True) -> None:
        """Leave the cluster (a local one stops with it), the token taken out of the environment, the local
        cluster's folder removed (remove_folder False: its caller, the signal watcher, removes it)."""
        if ray is not None:
            try:
                ray.shutdown()
            except Exception:
                logging.getLogger(__name__).debug("ray.shutdown failed", exc_info=True)
        for key in self._env:
            os.environ.pop(key, None)
        self._env = {}
        if self.folder and remove_folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            forget(self._token)
            self.folder = None
