"""A Ray cluster of this machine's own, for the matrix tests: a head and more node processes,
every one bound to the loopback address, on free ports, in a temporary folder of its own, and
stopped by the process ids this helper started (never `ray stop`, which stops every Ray process
of the machine, other people's included)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

WAIT_NODES = """
import json, sys, time, ray
deadline = time.monotonic() + float(sys.argv[3])
while True:  # the head's GCS may not listen yet
    try:
        ray.init(address=sys.argv[1], _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
        break
    except ConnectionError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) >= int(sys.argv[2]) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({n["NodeID"]: n["Resources"] for n in nodes}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    """start() a head, add() nodes, wait() for them; stop() ends every process group started."""

    def __init__(self, ray_bin: str) -> None:
        self.ray_bin = ray_bin
        # short: Ray's unix sockets live under it (a socket path holds at most 107 bytes)
        self.tmp = tempfile.mkdtemp(prefix="axr-", dir="/tmp")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        # Token authentication with a token of this cluster's own, given in the environment (the
        # nodes, the drivers): nothing is written to ~/.ray, which every Ray of the machine reads.
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
                        RAY_AUTH_TOKEN=secrets.token_hex(32))  # fmt: skip

    def _start(self, args: list[str], name: str) -> None:
        ports = [
            f"--node-manager-port={_free_port()}", f"--object-manager-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
            "--min-worker-port=0", "--max-worker-port=0",
        ]  # fmt: skip
        cmd = [self.ray_bin, "start", *args, "--node-ip-address=127.0.0.1", *ports, "--object-store-memory=100000000",
               "--disable-usage-stats", "--block"]  # fmt: skip
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        # a session of its own: its process group holds the node's raylet, workers and case processes
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True, env=self.env))  # fmt: skip

    def start(self, num_cpus: int = 1, resources: dict | None = None) -> None:
        self._start([f"--port={self.port}", "--head", "--include-dashboard=false", f"--temp-dir={self.tmp}",
                     f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources or {})}"], "head")  # fmt: skip

    def add(self, num_cpus: int = 1, resources: dict | None = None) -> None:
        self._start([f"--address={self.address}", f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources or {})}"],
                    f"node{len(self.procs)}")  # fmt: skip

    def wait(self, nodes: int, timeout_s: float = 60.0) -> dict:
        """{node id: resources} once `nodes` nodes are alive; RuntimeError with the logs' tails
        when they are not within the timeout."""
        try:
            out = subprocess.run([sys.executable, "-c", WAIT_NODES, self.address, str(nodes), str(timeout_s)],
                                 capture_output=True, text=True, timeout=timeout_s + 30, check=False, env=self.env)  # fmt: skip
            found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout else {}
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            found, out = {}, None
        if len(found) < nodes:
            raise RuntimeError(f"{len(found)} of {nodes} Ray nodes came up in {timeout_s:g} s: {self.log_tail()}"
                               + (f" / driver: {out.stderr.strip()[-300:]}" if out is not None else ""))  # fmt: skip
        return found

    def log_tail(self) -> str:
        tails = []
        for name in sorted(os.listdir(self.tmp)):
            if name.endswith(".log"):
                with open(os.path.join(self.tmp, name), errors="replace") as f:
                    lines = [line.strip() for line in f if line.strip()]
                tails.append(f"{name}: {' | '.join(lines[-3:])[-400:]}")
        return "; ".join(tails)

    def sessions(self) -> set[int]:
        """The sessions of the node processes (each `ray start` leads one: its raylet and Ray
        workers are in it, the workers in process groups of their own)."""
        return {p.pid for p in self.procs}

    def _members(self) -> list[int]:
        out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True, check=False).stdout
        return [int(pid) for pid, sid in (line.split() for line in out.splitlines()) if int(sid) in self.sessions()]

    def stop(self) -> None:
        """SIGTERM to each process group this helper started, SIGKILL to every process left in their
        sessions after 3 s."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for pid in self._members():  # what is left of the sessions: raylets, Ray workers in their own groups
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        subprocess.run(["rm", "-rf", self.tmp], check=False)
