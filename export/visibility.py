"""Which keys a query sees and what is added to its scores, over token index, as the terms' entries say
(attnx.export.terms: each mask term's hides and fit_grid, each bias term's bias): what every core's emitter calls to
mask (visibility, hidden_by), to bias its scores (score_bias), and what the audit fits a graph's computed mask grid
with (read_mask_grid)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from onnx import TensorProto

from attnx.errors import ConfigError
from attnx.export._graph import call_tokens, span, token_indices
from attnx.export.terms import GRAPH_TERMS, used_terms
from attnx.model.config import AttentionConfig
from attnx.model.reference import hidden_grid
from attnx.model.terms import TERMS

__all__ = ["adds_bias", "hidden_by", "read_mask_grid", "score_bias", "visibility"]


def hidden_by(g: Any, c: AttentionConfig, names: list[str], kpm: str | None, step: bool,
              span_: tuple[str, str] | None = None, indices: tuple[str, str] | None = None) -> str | None:  # fmt: skip
    """bool [B|1, 1, S, T]: key j hidden from query i by any of the named mask terms (each entry's hides, over token
    index; the padding mask only where a term counts from it), or None without one. indices: (qcol [B|1, 1, S, 1],
    krow [1, 1, 1, T]) where each row's queries sit at their own positions (the decomposed buffer form's)."""
    hidden = None
    if names:
        qcol, krow = indices or token_indices(g, *(span_ if span_ is not None else span(g, step)), rank=4)
        for name in names:
            part = GRAPH_TERMS[name].hides(g, c, qcol, krow, kpm)  # [B|1, 1, S, T]
            hidden = part if hidden is None else g.op("Or", hidden, part)
    return hidden


def visibility(g: Any, c: AttentionConfig, kpm: str | None, step: bool, span_: tuple[str, str] | None = None,
               indices: tuple[str, str] | None = None) -> tuple[str | None, str | None]:  # fmt: skip
    """(hidden bool [B|1, 1, S, T], visible-rows bool [B|1, 1, S, 1]), over token index: key j hidden from query i
    (at index past_seq + i in the step model, i otherwise) by any mask term the config uses (each entry's hides:
    after it, outside the window) or padded (key_padding_mask). (None, None) when nothing is hidden (a
    full-sequence model without mask or padding). span_: the step's (past_seq, T) as int64 scalars where
    past_key's length is not past_seq (the buffer form: its capacity); indices: hidden_by's."""
    hidden = hidden_by(g, c, [name for name in GRAPH_TERMS if GRAPH_TERMS[name].hides is not None
                               and TERMS[name].uses(c)], kpm, step, span_, indices)  # fmt: skip
    if kpm is not None:
        padded = g.op("Unsqueeze", kpm, g.ints("axes_12", [1, 2]))  # [B, 1, 1, T]
        if hidden is None:  # one row per query all the same: [B, 1, S, T] (Attention-23 broadcasts no query axis)
            rows = g.op("Concat", g.ints("one_one", [1, 1]), call_tokens(g), g.ints("one1", [1]),
                        axis=0)  # fmt: skip
            hidden = g.op("Expand", padded, rows)
        else:
            hidden = g.op("Or", hidden, padded)  # [B, 1, S, T]
    if hidden is None:
        return None, None
    seen = g.op("ReduceMax", g.op("Cast", g.op("Not", hidden), to=TensorProto.INT32), g.ints("axes_last", [-1]),
                keepdims=1)  # fmt: skip
    return hidden, g.op("Cast", seen, to=TensorProto.BOOL)  # [B|1, 1, S|1, 1]: some key visible to the query


def adds_bias(config: AttentionConfig) -> bool:
    """Whether a term of `config` adds a bias to the scores (score_bias)."""
    return bool(used_terms(config, "bias"))


def score_bias(g: Any, config: AttentionConfig, step: bool) -> str | None:
    """The sum of the biases the config's terms add to the scores (each entry's bias: ALiBi's slope_h * (j - i)),
    [1, H, S, T] float32, or None without one."""
    terms = used_terms(config, "bias")
    if not terms:
        return None
    qcol, krow = token_indices(g, *span(g, step))
    total = None
    for term in terms:
        part = term.bias(g, config, qcol, krow)
        total = part if total is None else g.op("Add", total, part)
    return total


def read_mask_grid(allowed: np.ndarray, config: AttentionConfig) -> tuple[AttentionConfig, str]:
    """(`config` with the mask terms whose union hides what `allowed` [tokens, tokens] hides, how the mask is said)
    for the grid a graph's mask computes for a prompt (True: query i sees key j, token indices): each term fitted
    by its entry (fit_grid), the whole held to the formula's own masks (attnx.model.reference.hidden_grid). A term
    the config (what the node states) has and the grid shows not is kept: the op applies it itself. ValueError
    where the formula's mask terms give no such grid."""
    fitted: dict[str, Any] = {}
    said: list[str] = []
    for name, term in GRAPH_TERMS.items():
        if term.fit_grid is not None:
            (key,) = TERMS[name].keys
            fitted[key], words = term.fit_grid(allowed)
            said += [words] if words else []
    names = ", ".join(n for n, t in GRAPH_TERMS.items() if t.fit_grid is not None)
    try:  # the grid's own terms alone (the step's cache and the padding are not the prompt's grid)
        grid_config = dataclasses.replace(config, kv_cache=False, key_padding_mask=False, **fitted)
    except ConfigError:
        grid_config = None
    if grid_config is None or not np.array_equal(~hidden_grid(grid_config, allowed.shape[0]), allowed):
        raise ValueError(f"it is no union of the formula's masks ({names})")
    merged = {key: value or getattr(config, key) for key, value in fitted.items()}
    return dataclasses.replace(config, **merged), ", ".join(said) or "none"
