"""alibi: head h adds slope_h * (j - i) to its scores, over token index (attnx.model.alibi's slopes: BLOOM, MPT)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.alibi import alibi_slopes
from attnx.model.terms._base import Config, Setter, Term, Weights, replace, self_attention_only


def _validate(c: Config, set_: Setter) -> None:
    if c.alibi:  # a distance between a query and a key of another sequence: no model attnx imports has it
        self_attention_only(c, "alibi")


def _drop_alibi(c: Config, w: Weights) -> tuple[Config, Weights]:
    return replace(c, alibi=False), w


def reference(c: Config, w: Mapping[str, np.ndarray], s: np.ndarray, query: int, keys: np.ndarray,
              head: int) -> np.ndarray:  # fmt: skip
    return s + alibi_slopes(c.n_heads)[head] * (keys - query)  # slope_h * (j - i), token indices


def torch_half(m: Any, scores: Any, i: Any, j: Any) -> Any:
    """slope_h * (j - i) over token index, added to the scores: computed in float32 at least (as the rope
    angle is) and rounded once to the scores' dtype."""
    import torch

    dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    slopes = torch.tensor(alibi_slopes(m.config.n_heads), dtype=dtype, device=scores.device).view(1, -1, 1, 1)
    distance = (j[None, :] - i[:, None]).to(dtype)  # (T, S)
    return scores + (slopes * distance).to(scores.dtype)  # (B, N, T, S)


TERM = Term("alibi", ("alibi",), "scores",
            "head h adds slope_h * (j - i) over token index (attnx.model.alibi's slopes: BLOOM, MPT)",
            lambda c: c.alibi, _validate,
            tolerance="S (the largest absolute score) includes the largest slope times distance",
            score_bound=lambda c, keys: float(alibi_slopes(c.n_heads).max()) * (keys - 1),  # |j - i| < keys
            table=lambda c: alibi_slopes(c.n_heads),
            fault=_drop_alibi, fault_summary="the bias dropped", modern=True,
            reference=reference, torch=torch_half)  # fmt: skip
