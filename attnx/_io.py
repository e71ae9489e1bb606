"""Writing files atomically: the one mechanism every writer of attnx uses, so that an
interrupted or failed write never leaves a half-written file under the final name."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["atomic_path", "write_json_atomic", "write_npy_atomic", "publish_staged_model"]


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


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """JSON (indented, no NaN: a non-finite number is an error, not invalid JSON), atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, allow_nan=False, default=_json_default)
        f.write("\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_npy_atomic(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """One array as .npy (no pickles), atomically."""
    with atomic_path(path, suffix=".npy") as tmp:  # np.save would append .npy to another name
        np.save(tmp, array, allow_pickle=False)


def publish_staged_model(staged_dir: str, name: str, parent: str) -> list[str]:
    """Move model `name` (and its `<name>.data`, when there is one) from the staging folder
    into `parent`, the data first so that a model never points at a missing data file. A
    stale `<name>.data` from an earlier model of that name is removed. Returns the paths."""
    data_name = f"{name}.data"
    written = [os.path.join(parent, name)]
    if os.path.exists(os.path.join(staged_dir, data_name)):
        os.replace(os.path.join(staged_dir, data_name), os.path.join(parent, data_name))
        written.append(os.path.join(parent, data_name))
    elif os.path.exists(os.path.join(parent, data_name)):
        os.remove(os.path.join(parent, data_name))
    os.replace(os.path.join(staged_dir, name), written[0])
    return written
