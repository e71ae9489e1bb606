"""The graph half of sinks: its comparison, the decomposed core's logit column and GroupQueryAttention's
head_sink input."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.export.passes._base import const_array
from attnx.export.passes.walk import NotRead, sink_logits
from attnx.export.terms._base import Context, GraphTerm, OpInput, presence
from attnx.model.config import AttentionConfig


def _sinks(g: AttentionConfig, reading: None, c: AttentionConfig, ctx: Context) -> list[str]:
    return presence("sinks", g.sinks, c.sinks, ctx)


def _sink_column(g: Any, c: AttentionConfig, weights: Mapping[str, np.ndarray], scores: str) -> str:
    """The sink logit of each head, [B, H, S, 1] beside the scores."""
    shape = g.op("Concat", g.op("Shape", scores, start=0, end=3), g.ints("one1", [1]), axis=0)
    logits = np.asarray(weights["sinks"], np.float32).reshape(1, c.n_heads, 1, 1)
    return g.op("Expand", g.const("sinks", logits), shape)


def _read_sink_column(value: Any) -> tuple[bool, dict[str, np.ndarray]]:
    return True, {"sinks": sink_logits(value).ravel()}


def _write_head_sink(g: Any, c: AttentionConfig, weights: Mapping[str, np.ndarray]) -> str:
    return g.const("sinks", np.asarray(weights["sinks"], np.float32))  # a logit per head (measured: exp(sink))


def _read_head_sink(value: Any) -> tuple[bool, dict[str, np.ndarray]]:
    if value is None:
        return False, {}
    logits = const_array(value)
    if logits is None:
        raise NotRead("head_sink is not a constant")
    return True, {"sinks": np.array(logits)}


GRAPH = GraphTerm("sinks", _sinks, column=_sink_column, read_column=_read_sink_column,
                  inputs={"gqa": OpInput(11, _write_head_sink, _read_head_sink)})
