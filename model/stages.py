"""The stages of the formula: the named intermediate values every form is compared at when a case
fails (docs/concepts/localisation.md). Part of the contract (attnx.model.contract re-exports them).

One entry a stage, in the formula's order (docs/concepts/formula.md, "Modern LLM attention": projections, qk_norm,
rope, scale * q.k, softcap, masks, softmax with sink, times v, out projection):

    q, k, v         the projections' outputs, bias included         [batch, seq, heads * dim]
    q_norm, k_norm  after the per-head RMS norm (config qk_norm)    same
    q_rope, k_rope  after the rotation (config rope)                same
    scores          scale * q.k, soft-capped (config softcap), before the masks
                                                                    [batch, n_heads, seq, keys]
    probs           the softmax over the visible keys (and the sink), 0 at a hidden key
                                                                    [batch, n_heads, seq, keys]
    z               the heads' outputs concatenated, before the output projection
                                                                    [batch, seq, n_heads * v_head_dim]
    y               the output                                      [batch, seq, d_model]
    present_key, present_value  a step model's cache after the step [batch, n_kv_heads, keys, dim]
    present_latent  a latent config's (attnx.model.terms.Latent) instead [batch, 1, keys, rope.dim + kv_lora_rank]

k and v are this call's keys and values (a step model's new tokens; the cache holds the earlier
ones), keys is every key a query is scored against (past + new for a step model). A fully hidden
row of probs has no probabilities (its z is 0 by definition): it is not compared.

A graph exposes a stage as a tensor named after it (the export names them: docs/reference/onnx-graph.md, "Names"), and
records in its metadata (STAGES_KEY, JSON {stage: layout}) the layout it holds it in when that is
not the canonical one above: a grouped graph keeps the scores of a group's query heads stacked
([batch, n_kv_heads, group * seq, keys], "b k (g t) s"). A fused operator (MultiHeadAttention,
GroupQueryAttention, Attention) hides the stages inside it: the graph then names what goes in and
what comes out, and localisation says the rest is hidden.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping

import numpy as np

from attnx.errors import ModelFileError
from attnx.model.config import AttentionConfig
from attnx.model.terms import TERMS

__all__ = [
    "Stage",
    "STAGES",
    "STAGES_KEY",
    "LAYOUTS",
    "stages_of",
    "get_stage",
    "stage_layouts",
    "to_canonical",
]

STAGES_KEY = "attnx.stages"  # metadata: {stage: layout} of the stages a graph names


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    what: str  # the formula's term, as reports say it
    layout: str  # the canonical layout (a key of LAYOUTS)
    present: Callable[[AttentionConfig, bool], bool]  # (config, step model) -> the formula has this stage
    # What the stage's value is computed from (its error model, attnx.model.tolerance.stage_tolerance):
    # "projection" (one projection: its own input width), "scores" (two projections and a dot
    # product), "probs", "attention" (z), "output" (y).
    kind: str
    projections: tuple[str, ...] = ()  # the projections it depends on (a quantized form's error model)


def _always(config: AttentionConfig, step: bool) -> bool:
    return True


def _term(name: str) -> Callable[[AttentionConfig, bool], bool]:
    """A stage of a term's output: there when the config uses the term (attnx.model.terms)."""
    return lambda config, step: TERMS[name].uses(config)


def _per_head_step(config: AttentionConfig, step: bool) -> bool:
    return step and config.latent is None


def _latent_step(config: AttentionConfig, step: bool) -> bool:
    return step and config.latent is not None  # its cache: the latents (attnx.model.terms.Latent)


STAGES: tuple[Stage, ...] = (
    Stage("q", "q = x Wq (+ bq)", "b t (h d)", _always, "projection", ("q",)),
    Stage("k", "k = m Wk (+ bk)", "b t (h d)", _always, "projection", ("k",)),
    Stage("v", "v = m Wv (+ bv)", "b t (h d)", _always, "projection", ("v",)),
    Stage("q_norm", "q after its per-head RMS norm", "b t (h d)", _term("qk_norm"), "projection", ("q",)),
    Stage("k_norm", "k after its per-head RMS norm", "b t (h d)", _term("qk_norm"), "projection", ("k",)),
    Stage("q_rope", "q rotated by position", "b t (h d)", _term("rope"), "rotated", ("q",)),
    Stage("k_rope", "k rotated by position", "b t (h d)", _term("rope"), "rotated", ("k",)),
    Stage("scores", "scale * q.k (soft-capped), before the masks", "b h t s", _always, "scores", ("q", "k")),
    Stage("probs", "softmax over the visible keys", "b h t s", _always, "probs", ("q", "k")),
    Stage("z", "the heads' outputs, concatenated", "b t (h d)", _always, "attention", ("q", "k", "v")),
    Stage("y", "y = z Wo (+ bo)", "b t (h d)", _always, "output", ("q", "k", "v", "out")),
    Stage("present_key", "the cache of keys after the step", "b h s d", _per_head_step, "projection", ("k",)),
    Stage("present_value", "the cache of values after the step", "b h s d", _per_head_step, "projection", ("v",)),
    Stage("present_latent", "the cache of latents after the step (rotated rope key, normed compressed kv)",
          "b h s d", _latent_step, "projection", ("k",)),
)
_BY_NAME = {s.name: s for s in STAGES}

# The layouts a graph may hold a stage in, as einops writes them: t the queries, s the keys, h the
# heads (n_heads for q, scores, probs and z; n_kv_heads for k, v and the cache), d a head's dims,
# k the key/value heads and g the query heads of a group (query head h = k * group + g).
LAYOUTS = {
    "b t (h d)": "[batch, seq, heads * dim]",
    "b h t d": "[batch, heads, seq, dim]",
    "b t h d": "[batch, seq, heads, dim]",
    "b h t s": "[batch, heads, seq, keys]",
    "b k (g t) s": "[batch, kv_heads, group * seq, keys]",
    "b h s d": "[batch, heads, keys, dim]",
}


def stages_of(config: AttentionConfig, step: bool = False) -> tuple[Stage, ...]:
    """The stages the formula of `config` has, in order (step: a step model's, with its cache)."""
    return tuple(s for s in STAGES if s.present(config, step))


def get_stage(name: str) -> Stage:
    return _BY_NAME[name]


def stage_layouts(metadata: Mapping[str, str]) -> dict[str, str]:
    """{stage: layout} of the stages a graph names (its STAGES_KEY metadata; {} when it has none:
    a model written before the stages were named)."""
    text = metadata.get(STAGES_KEY)
    if not text:
        return {}
    try:
        layouts = json.loads(text)
    except ValueError as e:
        raise ModelFileError(f"metadata {STAGES_KEY!r} is not JSON: {e}") from None
    if not isinstance(layouts, dict):
        raise ModelFileError(f"metadata {STAGES_KEY!r} is not a JSON object of stage: layout")
    for stage, layout in layouts.items():
        if stage not in _BY_NAME or layout not in LAYOUTS:
            raise ModelFileError(f"metadata {STAGES_KEY!r} names stage {stage!r} in layout {layout!r}: unknown")
    return layouts


def to_canonical(stage: str, value: np.ndarray, layout: str, config: AttentionConfig) -> np.ndarray:
    """A graph's value of `stage`, held in `layout`, in the stage's canonical layout."""
    canonical = _BY_NAME[stage].layout
    if layout == canonical:
        return value
    if layout == "b h t d" and canonical == "b t (h d)":
        b, h, t, d = value.shape
        return value.transpose(0, 2, 1, 3).reshape(b, t, h * d)
    if layout == "b t h d" and canonical == "b t (h d)":
        b, t, h, d = value.shape
        return value.reshape(b, t, h * d)
    if layout == "b k (g t) s" and canonical == "b h t s":
        b, _, _, s = value.shape
        return value.reshape(b, config.n_heads, -1, s)  # head k * group + g: the order of the query heads
    raise ValueError(f"stage {stage!r}: no conversion from layout {layout!r} to {canonical!r}")
