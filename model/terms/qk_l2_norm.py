"""qk_l2_norm: each head's q and k divided by sqrt(mean(x^2) + eps) after rope, no weights (Llama 4's L2Norm)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.terms._base import Config, Setter, Term, Weights, check_number, replace, rms, self_attention_only


def _validate(c: Config, set_: Setter) -> None:
    if c.qk_l2_norm is None:
        return
    set_("qk_l2_norm", check_number("qk_l2_norm", c.qk_l2_norm))
    self_attention_only(c, "qk_l2_norm")


def _drop_l2_norm(c: Config, w: Weights) -> tuple[Config, Weights]:
    # (the norm before the rotation would be no fault: a rotation of every pair keeps each head's mean square)
    return replace(c, qk_l2_norm=None), w


def reference(c: Config, w: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray, positions: Any,
              tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The same root mean square as qk_norm's, after rope and without weights."""
    return rms(q, c.qk_l2_norm), rms(k, c.qk_l2_norm)


def torch_half(m: Any, q: Any, k: Any, positions: Any, tokens: Any) -> tuple[Any, Any]:
    """x / sqrt(mean(x^2) + eps) over head_dim, no weights, in float32 at least (as transformers' L2Norm)."""
    import torch

    def norm(u: torch.Tensor) -> torch.Tensor:
        h = u if u.dtype == torch.float64 else u.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.config.qk_l2_norm)).to(u.dtype)

    return norm(q), norm(k)


TERM = Term("qk_l2_norm", ("qk_l2_norm",), "qk",
            "each head's q and k divided by sqrt(mean(x^2) + eps) after rope, no weights (Llama 4's L2Norm)",
            lambda c: c.qk_l2_norm is not None, _validate,
            tolerance="none: a norm drops the error's radial part",
            fault=_drop_l2_norm, fault_summary="the norm dropped", modern=True,
            reference=reference, torch=torch_half)  # fmt: skip
