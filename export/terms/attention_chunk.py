"""The graph half of attention_chunk: its comparison, the keys it hides and its fit from a computed mask's grid."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from attnx.export.terms._base import Context, GraphTerm, MaskReading
from attnx.model.config import AttentionConfig


def compare_chunk(g: AttentionConfig, reading: MaskReading, c: AttentionConfig, ctx: Context) -> list[str]:
    if g.attention_chunk == c.attention_chunk:
        return []
    graph = f"chunks of {g.attention_chunk}" if g.attention_chunk else "no chunks"
    source = f"attention_chunk {c.attention_chunk}" if c.attention_chunk else "no chunks"
    return [f"{ctx.where}: {graph} in the graph (its mask: {reading.mask or 'not read'}), {source} in "
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


GRAPH = GraphTerm("attention_chunk", compare_chunk, hides=hides_other_chunk, fit_grid=fit_chunk,
                  reading=lambda reading: reading.mask)
