"""Test-only traps for tests/faults/test_signals.py: the attnx process sends itself a signal from
the places where a handler that raises goes wrong, and holds there.

Imported by the test's bootstrap in the child process (never by attnx), configured by the
environment:

    ATTNX_TRAP         weakref   inside a weakref callback (an exception there is printed as
                                 "Exception ignored" and dropped: the command would go on)
                       del       inside a __del__ (the same)
                       dispatch  inside torch's dispatcher during torch.export's tracing: the
                                 first aten.transpose.int that FakeTensorMode.__torch_dispatch__
                                 (Python called from C++) sees (an exception there crosses C++)
                       published just after Staging.publish put the output in place (the
                                 command has done its work: it must end with 0, the output kept)
                       captured  inside attnx.runtimes.cuda.capture_native_stderr, while fd 2
                                 points at a file (the ort-cuda runner's session creation): the
                                 line must still reach the process's stderr
    ATTNX_TRAP_AT      the progress line (a part of it) after which the trap is set; for
                       published, the output's absolute path (not a file of the same name
                       published inside a stage)
    ATTNX_TRAP_SIGNAL  SIGINT or SIGTERM
    ATTNX_TRAP_LOG     a file the trap writes what it did to (stderr may be captured where it
                       fires: the exporter's output is)

The trap sends the signal with os.kill and then stays in that frame for TRAP_HOLD_S: the
process must end while it is there. If it is still alive after, the trap logs so ("the process
outlived its signal") and the command goes on, which the test sees.
"""

from __future__ import annotations

import os
import signal
import time
import weakref

from attnx.commands import _common

TRAP_HOLD_S = 20.0
KIND = os.environ["ATTNX_TRAP"]
AT = os.environ["ATTNX_TRAP_AT"]
SIGNAL = signal.Signals[os.environ["ATTNX_TRAP_SIGNAL"]]


def _log(line: str) -> None:
    with open(os.environ["ATTNX_TRAP_LOG"], "a", encoding="utf-8") as f:
        f.write(line + "\n")


def _spring(where: str) -> None:
    _log(f"sending {SIGNAL.name} {where}")
    os.kill(os.getpid(), SIGNAL)
    deadline = time.monotonic() + TRAP_HOLD_S
    while time.monotonic() < deadline:  # bytecode and sleeps: a Python handler runs in here
        time.sleep(0.01)
    _log("the process outlived its signal")


class _Bomb:
    def __del__(self) -> None:
        _spring("inside __del__")


class _Target:
    """What a weakref points at."""


def _set() -> None:
    if KIND == "weakref":
        target = _Target()
        ref = weakref.ref(target, lambda r: _spring("inside a weakref callback"))
        del target  # the callback runs now
        del ref
    elif KIND == "del":
        bomb = _Bomb()
        del bomb  # __del__ runs now
    elif KIND == "captured":
        import contextlib

        from attnx.runtimes import ort_runner

        original = ort_runner.capture_native_stderr

        @contextlib.contextmanager
        def capture(*args, **kwargs):
            with original(*args, **kwargs) as out:
                _spring("inside capture_native_stderr (fd 2 is a file)")
                yield out

        ort_runner.capture_native_stderr = capture
    elif KIND == "dispatch":
        from torch._subclasses.fake_tensor import FakeTensorMode

        original = FakeTensorMode.__torch_dispatch__
        sprung = []

        def dispatch(self, func, types, args=(), kwargs=None):
            if not sprung and str(func) == "aten.transpose.int":
                sprung.append(func)
                _spring("inside FakeTensorMode.__torch_dispatch__ (aten.transpose.int, called from C++)")
            return original(self, func, types, args, kwargs or {})

        FakeTensorMode.__torch_dispatch__ = dispatch
    else:
        raise ValueError(f"ATTNX_TRAP={KIND!r}")


def _set_after_publish() -> None:
    from attnx._io import Staging

    original = Staging.publish

    def publish(self, *args, **kwargs):
        written = original(self, *args, **kwargs)
        if self.target == AT:
            _spring(f"just after {self.target} was published")
        return written

    Staging.publish = publish


_progress = _common.Progress.__call__
_armed = [True]


def _watching(self: _common.Progress, message: str) -> None:
    _progress(self, message)
    if _armed[0] and AT in message:
        _armed[0] = False
        _set()


if KIND == "published":
    _set_after_publish()
else:
    _common.Progress.__call__ = _watching
