"""key_padding_mask: the keys marked True in the key_padding_mask input hidden."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.model.terms._base import Config, Term, check_bool


def reference(c: Config, query: int, keys: np.ndarray, padding: np.ndarray | None) -> np.ndarray:
    return np.asarray(padding, dtype=bool)  # True hides


def torch_half(m: Any, i: Any, j: Any, kpm: Any) -> Any:
    import torch

    return kpm.to(torch.bool)[:, None, None, :]  # (B, 1, 1, S): True hides


TERM = Term("key_padding_mask", ("key_padding_mask",), "mask", "keys marked True in key_padding_mask hidden",
            lambda c: c.key_padding_mask, lambda c, set_: check_bool("key_padding_mask", c.key_padding_mask),
            unsaid=True, reference=reference, torch=torch_half)  # fmt: skip
