"""The graph side of the mask terms (attnx.model.terms, place "mask": causal, the sliding window, chunks), and the
token indices a graph computes them over: what each hides (hides), how a graph's mask grid is fitted back to it
(fit_grid), how a graph's value is compared with a source's (compare). Their entries are in attnx.export.terms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import TensorProto

from attnx.model.config import AttentionConfig

if TYPE_CHECKING:
    from attnx.export.terms import Context

__all__ = ["compare_causal", "compare_chunk", "compare_window", "fit_causal", "fit_chunk", "fit_window",
           "hides_later", "hides_other_chunk", "hides_outside", "span", "token_indices"]


def compare_causal(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if g.causal == c.causal:
        return []
    mask = f" ({facts['mask']})" if "mask" in facts else ""
    return [ctx.said(f"{'a causal mask' if g.causal else 'no causal mask'}{mask}", "causal" if c.causal else "not causal")]


def compare_window(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if g.sliding_window == c.sliding_window:
        return []
    how = (f"local_window_size {facts['local_window_size']}" if "local_window_size" in facts
           else f"its mask: {facts.get('mask', 'not read')}")  # fmt: skip
    graph = f"window {g.sliding_window}" if g.sliding_window else "no window"
    source = f"sliding_window {c.sliding_window}" if c.sliding_window else "no window"
    why = f": every query past {c.sliding_window} sees keys it must not" if c.sliding_window and not g.sliding_window else ""
    return [f"{ctx.where}: {graph} in the graph ({how}), {source} in {ctx.source}{why}"]


def hides_later(g: Any, c: AttentionConfig, qcol: str, krow: str, kpm: str | None) -> str:
    return g.op("Greater", krow, qcol)  # key j after query i


def hides_outside(g: Any, c: AttentionConfig, qcol: str, krow: str, kpm: str | None) -> str:
    start = g.op("Sub", qcol, g.const("window_i64", np.asarray(c.sliding_window, np.int64)))
    return g.op("LessOrEqual", krow, start)  # j <= i - W


def fit_causal(allowed: np.ndarray) -> tuple[bool, str | None]:
    grid = np.arange(allowed.shape[0])
    causal = bool(allowed.any(axis=1).all() and not (allowed & (grid[None, :] > grid[:, None])).any())
    return causal, "causal" if causal else None


def fit_window(allowed: np.ndarray) -> tuple[int | None, str | None]:
    """W where query i sees min(i + 1, W) keys (the last query sees fewer than every key), None otherwise (a chunked
    grid's rows start anew at each chunk)."""
    tokens = allowed.shape[0]
    width = int(allowed[-1].sum())  # the keys the last query sees
    if width >= tokens or not np.array_equal(allowed.sum(axis=1), np.minimum(np.arange(tokens) + 1, width)):
        return None, None
    return width, f"window {width}"


def compare_chunk(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if g.attention_chunk == c.attention_chunk:
        return []
    graph = f"chunks of {g.attention_chunk}" if g.attention_chunk else "no chunks"
    source = f"attention_chunk {c.attention_chunk}" if c.attention_chunk else "no chunks"
    return [f"{ctx.where}: {graph} in the graph (its mask: {facts.get('mask', 'not read')}), {source} in "
            f"{ctx.source}"]  # fmt: skip


def hides_other_chunk(g: Any, c: AttentionConfig, qcol: str, krow: str, kpm: str | None) -> str:
    """(i - start) // C != (j - start) // C, start the row's leading padded keys ([B, 1, 1, 1]; 0 without
    padding). Div truncates: it differs from the floor only where i or j is before start, keys the padding hides
    and queries that see none (a chunked mask is causal)."""
    size = g.const("chunk_i64", np.asarray(c.attention_chunk, np.int64))
    if kpm is not None:
        kept = g.op("CumSum", g.op("Cast", g.op("Not", kpm), to=TensorProto.INT64), g.const("one_i64_axis",
                                                                                           np.asarray(1, np.int64)))
        leading = g.op("Cast", g.op("Equal", kept, g.const("zero_i64", np.asarray(0, np.int64))), to=TensorProto.INT64)
        start = g.op("Reshape", g.op("ReduceSum", leading, g.ints("axes_1", [1]), keepdims=1),
                     g.ints("b111", [-1, 1, 1, 1]))  # fmt: skip
        qcol, krow = g.op("Sub", qcol, start), g.op("Sub", krow, start)  # [B, 1, S, 1], [B, 1, 1, T]
    return g.op("Not", g.op("Equal", g.op("Div", qcol, size), g.op("Div", krow, size)))


def fit_chunk(allowed: np.ndarray) -> tuple[int | None, str | None]:
    """C where every query i sees exactly the keys of its chunk up to itself, [i - i % C, i], and some query a
    chunk starts at sees no earlier key; None otherwise."""
    tokens = allowed.shape[0]
    starts = [i for i in range(1, tokens) if allowed[i, i] and not allowed[i, i - 1]]
    if not starts:
        return None, None
    size = starts[0]
    grid = np.arange(tokens)
    chunked = (grid[None, :] <= grid[:, None]) & (grid[None, :] // size == grid[:, None] // size)
    return (size, f"chunks of {size}") if np.array_equal(allowed, chunked) else (None, None)


def span(g: Any, step: bool) -> tuple[str, str]:
    """(past_seq, T) as int64 scalars: the cache's length and every key's count (past_seq 0 and T the call's length
    without a cache)."""
    seq = g.op("Squeeze", g.op("Shape", "x", start=1, end=2), g.ints("axis0b", [0]))  # scalar S
    if not step:
        return g.const("zero_i64", np.asarray(0, np.int64)), seq
    past = g.op("Squeeze", g.op("Shape", "past_key", start=2, end=3), g.ints("axis0", [0]))
    return past, g.op("Add", past, seq)


def token_indices(g: Any, past: str, total: str, rank: int = 2) -> tuple[str, str]:
    """(qcol [S, 1], krow [1, T]) int64: the token indices of this call's queries (past_seq + i) and of every key;
    rank 4: [1, 1, S, 1] and [1, 1, 1, T]."""
    one = g.const("one_i64", np.asarray(1, np.int64))
    qpos = g.op("Range", past, total, one)  # [S]
    kpos = g.op("Range", g.const("zero_i64", np.asarray(0, np.int64)), total, one)  # [T]
    if rank == 4:
        return g.op("Unsqueeze", qpos, g.ints("axes_013", [0, 1, 3])), g.op("Unsqueeze", kpos, g.ints("axes_012",
                                                                                                        [0, 1, 2]))
    return g.op("Unsqueeze", qpos, g.ints("axes_1", [1])), g.op("Unsqueeze", kpos, g.ints("axes_0", [0]))
