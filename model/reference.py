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
) -> np.ndarray:
    """y [batch, seq, d_model] in float64 for x [batch, seq, d_model]."""
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
    s = m.shape[1]
    q = linear(x, "q_proj")  # (batch, t, N*hd)
    k = linear(m, "k_proj")  # (batch, s, N*hd)
    v = linear(m, "v_proj")  # (batch, s, N*vhd)
    z = np.zeros((batch, t, c.v_dim))  # heads concatenated
    for b in range(batch):
        for n in range(c.n_heads):
            qn = q[b, :, n * c.head_dim : (n + 1) * c.head_dim]
            kn = k[b, :, n * c.head_dim : (n + 1) * c.head_dim]
            vn = v[b, :, n * c.v_head_dim : (n + 1) * c.v_head_dim]
            for i in range(t):
                visible = np.ones(s, dtype=bool)
                if c.causal:
                    visible[i + 1 :] = False  # key j > query i is hidden
                if key_padding_mask is not None:
                    visible &= ~np.asarray(key_padding_mask[b], dtype=bool)  # True hides
                if not visible.any():
                    continue  # every key hidden: z_i = 0 by definition
                scores = c.softmax_scale * (kn[visible] @ qn[i])
                p = np.exp(scores - scores.max())
                p /= p.sum()
                z[b, i, n * c.v_head_dim : (n + 1) * c.v_head_dim] = p @ vn[visible]
    return linear(z, "out_proj")
