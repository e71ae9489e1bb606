"""The graph half of grouped_heads: the key/value heads compared by their count."""

from __future__ import annotations

from attnx.export.terms._base import Context, GraphTerm
from attnx.model.config import AttentionConfig


def _grouped_heads(g: AttentionConfig, reading: None, c: AttentionConfig, ctx: Context) -> list[str]:
    return [] if g.n_kv_heads == c.n_kv_heads else [ctx.said(f"n_kv_heads {g.n_kv_heads}", str(c.n_kv_heads))]


GRAPH = GraphTerm("grouped_heads", _grouped_heads)
