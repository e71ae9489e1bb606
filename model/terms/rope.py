"""rope: q and k rotated by position, pairs by inv_freq from the rope table (attnx.model.rope, which every form
shares)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.rope import parse_rope, rope_cos_sin, rope_pairs, rope_said
from attnx.model.terms._base import Config, Setter, Term, Weights, replace, self_attention_only


def _validate(c: Config, set_: Setter) -> None:
    set_("rope", parse_rope(c.rope, c.head_dim))
    if c.rope is not None:  # positions of a second sequence: no model attnx imports has them
        self_attention_only(c, "rope")


def _flip_rope_layout(c: Config, w: Weights) -> tuple[Config, Weights]:
    rope = dataclasses.replace(c.rope, interleaved=not c.rope.interleaved)
    return replace(c, rope=rope), w


def _says(c: Config) -> list[Any]:
    r = c.rope
    return [rope_said(r) + (f", dim {r.dim}" if r.dim != c.head_dim else "") + (", interleaved" if r.interleaved else "")]


def reference(c: Config, w: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray, positions: Any,
              tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
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


def torch_half(m: Any, q: Any, k: Any, positions: Any, tokens: Any) -> tuple[Any, Any]:
    """The module's own table and rotation (attnx.model.module: the table a constant of the exported graph)."""
    cos, sin = m._rope_cos_sin(positions, q.dtype)  # (B, T, 1, dim/2)
    return m._rotate(q, cos, sin), m._rotate(k, cos, sin)


TERM = Term("rope", ("rope",), "qk",
            "q and k rotated by position (position_ids), pairs by inv_freq from the rope table (attnx.model.rope)",
            lambda c: c.rope is not None, _validate,
            tolerance="4 eps32 P B rms(ref): the float32 angle's rounding at position P (tolerance, 'Rotary positions')",
            fault=_flip_rope_layout, fault_summary="the pair layout flipped (interleaved <-> half-split)",
            modern=True, says=_says, reference=reference, torch=torch_half, stage="rope")  # fmt: skip
