"""The numpy reference: the formula of docs/concepts/formula.md, written to be read, not to be fast.

One head and one query at a time, so that it shares no code and no numerical shortcut with the torch
module or the ONNX graph it checks; float64 (any dtype when asked: the tolerance table's float32
estimate runs this same formula). The one thing every form shares is the rope table
(attnx.model.rope: inv_freq and attention_factor), which tests check against transformers' own.

The terms of the formula are the registry's (attnx.model.terms.TERMS), each computed here by its
entry's numpy function (Term.reference), in the formula's order: projections, the q/k terms (qk_norm, rope), the
cache, scale * q.k and the score terms (softcap, ALiBi), the masks (causal, sliding window, key padding: over
token index), softmax over the visible keys and the softmax terms (a head's sink logit), times v, out
projection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.config import AttentionConfig
from attnx.model.terms import TERMS
from attnx.model.terms._base import linear

__all__ = ["hidden_grid", "hidden_keys", "reference_attention", "scored_qk"]


# The terms' functions (each entry's `reference`: attnx.model.terms). Each takes the config and the weights, then
# what its place acts on:
#   qk:      q [batch, t, n_heads, hd], k [batch, s, n_kv_heads, hd], position_ids [batch, t], the queries'
#            token indices [t] -> (q, k)
#   scores:  s [keys] of one query, the query's token index, the keys' token indices, its head -> s
#   mask:    the query's token index, every key's token index [keys], its batch's key_padding_mask row
#            (or None) -> hidden bool [keys]
#   softmax: its head -> more logits in the softmax's denominator, with no value
#   heads:   the term that computes q, k and v itself (latent): (project x -> q, what the cache holds; expand that
#            -> k, v)
QK = tuple[np.ndarray, np.ndarray]


def _terms(c: AttentionConfig, place: str) -> list[str]:
    return [t for t in c.terms if TERMS[t].place == place]


def hidden_keys(c: AttentionConfig, query: int, keys: int) -> np.ndarray:
    """bool [keys]: key j hidden from the query at token index `query` of a row without padding, by the union of
    the config's mask terms (token indices)."""
    index, padding = np.arange(keys), np.zeros(keys, bool)
    hidden = np.zeros(keys, bool)
    for term in _terms(c, "mask"):
        hidden |= TERMS[term].reference(c, query, index, padding)
    return hidden


def hidden_grid(c: AttentionConfig, tokens: int) -> np.ndarray:
    """bool [tokens, tokens]: key j hidden from query i of a prompt of `tokens` tokens without padding, by the
    union of the config's mask terms (token indices)."""
    return np.stack([hidden_keys(c, i, tokens) for i in range(tokens)]) if tokens else np.zeros((0, 0), bool)


def scored_qk(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    memory: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    dtype: Any = np.float64,
    stages: dict[str, np.ndarray] | None = None,
    past: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """q [batch, t, n_heads, hd] and k [batch, s, n_kv_heads, hd] as the formula scores them: the
    projections, then the q/k terms (qk_norm, rope, ...) in order, in `dtype`; the queries at token indices
    past.. (a step's after its cache). stages: filled with q, k and the q/k terms' stages, [batch, t, heads * hd]."""
    c = config
    x = np.asarray(x, dtype=dtype)
    m = np.asarray(memory, dtype=dtype) if c.cross else x
    q, k = _cached_qk(c, weights, x, m, position_ids, stages, past)
    if c.latent is not None:  # k scored: the latents expanded (attnx.model.terms.Latent)
        k = TERMS["latent"].reference[1](c, weights, k)[0]
    return q, k


def _cached_qk(c: AttentionConfig, weights: Mapping[str, np.ndarray], x: np.ndarray, m: np.ndarray,
               position_ids: np.ndarray | None, stages: dict[str, np.ndarray] | None, past: int) -> QK:  # fmt: skip
    """q [b, t, N, hd] and what the cache holds of k: k [b, s, Nkv, hd], or the latents [b, s, 1, rope.dim +
    kv_lora_rank] (latent), after the q/k terms."""
    if c.rope is not None and position_ids is None:
        raise ValueError("a config with rope takes position_ids [batch, seq]")
    if c.latent is not None:
        q, k = TERMS["latent"].reference[0](c, weights, x)
        if stages is not None:
            stages.update(q=q.reshape(*q.shape[:2], -1), k=k.reshape(*k.shape[:2], -1))
    else:
        q, k = linear(c, weights, x, "q_proj"), linear(c, weights, m, "k_proj")  # (b, t, N*hd), (b, s, Nkv*hd)
        if stages is not None:
            stages.update(q=q, k=k)
        q = q.reshape(*q.shape[:2], c.n_heads, c.head_dim)
        k = k.reshape(*k.shape[:2], c.n_kv_heads, c.head_dim)
    tokens = np.arange(past, past + q.shape[1])
    for term in _terms(c, "qk"):
        q, k = TERMS[term].reference(c, weights, q, k, position_ids, tokens)
        stage = TERMS[term].stage
        if stages is not None and stage is not None:
            stages[f"q_{stage}"] = q.reshape(*q.shape[:2], -1).copy()
            stages[f"k_{stage}"] = k.reshape(*k.shape[:2], -1).copy()
    return q, k


def reference_attention(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    memory: np.ndarray | None = None,
    key_padding_mask: np.ndarray | None = None,
    past_key: np.ndarray | None = None,
    past_value: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    stages: dict[str, np.ndarray] | None = None,
    core_stages: bool = True,
    dtype: Any = np.float64,
    stats: dict[str, float] | None = None,
    past_latent: np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """y [batch, seq, d_model] in `dtype` (float64 unless asked) for x [batch, seq, d_model]. With
    config.kv_cache, (y, present_key, present_value): the keys/values of past_key/past_value (token
    indices 0..past_seq-1) followed by this step's (past_seq..), query i at index past_seq + i; the cache
    holds keys as they are scored (after qk_norm and rope). position_ids int64 [batch, seq]: each new
    token's position, what rope rotates by (config.rope; the masks are over token index).
    stages: a dict to fill with the value of every stage of the formula (attnx.model.stages), in its
    canonical layout; "probs_rows" marks the rows of probs that have a visible key; core_stages=False
    leaves scores and probs out ([batch, n_heads, seq, keys]: too large to hold at long sequences).
    stats: a dict to add "score_sq" and "scores" to: the sum of squares and the count of the visible
    keys' scores, scale * q.k before the score terms (the quantized error model's score RMS).
    With config.latent (attnx.model.terms.Latent) the cache is the latents: past_latent [batch, 1, past_seq,
    rope.dim + kv_lora_rank] in, (y, present_latent) out, k and v expanded from them after the cache."""
    c = config
    x = np.asarray(x, dtype=dtype)
    m = np.asarray(memory, dtype=dtype) if c.cross else x
    batch, t, _ = x.shape
    if c.latent is not None:
        past = past_latent.shape[2] if c.kv_cache else 0
        q, latent = _cached_qk(c, weights, x, m, position_ids, stages, past)  # (b, t, N, hd), (b, s, 1, w)
        if c.kv_cache:  # the cache: [batch, 1, past, w], laid out as the latents [batch, past, 1, w]
            latent = np.concatenate([np.asarray(past_latent, dtype=dtype).transpose(0, 2, 1, 3), latent], axis=1)
        k, v = TERMS["latent"].reference[1](c, weights, latent)  # (b, s, N, hd), (b, s, N, vhd)
        if stages is not None:
            stages["v"] = v[:, past:].reshape(batch, -1, c.kv_v_dim)
    else:
        past = past_key.shape[2] if c.kv_cache else 0
        q, k = scored_qk(c, weights, x, memory, position_ids, dtype, stages, past)  # (b, t, N, hd), (b, s, Nkv, hd)
        v = linear(c, weights, m, "v_proj").reshape(batch, -1, c.n_kv_heads, c.v_head_dim)  # (b, s, Nkv, vhd)
        if stages is not None:
            stages["v"] = v.reshape(batch, -1, c.kv_v_dim)
    if c.kv_cache and c.latent is None:  # the cache: [batch, Nkv, past, hd], laid out as the projections
        k = np.concatenate([np.asarray(past_key, dtype=dtype).transpose(0, 2, 1, 3), k], axis=1)
        v = np.concatenate([np.asarray(past_value, dtype=dtype).transpose(0, 2, 1, 3), v], axis=1)
    s = k.shape[1]
    keys = np.arange(s)  # every key's token index
    scores_terms, mask_terms, softmax_terms = (_terms(c, p) for p in ("scores", "mask", "softmax"))
    z = np.zeros((batch, t, c.n_heads, c.v_head_dim), dtype=dtype)
    core = stages is not None and core_stages
    if core:
        all_scores = np.zeros((batch, c.n_heads, t, s), dtype=dtype)
        all_probs = np.zeros((batch, c.n_heads, t, s), dtype=dtype)
        rows = np.zeros((batch, c.n_heads, t), dtype=bool)
    for b in range(batch):
        padding = None if key_padding_mask is None else np.asarray(key_padding_mask[b], dtype=bool)
        for i in range(t):
            query = past + i  # the query's token index
            hidden = np.zeros(s, dtype=bool)
            for term in mask_terms:
                hidden |= TERMS[term].reference(c, query, keys, padding)
            visible = ~hidden
            for n in range(c.n_heads):
                g = n // c.group_size  # the key/value head query head n reads
                if core:  # every key's score (hidden ones too: the stage is before the masks)
                    every = c.softmax_scale * (k[b, :, g] @ q[b, i, n])  # (s,)
                    for term in scores_terms:
                        every = TERMS[term].reference(c, weights, every, query, keys, n)
                    all_scores[b, n, i] = every
                if not visible.any():
                    continue  # every key hidden: z_i = 0 by definition (a sink takes all the weight)
                scores = c.softmax_scale * (k[b, visible, g] @ q[b, i, n])  # the visible keys'
                if stats is not None:
                    stats["score_sq"] = stats.get("score_sq", 0.0) + float(np.sum(np.square(scores, dtype=np.float64)))
                    stats["scores"] = stats.get("scores", 0) + int(scores.size)
                for term in scores_terms:
                    scores = TERMS[term].reference(c, weights, scores, query, keys[visible], n)
                logits = scores
                extra = [x for term in softmax_terms for x in TERMS[term].reference(c, weights, n)]
                logits = np.append(logits, np.asarray(extra, dtype=dtype))  # more logits, no value
                e = np.exp(logits - logits.max())
                p = e[: visible.sum()] / e.sum()
                z[b, i, n] = p @ v[b, visible, g]
                if core:
                    all_probs[b, n, i, visible] = p
                    rows[b, n, i] = True
    z = z.reshape(batch, t, c.v_dim)  # heads concatenated
    y = linear(c, weights, z, "out_proj")
    if core:
        stages.update(scores=all_scores, probs=all_probs, probs_rows=rows)
    if stages is not None:
        stages.update(z=z, y=y)
    if not c.kv_cache:
        return y
    if c.latent is not None:
        present_latent = latent.transpose(0, 2, 1, 3)  # (b, 1, s, w)
        if stages is not None:
            stages["present_latent"] = present_latent
        return y, present_latent
    present_key, present_value = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (b, Nkv, s, d)
    if stages is not None:
        stages.update(present_key=present_key, present_value=present_value)
    return y, present_key, present_value
