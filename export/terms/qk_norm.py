"""The graph half of qk_norm: its comparison, its reading off q's and k's paths, and its operators in each
style (RMSNormalization-23, or the standard ops)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.export.passes.walk import NotRead
from attnx.export.terms._base import Context, GraphTerm, presence
from attnx.export.terms._reading import Reading
from attnx.model.config import AttentionConfig
from attnx.model.terms import QKNorm


def _qk_norm(g: AttentionConfig, reading: None, c: AttentionConfig, ctx: Context) -> list[str]:
    return presence("q/k norm", g.qk_norm is not None, c.qk_norm is not None, ctx)


def _emit_qk_norm(g: Any, c: AttentionConfig, weights: Mapping[str, np.ndarray], u4: str, which: str,
                  standard: bool, name: str | None) -> str:  # fmt: skip
    """RMSNorm of each head times {which}_norm.weight: ReduceMean, Sqrt, Div, Mul (standard ops), else
    RMSNormalization-23 (GroupQueryAttention's q_norm_weight runs on CUDA only: measurements/facts.md)."""
    w = g.const(f"{which}_norm.weight", np.asarray(weights[f"{which}_norm.weight"], np.float32))
    if not standard:
        return g.op("RMSNormalization", u4, w, axis=-1, epsilon=c.qk_norm.eps, name=name)  # opset 23
    eps = g.const("qk_norm_eps", np.asarray(c.qk_norm.eps, np.float32))
    mean_sq = g.op("ReduceMean", g.op("Mul", u4, u4), g.ints("axes_last", [-1]), keepdims=1)
    return g.op("Mul", g.op("Div", u4, g.op("Sqrt", g.op("Add", mean_sq, eps))), w, name=name)


def _read_norms(paths: Mapping[str, Any], weights: dict[str, np.ndarray], reading: Reading) -> QKNorm | None:
    """The per-head RMS norms met on q's and k's paths (their weights into `weights`, both eps into the reading), or
    None; one alone is not read."""
    q, k = paths["q"].norm, paths["k"].norm
    if q is None and k is None:
        return None
    if q is None or k is None:
        raise NotRead(f"a norm on {'q' if q is not None else 'k'} alone")
    (weights["q_norm.weight"], q_eps), (weights["k_norm.weight"], k_eps) = q, k
    reading.qk_norm_eps = (float(q_eps), float(k_eps))
    return QKNorm(eps=float(q_eps))


GRAPH = GraphTerm("qk_norm", _qk_norm, read_paths=_read_norms, opset=23, emit_styled=_emit_qk_norm)
