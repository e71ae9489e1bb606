"""The terms of the formula: one entry a term, one module an entry, in the formula's order (TERMS).

A term is a part of the formula that a config switches on (docs/concepts/formula.md and "Modern LLM
attention"). Its module (attnx.model.terms.rope, ...) holds its entry, `TERM` (attnx.model.terms._base.Term):

    keys        the config keys that set it, and validate(): their checks and normal form
    place       where it acts, in the formula's order (PLACES)
    uses()      whether a config uses it
    tensors()   the weights it adds beside the projections, and how seeded weights draw them
    reach()     a mask's reach: a query sees no key more than reach - 1 tokens before it (a window's W): what
                a step reads of its cache, how far a probe of a computed mask must run
    tolerance   what it adds to the tolerance table (attnx.model.tolerance), in words; score_bound(): what it
                adds to the largest absolute score, by which the table scales the scores' bound
    table()     the constants its formula is built from, where a check compares them with a source's
    fault       the wrong form of the term the tests plant, to show a check finds it
    said()      how a formula's one line says it (or leaves it out); listed: whether an audit's block line
                lists it; sdpa_is_causal: whether SDPA's is_causal computes it alone (the torch half)
    reference   its numpy float64 function (attnx.model.reference calls it, by its place)
    torch       its torch function (attnx.model.module calls it with the module, whose layers it reads); torch
                is imported inside it, so that the deployment side, which reads the entries, never loads torch
    stage       the stage its q/k output is (attnx.model.stages), if one

Why one module a term, the functions as fields: adding a term is writing its module and naming it in
_IN_ORDER below (the formula's order is one line, not a property of the files), and everything that
iterates the terms (the config's checks, the weights, the reference, the torch module, the tolerance,
the reports and the docs) reads it from TERMS. The graph half (how each core writes it in ONNX and how a
block's reading compares it) sits in the layer above, attnx.export.terms: one module a term there too,
of the same name, found by the entry's name (attnx.export.terms.graph_of); the core registry
(attnx.model.cores) says which cores express it.

No torch and no onnx here: the deployment side reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnx.model.terms import (
    alibi,
    attention_chunk,
    attn_temperature,
    causal,
    cross,
    grouped_heads,
    key_padding_mask,
    kv_cache,
    latent,
    qk_l2_norm,
    qk_norm,
    rope,
    sinks,
    sliding_window,
    softcap,
)
from attnx.model.terms._base import PLACES, Term, check_int, check_number
from attnx.model.terms.attn_temperature import Temperature
from attnx.model.terms.latent import Latent
from attnx.model.terms.qk_norm import QKNorm

if TYPE_CHECKING:
    from attnx.model.config import AttentionConfig

__all__ = ["PLACES", "Latent", "QKNorm", "Temperature", "Term", "TERMS", "LLM_TERMS", "terms_of", "term_tensors",
           "check_int", "check_number", "reach_of", "terms_at", "projection_shapes"]

# The entries in the formula's order: heads, qk, cache, scores, mask, softmax (each its PLACES), and within a place
# the order they are computed in.
_IN_ORDER = (grouped_heads, cross, latent, qk_norm, rope, qk_l2_norm, attn_temperature, kv_cache, softcap, alibi,
             causal, sliding_window, attention_chunk, key_padding_mask, sinks)  # fmt: skip
TERMS: dict[str, Term] = {module.TERM.name: module.TERM for module in _IN_ORDER}
# The modern-LLM terms (docs/concepts/formula.md, "Modern LLM attention"), in the formula's order.
LLM_TERMS = tuple(t.name for t in TERMS.values() if t.modern)


def terms_of(config: AttentionConfig) -> tuple[str, ...]:
    """The terms `config` uses, in the formula's order (TERMS)."""
    return tuple(name for name, t in TERMS.items() if t.uses(config))


def term_tensors(config: AttentionConfig) -> dict[str, tuple[tuple[int, ...], tuple[float, float]]]:
    """{name: (shape, draw range)} of every tensor the config's terms add beside the projections."""
    out: dict[str, tuple[tuple[int, ...], tuple[float, float]]] = {}
    for t in TERMS.values():
        if t.uses(config):
            out.update(t.tensors(config))
    return out


def reach_of(config: AttentionConfig) -> int | None:
    """The nearest reach of the config's mask terms (Term.reach: a query sees no key more than reach - 1 tokens
    before it), None where every query may see every earlier key."""
    reaches = [t.reach(config) for t in TERMS.values() if t.reach is not None and t.uses(config)]
    return min(reaches) if reaches else None


def projection_shapes(config: AttentionConfig) -> dict[str, tuple[tuple[int, int], bool]]:
    """{name: ((out, in), biased)} of the projections that compute q, k and v: q_proj, k_proj and v_proj, or those
    of the term that replaces them (Term.projections)."""
    c = config
    for t in TERMS.values():
        if t.projections is not None and t.uses(c):
            return dict(t.projections(c))
    return {"q_proj": ((c.q_dim, c.d_model), True), "k_proj": ((c.kv_q_dim, c.kv_dim), True),
            "v_proj": ((c.kv_v_dim, c.kv_dim), True)}  # n_kv_heads heads: fewer than n_heads when grouped


def terms_at(config: AttentionConfig, place: str) -> tuple[str, ...]:
    """The terms `config` uses that act at `place` (PLACES), in the formula's order."""
    return tuple(name for name, t in TERMS.items() if t.place == place and t.uses(config))
