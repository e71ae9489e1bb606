"""causal: key j hidden from query i when j > i (token index)."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.model.terms._base import Config, Term, Weights, check_bool, replace


def _no_causal_mask(c: Config, w: Weights) -> tuple[Config, Weights]:
    return replace(c, causal=False, sliding_window=None), w


def reference(c: Config, query: int, keys: np.ndarray, padding: np.ndarray | None) -> np.ndarray:
    return keys > query  # a key after the query's token


def torch_half(m: Any, i: Any, j: Any, kpm: Any) -> Any:
    return (j[None, :] > i[:, None])[None, None]  # (1, 1, T, S): key j after query i


TERM = Term("causal", ("causal",), "mask", "key j hidden from query i when j > i (token index)",
            lambda c: c.causal, lambda c, set_: check_bool("causal", c.causal),
            fault=_no_causal_mask, fault_summary="the causal mask dropped", unsaid=True, listed=False,
            sdpa_is_causal=True, reference=reference, torch=torch_half)  # fmt: skip
