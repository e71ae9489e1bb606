"""Writing outputs: the one mechanism every writer of attnx uses.

Nothing is ever half-written under its final name. A writer stages its output in a folder
beside the target, `.NAME.partial-PID-START-RANDOM/` (PID and START, the process's start time,
prove later whether its writer is still alive), runs every check there, and only then
publishes: files are renamed into place (a model's data file before the model, so a model never
points at a missing data file), a folder replaces the target (the old one moved aside first, and
deleted only once the new one is in place). When the writer fails or is interrupted (Ctrl-C,
SIGTERM), the staging folder is removed and the target is untouched. A writer killed outright
(SIGKILL, a power cut) cannot clean up: the next writer of the same target removes every staging
folder whose process is provably gone (remove_stale).

Writers of expensive outputs (export, optimize, build) also hold the target's lock
(output_lock) from before they start working: a second writer of the same target is refused at
once, not after it has done all the work.

Stages and locks register with attnx._signals as they are created, and a publish's renames run
under its lock (critical): in the CLI's process a signal is handled by a watcher that removes
what is registered and ends the process, and it never lands between two renames of a publish.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from attnx import _signals
from attnx.errors import UsageError

__all__ = [
    "Staging",
    "atomic_path",
    "output_lock",
    "remove_stale",
    "check_output_file",
    "check_output_parent",
    "not_a_file",
    "write_json_atomic",
    "write_npy_atomic",
]

logger = logging.getLogger(__name__)

PARTIAL = ".partial-"
LOCK = ".lock"


# Processes -------------------------------------------------------------------------------------
def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or 0 where
    there is no /proc: with the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int, start: int) -> bool:
    """Whether process `pid` that started at `start` may still run (True unless provably gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, but not ours to judge by start time
        return True
    now = _start_time(pid)
    return not (start and now and now != start)


def _stamp() -> str:
    pid = os.getpid()
    return f"{pid}-{_start_time(pid)}"


# Staging -------------------------------------------------------------------------------------
def _staging_prefix(target: str) -> str:
    return f".{os.path.basename(target)}{PARTIAL}"


def remove_stale(target: str | os.PathLike[str]) -> list[str]:
    """Remove the staging folders (and files) of `target` left by writers that are gone (killed
    before they could clean up). Returns what was removed. A staging entry of a live process,
    or one whose name does not say its process, is left alone."""
    target = os.path.abspath(os.fspath(target))
    parent, prefix = os.path.dirname(target), _staging_prefix(target)
    removed = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        try:
            pid_text, start_text, _ = entry[len(prefix) :].split("-", 2)
            pid, start = int(pid_text), int(start_text)
        except ValueError:
            continue
        if _alive(pid, start):
            continue
        path = os.path.join(parent, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
        logger.info("removed %s, left by process %d that is gone", path, pid)
        removed.append(path)
    return removed


class Staging:
    """A staging folder for the output `target` (a file, or with folder=True a folder).

        with Staging(out) as stage:
            write(stage.path())          # the output under its final name, inside the stage
            check(stage.path())
            stage.publish()              # only now does `out` change

    Leaving the block without publish() (an error, Ctrl-C, SIGTERM) removes the stage and leaves
    `out` as it was. Entering removes stale stages of the same target first.
    """

    def __init__(self, target: str | os.PathLike[str], *, folder: bool = False) -> None:
        self.target = os.path.abspath(os.fspath(target))
        self.parent, self.name = os.path.dirname(self.target), os.path.basename(self.target)
        self.folder = folder
        self.dir = ""
        self.published = False
        self._token: int | None = None  # its registration with attnx._signals

    def __enter__(self) -> Staging:
        check_output_parent(self.target)
        remove_stale(self.target)
        self.dir = os.path.join(self.parent, f"{_staging_prefix(self.target)}{_stamp()}-{secrets.token_hex(4)}")
        with _signals.critical():  # registered before it exists: no moment has it unknown to the watcher
            self._token = _signals.track_folder(self.dir)
            try:
                os.mkdir(self.dir)
            except BaseException:
                _signals.forget(self._token)
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if os.path.lexists(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)
        _signals.forget(self._token)

    def path(self, name: str | None = None) -> str:
        """Where to write: the output itself (a file under its final name, or the folder), or
        with `name` another file of it."""
        if self.folder:
            return self.dir if name is None else os.path.join(self.dir, name)
        return os.path.join(self.dir, name or self.name)

    def publish(self, replace_folder: Any = None) -> list[str]:
        """Move the output into place. A file output: the file and its `<name>.data` (when
        staged) are renamed beside the target, the data first; a stale `<name>.data` of an
        earlier model is removed. A folder output: replace_folder(target) is called first when
        the target exists (it checks that it may be replaced, and raises if not); the old folder
        is moved aside and deleted once the new one is in place. Returns the paths written."""
        if self.folder:
            self._publish_folder(replace_folder)
            return [self.target]
        data = f"{self.name}.data"
        written = [self.target]
        with _signals.critical():  # the renames are one step: a signal finds the old output or the new
            if os.path.exists(self.path(data)):
                os.replace(self.path(data), os.path.join(self.parent, data))
                written.append(os.path.join(self.parent, data))
            os.replace(self.path(), self.target)
            if len(written) == 1 and os.path.exists(os.path.join(self.parent, data)):
                os.remove(os.path.join(self.parent, data))  # an earlier model's, after the model that needs none
            self.published = True
            _signals.published(self.target)
        return written

    def _publish_folder(self, replace_folder: Any) -> None:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.dir, 0o777 & ~umask)  # an ordinary folder once it is the output
        if os.path.lexists(self.target) and replace_folder is not None:
            replace_folder(self.target)
        old = os.path.join(self.parent, f"{_staging_prefix(self.target)}{_stamp()}-old-{secrets.token_hex(4)}")
        old_token = None
        with _signals.critical():  # the renames are one step: a signal finds the old output or the new
            if os.path.lexists(self.target):
                old_token = _signals.track_folder(old)
                os.rename(self.target, old)
            os.rename(self.dir, self.target)
            _signals.forget(self._token)  # the stage is the output now: nothing to remove
            self._token = None
            self.published = True
            _signals.published(self.target)
        if old_token is not None:
            shutil.rmtree(old, ignore_errors=True)
            _signals.forget(old_token)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = "") -> Iterator[str]:
    """Yield a name to write one file at; when the block succeeds it becomes `path`, when it
    fails `path` is untouched (a Staging of one file).

    suffix is kept at the end of the temporary name, for writers that add or need an
    extension (np.save appends .npy, matplotlib picks the format from it).
    """
    with Staging(path) as stage:
        tmp = stage.path(stage.name + suffix)
        yield tmp
        os.replace(tmp, stage.path())
        stage.publish()


# Checks before any work -----------------------------------------------------------------------
def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot be read as a file, in words that follow it in a message ("'x' does not
    exist", "'x' is a folder, not a file", ...), or None when it is a regular file."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return None
    if os.path.isdir(path):
        return "is a folder, not a file"
    if os.path.lexists(path) and not os.path.exists(path):
        return "is a broken link"
    if os.path.exists(path):
        return "is not a regular file (a device, pipe or socket)"
    return "does not exist"


def check_output_parent(path: str | os.PathLike[str], flag: str = "output") -> None:
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} folder {parent!r} does not exist")


def check_output_file(path: str | os.PathLike[str], flag: str = "output") -> None:
    """Raise UsageError, before any work, when `path` cannot be written as a file: its folder is
    missing or not writable, or it names a folder."""
    path = os.fspath(path)
    if not path or path.endswith(("/", os.sep)):
        raise UsageError(f"{flag} {path!r} names no file")
    check_output_parent(path, flag)
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a folder, not a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} folder {parent!r} is not writable")


# Locks -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def output_lock(target: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the lock of output `target` (`.NAME.lock` beside it, flock) for the block: a second
    writer of the same target is refused at once with UsageError naming the holder. The lock
    file is removed when released."""
    import fcntl

    target = os.path.abspath(os.fspath(target))
    check_output_parent(target)
    lock_path = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}{LOCK}")
    while True:
        with _signals.critical():  # taken and registered at once (flock with LOCK_NB never waits)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").split("-")[0].strip() or "?"
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    raise UsageError(
                        f"{target!r} is being written by another attnx (pid {holder}): wait for it, or choose another "
                        "output"
                    ) from None
                raise
            try:  # the lock file may have been removed by its last holder after we opened it
                same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
            except FileNotFoundError:
                same = False
            if same:
                token = _signals.track_lock(fd, lock_path)
                break
            os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, _stamp().encode(), 0)
        yield
    finally:
        with _signals.critical():
            with contextlib.suppress(OSError):
                os.remove(lock_path)
            os.close(fd)
            _signals.forget(token)


# Small files ---------------------------------------------------------------------------------
def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """JSON (indented, no NaN: a non-finite number is an error, not invalid JSON), atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, allow_nan=False, default=_json_default)
        f.write("\n")


def write_lines_atomic(path: str | os.PathLike[str], lines: Sequence[str]) -> None:
    """Text lines (each without its newline), atomically: the file holds all of them, or is as it was."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_npy_atomic(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """One array as .npy (no pickles), atomically."""
    with atomic_path(path, suffix=".npy") as tmp:  # np.save would append .npy to another name
        np.save(tmp, array, allow_pickle=False)
