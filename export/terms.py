"""The graph side of each term of the formula (attnx.model.terms declares them): how a graph's value of the term,
as a reader read it (the block's config and its facts: attnx.export._blocks), is compared with a source's: a
checkpoint's layer or a model's attnx.config. Each entry's compare() returns the findings, one line each, "layer N:
..."; compare_terms() runs them in the formula's order (TERMS) after the core's own (heads, scale), so a new term is
one entry here and its declaration there, never a branch in the audit.

    compare(graph, facts, source, ctx) -> [finding]     graph, source: AttentionConfig; facts: what the reader noted

A weight a term adds (its declaration's tensors) that one side lacks with the term is said by the term's own finding
(said_by_terms), not again by the weights' comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from attnx.model.config import AttentionConfig
from attnx.model.rope import rope_frequencies
from attnx.model.rope_fit import rope_table_error
from attnx.model.terms import TERMS

__all__ = ["Context", "GRAPH_TERMS", "GraphTerm", "compare_terms", "said_by_terms"]


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a finding is: the layer ("layer N") and what the block is held to ("the checkpoint")."""

    where: str
    source: str

    def said(self, graph: str, source: str, why: str = "") -> str:
        return f"{self.where}: {graph} in the graph, {source} in {self.source}{why}"


Compare = Callable[[AttentionConfig, dict[str, Any], AttentionConfig, Context], list[str]]


@dataclasses.dataclass(frozen=True)
class GraphTerm:
    """The graph side of one term (the module doc)."""

    name: str
    compare: Compare


def _presence(name: str, graph: bool, source: bool, ctx: Context) -> list[str]:
    if graph == source:
        return []
    return [f"{ctx.where}: {name} {'in the graph' if graph else 'missing from the graph'}, "
            f"{'in' if source else 'not in'} {ctx.source}"]  # fmt: skip


def _grouped_heads(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    return [] if g.n_kv_heads == c.n_kv_heads else [ctx.said(f"n_kv_heads {g.n_kv_heads}", str(c.n_kv_heads))]


def _qk_norm(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    return _presence("q/k norm", g.qk_norm is not None, c.qk_norm is not None, ctx)


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


def _softcap(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if (g.softcap or None) == (c.softcap or None) or (g.softcap and c.softcap and np.isclose(g.softcap, c.softcap,
                                                                                             rtol=1e-6)):  # fmt: skip
        return []
    return [ctx.said(f"softcap {g.softcap}", str(c.softcap))]


def _alibi(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    return _presence("the ALiBi bias", g.alibi, c.alibi, ctx)


def _causal(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if g.causal == c.causal:
        return []
    mask = f" ({facts['mask']})" if "mask" in facts else ""
    return [ctx.said(f"{'a causal mask' if g.causal else 'no causal mask'}{mask}", "causal" if c.causal else "not causal")]


def _sliding_window(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    if g.sliding_window == c.sliding_window:
        return []
    how = (f"local_window_size {facts['local_window_size']}" if "local_window_size" in facts
           else f"its mask: {facts.get('mask', 'not read')}")  # fmt: skip
    graph = f"window {g.sliding_window}" if g.sliding_window else "no window"
    source = f"sliding_window {c.sliding_window}" if c.sliding_window else "no window"
    why = f": every query past {c.sliding_window} sees keys it must not" if c.sliding_window and not g.sliding_window else ""
    return [f"{ctx.where}: {graph} in the graph ({how}), {source} in {ctx.source}{why}"]


def _sinks(g: AttentionConfig, facts: dict[str, Any], c: AttentionConfig, ctx: Context) -> list[str]:
    return _presence("sinks", g.sinks, c.sinks, ctx)


GRAPH_TERMS: dict[str, GraphTerm] = {
    t.name: t
    for t in (
        GraphTerm("grouped_heads", _grouped_heads),
        GraphTerm("qk_norm", _qk_norm),
        GraphTerm("rope", _rope),
        GraphTerm("softcap", _softcap),
        GraphTerm("alibi", _alibi),
        GraphTerm("causal", _causal),
        GraphTerm("sliding_window", _sliding_window),
        GraphTerm("sinks", _sinks),
    )
}
# the terms not compared here, and why: cross (the audit reads self-attention), kv_cache and key_padding_mask (the
# forms and inputs the audit feeds, not the formula: its reference is set without them)
NOT_COMPARED = {"cross", "kv_cache", "key_padding_mask"}
assert set(GRAPH_TERMS) | NOT_COMPARED == set(TERMS), set(TERMS) ^ (set(GRAPH_TERMS) | NOT_COMPARED)


def compare_terms(graph: AttentionConfig, facts: dict[str, Any], source: AttentionConfig, ctx: Context) -> list[str]:
    """Every difference between the formula a graph states and its source's: the core's own (the query heads, the
    head size, the scale), then each term's, in the formula's order."""
    found = [ctx.said(f"{key} {getattr(graph, key)}", str(getattr(source, key)))
             for key in ("n_heads", "head_dim") if getattr(graph, key) != getattr(source, key)]  # fmt: skip
    if not np.isclose(graph.softmax_scale, source.softmax_scale, rtol=1e-6):
        found.append(ctx.said(f"scale {graph.softmax_scale:.6g}", f"{source.softmax_scale:.6g}"))
    for name in TERMS:
        if name in GRAPH_TERMS:
            found += GRAPH_TERMS[name].compare(graph, facts, source, ctx)
    return found


def said_by_terms(graph: AttentionConfig, source: AttentionConfig) -> frozenset[str]:
    """The weights a term adds (its declaration's tensors) where one side has the term and the other not: the term's
    own finding says so (sinks missing from the graph), not one per tensor."""
    out: set[str] = set()
    for name in GRAPH_TERMS:
        term = TERMS[name]
        if term.uses(graph) != term.uses(source):
            out |= set(term.tensors(graph if term.uses(graph) else source))
    return frozenset(out)
