"""The attnx command line: a thin layer, each subcommand calls one public function.

main() is the one error boundary: whatever a command raises ends as one line on stderr and an
exit status (README, "Exit codes"); --debug adds the traceback, with the same status. SIGTERM is
handled as Ctrl-C is (cleanup runs, nothing half-written is left), with status 143.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence

from attnx import __version__
from attnx.commands import COMMANDS
from attnx.errors import AttnxError, Terminated
from attnx.runtimes.cuda import set_ort_log_severity

EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


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


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated (a KeyboardInterrupt) in the main thread for the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _error_line(error: BaseException) -> tuple[str, int]:
    """(the one line, exit status) for an error a command raised."""
    if isinstance(error, AttnxError):
        return f"error: {error}", error.exit_code
    if isinstance(error, Terminated):
        return "terminated (SIGTERM): nothing half-written was left", EXIT_TERMINATED
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
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    parser = build_parser(command if command in COMMANDS else "")
    args = parser.parse_args(argv)  # argparse exits 2 on bad usage (an unknown command too)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.debug:
        set_ort_log_severity(3)  # ORT's C++ log: errors only (recorded: ort-cuda's log capture restores it)
    try:
        with sigterm_as_interrupt():
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
