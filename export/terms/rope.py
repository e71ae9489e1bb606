"""The graph half of rope: the graph's rotary table compared with the source's rope (the rotation itself is written
by each core's emitter: attnx.export._llm, attnx.export.cores)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.export.terms._base import Context, GraphTerm
from attnx.model.config import AttentionConfig
from attnx.model.rope import rope_frequencies
from attnx.model.rope_fit import rope_table_error


@dataclasses.dataclass(frozen=True)
class RopeReading:
    """What a block's reading holds of its rotation: the cos and sin tables ([positions, rotated dims / 2] each;
    None: no rotary read), the tables at each prompt length the audit ran where the graph computes them (None: a
    constant table), theta fitted to them (attnx.model.rope_fit; nan: not fitted) and the pairing of the rotated dims
    (True: (2i, 2i+1); None: not read)."""

    tables: tuple[np.ndarray, np.ndarray] | None = None
    tables_at: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None
    theta: float = float("nan")
    interleaved: bool | None = None

    @classmethod
    def of(cls, facts: Mapping[str, Any]) -> RopeReading:
        return cls(facts.get("rope_tables"), facts.get("rope_tables_at"), facts.get("rope_theta", float("nan")),
                   facts.get("rotary_interleaved"))  # fmt: skip


def _rope(g: AttentionConfig, reading: RopeReading, c: AttentionConfig, ctx: Context) -> list[str]:
    """The graph's rotary table against the source's rope, entry by entry within the bound of the table's own
    storage (rope_table_error); a table the graph computes is read at each prompt length (tables_at), a constant
    one holds a row per position whatever the length. Then the pairing of the rotated dims."""
    if c.rope is None:
        return []
    tables = reading.tables
    if tables is None:
        return [f"{ctx.where}: no rotary in the graph, rope in {ctx.source}"]
    found = []
    at = reading.tables_at or {tables[0].shape[0]: tables}
    for tokens, (cos, sin) in sorted(at.items()):
        inv_freq, factor = rope_frequencies(c.rope, tokens)
        if cos.shape[1] != inv_freq.shape[0]:
            found.append(ctx.said(f"rotary on {2 * cos.shape[1]} of each head's dims", str(2 * inv_freq.shape[0])))
            break
        err, ratio = rope_table_error(cos, sin, inv_freq, factor)
        if ratio > 1:  # beyond float32's rounding of the angles (rope_table_error)
            prompt = f" for a prompt of {tokens} tokens" if reading.tables_at is not None else ""
            found.append(f"{ctx.where}: rotary table{prompt} differs from {ctx.source}'s rope ({c.rope.rope_type}, "
                         f"theta {c.rope.theta:g}) by {err:.3g}, {ratio:.3g} times its bound (graph theta fit "
                         f"{reading.theta:.6g})")  # fmt: skip
    if reading.interleaved != c.rope.interleaved:
        found.append(f"{ctx.where}: rotary_interleaved {int(reading.interleaved or 0)} in the graph, "
                     f"{ctx.source}'s rope pairs {'(2i, 2i+1)' if c.rope.interleaved else '(i, i+dim/2)'}")  # fmt: skip
    return found


GRAPH = GraphTerm("rope", _rope, reading=RopeReading.of)
