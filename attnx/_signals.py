"""Ctrl-C and SIGTERM: one mechanism that ends an attnx command wherever the signal lands.

Why not raise: a Python signal handler runs at whatever bytecode the main thread is at. A handler
that raises (KeyboardInterrupt) inside a weakref callback or a __del__ is printed ("Exception
ignored") and dropped, and the command goes on; inside a Python callback that C++ called
(torch's dispatcher) it cannot cross the C++ frames and the process aborts. So the attnx process
never raises from a handler. Its handlers only wake a watcher thread (signal.set_wakeup_fd: the
byte is written by the C handler, at once, from whichever thread the signal reached), and the
watcher ends the command itself, in this order:

1. it silences sys.stdout and sys.stderr (the main thread may run on for a moment: it must not
   print), and kills the child processes (each its own process group) and reaps them;
2. it takes the registry lock, and keeps it until the process ends: a publish's renames, a
   stage, lock or child being created finish first; whatever wants the lock after that
   (registering, publishing) waits for ever, so the rest of the process stops there;
3. it runs the interrupt actions of the work in progress, innermost first, as unwinding would
   have: bench and matrix rewrite their report with the cases they finished, a Ray run is
   cancelled;
4. it removes the staging folders and the command's scratch folder (its temporary files), and
   releases the output locks;
5. it writes the one line (to the stderr the process started with: a block may have pointed fd 2
   at a file) and ends the process with os._exit: 130 (SIGINT), 143 (SIGTERM).

Nothing is raised in the main thread, so nothing is swallowed or crosses C++, and os._exit
cannot be caught. A second signal while it runs is ignored (the watcher acts on the first), and
the lock keeps the cleanup from interleaving with a publish: the outcome is one of the two
states, never between. A signal after the command's outputs are all in place (commit) or after
the command ended changes nothing: the process ends at once with status 0 (or the command's).

The CLI process installs this (install, begin, end; attnx.cli.main). Every writer registers in
every process (attnx._io's Staging and output_lock, the workers of bench and matrix, their
reports): in a library caller's process nothing is installed, the registrations are
bookkeeping, and Ctrl-C raises KeyboardInterrupt as Python's default does, unwinding through
the same with-blocks.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "begin",
    "child_process",
    "critical",
    "end",
    "forget",
    "install",
    "is_process_entry",
    "on_interrupt",
    "published",
    "reclaim",
    "system_tempdir",
    "track_folder",
    "track_lock",
]

EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
SIGNALS = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}
_BYTES = {int(sig): bytes([sig]) for sig in SIGNALS}  # made once: the handler allocates nothing
LOCK_WAIT_S = 10.0  # a critical section is a few renames: past this the watcher goes on without the lock
CHILD_WAIT_S = 5.0  # a child killed with SIGKILL is gone in milliseconds; past this it is not waited for
RETRIES = 20  # an action or a removal that met the main thread still changing what it reads


# The registry -----------------------------------------------------------------------------------
_lock = threading.RLock()  # the critical sections; the watcher holds it from step 2 to the end


@dataclasses.dataclass
class _State:
    entries: dict[int, tuple[str, Any]] = dataclasses.field(default_factory=dict)  # token -> (kind, what)
    next_token: int = 0
    command: str | None = None  # the CLI's subcommand, for the line
    outputs: frozenset[str] = frozenset()  # the command's outputs: all published = committed
    published: set[str] = dataclasses.field(default_factory=set)
    scratch: str | None = None  # the command's temporary folder (tempfile.tempdir while it runs)
    tempdir: str | None = None  # tempfile.tempdir before it
    ended: int | None = None  # the command's status, once it is final
    installed: bool = False
    wake: int = -1  # the write end of the watcher's pipe
    stderr: int = 2  # the process's stderr as it started (a copy of fd 2: a block may point fd 2 elsewhere)
    silenced: bool = False  # the watcher ends the command: sys.stdout and sys.stderr write nothing
    mid_line: bool = False  # the last write to sys.stderr did not end its line


_state = _State()


def critical() -> threading.RLock:
    """The registry lock, as a context manager: a block under it (renames that publish an
    output, creating a stage or a lock and registering it) is never cut in two by the watcher."""
    return _lock


def _track(kind: str, what: Any) -> int:
    with _lock:
        _state.next_token += 1
        _state.entries[_state.next_token] = (kind, what)
        return _state.next_token


def forget(token: int | None) -> None:
    """Drop a registration (the stage was published or removed, the lock released...)."""
    if token is not None:
        with _lock:
            _state.entries.pop(token, None)


def track_folder(path: str) -> int:
    """A folder the watcher removes (a stage, a scratch folder): register it before creating it."""
    return _track("folder", os.path.abspath(path))


def track_lock(fd: int, path: str) -> int:
    """An output lock this process holds (flock on fd): the watcher removes its file."""
    return _track("lock", (fd, path))


def published(target: str) -> None:
    """Staging.publish, under critical(): `target` is in place. Once every output the command
    declared (begin) is, the command has done its work: a later signal does not undo it."""
    target = os.path.abspath(target)
    if target in _state.outputs:
        _state.published.add(target)


@contextlib.contextmanager
def on_interrupt(action: Callable[[], str | None], *, limit_s: float | None = None) -> Iterator[None]:
    """For the block: what the watcher does if a signal ends the command there, as an `except
    KeyboardInterrupt` would have (keep a report, cancel remote work). It returns a note for the
    line ("kept 3 measured cases in b.json") or None. It runs in the watcher's thread while
    the main thread may still run, so it reads what it needs as a snapshot (a RuntimeError from
    a container changed under it is retried) and writes only through attnx._io. With limit_s
    it runs in a thread of its own for at most that long (for a call that may hang, such as
    Ray's; such an action must not write through attnx._io, whose lock the watcher holds)."""
    token = _track("action", (action, limit_s))
    try:
        yield
    finally:
        forget(token)


# Child processes --------------------------------------------------------------------------------
def _prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError, ImportError):
        return None


_PRCTL = _prctl() if sys.platform == "linux" else None  # resolved here: the child only calls it
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it dies (the process
    killed outright, the watcher's os._exit). Nothing is imported or allocated here: the parent
    may have threads, and only an async-signal-safe call belongs between fork and exec."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def child_process(cmd: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """Start `cmd` as a child that ends with this process: a session of its own (a Ctrl-C at
    the terminal reaches attnx only, which ends the child), SIGKILL when its parent dies
    (PR_SET_PDEATHSIG, Linux), its temporary files in the command's scratch folder, and
    registered: the watcher kills its process group. When the block leaves with the child
    still running (an error, Ctrl-C in a library caller), the child is killed and reaped."""
    if _state.scratch and "env" not in popen:
        popen["env"] = {**os.environ, "TMPDIR": _state.scratch}
    with _lock:  # not while the watcher ends the process: no child starts after its sweep
        proc = subprocess.Popen(list(cmd), start_new_session=True,
                                preexec_fn=_die_with_parent if _PRCTL else None, **popen)  # noqa: PLW1509  # fmt: skip
        token = _track("child", proc)
    try:
        yield proc
    finally:
        if proc.returncode is None and proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
        forget(token)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)  # the child leads its own group (start_new_session)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _reap(pid: int, deadline: float) -> None:
    """Wait until child `pid` is gone (reaped here or by the thread that waits for it)."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped already
        if done == pid or time.monotonic() > deadline:
            return
        time.sleep(0.005)


# The process's side: installed by the CLI only ---------------------------------------------------
def is_process_entry(module_name: str) -> bool:
    """Whether the module named `module_name` runs as the attnx process itself: `python -m
    attnx.cli`, or imported by the `attnx` console script."""
    if module_name == "__main__":
        return True
    main = sys.modules.get("__main__")
    return os.path.basename(getattr(main, "__file__", "") or "") == "attnx"


class _Stream:
    """sys.stdout or sys.stderr in the CLI's process: the same stream, silenced once the watcher
    ends the command, and for stderr whether its last write ended a line (so that the watcher's
    line starts on a line of its own, also when it came between a print's text and its newline)."""

    def __init__(self, stream: Any, track: bool) -> None:
        self._stream, self._track = stream, track

    def write(self, text: str) -> int:
        if _state.silenced:
            return len(text)
        if self._track and text:
            _state.mid_line = not text.endswith("\n")
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _poke(signum: int, frame: object) -> None:
    """The Python-level handler: wakes the watcher (again: the C handler already wrote the
    byte, unless something replaced the wakeup fd). Returns; raises nothing, wherever it runs."""
    try:
        os.write(_state.wake, _BYTES[signum])
    except (OSError, KeyError):  # the pipe is full: the watcher has its byte already
        pass


def install() -> bool:
    """Make SIGINT and SIGTERM the watcher's in this process, for its whole life (once; from
    the main thread only). A SIGINT that was ignored when the process started (a job started with
    `&` by a non-interactive shell) stays ignored, as Python itself leaves it."""
    if _state.installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    read_end, write_end = os.pipe()  # both close-on-exec: children do not inherit them
    with contextlib.suppress(OSError):  # the line goes there: fd 2 may be a capture when it is written
        _state.stderr = os.dup(2)  # (attnx.runtimes.cuda points it at a file while ORT probes CUDA)
    os.set_blocking(write_end, False)
    _state.wake = write_end
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for sig in SIGNALS:
        if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        signal.signal(sig, _poke)
    if sys.stdout is not None:
        sys.stdout = _Stream(sys.stdout, track=False)
    if sys.stderr is not None:
        sys.stderr = _Stream(sys.stderr, track=True)
    threading.Thread(target=_watch, args=(read_end,), name="attnx-signals", daemon=True).start()
    _state.installed = True
    return True


def reclaim() -> None:
    """After a library set handlers of its own (ray.init sets a SIGTERM handler that raises
    SystemExit in the main thread): SIGINT and SIGTERM are the watcher's again. A no-op where
    install() was not called (a library caller's process keeps what it chose)."""
    if not _state.installed or threading.current_thread() is not threading.main_thread():
        return
    signal.set_wakeup_fd(_state.wake, warn_on_full_buffer=False)
    for sig in SIGNALS:
        if signal.getsignal(sig) not in (signal.SIG_IGN, _poke):
            signal.signal(sig, _poke)


def begin(command: str, outputs: Sequence[str] = ()) -> None:
    """The command starts: its name (for the line), the outputs whose publishing completes it,
    and its scratch folder (tempfile's default folder for this process and its children, so
    that no temporary file outlives it)."""
    _state.command = command
    _state.outputs = frozenset(os.path.abspath(o) for o in outputs)
    _state.tempdir = tempfile.tempdir
    with _lock:  # created and registered at once: the watcher removes it, last (registered first)
        _state.scratch = tempfile.mkdtemp(prefix=f"attnx-{command}-")
        track_folder(_state.scratch)
    tempfile.tempdir = _state.scratch


def system_tempdir() -> str:
    """The temporary folder as it was before the command's scratch folder replaced it (for what
    must live elsewhere: Ray's session folder, whose socket paths have a length limit)."""
    return _state.tempdir or tempfile.gettempdir()


def end(status: int) -> NoReturn:
    """The command ended with `status`: from here a signal ends the process with that status.
    Flush, remove the scratch folder, run the exit handlers (atexit), and end the process at
    once: the interpreter's teardown (most of a second once torch is loaded) is skipped, and
    with it a window in which a signal would find no handler."""
    with _lock:
        _state.ended = status
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    _remove_folders()
    tempfile.tempdir = _state.tempdir
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # logging's flush, Ray's shutdown: what a normal exit would run
    os._exit(status)


def _watch(read_end: int) -> None:
    while True:
        try:
            data = os.read(read_end, 64)
        except OSError:
            return
        for byte in data:
            if byte in SIGNALS:
                _finish(signal.Signals(byte))


def _finish(sig: signal.Signals) -> NoReturn:
    code = SIGNALS[sig]
    _state.silenced = True
    try:
        _kill_children()  # first, unlocked: the children stop working now
        _lock.acquire(timeout=LOCK_WAIT_S)  # kept: nothing registers or publishes after this
        _kill_children()  # any started before the lock was ours
        if _state.ended is not None:
            code, line = _state.ended, None
        elif _state.outputs and _state.outputs <= _state.published:
            code, line = 0, f"{_why(sig)} once its output was complete: {', '.join(sorted(_state.outputs))} kept"
        else:
            notes = [note for note in _run_actions() if note]
            line = f"{_why(sig)}: {'; '.join([*notes, 'nothing half-written was left'])}"
        _remove_folders()
        _release_locks()
        if line is not None:
            command = _state.command or _command_from_argv()
            prefix = "\n" if _state.mid_line else ""
            with contextlib.suppress(OSError):  # stderr closed: the line has nowhere to go
                os.write(_state.stderr, f"{prefix}attnx{' ' + command if command else ''}: {line}\n".encode())
    finally:
        os._exit(code)


def _why(sig: signal.Signals) -> str:
    return "interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)"


def _command_from_argv() -> str | None:
    """The subcommand before main() has parsed it (a signal while attnx starts)."""
    return next((a for a in sys.argv[1:] if not a.startswith("-")), None)


def _entries(kind: str) -> list[tuple[int, Any]]:
    return [(token, what) for token, (k, what) in list(_state.entries.items()) if k == kind]


def _kill_children() -> None:
    children = _entries("child")
    for _, proc in children:
        _kill_group(proc.pid)
    deadline = time.monotonic() + CHILD_WAIT_S
    for token, proc in children:
        _reap(proc.pid, deadline)
        _state.entries.pop(token, None)  # gone: its pid is not signalled again (it may be reused)


def _run_actions() -> list[str | None]:
    notes = []
    for _, (action, limit_s) in reversed(_entries("action")):  # innermost first
        notes.append(_retry(action) if limit_s is None else _bounded(action, limit_s))
    return notes


def _retry(action: Callable[[], Any]) -> Any:
    for attempt in range(RETRIES):
        try:
            return action()
        except RuntimeError:  # "changed size during iteration": the main thread moved on; again
            time.sleep(0.01 * (attempt + 1))
        except BaseException:  # noqa: BLE001 (the process ends next: an action's failure stops nothing)
            return None
    return None


def _bounded(action: Callable[[], Any], limit_s: float) -> Any:
    result: list[Any] = [None]

    def run() -> None:
        result[0] = _retry(action)

    thread = threading.Thread(target=run, name="attnx-interrupt-action", daemon=True)
    thread.start()
    thread.join(limit_s)
    return result[0]


def _remove_folders() -> None:
    for token, path in reversed(_entries("folder")):  # inner stages first, the scratch folder last
        for _ in range(RETRIES):  # the main thread may still be writing into it
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                break
            time.sleep(0.005)
        _state.entries.pop(token, None)


def _release_locks() -> None:
    for token, (fd, path) in _entries("lock"):
        with contextlib.suppress(OSError):  # still ours (the lock is held): remove its file
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.remove(path)
        _state.entries.pop(token, None)
