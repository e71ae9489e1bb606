"""The attnx command line: a thin layer, each subcommand calls one public function."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from attnx import __version__
from attnx.commands import bench, build, export, inspect, optimize, parity, run, verify
from attnx.errors import AttnxError
from attnx.runtimes.cuda import set_ort_log_severity

# Subcommands, in the order --help lists them: each module has add_parser() and run(). Each
# imports what only some commands need (torch, onnx-ir) inside its run(), so that the
# deployment side (verify, run, inspect) works where only numpy, onnx and onnxruntime are.
COMMANDS = [export, optimize, parity, bench, build, verify, run, inspect]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnx", description="Multi-head attention from PyTorch to ONNX Runtime, verified number by number."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--version", action="version", version=f"attnx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits 2 on bad usage
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.debug:
        set_ort_log_severity(3)  # ORT's C++ log: errors only (recorded: ort-cuda's log capture restores it)
    try:
        return args.run(args)
    except AttnxError as e:
        if args.debug:
            raise
        print(f"attnx {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"attnx {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
