"""The graph half of alibi: its comparison and the bias every core adds to its scores."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from attnx.export.terms._base import Context, GraphTerm, presence
from attnx.model.alibi import alibi_slopes
from attnx.model.config import AttentionConfig


def _alibi(g: AttentionConfig, reading: None, c: AttentionConfig, ctx: Context) -> list[str]:
    return presence("the ALiBi bias", g.alibi, c.alibi, ctx)


def _alibi_bias(g: Any, c: AttentionConfig, qcol: str, krow: str) -> str:
    """slope_h * (j - i) over token index, [1, H, S, T] float32: the slopes of attnx.model.alibi, the distance exact
    in float32 (below 2^24)."""
    distance = g.op("Cast", g.op("Sub", krow, qcol), to=TensorProto.FLOAT)  # [S, T]: j - i
    slopes = g.const("alibi_slopes", alibi_slopes(c.n_heads).astype(np.float32).reshape(1, -1, 1, 1))
    return g.op("Mul", slopes, g.op("Unsqueeze", distance, g.ints("axes_01", [0, 1])))


GRAPH = GraphTerm("alibi", _alibi, bias=_alibi_bias)
