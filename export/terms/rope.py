"""The graph half of rope: the graph's rotary table compared with the source's rope (the rotation itself is written
by each core's emitter: attnx.export._llm, attnx.export.cores)."""

from __future__ import annotations

from typing import Any

from attnx.export.terms._base import Context, GraphTerm
from attnx.model.config import AttentionConfig
from attnx.model.rope import rope_frequencies
from attnx.model.rope_fit import rope_table_error


def _rope(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    """The graph's rotary table against the source's rope, entry by entry within the bound of the table's own
    storage (rope_table_error); a table the graph computes is read at each prompt length (facts rope_tables_at), a
    constant one holds a row per position whatever the length. Then the pairing of the rotated dims."""
    if c.rope is None:
        return []
    tables = facts.get("rope_tables")
    if tables is None:
        return [f"{ctx.where}: no rotary in the graph, rope in {ctx.source}"]
    found = []
    at = facts.get("rope_tables_at") or {tables[0].shape[0]: tables}
    for tokens, (cos, sin) in sorted(at.items()):
        inv_freq, factor = rope_frequencies(c.rope, tokens)
        if cos.shape[1] != inv_freq.shape[0]:
            found.append(ctx.said(f"rotary on {2 * cos.shape[1]} of each head's dims", str(2 * inv_freq.shape[0])))
            break
        err, ratio = rope_table_error(cos, sin, inv_freq, factor)
        if ratio > 1:  # beyond float32's rounding of the angles (rope_table_error)
            prompt = f" for a prompt of {tokens} tokens" if "rope_tables_at" in facts else ""
            found.append(f"{ctx.where}: rotary table{prompt} differs from {ctx.source}'s rope ({c.rope.rope_type}, "
                         f"theta {c.rope.theta:g}) by {err:.3g}, {ratio:.3g} times its bound (graph theta fit "
                         f"{facts.get('rope_theta', float('nan')):.6g})")  # fmt: skip
    if facts.get("rotary_interleaved") != c.rope.interleaved:
        found.append(f"{ctx.where}: rotary_interleaved {int(facts.get('rotary_interleaved', 0))} in the graph, "
                     f"{ctx.source}'s rope pairs {'(2i, 2i+1)' if c.rope.interleaved else '(i, i+dim/2)'}")  # fmt: skip
    return found


GRAPH = GraphTerm("rope", _rope)
