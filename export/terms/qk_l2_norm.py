"""The graph half of qk_l2_norm: its comparison, its reading off q's and k's paths, and its standard ops."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.export.passes.walk import NotRead
from attnx.export.terms._base import Context, GraphTerm, presence
from attnx.model.config import AttentionConfig


def _l2_norm(g: AttentionConfig, reading: None, c: AttentionConfig, ctx: Context) -> list[str]:
    if (g.qk_l2_norm is None) != (c.qk_l2_norm is None):
        return presence("the q/k norm after rope", g.qk_l2_norm is not None, c.qk_l2_norm is not None, ctx)
    if g.qk_l2_norm is not None and not np.isclose(g.qk_l2_norm, c.qk_l2_norm, rtol=1e-3):
        return [ctx.said(f"q/k norm after rope eps {g.qk_l2_norm:g}", f"{c.qk_l2_norm:g}")]
    return []


def _read_l2_norms(paths: Mapping[str, Any], weights: dict[str, np.ndarray], reading: Any) -> float | None:
    """The eps of the norms without weights met on q's and k's paths (Path.plain_norm), or None; one alone is not
    read."""
    q, k = paths["q"].plain_norm, paths["k"].plain_norm
    if (q is None) != (k is None):
        raise NotRead(f"a norm without weights on {'q' if q is not None else 'k'} alone")
    return q


def _per_head(g: Any, u: str, heads: int, hd: int, f: Callable[[str], str], name: str) -> str:
    """f over each head of u [B, S, heads * hd] ([B, S, heads, hd] inside), back to [B, S, heads * hd]."""
    u4 = g.op("Reshape", u, g.ints(f"{name}_4d", [0, 0, heads, hd]))
    return g.op("Reshape", f(u4), g.ints(f"{name}_3d", [0, 0, heads * hd]))


def _emit_l2_norm(g: Any, c: AttentionConfig, q: str, k: str, step: bool) -> tuple[str, str]:
    """x / sqrt(mean(x^2) + eps) over each head's head_dim: ReduceMean, Add, Sqrt, Div (any opset)."""
    eps = g.const("qk_l2_norm_eps", np.asarray(c.qk_l2_norm, np.float32))

    def norm(u4: str) -> str:
        mean_sq = g.op("ReduceMean", g.op("Mul", u4, u4), g.ints("axes_last", [-1]), keepdims=1)
        return g.op("Div", u4, g.op("Sqrt", g.op("Add", mean_sq, eps)))

    return (_per_head(g, q, c.n_heads, c.head_dim, norm, "q_l2"),
            _per_head(g, k, c.n_kv_heads, c.head_dim, norm, "k_l2"))  # fmt: skip


GRAPH = GraphTerm("qk_l2_norm", _l2_norm, emit_qk=_emit_l2_norm, read_paths=_read_l2_norms)
