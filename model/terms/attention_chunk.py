"""attention_chunk: key j hidden from query i unless both are in the same chunk of C tokens (Llama 4's chunked
layers)."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.errors import ConfigError
from attnx.model.terms._base import Config, Setter, Term, Weights, check_int, replace


def _validate(c: Config, set_: Setter) -> None:
    if c.attention_chunk is None:
        return
    check_int("attention_chunk", c.attention_chunk)
    if not c.causal:
        raise ConfigError("config key 'attention_chunk' needs 'causal': true (a query sees the keys of its own chunk "
                          "up to itself)")  # fmt: skip


def _chunk_off_by_one(c: Config, w: Weights) -> tuple[Config, Weights]:
    return replace(c, attention_chunk=c.attention_chunk + 1), w


def reference(c: Config, query: int, keys: np.ndarray, padding: np.ndarray | None) -> np.ndarray:
    """Another chunk than the query's, chunks of C counted from the row's first unpadded key (transformers counts
    the leading padding alone)."""
    kept = np.zeros(0, bool) if padding is None else ~np.asarray(padding, bool)
    start = int(np.argmax(kept)) if kept.any() else len(kept)  # the leading padded keys (0 without padding)
    return (keys - start) // c.attention_chunk != (query - start) // c.attention_chunk


def torch_half(m: Any, i: Any, j: Any, kpm: Any) -> Any:
    """(B|1, 1, T, S): key j in another chunk than query i, chunks counted from each row's first unpadded key."""
    import torch

    size = m.config.attention_chunk
    if kpm is None:
        start = torch.zeros(1, 1, dtype=i.dtype, device=i.device)
    else:  # the leading padded keys of each row: those before its first kept one
        start = ((~kpm.to(torch.bool)).to(i.dtype).cumsum(-1) == 0).sum(-1, keepdim=True)  # (B, 1)
    qc = torch.div(i[None, :] - start, size, rounding_mode="floor")  # (B|1, T)
    kc = torch.div(j[None, :] - start, size, rounding_mode="floor")  # (B|1, S)
    return (qc[:, :, None] != kc[:, None, :])[:, None]


TERM = Term("attention_chunk", ("attention_chunk",), "mask",
            "key j hidden from query i unless both are in the same chunk of C tokens, counted from the row's first "
            "unpadded key (Llama 4's chunked layers)",
            lambda c: c.attention_chunk is not None, _validate, reach=lambda c: c.attention_chunk,
            fault=_chunk_off_by_one, fault_summary="the chunk one key longer (C + 1)", modern=True,
            reference=reference, torch=torch_half)  # fmt: skip
