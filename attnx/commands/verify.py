"""attnx verify: check a package on the deployment machine (no torch needed)."""

from __future__ import annotations

import argparse

from attnx._io import check_output_file, write_json_atomic
from attnx._text import format_table
from attnx.commands import COMMANDS
from attnx.commands._common import Progress, exporter_for_localisation
from attnx.model.contract import PROVIDERS
from attnx.runtimes.package import verify_package

HELP = COMMANDS["verify"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help=HELP, description=HELP + ". Exit 0: all holds; 1: a check failed; 2: not a package."
    )
    p.add_argument("package", metavar="DIR", help="the package folder (attnx build's --out)")
    p.add_argument(
        "--provider", choices=list(PROVIDERS), default="cpu", help="execution provider to run on (default cpu)"
    )
    p.add_argument("--json", metavar="FILE", help="write the checks as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    exporter_for_localisation("verify")
    if args.json:
        check_output_file(args.json, "--json")
    report = verify_package(args.package, args.provider, Progress())
    rows = [(c.name, "pass" if c else "FAIL", c.detail) for c in report.checks]
    print(format_table(["check", "status", "detail"], rows))
    for note in report.notes:
        print(f"note: {note}")
    for c in report.checks:  # a failing golden case, localised once: where it diverges
        if c.localisation:
            print(f"{c.name}:\n  {c.localisation['line']}")
    if args.json:
        write_json_atomic(args.json, report.to_dict())
    failed = report.failures()
    if failed:
        print(f"verify FAILED ({args.provider}): " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
        return 1
    print(f"verify PASSED ({args.provider}): {len(report.checks)} checks")
    return 0
