"""Seeded example inputs for a config: what parity, export checks, bench and golden files feed."""

from __future__ import annotations

import numpy as np

from attnx.model.config import AttentionConfig
from attnx.model.contract import DTYPES, float_dtype, numpy_dtype

__all__ = ["make_inputs"]


def make_inputs(
    config: AttentionConfig,
    batch: int,
    seq: int,
    mem_seq: int | None = None,
    dtype: str = "fp32",
    seed: int = 0,
    mean: float = 0.0,
) -> dict[str, np.ndarray]:
    """x ~ N(mean, 1) (and memory for cross-attention), plus a key padding mask when the model
    takes one: batch element 0 hides about a third of its keys (never all), element 1 hides
    every key (the fully masked row: y must be the output bias there), others hide half.
    The same seed draws the same noise whatever the mean."""
    if config.cross and mem_seq is None:
        raise ValueError("cross-attention inputs need mem_seq")
    rng = np.random.Generator(np.random.PCG64(seed))
    dtype = float_dtype(dtype)  # a quantized model (int8, int4) takes float32 inputs
    np_dtype = numpy_dtype(dtype) if dtype in DTYPES and DTYPES[dtype].numpy else np.dtype(np.float32)
    mean = np.float32(mean)
    feeds = {"x": (rng.standard_normal((batch, seq, config.d_model), dtype=np.float32) + mean).astype(np_dtype)}
    kv_len = seq
    if config.cross:
        feeds["memory"] = (rng.standard_normal((batch, mem_seq, config.kv_dim), dtype=np.float32) + mean).astype(np_dtype)
        kv_len = mem_seq
    if config.key_padding_mask:
        mask = np.zeros((batch, kv_len), dtype=bool)
        for b in range(batch):
            if b == 1:
                mask[b] = True
                continue
            mask[b] = rng.random(kv_len) < (1 / 3 if b == 0 else 1 / 2)
            mask[b, rng.integers(kv_len)] = False  # at least one visible key
        feeds["key_padding_mask"] = mask
    return feeds
