"""A rotary table read back: the frequencies and attention factor a graph's cos/sin table [positions, dim/2] holds
(fit_rope), how far it is from a rope's (rope_table_error, against the bound of a table stored in its dtype with its
angles in float32), and the Rope(theta, dim) it is, if any (rope_of_table). The other half of attnx.model.rope: what
the audit reads a graph's rotation with. numpy only."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.model.rope import Rope, rope_frequencies
from attnx.model.tolerance import rope_table_bound, stored_bound

__all__ = ["fit_rope", "half_table", "rope_of_table", "rope_table_error"]


def fit_rope(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, float]:
    """The frequencies and attention factor of a rotary table cos/sin [positions, dim/2] (row p, column
    i: cos(p * inv_freq_i) * factor): each column's angle unwrapped along the positions (every frequency is
    below pi per position) and fitted through the origin, so a table stored in half precision reads as well."""
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    angles = np.unwrap(np.arctan2(sin, cos), axis=0)
    positions = np.arange(cos.shape[0], dtype=np.float64)
    inv_freq = positions @ angles / max(float(positions @ positions), 1e-30)
    return inv_freq, float(np.hypot(cos, sin).mean())


def rope_table_error(cos: np.ndarray, sin: np.ndarray, inv_freq: np.ndarray, factor: float = 1.0) -> tuple[float, float]:
    """(max |difference|, max difference / its bound) of a table cos/sin [positions, k] against
    factor * cos/sin(position * inv_freq[:k]) in float64, each entry's bound that of a table stored in its dtype with
    its angle computed in float32 (attnx.model.tolerance.rope_table_bound): a ratio above 1 is another table."""
    angles = np.arange(cos.shape[0], dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, : cos.shape[1]]
    c, s = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    diff = np.maximum(np.abs(np.cos(angles) * factor - c), np.abs(np.sin(angles) * factor - s))
    bound = abs(factor) * rope_table_bound(np.asarray(cos).dtype, angles)
    return float(diff.max()), float((diff / bound).max())


def half_table(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A rotary table [positions, dim/2]: a whole head's table, cat(freqs, freqs) as transformers writes it, read
    as its first half."""
    half = cos.shape[1] // 2
    if cos.shape[1] % 2 == 0 and np.array_equal(cos[:, :half], cos[:, half:]) and np.array_equal(sin[:, :half],
                                                                                                  sin[:, half:]):  # fmt: skip
        return cos[:, :half], sin[:, :half]
    return cos, sin


def rope_of_table(cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> tuple[Rope | None, dict[str, Any]]:
    """A Rope(theta, dim) whose table matches the graph's (within rope_table_error's bound), with the fit's error;
    None (and why) when the table is not theta^(-2i/dim) for any theta (a scaled rope: read against a checkpoint's)."""
    cos, sin = half_table(cos, sin)
    inv_freq, factor = fit_rope(cos, sin)
    dim = 2 * inv_freq.shape[0]
    facts: dict[str, Any] = {"rope_positions": int(cos.shape[0]), "rope_dim": dim}
    if dim < 4 or np.any(inv_freq[1:] <= 0):
        return None, {**facts, "rope": "not read: fewer than 2 frequencies, or one not positive"}
    # inv_freq_i = theta^(-2i/dim): log theta from every frequency past the first (which is 1 for any theta)
    i = np.arange(1, dim // 2, dtype=np.float64)
    theta = float(np.exp(-(np.log(inv_freq[1:]) @ i) / (2.0 / dim * (i @ i))))
    rope = Rope(theta=theta, dim=dim, interleaved=interleaved)
    expected, _ = rope_frequencies(rope)
    error, ratio = rope_table_error(cos, sin, expected)
    facts.update(rope_theta=theta, rope_fit_error=error, rope_fit_bound_ratio=ratio, rope_factor=factor)
    if ratio > 1 or abs(factor - 1.0) > stored_bound(np.asarray(cos).dtype):
        return None, {**facts, "rope": f"not read: the table is not theta^(-2i/{dim}) of any theta (max error "
                                       f"{error:.2g}, {ratio:.3g} times its bound; factor {factor:.4g}): a scaled "
                                       "rope"}  # fmt: skip
    return rope, facts
