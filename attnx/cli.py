"""The attnx command line: a thin layer, each subcommand calls one public function.

main() is the one error boundary: whatever a command raises ends as one line on stderr and an
exit status (docs/reference/behaviour.md, "Exit codes and errors"); --debug adds the traceback, with the same status.

Run as the process (the `attnx` script, `python -m attnx.cli`), Ctrl-C and SIGTERM belong to
attnx._signals from the first line of this module: a watcher thread removes what the command
registered (stages, locks, child processes, its scratch folder), keeps what it promised to keep
(bench's and matrix's finished cases), prints the one line and ends the process with 130 or 143;
no handler ever raises into the command. Called with argv from another program, main() leaves
that program's signal handling as it is (Ctrl-C raises KeyboardInterrupt, which unwinds the same
with-blocks and ends as status 130).
"""

from __future__ import annotations

from attnx import _signals

if _signals.is_process_entry(__name__):
    _signals.install()  # before the imports below (a fifth of a second): a signal while attnx starts

import argparse
import contextlib
import errno
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from attnx import __version__
from attnx.commands import COMMANDS
from attnx.errors import AttnxError
from attnx.runtimes.cuda import set_ort_log_severity

EXIT_INTERRUPTED = _signals.EXIT_INTERRUPTED
# The arguments that name what a command writes and has done its work once all are in place: a
# signal after that keeps them and ends the process with 0 (attnx._signals: commit).
OUTPUTS = {"export": ("out",), "optimize": ("out",), "build": ("out",), "import": ("out",),
           "run": ("output", "present_key", "present_value")}  # fmt: skip


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or with `only` of that one: the other commands are then
    listed by name and help alone, and their modules (and what they import) are not loaded."""
    parser = argparse.ArgumentParser(
        prog="attnx", description="Multi-head attention from PyTorch to ONNX Runtime, verified number by number."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--version", action="version", version=f"attnx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(f"attnx.commands.{command.module}").add_parser(sub)
        else:
            sub.add_parser(name, help=command.help)
    return parser


def _command_of(argv: Sequence[str]) -> str:
    """The command named on the command line ("" when none is: attnx --help, attnx --version)."""
    return next((a for a in argv if not a.startswith("-")), "")


def _error_line(error: BaseException) -> tuple[str, int]:
    """(the one line, exit status) for an error a command raised."""
    if isinstance(error, AttnxError):
        return f"error: {error}", error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return "interrupted: nothing half-written was left", EXIT_INTERRUPTED
    if isinstance(error, BrokenPipeError):
        return "error: its output was closed before it was all written (broken pipe)", 1
    if isinstance(error, MemoryError):
        return "error: out of memory (--max-mem-gb sets what a command may use)", 2
    if isinstance(error, OSError):
        where = f" ({error.filename})" if error.filename else ""
        if error.errno == errno.ENOSPC:
            return f"error: no space left on the device{where}: nothing half-written was left", 2
        return f"error: {error.strerror or error}{where}", 2
    first = str(error).strip().splitlines()
    return f"internal error: {type(error).__name__}: {first[0] if first else ''} (attnx --debug shows where)", 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command of argv. Without argv (the process's own command line) main is the
    process: it installs the signal watcher, and ends the process itself once the command
    ended (attnx._signals.end: no return). With argv it returns the status."""
    process = argv is None
    if process:
        _signals.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    parser = build_parser(command if command in COMMANDS else "")
    args = parser.parse_args(argv)  # argparse exits 2 on bad usage (an unknown command too)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if process:
        outputs = [getattr(args, name) for name in OUTPUTS.get(args.command, ()) if getattr(args, name, None)]
        _signals.begin(args.command, outputs)
    status = _run(args)
    if process:
        _signals.end(status)
    return status


def _run(args: argparse.Namespace) -> int:
    if not args.debug and COMMANDS[args.command].runs_ort:
        set_ort_log_severity(3)  # ORT's C++ log: errors only (recorded: ort-cuda's log capture restores it)
    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the boundary, not at exit
        return status
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        if isinstance(e, BrokenPipeError):
            # Nothing more can reach stdout; point it at /dev/null so the exit's flush is quiet.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if args.debug:
            traceback.print_exc()
        line, status = _error_line(e)
        with contextlib.suppress(OSError, ValueError):
            print(f"attnx {args.command}: {line}", file=sys.stderr, flush=True)
        return status


if __name__ == "__main__":
    sys.exit(main())
