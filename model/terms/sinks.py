"""sinks: one more logit per query head in the softmax's denominator (tensor sinks), with no value (gpt-oss)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.terms._base import Config, Term, Weights, check_bool, replace


def _drop_sinks(c: Config, w: Weights) -> tuple[Config, Weights]:
    return replace(c, sinks=False), {k: v for k, v in w.items() if k != "sinks"}


def reference(c: Config, w: Mapping[str, np.ndarray], head: int) -> list[float]:
    return [float(np.asarray(w["sinks"])[head])]  # a logit with no value


def torch_half(m: Any, scores: Any) -> Any:
    B, N, T, _ = scores.shape
    return m.sinks.to(scores.dtype).view(1, N, 1, 1).expand(B, N, T, 1)  # a logit per head


TERM = Term("sinks", ("sinks",), "softmax", "one more logit per query head in the softmax (tensor sinks), no value",
            lambda c: c.sinks, lambda c, set_: check_bool("sinks", c.sinks),
            tensors=lambda c: {"sinks": ((c.n_heads,), (-2.0, 2.0))},
            tolerance="none: one more logit with no value and no error",
            fault=_drop_sinks, fault_summary="the sink logit dropped", modern=True,
            reference=reference, torch=torch_half)  # fmt: skip
