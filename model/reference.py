"""The numpy reference: the formula of the README ("The model"), written to be read, not to be fast.

float64 throughout, one head and one query at a time, so that it shares no code and no
numerical shortcut with the torch module or the ONNX graph it checks. The one thing every form
shares is the rope table (attnx.model.rope: inv_freq and attention_factor), which tests check
against transformers' own.

The order (README, "Modern LLM attention"): projections, qk_norm, rope, scale * q.k, softcap,
ALiBi's slope_h * (j - i), masks (causal, sliding window, key padding; ALiBi and the masks over token
index), softmax over the visible keys and the head's sink logit, times v, out projection.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attnx.model.alibi import alibi_slopes
from attnx.model.config import AttentionConfig
from attnx.model.rope import rope_cos_sin, rope_pairs

__all__ = ["reference_attention"]


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
) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y [batch, seq, d_model] in float64 for x [batch, seq, d_model]. With config.kv_cache,
    (y, present_key, present_value): the keys/values of past_key/past_value (token indices
    0..past_seq-1) followed by this step's (past_seq..), query i at index past_seq + i; the cache
    holds keys as they are scored (after qk_norm and rope). position_ids int64 [batch, seq]: each
    new token's position, what rope rotates by (config.rope; the masks are over token index).
    stages: a dict to fill with the value of every stage of the formula (attnx.model.stages), in
    its canonical layout, float64; "probs_rows" marks the rows of probs that have a visible key;
    core_stages=False leaves scores and probs out ([batch, n_heads, seq, keys]: too large to hold at
    long sequences)."""
    c = config
    if c.rope is not None and position_ids is None:
        raise ValueError("a config with rope takes position_ids [batch, seq]")

    def linear(inp: np.ndarray, name: str) -> np.ndarray:
        # Each tensor is made float64 when used, not all up front: a float64 copy of every
        # weight would be 4.8 GB for the gpt3 preset (2x its float32 weights).
        w = np.asarray(weights[f"{name}.weight"], dtype=np.float64)
        out = inp @ w.T  # torch Linear convention: W is [out, in]
        if c.bias:
            out = out + np.asarray(weights[f"{name}.bias"], dtype=np.float64)
        return out

    x = np.asarray(x, dtype=np.float64)
    m = np.asarray(memory, dtype=np.float64) if c.cross else x
    batch, t, _ = x.shape
    q = linear(x, "q_proj")  # (batch, t, N*hd)
    k = linear(m, "k_proj")  # (batch, s, Nkv*hd)
    v = linear(m, "v_proj")  # (batch, s, Nkv*vhd)
    record = stages
    if record is not None:
        record.update(q=q, k=k, v=v)
    if c.qk_norm is not None or c.rope is not None:
        q = _norm_and_rotate(c, weights, q, c.n_heads, "q_norm", position_ids, record, "q")
        k = _norm_and_rotate(c, weights, k, c.n_kv_heads, "k_norm", position_ids, record, "k")
    sinks = np.asarray(weights["sinks"], dtype=np.float64) if c.sinks else None
    slopes = alibi_slopes(c.n_heads) if c.alibi else None
    past = 0
    if c.kv_cache:
        past = past_key.shape[2]
        # The cache is per head, [batch, Nkv, past, hd]: laid out as the projections, [batch, past, Nkv*hd].
        pk = np.asarray(past_key, dtype=np.float64).transpose(0, 2, 1, 3).reshape(batch, past, c.kv_q_dim)
        pv = np.asarray(past_value, dtype=np.float64).transpose(0, 2, 1, 3).reshape(batch, past, c.kv_v_dim)
        k = np.concatenate([pk, k], axis=1)  # (batch, past + t, Nkv*hd)
        v = np.concatenate([pv, v], axis=1)
    s = k.shape[1]
    z = np.zeros((batch, t, c.v_dim))  # heads concatenated
    core = stages is not None and core_stages
    if core:  # every key's score (hidden ones too: the stage is before the masks)
        all_scores = np.zeros((batch, c.n_heads, t, s))
        all_probs = np.zeros((batch, c.n_heads, t, s))
        rows = np.zeros((batch, c.n_heads, t), dtype=bool)
    for b in range(batch):
        for n in range(c.n_heads):
            g = n // c.group_size  # the key/value head query head n reads
            qn = q[b, :, n * c.head_dim : (n + 1) * c.head_dim]
            kn = k[b, :, g * c.head_dim : (g + 1) * c.head_dim]
            vn = v[b, :, g * c.v_head_dim : (g + 1) * c.v_head_dim]
            for i in range(t):
                p_index = past + i  # the query's token index
                visible = np.ones(s, dtype=bool)
                if c.causal:
                    visible[p_index + 1 :] = False  # a key after the query's token is hidden
                if c.sliding_window is not None:
                    visible[: max(p_index - c.sliding_window + 1, 0)] = False  # p - W < j only
                if key_padding_mask is not None:
                    visible &= ~np.asarray(key_padding_mask[b], dtype=bool)  # True hides
                # ALiBi: slope_n * (j - i) over token index (key j at index j, the query at p_index)
                distance = np.arange(s) - p_index
                if core:
                    every = c.softmax_scale * (kn @ qn[i])
                    every = c.softcap * np.tanh(every / c.softcap) if c.softcap is not None else every
                    all_scores[b, n, i] = every + slopes[n] * distance if slopes is not None else every
                if not visible.any():
                    continue  # every key hidden: z_i = 0 by definition (a sink takes all the weight)
                scores = c.softmax_scale * (kn[visible] @ qn[i])
                if c.softcap is not None:
                    scores = c.softcap * np.tanh(scores / c.softcap)
                if slopes is not None:
                    scores = scores + slopes[n] * distance[visible]
                logits = scores if sinks is None else np.append(scores, sinks[n])  # the sink: a logit, no value
                e = np.exp(logits - logits.max())
                p = e[: len(scores)] / e.sum()
                z[b, i, n * c.v_head_dim : (n + 1) * c.v_head_dim] = p @ vn[visible]
                if core:
                    all_probs[b, n, i, visible] = p
                    rows[b, n, i] = True
    y = linear(z, "out_proj")
    if core:
        stages.update(scores=all_scores, probs=all_probs, probs_rows=rows)
    if stages is not None:
        stages.update(z=z, y=y)
    if not c.kv_cache:
        return y
    present_key = k.reshape(batch, s, c.n_kv_heads, c.head_dim).transpose(0, 2, 1, 3)  # (batch, Nkv, s, hd)
    present_value = v.reshape(batch, s, c.n_kv_heads, c.v_head_dim).transpose(0, 2, 1, 3)
    if stages is not None:
        stages.update(present_key=present_key, present_value=present_value)
    return y, present_key, present_value


def _norm_and_rotate(
    c: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    u: np.ndarray,
    heads: int,
    norm: str,
    position_ids: np.ndarray | None,
    record: dict[str, np.ndarray] | None = None,
    label: str = "",
) -> np.ndarray:
    """q or k [batch, t, heads*hd] after qk_norm (RMSNorm of each head over head_dim, times the
    weights `norm`.weight) and rope (pair i of each head at position p turned by p * inv_freq_i);
    record gets the stages `label`_norm and `label`_rope."""
    batch, t, _ = u.shape
    out = u.reshape(batch, t, heads, c.head_dim).copy()  # (batch, t, heads, hd)
    if c.qk_norm is not None:
        w = np.asarray(weights[f"{norm}.weight"], dtype=np.float64)
        out = out / np.sqrt(np.mean(out**2, axis=-1, keepdims=True) + c.qk_norm.eps) * w
        if record is not None:
            record[f"{label}_norm"] = out.reshape(batch, t, heads * c.head_dim).copy()
    if c.rope is not None:
        cos, sin = rope_cos_sin(c.rope, np.asarray(position_ids))  # (batch, t, dim/2), times attention_factor
        a, b = rope_pairs(c.rope)  # pair i is (a[i], b[i]) of each head
        qa, qb = out[..., a].copy(), out[..., b].copy()
        out[..., a] = qa * cos[:, :, None] - qb * sin[:, :, None]
        out[..., b] = qb * cos[:, :, None] + qa * sin[:, :, None]
        if record is not None:
            record[f"{label}_rope"] = out.reshape(batch, t, heads * c.head_dim).copy()
    return out.reshape(batch, t, heads * c.head_dim)
