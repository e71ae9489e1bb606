"""The graph half of causal: its comparison, the keys it hides and its fit from a computed mask's grid."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.export.terms._base import Context, GraphTerm, MaskReading
from attnx.model.config import AttentionConfig


def compare_causal(g: AttentionConfig, reading: MaskReading, c: AttentionConfig, ctx: Context) -> list[str]:
    if g.causal == c.causal:
        return []
    mask = f" ({reading.mask})" if reading.mask is not None else ""
    return [ctx.said(f"{'a causal mask' if g.causal else 'no causal mask'}{mask}", "causal" if c.causal else "not causal")]


def hides_later(g: Any, c: AttentionConfig, qcol: str, krow: str, kpm: str | None) -> str:
    return g.op("Greater", krow, qcol)  # key j after query i


def fit_causal(allowed: np.ndarray) -> tuple[bool, str | None]:
    grid = np.arange(allowed.shape[0])
    causal = bool(allowed.any(axis=1).all() and not (allowed & (grid[None, :] > grid[:, None])).any())
    return causal, "causal" if causal else None


GRAPH = GraphTerm("causal", compare_causal, hides=hides_later, fit_grid=fit_causal,
                  reading=lambda reading: reading.mask)
