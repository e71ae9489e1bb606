"""The matrix report: report.json (every case with its verdict, the comparator's statistics, the
bench timings, an audit case's block and the host it ran on) and report.md (a case x host table:
an audit's cases are its blocks, one row per block and backend), both rewritten
atomically (attnx._io) after every finished case, so that the JSON is valid at all times and
Ctrl-C keeps every finished case.

Statuses: pass, fail, skipped (the backend cannot run on that host: the reason says why), lost
(the case's process or its Ray worker died, retries included), unschedulable (no node has the
resources the case requires, after the plan's unschedulable_timeout_s).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from attnx._io import atomic_path, write_json_atomic
from attnx.errors import UsageError

__all__ = ["FINISHED", "SCHEMA", "STATUSES", "MatrixReport", "host_key", "markdown"]

SCHEMA = "attnx.matrix/1"
STATUSES = ("pass", "fail", "skipped", "lost", "unschedulable")
# What --resume keeps: a case that ran to a verdict. lost and unschedulable are run again.
FINISHED = ("pass", "fail", "skipped")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def host_key(host: dict[str, Any] | None) -> str:
    """A host's column in the table: its name and the start of its node id."""
    if not host:
        return "not placed"
    node = host.get("node_id") or ""
    return f"{host.get('hostname')}" + (f" ({node[:8]})" if node and node != "local" else "")


class MatrixReport:
    """The cases finished so far, in the plan's order, and where they ran."""

    def __init__(self, plan: Any, executor: str, out: str) -> None:
        self.plan = plan
        self.executor = executor
        self.out = out
        self.created = _now()
        self.cases: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}  # Ray: node id -> its resources and address
        self.complete = False
        self.interrupted = False
        self.interrupt: KeyboardInterrupt | None = None  # what stopped the run (Ctrl-C, SIGTERM)
        self.notes: list[str] = []
        self.order = {c.id: i for i, c in enumerate(plan.cases())}

    @property
    def json_path(self) -> str:
        return os.path.join(self.out, "report.json")

    @property
    def md_path(self) -> str:
        return os.path.join(self.out, "report.md")

    def add(self, record: dict[str, Any]) -> None:
        self.cases[record["id"]] = record

    def summary(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for c in self.cases.values():
            out[c["status"]] += 1
        return out

    @property
    def passed(self) -> bool:
        """Every case of the plan has a verdict, none failed, lost or unschedulable, one passed."""
        s = self.summary()
        return (self.complete and s["pass"] > 0 and not (s["fail"] or s["lost"] or s["unschedulable"])
                and len(self.cases) == len(self.order))  # fmt: skip

    def ordered(self) -> list[dict[str, Any]]:
        return sorted(self.cases.values(), key=lambda c: (self.order.get(c["id"], len(self.order)), c["id"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "plan": {
                "path": self.plan.path,
                "sha256": self.plan.sha256,
                "plan": self.plan.data,
                "cases": len(self.order),
            },
            "executor": self.executor,
            "created": self.created,
            "updated": _now(),
            "complete": self.complete,
            "interrupted": self.interrupted,
            "passed": self.passed,
            "summary": self.summary(),
            "notes": self.notes,
            "nodes": self.nodes,
            "cases": self.ordered(),
        }

    def write(self) -> None:
        write_json_atomic(self.json_path, self.to_dict())
        with atomic_path(self.md_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(markdown(self.to_dict()))

    def resume_from(self, path: str) -> int:
        """Keep the finished cases of an earlier report of the same plan; returns how many."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--resume: cannot read {path!r}: {e}") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise UsageError(f"--resume: {path!r} is not an attnx matrix report ({SCHEMA})")
        if data.get("plan", {}).get("sha256") != self.plan.sha256:
            raise UsageError(
                f"--resume: {path!r} was made from another plan (sha256 {str(data.get('plan', {}).get('sha256'))[:12]}..., "
                f"this plan {self.plan.sha256[:12]}...): use another --out, or the plan it was made from"
            )
        self.created = data.get("created", self.created)
        self.nodes.update(data.get("nodes") or {})
        kept = 0
        for record in data.get("cases", []):
            if record.get("id") in self.order and record.get("status") in FINISHED:
                self.cases[record["id"]] = record
                kept += 1
        return kept


def _cell(c: dict[str, Any]) -> str:
    status = c["status"]
    parts = [status]
    stats = c.get("stats") or {}
    if stats.get("needed_atol") is not None:
        parts.append(f"needs atol {stats['needed_atol']:.2g} of {stats['atol']:.2g}")
    bench = c.get("bench") or {}
    if bench.get("median_ms") is not None:
        parts.append(f"{bench['median_ms']:.3g} ms")
    return ", ".join(parts)


def markdown(data: dict[str, Any]) -> str:
    """report.md: the summary, a case x host table (each cell the verdict, the tolerance the case
    needed against the one it had, the median time of a bench case), the audited blocks (each
    block's line, as `attnx audit` prints it) and the reasons."""
    cases = data["cases"]
    hosts = list(dict.fromkeys(host_key(c.get("host")) for c in cases))
    rows = []
    for c in cases:
        cells = ["" for _ in hosts]
        cells[hosts.index(host_key(c.get("host")))] = _cell(c)
        rows.append([c["id"], *cells])
    s = data["summary"]
    state = "complete" if data["complete"] else ("interrupted" if data["interrupted"] else "running")
    lines = [
        f"# attnx matrix: {os.path.basename(data['plan']['path'])}",
        "",
        f"{len(cases)} of {data['plan']['cases']} cases ({state}; {data['executor']}): "
        + ", ".join(f"{s[k]} {k}" for k in STATUSES if s.get(k)),
        "",
    ]
    if rows:
        lines += [_md_row(["case", *hosts]), _md_row(["---"] * (len(hosts) + 1)), *(_md_row(r) for r in rows)]
    audits = [c for c in cases if c.get("audit")]
    if audits:
        lines += ["", "## Audited blocks", ""]
        lines += [f"- `{c['id']}` on {host_key(c.get('host'))}: {c['audit']['line']}" for c in audits]
    reasons = [(c["id"], c["status"], c.get("reason")) for c in cases if c["status"] != "pass" and c.get("reason")]
    if reasons:
        lines += ["", "## Reasons", ""]
        lines += [f"- `{i}` {status}: {reason}" for i, status, reason in reasons]
    hosts_info = {host_key(c.get("host")): c.get("host") for c in cases if c.get("host")}
    if hosts_info:
        lines += ["", "## Hosts", ""]
        for key, h in hosts_info.items():
            gpu = ", ".join(h.get("gpus") or []) or "no GPU"
            lines.append(f"- {key}: {h.get('cpu')} ({h.get('cpu_count')} cores; {' '.join(h.get('cpu_flags') or [])}), "
                         f"{gpu}, onnxruntime {h.get('onnxruntime')}, torch {h.get('torch')}, node {h.get('node_id')}")  # fmt: skip
    lines += [f"- note: {n}" for n in data.get("notes") or []]
    return "\n".join(lines) + "\n"


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

