"""The numpy reference: the formula of the README ("The model"), written to be read, not to be fast.

float64 throughout, one head and one query at a time, so that it shares no code and no
numerical shortcut with the torch module or the ONNX graph it checks.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attnx.model.config import AttentionConfig

__all__ = ["reference_attention"]


def reference_attention(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    memory: np.ndarray | None = None,
    key_padding_mask: np.ndarray | None = None,
    past_key: np.ndarray | None = None,
    past_value: np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y [batch, seq, d_model] in float64 for x [batch, seq, d_model]. With config.kv_cache,
    (y, present_key, present_value): the keys/values of past_key/past_value (positions
    0..past_seq-1) followed by this step's (positions past_seq..), query i at past_seq + i."""
    c = config

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
    for b in range(batch):
        for n in range(c.n_heads):
            g = n // c.group_size  # the key/value head query head n reads
            qn = q[b, :, n * c.head_dim : (n + 1) * c.head_dim]
            kn = k[b, :, g * c.head_dim : (g + 1) * c.head_dim]
            vn = v[b, :, g * c.v_head_dim : (g + 1) * c.v_head_dim]
            for i in range(t):
                visible = np.ones(s, dtype=bool)
                if c.causal:
                    visible[past + i + 1 :] = False  # a key after the query's position is hidden
                if key_padding_mask is not None:
                    visible &= ~np.asarray(key_padding_mask[b], dtype=bool)  # True hides
                if not visible.any():
                    continue  # every key hidden: z_i = 0 by definition
                scores = c.softmax_scale * (kn[visible] @ qn[i])
                p = np.exp(scores - scores.max())
                p /= p.sum()
                z[b, i, n * c.v_head_dim : (n + 1) * c.v_head_dim] = p @ vn[visible]
    y = linear(z, "out_proj")
    if not c.kv_cache:
        return y
    present_key = k.reshape(batch, s, c.n_kv_heads, c.head_dim).transpose(0, 2, 1, 3)  # (batch, Nkv, s, hd)
    present_value = v.reshape(batch, s, c.n_kv_heads, c.v_head_dim).transpose(0, 2, 1, 3)
    return y, present_key, present_value
