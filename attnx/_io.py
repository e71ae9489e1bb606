"""Atomic file writes: the one mechanism every writer of attnx uses, so that an
interrupted or failed write never leaves a half-written file under the final name."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["atomic_path"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = "") -> Iterator[str]:
    """Yield a temporary name beside `path` (same folder, so the rename is atomic); when the
    block succeeds it is renamed to `path`, when it fails it is removed.

    suffix is kept at the end of the temporary name, for writers that add or need an
    extension (np.save appends .npy, matplotlib picks the format from it).
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}{suffix}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
