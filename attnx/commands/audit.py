"""attnx audit: the attention blocks of a whole exported model, read back and checked layer by layer."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from attnx._io import check_output_file, not_a_file, write_json_atomic
from attnx.commands import COMMANDS
from attnx.commands._common import str_list
from attnx.errors import UsageError
from attnx.model.contract import AUDIT_BACKENDS

HELP = COMMANDS["audit"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help=HELP, description=HELP)
    p.add_argument("model", metavar="MODEL.onnx", help="a whole model another tool exported (its external data beside it)")
    p.add_argument("--checkpoint", metavar="HF_DIR", default=None,
                   help="the Hugging Face checkpoint it was made from: each block is paired with its layer by the "
                        "weights' values and every term that differs is a finding")  # fmt: skip
    p.add_argument("--backends", type=str_list, default=["ort-cpu"], metavar="B,B",
                   help=f"where each block runs: {', '.join(AUDIT_BACKENDS)} (default ort-cpu); one asked for that "
                        "cannot load or run a block is a finding, one unavailable on this machine a skip")  # fmt: skip
    p.add_argument("--layers", default=None, metavar="I,J,...", help="audit these blocks only (graph order, from 0)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1) on any check that could not run (a 'not checked' line) as well; without it "
                        "the verdict is what was run: exit 0 when every block was read and every check run passed")  # fmt: skip
    p.add_argument("--json", dest="json_out", metavar="OUT.json", default=None, help="write the report as JSON")
    p.set_defaults(run=run)


def _layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--layers {text!r}: give block indices separated by commas, e.g. 0,1") from None


def run(args: argparse.Namespace) -> int:
    from attnx.workflows.audit import audit_model

    if not os.path.isfile(args.model):
        raise UsageError(f"{args.model!r} {not_a_file(args.model)}")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise UsageError(f"--checkpoint {args.checkpoint!r} is not a folder")
    if args.json_out:
        check_output_file(args.json_out, "--json")
    report = audit_model(args.model, checkpoint=args.checkpoint, layers=_layers(args.layers), backends=args.backends,
                         strict=args.strict, progress=lambda m: print(f"auditing {m}", file=sys.stderr))  # fmt: skip
    for block in report.blocks:
        print(block.line())
        for line in block.findings:
            print(f"  finding: {line}")
        for line in block.not_checked:
            print(f"  not checked: {line}")
        for line in block.notes:
            print(f"  note: {line}")
        if block.localised:
            print(f"  {block.localised.split(': ', 1)[1]}")
    for line in report.findings:
        print(f"finding: {line}")
    for line in report.not_checked:
        print(f"not checked: {line}")
    for line in report.not_applicable:
        print(f"not applicable: {line}")
    for line in report.unread:
        print(f"not read: {line}")
    for line in report.others:
        print(f"not attention: {line}")
    for line in report.skipped:
        print(f"skipped: {line}")
    if args.json_out:
        write_json_atomic(args.json_out, report.to_dict())
    print(verdict(report))
    return 0 if report.passed else 1


def verdict(report: Any) -> str:
    """The last line: what was proven, and the checks that could not run (which fail it under --strict)."""
    n, gaps = len(report.blocks), len(report.gaps)
    line = (f"audit {'PASSED' if report.passed else 'FAILED'}{' (--strict)' if report.strict and gaps else ''}: "
            f"{sum(b.passed for b in report.blocks)} of {n} block(s) pass"
            f"{f', {len(report.unread)} not read' if report.unread else ''}")  # fmt: skip
    if gaps:
        line += (f"; {gaps} check{'s' if gaps != 1 else ''} could not run (the 'not checked' lines)"
                 + ("" if report.strict else ", which --strict fails on"))  # fmt: skip
    return line
