"""ALiBi, attention with linear biases: the config's `alibi` key and its slopes.

With `alibi`, head h adds slope_h * (j - i) to the score of query i and key j (token indices; the
query of a step model sits at past + i), after the scale and softcap, before the masks
(docs/concepts/formula.md, "Modern LLM attention"). The slopes are the one thing every form shares, so they are one function,
as the rope table is (attnx.model.rope).
"""

from __future__ import annotations

import numpy as np

__all__ = ["alibi_slopes"]


def alibi_slopes(n_heads: int) -> np.ndarray:
    """The ALiBi slopes of `n_heads` heads, float64 [n_heads]: Press, Smith and Lewis, "Train Short,
    Test Long: Attention with Linear Biases Enables Input Length Extrapolation", ICLR 2022
    (arXiv:2108.12409), section 3 and its reference code (get_slopes).

    For a power of two n, the geometric sequence 2^(-8k/n), k = 1..n (bias max 8: the last head's
    slope is 2^-8). For any other n, with p the largest power of two below n, the p slopes of p
    heads followed by the slopes of 2p heads at odd k, 2^(-8k/(2p)) for k = 1, 3, .., 2(n - p) - 1:
    the paper's rule, as BLOOM's and Falcon's build_alibi_tensor compute it, and MPT's
    build_mpt_alibi_tensor at its default alibi_bias_max 8 (its interleaving of the 2p-head sequence
    gives the same list). transformers computes them in float32 (Falcon then rounds them to bfloat16:
    measurements/alibi_transformers); these are float64 (tests/model/test_alibi.py holds them to its functions)."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"alibi_slopes needs a positive number of heads, got {n_heads!r}")
    p = 1 << (n_heads.bit_length() - 1)  # the largest power of two <= n_heads
    main = np.exp2(-8.0 * np.arange(1, p + 1) / p)
    extra = np.exp2(-8.0 * np.arange(1, 2 * (n_heads - p), 2) / (2 * p))  # empty for a power of two
    return np.concatenate([main, extra])
