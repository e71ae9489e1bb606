"""com.microsoft.MultiHeadAttention: with separate q, k and v projections (mha), or one packed q/k/v MatMul and a Split (mha-packed)."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnx import TensorProto

from attnx.export._graph import linear
from attnx.export.cores._block import Block, read_separate
from attnx.export.cores._emit import Emit
from attnx.export.cores._registry import CoreGraph, float_attr, int_attr, present, register
from attnx.export.passes.walk import NotRead
from attnx.export.visibility import score_bias, visibility
from attnx.model.contract import MS_DOMAIN


def _mha(e: Emit) -> str:
    """com.microsoft.MultiHeadAttention. Full sequence: the projections without their biases (the op
    adds them, packed [Dq | Dk | Dv]), the causal mask as unidirectional=1, the padding mask as int32
    [B, L] (1 keeps). A step: the new keys/values with past_key/past_value. The op averages a fully
    hidden row: it is set to 0 after, as the formula says."""
    c, g = e.c, e.g
    e.ms()
    attrs = {"num_heads": c.n_heads, "scale": c.softmax_scale, "mask_filter_value": e.fill}
    if c.causal:
        attrs["unidirectional"] = 1
    keep = g.op("Cast", g.op("Not", e.kpm), to=TensorProto.INT32) if e.kpm else ""  # [B, L], 1 keeps
    bias = score_bias(g, c, e.step) or ""  # attention_bias [1, H, S, T]: the terms' bias (ALiBi)
    if e.step:
        q, k, v = e.projections()
        z = g.op("MultiHeadAttention", q, k, v, "", keep, bias, "past_key", "past_value", outputs=3, domain=MS_DOMAIN,
                 **attrs)[0]  # fmt: skip
        g.nodes[-1].output[1:] = ["present_key", "present_value"]
        if e.kpm:
            return e.zero_hidden(z, visibility(g, c, e.kpm, e.step)[1])
    else:
        q, k, v, qkv_bias = e.unbiased_projections()
        inputs = [q, k, v, qkv_bias or "", keep, bias]
        while inputs[-1] == "":
            inputs.pop()
        z = g.op("MultiHeadAttention", *inputs, domain=MS_DOMAIN, **attrs)
        if e.kpm:
            return e.zero_hidden(z, e.visible_rows(keep), squeeze=False)
    g.nodes[-1].output[0] = g.stage("z")
    return "z"


def _mha_packed(e: Emit) -> str:
    """com.microsoft.MultiHeadAttention fed by one packed q/k/v MatMul and a Split: one GEMM instead of
    three (self-attention: q, k and v project the same x); the biases added inside the op."""
    c, g = e.c, e.g
    e.ms()
    packed = e.packed()
    qkv = linear(g, "x", {"qkv_proj.weight": packed["qkv_proj.weight"]}, "qkv_proj", False)
    q, k, v = g.op("Split", qkv, g.ints("qkv_split", [c.q_dim, c.kv_q_dim, c.kv_v_dim]), outputs=3, axis=-1)
    if not c.bias:  # without biases the Split's outputs are the stages q, k, v themselves
        g.nodes[-1].output[:] = q, k, v = g.stage("q"), g.stage("k"), g.stage("v")
    attrs = {"num_heads": c.n_heads, "scale": c.softmax_scale, "mask_filter_value": e.fill}
    if c.causal:
        attrs["unidirectional"] = 1
    keep = g.op("Cast", g.op("Not", e.kpm), to=TensorProto.INT32) if e.kpm else ""
    bias = g.const("qkv_proj.bias", packed["qkv_proj.bias"]) if c.bias else ""
    inputs = [q, k, v, bias, keep, score_bias(g, c, False) or ""]
    while inputs[-1] == "":
        inputs.pop()
    z = g.op("MultiHeadAttention", *inputs, domain=MS_DOMAIN, **attrs)
    if e.kpm:
        return e.zero_hidden(z, e.visible_rows(keep), squeeze=False)
    g.nodes[-1].output[0] = g.stage("z")
    return "z"


def _read_mha(node: ir.Node) -> dict[str, Any]:
    return {"n_heads": int_attr(node, "num_heads"), "scale": float_attr(node, "scale") or None,
            "causal": bool(int_attr(node, "unidirectional", 0)), "key_padding_mask": present(node, 4),
            "kv_cache": present(node, 6)}  # fmt: skip


def _read_mha_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """com.microsoft MultiHeadAttention with separate query, key and value (as the GenAI builder writes its fp16
    CPU models)."""
    inputs = list(node.inputs) + [None] * (10 - len(node.inputs))
    if inputs[1] is None or inputs[2] is None:
        raise NotRead("a packed query/key/value MultiHeadAttention: not read in this version")
    if (inputs[6] is None) != (inputs[7] is None):
        raise NotRead("the op's own past_key or past_value alone")
    mask = inputs[5] if inputs[5] is not None else inputs[4]  # an additive bias, else a key padding mask
    cache = (inputs[6], inputs[7], node.outputs[1], node.outputs[2]) if inputs[6] is not None else None
    return read_separate(index, node, "mha", _read_mha(node), inputs[:3], mask, keep_weights,
                          packed_bias=inputs[3], own_cache=cache)


register(CoreGraph("mha", _mha, _read_mha, _read_mha_block))
# a Split's q, k and v read as separate ones (a foreign model's, the packed form's own): the block is mha's
register(CoreGraph("mha-packed", _mha_packed, _read_mha, _read_mha_block))
