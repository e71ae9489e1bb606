"""softcap: s -> c tanh(s / c), after the scale, before the masks (Gemma 2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.terms._base import Config, Setter, Term, Weights, check_number, replace


def _validate(c: Config, set_: Setter) -> None:
    if c.softcap is not None:
        set_("softcap", check_number("softcap", c.softcap))


def _double_softcap(c: Config, w: Weights) -> tuple[Config, Weights]:
    return replace(c, softcap=2 * c.softcap), w


def reference(c: Config, w: Mapping[str, np.ndarray], s: np.ndarray, query: int, keys: np.ndarray,
              head: int) -> np.ndarray:  # fmt: skip
    return c.softcap * np.tanh(s / c.softcap)


def torch_half(m: Any, scores: Any, i: Any, j: Any) -> Any:
    import torch

    return torch.tanh(scores / m.config.softcap) * m.config.softcap


TERM = Term("softcap", ("softcap",), "scores", "s -> c tanh(s / c), after the scale, before the masks",
            lambda c: c.softcap is not None, _validate,
            tolerance="none: the slope of c tanh(s / c) is at most 1",
            fault=_double_softcap, fault_summary="the cap doubled", modern=True,
            reference=reference, torch=torch_half)  # fmt: skip
