"""attn_temperature: q at token index i scaled by log1p(floor((i + 1) / floor_scale)) * attn_scale + 1 (Llama 4's
NoPE layers)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.terms._base import Config, Setter, Term, Weights, number_object, replace, self_attention_only


@dataclasses.dataclass(frozen=True)
class Temperature:
    """The config's `attn_temperature`: the query at token index i (its slot, padding included) scaled by
    log1p(floor((i + 1) / floor_scale)) * attn_scale + 1 before it is scored (Llama 4's attention temperature
    tuning on its NoPE layers, arXiv:2501.19399)."""

    floor_scale: float
    attn_scale: float

    def to_dict(self) -> dict[str, Any]:
        return {"floor_scale": self.floor_scale, "attn_scale": self.attn_scale}

    def factors(self, tokens: np.ndarray) -> np.ndarray:
        """The factor of each query token index, float64 (the one definition every form follows)."""
        return np.log1p(np.floor((np.asarray(tokens, np.float64) + 1.0) / self.floor_scale)) * self.attn_scale + 1.0


def _validate(c: Config, set_: Setter) -> None:
    if c.attn_temperature is None:
        return
    set_("attn_temperature", number_object("attn_temperature", c.attn_temperature, Temperature))
    self_attention_only(c, "attn_temperature")


def _double_temperature(c: Config, w: Weights) -> tuple[Config, Weights]:
    t = c.attn_temperature
    return replace(c, attn_temperature=Temperature(t.floor_scale, 2 * t.attn_scale)), w


def reference(c: Config, w: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray, positions: Any,
              tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """q at token index i times its factor; k as it was."""
    return q * c.attn_temperature.factors(tokens).astype(q.dtype)[None, :, None, None], k


def torch_half(m: Any, q: Any, k: Any, positions: Any, tokens: Any) -> tuple[Any, Any]:
    """q (B, T, N, hd) times its token index's factor, computed in float32 at least."""
    import torch

    t = m.config.attn_temperature
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    factor = torch.log1p(torch.floor((tokens.to(dtype) + 1.0) / t.floor_scale)) * t.attn_scale + 1.0  # (T,)
    return (q.to(dtype) * factor[None, :, None, None]).to(q.dtype), k


TERM = Term("attn_temperature", ("attn_temperature",), "qk",
            "q at token index i times log1p(floor((i + 1) / floor_scale)) * attn_scale + 1 (Llama 4's NoPE layers)",
            lambda c: c.attn_temperature is not None, _validate,
            tolerance="S (the largest absolute score) is taken from q as scaled",
            fault=_double_temperature, fault_summary="attn_scale doubled", modern=True, by_slot=True,
            reference=reference, torch=torch_half)  # fmt: skip
