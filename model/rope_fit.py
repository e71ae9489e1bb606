"""A rotary table read back: the frequencies and attention factor a graph's cos/sin table [positions, dim/2] holds
(fit_rope), how far it is from a rope's (rope_table_error, against the bound of a table stored in its dtype with its
angles in float32), and the Rope(theta, dim) it is, if any (rope_of_table). The other half of attnx.model.rope: what
the audit reads a graph's rotation with. numpy only."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import numpy as np

from attnx.model.rope import SCALING_PARAMS, Rope, RopeScaling, rope_frequencies, rope_said
from attnx.model.tolerance import rope_table_bound, stored_bound

__all__ = ["RopeFit", "fit_rope", "half_table", "named_rope", "rope_of_table", "rope_table_error"]


@dataclasses.dataclass(frozen=True)
class RopeFit:
    """How a rotary table cos/sin [positions, dim/2] was read (rope_of_table): its rows and rotated dims, theta fitted
    to its frequencies (nan: no fit), the table's max error against that theta's and its ratio to the table's bound
    (above 1: not that theta's table; where no named rope fits, against the table's own frequencies), the attention
    factor it is multiplied by, and in words what it matches ("theta 10000", a named scaling, "the graph's own
    table") or why it is not read as a rotation ("not read: ..."; then no Rope). switch: the prompt length past which
    the graph changes tables (longrope's rule; None: one table)."""

    positions: int
    dim: int
    theta: float = float("nan")
    error: float = float("nan")
    bound_ratio: float = float("nan")
    factor: float = float("nan")
    matches: str | None = None
    unread: str | None = None
    switch: int | None = None


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


def rope_of_table(cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> tuple[Rope | None, RopeFit]:
    """The Rope whose table is the graph's (within rope_table_error's bound), with the fit: theta^(-2i/dim) for a
    theta; else the named scaling it matches (named_rope: "llama3, factor 8, ..."); else the graph's own table (rope
    type "table": its frequencies and attention factor as numbers). RopeFit.matches says which. None (and why:
    RopeFit.unread) only where the table is no rotation at all: its entries not cos/sin of position * a frequency."""
    cos, sin = half_table(cos, sin)
    inv_freq, factor = fit_rope(cos, sin)
    dim = 2 * inv_freq.shape[0]
    fit = RopeFit(positions=int(cos.shape[0]), dim=dim)
    if dim < 4 or np.any(inv_freq[1:] <= 0):
        return None, dataclasses.replace(fit, unread="not read: fewer than 2 frequencies, or one not positive")
    # inv_freq_i = theta^(-2i/dim): log theta from every frequency past the first (which is 1 for any theta)
    i = np.arange(1, dim // 2, dtype=np.float64)
    theta = float(np.exp(-(np.log(inv_freq[1:]) @ i) / (2.0 / dim * (i @ i))))
    rope = Rope(theta=theta, dim=dim, interleaved=interleaved)
    expected, _ = rope_frequencies(rope)
    error, ratio = rope_table_error(cos, sin, expected)
    fit = dataclasses.replace(fit, theta=theta, error=error, bound_ratio=ratio, factor=factor)
    if ratio <= 1 and abs(factor - 1.0) <= stored_bound(np.asarray(cos).dtype):
        return rope, dataclasses.replace(fit, matches=rope_said(rope))
    named = named_rope(cos, sin, inv_freq, factor, interleaved)
    if named is not None:
        rope, said = named
        return rope, dataclasses.replace(fit, matches=said)
    own_error, own_ratio = rope_table_error(cos, sin, inv_freq, factor)
    if own_ratio > 1:
        return None, dataclasses.replace(fit, unread=f"not read: the table is not cos/sin of position * a frequency "
                                                     f"(max error {own_error:.2g}, {own_ratio:.3g} times its bound)")
    # the high frequencies of every named scaling are theta's own: theta as its second frequency says it
    scaling = RopeScaling("table", (("attention_factor", factor), ("inv_freq", tuple(float(f) for f in inv_freq))))
    rope = Rope(theta=max(float(inv_freq[1]) ** (-dim / 2.0), 1.0 + 1e-9), dim=dim, interleaved=interleaved,
                scaling=scaling)  # fmt: skip
    return rope, dataclasses.replace(fit, error=own_error, bound_ratio=own_ratio, matches=rope_said(rope))


# the bases checkpoints use, tried beside the fitted one: a scaling with a short original length keeps no high
# frequency as theta's own (Llama 3's at original 32 keeps only the first, which is 1 for any theta)
COMMON_THETAS = (10000.0, 50000.0, 100000.0, 150000.0, 500000.0, 1000000.0, 2000000.0, 5000000.0, 10000000.0)


def _round(value: float) -> list[float]:
    """A fitted number, and the same to 5 and 3 significant digits (a config's numbers are round)."""
    return list(dict.fromkeys([float(f"{value:.5g}"), float(f"{value:.3g}"), value]))


def _candidates(inv_freq: np.ndarray, factor: float, dim: int, interleaved: bool,
                factor_fits: Callable[[float], bool]) -> Iterator[Rope]:  # fmt: skip
    """Named scalings (ROPE_INIT_FUNCTIONS) whose parameters the fitted frequencies suggest: theta from the high
    frequencies every scaling keeps (or, for linear, from their ratios), the factor from the lowest, the original
    length and the ramps' ends from the values checkpoints use. Left out unbuilt, as named_rope's screens would
    refuse them: a (theta, factor) whose llama3 and yarn frequencies cannot come within 1e-4 of the fit (each of
    theirs lies between theta's own, kept, and theta's divided by the factor), and a yarn attention factor that
    factor_fits refuses (yarn's table is multiplied by its attention_factor as it is)."""
    lengths = [2**k for k in range(4, 21)]
    high_theta = float(inv_freq[1]) ** (-dim / 2.0)
    scale = float(inv_freq[0] ** -1)
    linear_theta = float(inv_freq[1] / inv_freq[0]) ** (-dim / 2.0)
    for theta, f in itertools.product(_round(linear_theta), _round(scale)):
        if theta > 1 and f > 0:
            yield Rope(theta, dim, interleaved, RopeScaling("linear", (("factor", f),)))
    for theta in dict.fromkeys(_round(high_theta) + list(COMMON_THETAS)):
        if theta <= 1:
            continue
        lowest = float(1.0 / theta ** ((dim - 2) / dim))
        for f in _round(lowest / float(inv_freq[-1])):
            if f <= 1:
                continue
            kept, _ = rope_frequencies(Rope(theta, dim, interleaved))
            if not _between(inv_freq, kept / f, kept):
                continue
            for original, (low, high) in itertools.product(lengths, ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0), (1.0, 8.0))):
                params = (("factor", f), ("high_freq_factor", high), ("low_freq_factor", low),
                          ("original_max_position_embeddings", original))  # fmt: skip
                yield Rope(theta, dim, interleaved, RopeScaling("llama3", params))
            # the attention factor transformers resolves (exact where it is the one), else the table's own
            attentions = dict.fromkeys([SCALING_PARAMS["yarn"].attention_factor({"factor": f}), factor])
            for attention, original, fast, slow, truncate in itertools.product(
                    [a for a in attentions if factor_fits(a)], lengths, (32.0, 16.0, 8.0, 4.0), (1.0, 2.0),
                    (True, False)):  # fmt: skip
                params = (("attention_factor", attention), ("beta_fast", fast), ("beta_slow", slow), ("factor", f),
                          ("original_max_position_embeddings", original), ("truncate", truncate))  # fmt: skip
                yield Rope(theta, dim, interleaved, RopeScaling("yarn", params))


# named_rope's screen on frequencies: each within this of the fitted one, relative
FREQ_SCREEN = 1e-4


def _between(inv_freq: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> bool:
    """Whether frequencies from `lower` to `upper` (each entry's own range, with a rounding's slack) can pass
    named_rope's screen of `inv_freq`: False only where one fitted frequency is beyond FREQ_SCREEN of its range."""
    slack = 1e-12
    return bool(np.all(inv_freq * (1 - FREQ_SCREEN) < upper * (1 + slack))
                and np.all(inv_freq * (1 + FREQ_SCREEN) > lower * (1 - slack)))  # fmt: skip


def named_rope(cos: np.ndarray, sin: np.ndarray, inv_freq: np.ndarray, factor: float,
               interleaved: bool) -> tuple[Rope, str] | None:  # fmt: skip
    """The named scaling (linear, llama3, yarn) whose table is the graph's within rope_table_error's bound, and
    what it is in words ("llama3, theta 500000, factor 8, ..."), or None. Candidates are screened on their
    frequencies (1e-4 relative to the fit) and attention factor before the table is compared entry by entry."""
    dim = 2 * inv_freq.shape[0]
    bound = stored_bound(np.asarray(cos).dtype)

    def factor_fits(expected_factor: float) -> bool:
        return not abs(expected_factor - factor) > 4 * bound * max(1.0, abs(factor))

    for rope in _candidates(inv_freq, factor, dim, interleaved, factor_fits):
        try:
            expected, expected_factor = rope_frequencies(rope)
        except (ValueError, ZeroDivisionError, OverflowError):
            continue
        if not factor_fits(expected_factor):
            continue
        if not np.all(np.abs(expected / inv_freq - 1) < FREQ_SCREEN):
            continue
        if rope_table_error(cos, sin, expected, expected_factor)[1] <= 1:
            return rope, rope_said(rope)
    return None
