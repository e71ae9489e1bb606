"""A pytest plugin that counts the garbage collector's work in a run: the explicit gc.collect() calls and their time,
and every collection (gc.callbacks), printed at exit. Used for d125bc3's numbers:

    PYTHONPATH=measurements/ci_time .venv/bin/python -m pytest -p no:xdist -p gcspy tests/export/test_export.py ...
"""

import atexit
import gc
import time

_collect = gc.collect
explicit = {"calls": 0, "seconds": 0.0}
every = {"collections": 0, "seconds": 0.0, "start": 0.0}


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        every["start"] = time.perf_counter()
    else:
        every["collections"] += 1
        every["seconds"] += time.perf_counter() - every["start"]


def _counted(*args, **kwargs):
    start = time.perf_counter()
    try:
        return _collect(*args, **kwargs)
    finally:
        explicit["calls"] += 1
        explicit["seconds"] += time.perf_counter() - start


def _report() -> None:
    print(f"\nGCSPY explicit {explicit['calls']} {explicit['seconds']:.2f} s; all collections {every['collections']} "
          f"{every['seconds']:.2f} s")  # fmt: skip


gc.callbacks.append(_callback)
gc.collect = _counted
atexit.register(_report)
