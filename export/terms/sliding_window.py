"""The graph half of sliding_window: its comparison, the keys it hides, its fit from a computed mask's grid
and GroupQueryAttention's attribute."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.export.terms._base import Context, GraphTerm, MaskReading, OpAttribute
from attnx.model.config import AttentionConfig

# local_window_size W is attnx's window: GroupQueryAttention shows key j to query p iff p - W < j <= p (measured
# against both conventions: measurements/facts.md); -1 is none
_WINDOW = OpAttribute("local_window_size", lambda c: c.sliding_window,
                      lambda value: value if value is not None and value > 0 else None)  # fmt: skip


def compare_window(g: AttentionConfig, reading: MaskReading, c: AttentionConfig, ctx: Context) -> list[str]:
    if g.sliding_window == c.sliding_window:
        return []
    how = (f"local_window_size {reading.local_window_size}" if reading.local_window_size is not None
           else f"its mask: {reading.mask or 'not read'}")  # fmt: skip
    graph = f"window {g.sliding_window}" if g.sliding_window else "no window"
    source = f"sliding_window {c.sliding_window}" if c.sliding_window else "no window"
    why = f": every query past {c.sliding_window} sees keys it must not" if c.sliding_window and not g.sliding_window else ""
    return [f"{ctx.where}: {graph} in the graph ({how}), {source} in {ctx.source}{why}"]


def hides_outside(g: Any, c: AttentionConfig, qcol: str, krow: str, kpm: str | None) -> str:
    start = g.op("Sub", qcol, g.const("window_i64", np.asarray(c.sliding_window, np.int64)))
    return g.op("LessOrEqual", krow, start)  # j <= i - W


def fit_window(allowed: np.ndarray) -> tuple[int | None, str | None]:
    """W where query i sees min(i + 1, W) keys (the last query sees fewer than every key), None otherwise (a chunked
    grid's rows start anew at each chunk)."""
    tokens = allowed.shape[0]
    width = int(allowed[-1].sum())  # the keys the last query sees
    if width >= tokens or not np.array_equal(allowed.sum(axis=1), np.minimum(np.arange(tokens) + 1, width)):
        return None, None
    return width, f"window {width}"


GRAPH = GraphTerm("sliding_window", compare_window, {"gqa": _WINDOW}, stated=("sliding_window",),
                  hides=hides_outside, fit_grid=fit_window, reading=lambda reading: reading.mask)
