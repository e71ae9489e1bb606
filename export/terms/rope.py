"""The graph half of rope: the graph's rotary table compared with the source's rope (the rotation itself is written
by each core's emitter: attnx.export._llm, attnx.export.cores)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.export.terms._base import Context, GraphTerm
from attnx.model.config import AttentionConfig
from attnx.model.rope import rope_frequencies
from attnx.model.rope_fit import RopeFit, rope_table_error


@dataclasses.dataclass(frozen=True)
class RopeReading:
    """What a block's reading holds of its rotation (Reading.rope), each None where not read:

    tables      the cos and sin tables [positions, rotated dims / 2] each, constants of the graph or computed by it
                and run by the audit (at AUDIT_SHAPE's prompt)
    tables_at   the tables at each prompt length the audit ran where the graph computes them (None: a constant table)
    interleaved the pairing of the rotated dims (True: (2i, 2i+1))
    fit         how the tables were read as a rope (attnx.model.rope_fit.RopeFit: theta, its error, what it matches,
                or why no rope fits it)
    tensors     q's cos and sin tensors where the graph computes them (from position_ids): what the audit runs, and
                what attnx optimize binds the new core to
    k_tensors   k's, where the graph computes them apart from q's (the audit holds them to q's)
    caches      GroupQueryAttention's own cos/sin cache inputs (attnx optimize binds them as they are)"""

    tables: tuple[np.ndarray, np.ndarray] | None = None
    tables_at: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None
    interleaved: bool | None = None
    fit: RopeFit | None = None
    tensors: tuple[str, str] | None = None
    k_tensors: tuple[str, str] | None = None
    caches: tuple[str, str] | None = None

    @property
    def theta(self) -> float:
        """theta fitted to the tables (nan: not fitted)."""
        return self.fit.theta if self.fit is not None else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """What is read, in JSON's types (the tables by their rows, not their entries)."""
        fit = self.fit
        return {"interleaved": self.interleaved, "tensors": self.tensors, "k_tensors": self.k_tensors,
                "caches": self.caches, "positions": None if self.tables is None else int(self.tables[0].shape[0]),
                "lengths_read": None if self.tables_at is None else sorted(self.tables_at),
                "fit": None if fit is None else {k: v for k, v in dataclasses.asdict(fit).items()
                                                 if not (isinstance(v, float) and math.isnan(v))}}  # fmt: skip


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


GRAPH = GraphTerm("rope", _rope, reading=lambda reading: reading.rope)
