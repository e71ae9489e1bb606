"""The graph half of softcap: its comparison, its recognition among the scalings of the scores, its decomposed
ops and the attribute the fused cores state it by."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.export.passes._base import const_array
from attnx.export.passes.walk import NotRead
from attnx.export.terms._base import Context, GraphTerm, OpAttribute
from attnx.model.config import AttentionConfig


def _softcap(g: AttentionConfig, reading: None, c: AttentionConfig, ctx: Context) -> list[str]:
    if (g.softcap or None) == (c.softcap or None) or (g.softcap and c.softcap and np.isclose(g.softcap, c.softcap,
                                                                                             rtol=1e-6)):  # fmt: skip
        return []
    return [ctx.said(f"softcap {g.softcap}", str(c.softcap))]


def _recognise_softcap(scalings: list[tuple[Any, ...]]) -> tuple[float | None, list[tuple[Any, ...]]]:
    """c * tanh(s / c) in the order the graph computes it (the scalings run from the Softmax back): the cap c is the
    multiply after the tanh that undoes a divide before it (their product 1); the divide gone, the other scalings
    before the tanh are the scale's. A scaling after the tanh other than the cap's multiply (after the softcap,
    after the mask added to the capped scores, or between the tanh and the multiply) scales the capped scores, which
    no term does: NotRead naming it. A scaling by exactly 1 changes nothing and is read as none."""
    scalings = [entry for entry in scalings if not (entry[0] == "scale" and entry[1] == 1.0)]
    at = next((i for i, entry in enumerate(scalings) if entry[0] == "tanh"), None)
    if at is None:
        return None, scalings
    end = next((i for i in range(at + 1, len(scalings)) if scalings[i][0] != "scale"), len(scalings))
    inside = range(at + 1, end)  # the scalings before the tanh, up to any other tanh
    # the cap's multiply: the one nearest the tanh that a divide before it undoes
    pair = next(((i, j) for i in range(at - 1, -1, -1) for j in inside
                 if np.isclose(scalings[i][1] * scalings[j][1], 1.0, rtol=1e-5)), None)  # fmt: skip
    if pair is None:
        raise NotRead("a tanh in the scores that is not a softcap c * tanh(s / c): no multiply after it undoes a "
                      "divide before it")  # fmt: skip
    cap_at, divide_at = pair
    if at - 1 > cap_at:
        raise NotRead(f"{_scaling_said(scalings[at - 1])} between the tanh and the softcap's multiply by "
                      f"{scalings[cap_at][1]:g}: no term explains it")  # fmt: skip
    if cap_at > 0:
        raise NotRead(f"{_scaling_said(scalings[cap_at - 1])} after the softcap: no term explains it")
    return scalings[cap_at][1], [e for i, e in enumerate(scalings) if i not in (cap_at, at, divide_at)]


def _scaling_said(entry: tuple[Any, ...]) -> str:
    """'a Mul by 1.25', 'a Div by 0.8': a scaling of the scores as the graph writes it (ScoreChain.scalings)."""
    node, const = entry[2], const_array(entry[3])
    return f"a {node.op_type} by {float(const.ravel()[0]):g}"


def _emit_softcap(g: Any, c: AttentionConfig, scores: str) -> str:
    """c * tanh(s / c) as Div, Tanh, Mul, after the scale, before the masks."""
    cap = g.const("softcap", np.asarray(c.softcap, np.float32))
    return g.op("Mul", g.op("Tanh", g.op("Div", scores, cap)), cap)


_SOFTCAP = OpAttribute("softcap", lambda c: c.softcap, lambda value: value or None)


GRAPH = GraphTerm("softcap", _softcap, {"attention23": _SOFTCAP, "gqa": _SOFTCAP}, _recognise_softcap, _emit_softcap,
                  ("softcap",))
