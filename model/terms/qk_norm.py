"""qk_norm: RMSNorm of each head's q and k over head_dim, times q_norm.weight / k_norm.weight (Qwen3, Gemma 3)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.terms._base import Config, Setter, Term, Weights, number_object, rms, self_attention_only


@dataclasses.dataclass(frozen=True)
class QKNorm:
    """The config's `qk_norm`: RMSNorm of each head's q and k over head_dim, x / sqrt(mean(x^2) + eps)
    times the weights q_norm.weight / k_norm.weight [head_dim], before rope (Qwen3, Gemma 3)."""

    eps: float

    def to_dict(self) -> dict[str, Any]:
        return {"eps": self.eps}


def _validate(c: Config, set_: Setter) -> None:
    if c.qk_norm is None:
        return
    set_("qk_norm", number_object("qk_norm", c.qk_norm, QKNorm))
    self_attention_only(c, "qk_norm")


def _swap_qk_norms(c: Config, w: Weights) -> tuple[Config, Weights]:
    out = dict(w)
    out["q_norm.weight"], out["k_norm.weight"] = w["k_norm.weight"], w["q_norm.weight"]
    return c, out


def reference(c: Config, w: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray, positions: Any,
              tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """RMSNorm of each head over head_dim, times the weights q_norm.weight / k_norm.weight."""

    def norm(u: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return rms(u, c.qk_norm.eps) * np.asarray(weight, dtype=u.dtype)

    return norm(q, w["q_norm.weight"]), norm(k, w["k_norm.weight"])


def torch_half(m: Any, q: Any, k: Any, positions: Any, tokens: Any) -> tuple[Any, Any]:
    return m.q_norm(q), m.k_norm(k)  # the module's HeadRMSNorms: over head_dim, each head alike


TERM = Term("qk_norm", ("qk_norm",), "qk", "RMSNorm of each head's q and k over head_dim, times q_norm/k_norm.weight",
            lambda c: c.qk_norm is not None, _validate,
            tensors=lambda c: {"q_norm.weight": ((c.head_dim,), (0.5, 1.5)),
                               "k_norm.weight": ((c.head_dim,), (0.5, 1.5))},
            tolerance="none: a norm drops the error's radial part",
            fault=_swap_qk_norms, fault_summary="q_norm and k_norm weights swapped", modern=True,
            reference=reference, torch=torch_half, stage="norm")  # fmt: skip
