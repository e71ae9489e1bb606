"""The graph half of attn_temperature: its comparison, its reading (a factor the graph computes per token,
run and fitted by the audit) and its standard ops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import TensorProto

from attnx.export._graph import span
from attnx.export.passes.walk import NotRead
from attnx.export.terms._base import Context, GraphTerm, presence
from attnx.export.terms._reading import ComputedTerm, Reading
from attnx.model.config import AttentionConfig
from attnx.model.terms import Temperature


def _temperature(g: AttentionConfig, reading: None, c: AttentionConfig, ctx: Context) -> list[str]:
    ours, theirs = g.attn_temperature, c.attn_temperature
    if (ours is None) != (theirs is None):
        return presence("the attention temperature", ours is not None, theirs is not None, ctx)
    if ours is not None and not (np.isclose(ours.floor_scale, theirs.floor_scale, rtol=1e-6)
                                 and np.isclose(ours.attn_scale, theirs.attn_scale, rtol=1e-4)):  # fmt: skip
        return [ctx.said(f"temperature floor_scale {ours.floor_scale:g}, attn_scale {ours.attn_scale:g}",
                         f"{theirs.floor_scale:g}, {theirs.attn_scale:g}")]  # fmt: skip
    return []


def _read_temperature(paths: Mapping[str, Any], weights: dict[str, np.ndarray], reading: Reading) -> None:
    """A factor the graph computes per position on q (Path.factor): named for the audit to run (Reading.computed),
    its value fitted after (fit_values); None until then."""
    if paths["k"].factor is not None:
        raise NotRead("a factor computed per position on k: not a temperature")
    if paths["q"].factor is not None:
        reading.computed[GRAPH.name] = ComputedTerm(paths["q"].factor.name)
    return None


def _fit_temperature(factors: np.ndarray) -> tuple[Temperature | None, str]:
    """The temperature whose factors, log1p(floor((i + 1) / F)) * A + 1 for token indices i = 0.., are `factors`
    [tokens]: F the first index + 1 where a factor is not 1, A from it; checked at every index. (None, why) where no
    temperature gives them, or where every factor is 1 (F beyond the prompt)."""
    tokens = np.arange(factors.shape[0])
    moved = np.flatnonzero(factors != 1.0)
    if moved.size == 0:
        return None, f"every factor 1 over {factors.shape[0]} tokens"
    floor_scale = float(moved[0] + 1)
    attn_scale = float((factors[moved[0]] - 1.0) / np.log(2.0))
    if not attn_scale > 0:
        return None, f"a factor {factors[moved[0]]:g} at token {moved[0]}: not a temperature"
    fitted = Temperature(floor_scale, attn_scale)
    error = np.abs(fitted.factors(tokens) - factors).max()
    if error > 4 * np.finfo(np.float32).eps * np.abs(factors).max():
        return None, f"no floor_scale and attn_scale give the factors (off by {error:.3g})"
    return fitted, f"floor_scale {floor_scale:g}, attn_scale {attn_scale:.6g}"


def _emit_temperature(g: Any, c: AttentionConfig, q: str, k: str, step: bool) -> tuple[str, str]:
    """q [B, S, D] times log1p(floor((i + 1) / floor_scale)) * attn_scale + 1 of its token index i ([S, 1]:
    past_seq + s in a step), in float32 (Log of 1 + an integer-valued float)."""
    past, total = span(g, step)
    one = g.const("one_i64", np.asarray(1, np.int64))
    tokens = g.op("Cast", g.op("Range", past, total, one), to=TensorProto.FLOAT)  # [S]
    t = c.attn_temperature
    f32 = {name: g.const(f"temperature_{name}", np.asarray(value, np.float32))
           for name, value in (("one", 1.0), ("floor", t.floor_scale), ("scale", t.attn_scale))}  # fmt: skip
    steps = g.op("Floor", g.op("Div", g.op("Add", tokens, f32["one"]), f32["floor"]))
    factor = g.op("Add", g.op("Mul", g.op("Log", g.op("Add", steps, f32["one"])), f32["scale"]), f32["one"])
    return g.op("Mul", q, g.op("Unsqueeze", factor, g.ints("axes_1", [1]))), k  # [B, S, D] * [S, 1]


GRAPH = GraphTerm("attn_temperature", _temperature, emit_qk=_emit_temperature, read_paths=_read_temperature,
                  fit_values=_fit_temperature)
