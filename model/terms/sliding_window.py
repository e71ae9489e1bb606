"""sliding_window: key j hidden from query i when j <= i - W (Mistral, Gemma 2's local layers)."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.errors import ConfigError
from attnx.model.terms._base import Config, Setter, Term, Weights, check_int, replace


def _validate(c: Config, set_: Setter) -> None:
    if c.sliding_window is None:
        return
    check_int("sliding_window", c.sliding_window)
    if not c.causal:
        raise ConfigError("config key 'sliding_window' needs 'causal': true (query p sees key j only if p - W < j <= p)")


def _window_off_by_one(c: Config, w: Weights) -> tuple[Config, Weights]:
    return replace(c, sliding_window=c.sliding_window + 1), w


def reference(c: Config, query: int, keys: np.ndarray, padding: np.ndarray | None) -> np.ndarray:
    return keys <= query - c.sliding_window  # only p - W < j is seen


def torch_half(m: Any, i: Any, j: Any, kpm: Any) -> Any:
    return (j[None, :] <= i[:, None] - m.config.sliding_window)[None, None]  # outside p - W < j


TERM = Term("sliding_window", ("sliding_window",), "mask", "key j hidden from query i when j <= i - W",
            lambda c: c.sliding_window is not None, _validate, reach=lambda c: c.sliding_window,
            fault=_window_off_by_one, fault_summary="the window one key wider (W + 1)", modern=True,
            reference=reference, torch=torch_half)  # fmt: skip
