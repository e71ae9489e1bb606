"""Seeded example inputs for a config: what parity, export checks, bench and golden files feed."""

from __future__ import annotations

import numpy as np

from attnx.model.config import AttentionConfig
from attnx.model.contract import DTYPES, float_dtype, numpy_dtype

__all__ = ["make_inputs", "position_ids_from_mask", "left_padding"]


def make_inputs(
    config: AttentionConfig,
    batch: int,
    seq: int,
    mem_seq: int | None = None,
    dtype: str = "fp32",
    seed: int = 0,
    mean: float = 0.0,
    position_offset: int = 0,
) -> dict[str, np.ndarray]:
    """x ~ N(mean, 1) (and memory for cross-attention), plus a key padding mask when the model
    takes one: batch element 0 hides about a third of its keys (never all), element 1 hides
    every key (the fully masked row: y must be the output bias there), others hide half.
    The same seed draws the same noise whatever the mean.

    A model with rope also takes position_ids int64 [batch, seq], Hugging Face's rule
    (position_ids_from_mask) over the tokens that count: with a key padding mask, the visible
    ones; without, a left-padded batch (left_padding: element 0 unpadded, element 1 a third of
    its tokens padded, element 2 two thirds, ...: each element's positions shifted). Every
    position is then moved by position_offset (a prompt continued at position_offset, or a long
    context). The random draws do not depend on any of it."""
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
    if config.rope is not None:
        attended = ~feeds["key_padding_mask"] if config.key_padding_mask else ~left_padding(batch, seq)
        feeds["position_ids"] = position_ids_from_mask(attended) + np.int64(position_offset)
    return feeds


def left_padding(batch: int, seq: int) -> np.ndarray:
    """True on the padding of a left-padded batch [batch, seq]: element b has (b % 3) * seq // 3
    padding tokens first (element 0 none, element 1 a third, element 2 two thirds)."""
    pad = np.zeros((batch, seq), dtype=bool)
    for b in range(batch):
        pad[b, : (b % 3) * seq // 3] = True
    return pad


def position_ids_from_mask(attended: np.ndarray) -> np.ndarray:
    """Hugging Face's position_ids of a padded batch (generate's rule): the count of attended
    tokens before each one, cumsum(attention_mask) - 1, and 1 on the padding. int64 [batch, seq]."""
    attended = np.asarray(attended, dtype=bool)
    positions = np.cumsum(attended, axis=-1, dtype=np.int64) - 1
    return np.where(attended, positions, np.int64(1))
