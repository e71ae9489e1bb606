"""The standard Attention operator (opset 23)."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from attnx.export.cores._block import Block, read_separate
from attnx.export.cores._emit import Emit
from attnx.export.cores._registry import CoreGraph, float_attr, int_attr, present, register
from attnx.export.passes.walk import NotRead
from attnx.export.terms import read_attributes, term_attributes
from attnx.export.visibility import adds_bias, score_bias, visibility
from attnx.model.terms import TERMS


def _attention23(e: Emit) -> str:
    """The opset-23 Attention op, q/k/v as [B, S, heads*d] (q_num_heads, kv_num_heads), the masks as its
    boolean attn_mask over token index (its causal flag aligns top-left: not a cache's rule, so it is
    used for the causal mask alone of a full sequence, where queries and keys are the same tokens, and
    no [S, T] grid is built), its terms' attributes (attnx.export.terms: the softcap, after the scale, before the mask: measured), a
    cache as past_key/past_value."""
    c, g = e.c, e.g
    q, k, v = e.projections()
    q, k = e.scored(q, k)
    masks = {t for t in c.terms if TERMS[t].place == "mask"}
    if not e.step and masks == {"causal"} and not adds_bias(c):
        attrs = {"q_num_heads": c.n_heads, "kv_num_heads": c.n_kv_heads, "scale": c.softmax_scale, "is_causal": 1,
                 **term_attributes(c, "attention23")}  # fmt: skip
        g.op("Attention", q, k, v, name=g.stage("z"), **attrs)  # causal alone hides no row: nothing to zero
        return "z"
    hidden, visible = visibility(g, c, e.kpm, e.step)
    attend = g.op("Not", hidden) if hidden is not None else ""  # [B|1, 1, S, T]: True takes part
    bias = score_bias(g, c, e.step)  # [1, H, S, T]: the terms' bias (ALiBi's slope_h * (j - i))
    if bias is not None:  # an additive float mask instead, hidden keys at the lowest value
        attend = bias if hidden is None else g.op("Where", hidden, e.lowest(), bias)
    attrs = {"q_num_heads": c.n_heads, "kv_num_heads": c.n_kv_heads, "scale": c.softmax_scale,
             **term_attributes(c, "attention23")}  # fmt: skip
    if e.step:
        z = g.op("Attention", q, k, v, attend, "past_key", "past_value", outputs=3, **attrs)[0]
        g.nodes[-1].output[1:] = ["present_key", "present_value"]
    else:
        z = g.op("Attention", q, k, v, *([attend] if attend else []), **attrs)
    if visible is not None:  # z is what comes out of the zeroing, the op's output before it
        return e.zero_hidden(z, visible)
    g.nodes[-1].output[0] = g.stage("z")
    return "z"


def _read_attention23(node: ir.Node) -> dict[str, Any]:
    stated = {"n_heads": int_attr(node, "q_num_heads"), "n_kv_heads": int_attr(node, "kv_num_heads"),
              "scale": float_attr(node, "scale") or None, **read_attributes(node, "attention23"),
              "kv_cache": present(node, 4)}  # fmt: skip
    if int_attr(node, "is_causal", 0):  # the causal mask alone (a mask input is a grid, read with its masks)
        stated["causal"] = True
    return stated


def _read_attention23_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """ONNX's Attention (opset 23): query, key and value, a mask input (boolean: True attends; or additive), the op's
    own past_key/past_value -> present_key/present_value, is_causal."""
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    stated = {**_read_attention23(node), "causal": bool(int_attr(node, "is_causal", 0))}
    cache = None
    if inputs[4] is not None:
        if not (inputs[4].is_graph_input() and inputs[5] is not None and inputs[5].is_graph_input()):
            raise NotRead("past_key/past_value that are not graph inputs")
        cache = (inputs[4], inputs[5], node.outputs[1], node.outputs[2])
    return read_separate(index, node, "attention23", stated, inputs[:3], inputs[3], keep_weights, own_cache=cache)


register(CoreGraph("attention23", _attention23, _read_attention23, _read_attention23_block))
