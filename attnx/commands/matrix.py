"""attnx matrix: a plan's parity / verify / bench / audit cases on this machine or across a Ray cluster,
into one report."""

from __future__ import annotations

import argparse
import os
import sys

from attnx._text import format_table
from attnx.commands import COMMANDS
from attnx.commands._common import Progress, int_arg
from attnx.matrix import LocalExecutor, RayExecutor, load_plan, run_matrix
from attnx.matrix._report import STATUSES, host_key

HELP = COMMANDS["matrix"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "matrix",
        help=HELP,
        description=HELP + ": DIR/report.json and DIR/report.md (a case x host table), rewritten after every "
        "case. Exit 0: every case has a verdict and none failed; 1: a case failed, was lost or unschedulable; "
        "2: a bad plan; 130: interrupted (the finished cases are kept: --resume continues).",
    )
    p.add_argument("plan", metavar="PLAN", help="the plan: JSON (or YAML with PyYAML installed)")
    p.add_argument("--out", metavar="DIR", required=True, help="the report's folder (created)")
    p.add_argument(
        "--ray", metavar="ADDRESS", default=None,
        help="run on Ray: local (a cluster started here for the run), auto (the cluster `ray start` runs here), "
        "HOST:PORT or ray://HOST:PORT; without it, a process pool on this machine (Ray is not imported)",
    )  # fmt: skip
    p.add_argument("--resume", action="store_true", help="keep the finished cases of DIR/report.json, run the rest")
    p.add_argument("--jobs", type=int_arg(1, 1024), default=None,
                   help="cases at a time without --ray (default: the cores here; bench cases run alone)")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    executor = RayExecutor(args.ray) if args.ray is not None else LocalExecutor(args.jobs)
    report = run_matrix(plan, args.out, executor, resume=args.resume, progress=Progress())
    rows = []
    for c in report.ordered():
        stats, bench = c.get("stats") or {}, c.get("bench") or {}
        rows.append([c["id"], c["status"], host_key(c.get("host")), stats.get("max_abs"), stats.get("needed_atol"),
                     stats.get("atol"), bench.get("median_ms")])  # fmt: skip
    print(format_table(["case", "status", "host", "max_abs", "needed_atol", "atol", "median_ms"], rows))
    for c in report.ordered():
        if c["status"] != "pass" and c.get("reason"):
            print(f"{c['status']} {c['id']}: {c['reason']}")
    s = report.summary()
    print(f"matrix {'PASSED' if report.passed else 'FAILED' if report.complete else 'INCOMPLETE'}: "
          + ", ".join(f"{s[k]} {k}" for k in STATUSES) + f" of {len(report.order)} cases")  # fmt: skip
    print(f"wrote {os.path.join(args.out, 'report.json')} and {os.path.join(args.out, 'report.md')}")
    if report.interrupt is not None:
        print(f"attnx matrix: {len(report.cases)} finished cases kept; --resume continues", file=sys.stderr)
        raise report.interrupt  # the CLI's boundary: exit 130 (Ctrl-C) or 143 (SIGTERM)
    return 0 if report.passed else 1
