"""The numpy reference: the formula of docs/concepts/formula.md, written to be read, not to be fast.

One head and one query at a time, so that it shares no code and no numerical shortcut with the torch
module or the ONNX graph it checks; float64 (any dtype when asked: the tolerance table's float32
estimate runs this same formula). The one thing every form shares is the rope table
(attnx.model.rope: inv_freq and attention_factor), which tests check against transformers' own.

The terms of the formula are the registry's (attnx.model.terms.TERMS), each computed here by its
function in REFERENCE_TERMS, in the formula's order: projections, the q/k terms (qk_norm, rope), the
cache, scale * q.k and the score terms (softcap, ALiBi), the masks (causal, sliding window, key padding: over
token index), softmax over the visible keys and the softmax terms (a head's sink logit), times v, out
projection.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.model.alibi import alibi_slopes
from attnx.model.config import AttentionConfig
from attnx.model.rope import rope_cos_sin, rope_pairs
from attnx.model.terms import TERMS

__all__ = ["REFERENCE_TERMS", "hidden_grid", "hidden_keys", "reference_attention", "scored_qk"]


# The terms' functions. Each takes the config and the weights, then what its place acts on:
#   qk:      q [batch, t, n_heads, hd], k [batch, s, n_kv_heads, hd], position_ids [batch, t], the queries'
#            token indices [t] -> (q, k)
#   scores:  s [keys] of one query, the query's token index, the keys' token indices, its head -> s
#   mask:    the query's token index, every key's token index [keys], its batch's key_padding_mask row
#            (or None) -> hidden bool [keys]
#   softmax: its head -> more logits in the softmax's denominator, with no value
QK = tuple[np.ndarray, np.ndarray]


def _rms(u: np.ndarray, eps: float) -> np.ndarray:
    """u over the root of its mean square (+ eps) along head_dim."""
    return u / np.sqrt(np.mean(u**2, axis=-1, keepdims=True) + u.dtype.type(eps))


def _qk_norm(c: AttentionConfig, w: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray, positions: Any,
             tokens: np.ndarray) -> QK:  # fmt: skip
    """RMSNorm of each head over head_dim, times the weights q_norm.weight / k_norm.weight."""

    def norm(u: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return _rms(u, c.qk_norm.eps) * np.asarray(weight, dtype=u.dtype)

    return norm(q, w["q_norm.weight"]), norm(k, w["k_norm.weight"])


def _l2_norm(c: AttentionConfig, w: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray, positions: Any,
             tokens: np.ndarray) -> QK:  # fmt: skip
    """The same root mean square, after rope and without weights."""
    return _rms(q, c.qk_l2_norm), _rms(k, c.qk_l2_norm)


def _temperature(c: AttentionConfig, w: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray, positions: Any,
                 tokens: np.ndarray) -> QK:  # fmt: skip
    """q at token index i times its factor; k as it was."""
    return q * c.attn_temperature.factors(tokens).astype(q.dtype)[None, :, None, None], k


def _rope(c: AttentionConfig, w: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray, positions: Any,
          tokens: np.ndarray) -> QK:  # fmt: skip
    """Pair i of each head at position p turned by p * inv_freq_i (the rope table), times attention_factor."""
    cos, sin = (t.astype(q.dtype)[:, :, None] for t in rope_cos_sin(c.rope, np.asarray(positions)))  # (b, t, 1, dim/2)
    a, b = rope_pairs(c.rope)  # pair i is (a[i], b[i]) of each head

    def turn(u: np.ndarray) -> np.ndarray:
        out = u.copy()
        ua, ub = u[..., a], u[..., b]
        out[..., a] = ua * cos - ub * sin
        out[..., b] = ub * cos + ua * sin
        return out

    return turn(q), turn(k)


def _softcap(c: AttentionConfig, w: Mapping[str, np.ndarray], s: np.ndarray, query: int, keys: np.ndarray,
             head: int) -> np.ndarray:  # fmt: skip
    return c.softcap * np.tanh(s / c.softcap)


def _alibi(c: AttentionConfig, w: Mapping[str, np.ndarray], s: np.ndarray, query: int, keys: np.ndarray,
           head: int) -> np.ndarray:  # fmt: skip
    return s + alibi_slopes(c.n_heads)[head] * (keys - query)  # slope_h * (j - i), token indices


def _causal(c: AttentionConfig, query: int, keys: np.ndarray, padding: np.ndarray | None) -> np.ndarray:
    return keys > query  # a key after the query's token


def _window(c: AttentionConfig, query: int, keys: np.ndarray, padding: np.ndarray | None) -> np.ndarray:
    return keys <= query - c.sliding_window  # only p - W < j is seen


def _chunk(c: AttentionConfig, query: int, keys: np.ndarray, padding: np.ndarray | None) -> np.ndarray:
    """Another chunk than the query's, chunks of C counted from the row's first unpadded key (transformers counts
    the leading padding alone)."""
    kept = np.zeros(0, bool) if padding is None else ~np.asarray(padding, bool)
    start = int(np.argmax(kept)) if kept.any() else len(kept)  # the leading padded keys (0 without padding)
    return (keys - start) // c.attention_chunk != (query - start) // c.attention_chunk


def _key_padding(c: AttentionConfig, query: int, keys: np.ndarray, padding: np.ndarray | None) -> np.ndarray:
    return np.asarray(padding, dtype=bool)  # True hides


def _sinks(c: AttentionConfig, w: Mapping[str, np.ndarray], head: int) -> list[float]:
    return [float(np.asarray(w["sinks"])[head])]  # a logit with no value


def _matmul(w: Mapping[str, np.ndarray], inp: np.ndarray, name: str) -> np.ndarray:
    return inp @ np.asarray(w[f"{name}.weight"], dtype=inp.dtype).T  # a projection without bias


def _latent_project(c: AttentionConfig, w: Mapping[str, np.ndarray], x: np.ndarray) -> QK:
    """q [b, t, N, hd], each head [rope part | nope part], and each token's latent [b, t, 1, rope.dim +
    kv_lora_rank]: [its rope key (one, shared by every head) | its compressed kv, RMS-normed] (attnx.model.terms.Latent)."""
    L, r = c.latent, c.rope.dim
    nope = c.head_dim - r
    if L.q_lora_rank is None:
        q = _linear(c, w, x, "q_proj")
    else:
        qa = _rms(_linear(c, w, x, "q_a_proj"), L.eps) * np.asarray(w["q_a_layernorm.weight"], x.dtype)  # (b, t, qr)
        q = _matmul(w, qa, "q_b_proj")
    q = q.reshape(*q.shape[:2], c.n_heads, c.head_dim)  # transformers' head: [nope | rope]
    q = np.concatenate([q[..., nope:], q[..., :nope]], axis=-1)  # [rope | nope]
    a = _linear(c, w, x, "kv_a_proj_with_mqa")  # (b, t, kv_lora_rank + r): [compressed kv | rope key]
    kv = _rms(a[..., : L.kv_lora_rank], L.eps) * np.asarray(w["kv_a_layernorm.weight"], x.dtype)
    return q, np.concatenate([a[..., L.kv_lora_rank :], kv], axis=-1)[:, :, None, :]


def _latent_expand(c: AttentionConfig, w: Mapping[str, np.ndarray], latent: np.ndarray) -> QK:
    """k [b, s, N, hd] ([the shared rope key | the head's k_nope]) and v [b, s, N, vhd] of the (cached) latents
    [b, s, 1, rope.dim + kv_lora_rank]: kv_b_proj expands the compressed kv to each head's [k_nope | v]."""
    r, nope = c.rope.dim, c.head_dim - c.rope.dim
    kv = _matmul(w, latent[:, :, 0, r:], "kv_b_proj").reshape(*latent.shape[:2], c.n_heads, nope + c.v_head_dim)
    k_rot = np.broadcast_to(latent[..., :r], (*latent.shape[:2], c.n_heads, r))
    return np.concatenate([k_rot, kv[..., :nope]], axis=-1), kv[..., nope:]


REFERENCE_TERMS: dict[str, Callable[..., Any]] = {
    "qk_norm": _qk_norm,
    "rope": _rope,
    "qk_l2_norm": _l2_norm,
    "attn_temperature": _temperature,
    "softcap": _softcap,
    "alibi": _alibi,
    "causal": _causal,
    "sliding_window": _window,
    "attention_chunk": _chunk,
    "key_padding_mask": _key_padding,
    "sinks": _sinks,
    # heads: the term that computes q, k and v itself: (project x -> q, what the cache holds; expand that -> k, v)
    "latent": (_latent_project, _latent_expand),
}
# Where a term's output is a stage of the formula (attnx.model.stages): q_norm, k_rope, ...
_QK_STAGES = {"qk_norm": "norm", "rope": "rope"}


def _terms(c: AttentionConfig, place: str) -> list[str]:
    return [t for t in c.terms if TERMS[t].place == place]


def hidden_keys(c: AttentionConfig, query: int, keys: int) -> np.ndarray:
    """bool [keys]: key j hidden from the query at token index `query` of a row without padding, by the union of
    the config's mask terms (token indices)."""
    index, padding = np.arange(keys), np.zeros(keys, bool)
    hidden = np.zeros(keys, bool)
    for term in _terms(c, "mask"):
        hidden |= REFERENCE_TERMS[term](c, query, index, padding)
    return hidden


def hidden_grid(c: AttentionConfig, tokens: int) -> np.ndarray:
    """bool [tokens, tokens]: key j hidden from query i of a prompt of `tokens` tokens without padding, by the
    union of the config's mask terms (token indices)."""
    return np.stack([hidden_keys(c, i, tokens) for i in range(tokens)]) if tokens else np.zeros((0, 0), bool)


def _linear(c: AttentionConfig, weights: Mapping[str, np.ndarray], inp: np.ndarray, name: str) -> np.ndarray:
    # Each tensor is made the compute dtype when used, not all up front: a float64 copy of every
    # weight would be 4.8 GB for the gpt3 preset (2x its float32 weights).
    w = np.asarray(weights[f"{name}.weight"], dtype=inp.dtype)
    out = inp @ w.T  # torch Linear convention: W is [out, in]
    if c.bias:
        out = out + np.asarray(weights[f"{name}.bias"], dtype=inp.dtype)
    return out


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
        k = REFERENCE_TERMS["latent"][1](c, weights, k)[0]
    return q, k


def _cached_qk(c: AttentionConfig, weights: Mapping[str, np.ndarray], x: np.ndarray, m: np.ndarray,
               position_ids: np.ndarray | None, stages: dict[str, np.ndarray] | None, past: int) -> QK:  # fmt: skip
    """q [b, t, N, hd] and what the cache holds of k: k [b, s, Nkv, hd], or the latents [b, s, 1, rope.dim +
    kv_lora_rank] (latent), after the q/k terms."""
    if c.rope is not None and position_ids is None:
        raise ValueError("a config with rope takes position_ids [batch, seq]")
    if c.latent is not None:
        q, k = REFERENCE_TERMS["latent"][0](c, weights, x)
        if stages is not None:
            stages.update(q=q.reshape(*q.shape[:2], -1), k=k.reshape(*k.shape[:2], -1))
    else:
        q, k = _linear(c, weights, x, "q_proj"), _linear(c, weights, m, "k_proj")  # (b, t, N*hd), (b, s, Nkv*hd)
        if stages is not None:
            stages.update(q=q, k=k)
        q = q.reshape(*q.shape[:2], c.n_heads, c.head_dim)
        k = k.reshape(*k.shape[:2], c.n_kv_heads, c.head_dim)
    tokens = np.arange(past, past + q.shape[1])
    for term in _terms(c, "qk"):
        q, k = REFERENCE_TERMS[term](c, weights, q, k, position_ids, tokens)
        if stages is not None and term in _QK_STAGES:
            stages[f"q_{_QK_STAGES[term]}"] = q.reshape(*q.shape[:2], -1).copy()
            stages[f"k_{_QK_STAGES[term]}"] = k.reshape(*k.shape[:2], -1).copy()
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
        k, v = REFERENCE_TERMS["latent"][1](c, weights, latent)  # (b, s, N, hd), (b, s, N, vhd)
        if stages is not None:
            stages["v"] = v[:, past:].reshape(batch, -1, c.kv_v_dim)
    else:
        past = past_key.shape[2] if c.kv_cache else 0
        q, k = scored_qk(c, weights, x, memory, position_ids, dtype, stages, past)  # (b, t, N, hd), (b, s, Nkv, hd)
        v = _linear(c, weights, m, "v_proj").reshape(batch, -1, c.n_kv_heads, c.v_head_dim)  # (b, s, Nkv, vhd)
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
                hidden |= REFERENCE_TERMS[term](c, query, keys, padding)
            visible = ~hidden
            for n in range(c.n_heads):
                g = n // c.group_size  # the key/value head query head n reads
                if core:  # every key's score (hidden ones too: the stage is before the masks)
                    every = c.softmax_scale * (k[b, :, g] @ q[b, i, n])  # (s,)
                    for term in scores_terms:
                        every = REFERENCE_TERMS[term](c, weights, every, query, keys, n)
                    all_scores[b, n, i] = every
                if not visible.any():
                    continue  # every key hidden: z_i = 0 by definition (a sink takes all the weight)
                scores = c.softmax_scale * (k[b, visible, g] @ q[b, i, n])  # the visible keys'
                if stats is not None:
                    stats["score_sq"] = stats.get("score_sq", 0.0) + float(np.sum(np.square(scores, dtype=np.float64)))
                    stats["scores"] = stats.get("scores", 0) + int(scores.size)
                for term in scores_terms:
                    scores = REFERENCE_TERMS[term](c, weights, scores, query, keys[visible], n)
                logits = scores
                extra = [x for term in softmax_terms for x in REFERENCE_TERMS[term](c, weights, n)]
                logits = np.append(logits, np.asarray(extra, dtype=dtype))  # more logits, no value
                e = np.exp(logits - logits.max())
                p = e[: visible.sum()] / e.sum()
                z[b, i, n] = p @ v[b, visible, g]
                if core:
                    all_probs[b, n, i, visible] = p
                    rows[b, n, i] = True
    z = z.reshape(batch, t, c.v_dim)  # heads concatenated
    y = _linear(c, weights, z, "out_proj")
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
