"""com.microsoft.Attention (packed q/k/v weights inside the op), as ONNX Runtime's transformers optimizer fuses BERT."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from attnx.export.cores._block import Block, dtype_of, keep, output_projection
from attnx.export.cores._emit import Emit
from attnx.export.cores._registry import CoreGraph, float_attr, int_attr, present, register
from attnx.export.passes._base import const_array
from attnx.export.passes.walk import NotRead
from attnx.model.config import AttentionConfig
from attnx.model.contract import MS_DOMAIN


def _ms_attention(e: Emit) -> str:
    """com.microsoft.Attention: x and the packed q/k/v weights [d_model, Dq + Dk + Dv] (qkv_hidden_sizes)
    and bias (zeros without biases: the op requires one), the projection inside the op; the padding mask
    as mask_index int32 [B, L] (1 keeps), the causal mask as unidirectional=1."""
    c, g = e.c, e.g
    e.ms()
    packed = e.packed()
    w = g.const("qkv_proj.weight.T", np.ascontiguousarray(packed["qkv_proj.weight"].T))
    bias = packed.get("qkv_proj.bias", np.zeros(c.q_dim + c.kv_q_dim + c.kv_v_dim, np.float32))
    attrs = {"num_heads": c.n_heads, "scale": c.softmax_scale, "mask_filter_value": e.fill,
             "qkv_hidden_sizes": [c.q_dim, c.kv_q_dim, c.kv_v_dim]}  # fmt: skip
    if c.causal:
        attrs["unidirectional"] = 1
    keep = g.op("Cast", g.op("Not", e.kpm), to=TensorProto.INT32) if e.kpm else None
    z = g.op("Attention", "x", w, g.const("qkv_proj.bias", bias), *([keep] if keep else []), domain=MS_DOMAIN,
             **attrs)  # fmt: skip
    if keep:
        return e.zero_hidden(z, e.visible_rows(keep), squeeze=False)
    g.nodes[-1].output[0] = g.stage("z")
    return "z"


def _read_ms_attention(node: ir.Node) -> dict[str, Any]:
    return {"n_heads": int_attr(node, "num_heads"), "scale": float_attr(node, "scale") or None,
            "causal": bool(int_attr(node, "unidirectional", 0)), "key_padding_mask": present(node, 3)}  # fmt: skip


def _read_ms_attention_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """com.microsoft Attention, as ONNX Runtime's transformers optimizer fuses BERT: the hidden state in, one packed
    [q | k | v] weight and bias (qkv_hidden_sizes, else thirds), mask_index (each row's length, right padding),
    unidirectional for a causal mask; the output projection after it (its bias possibly in the next
    SkipLayerNormalization)."""
    inputs = list(node.inputs) + [None] * (10 - len(node.inputs))
    if inputs[4] is not None:
        raise NotRead("the op's packed past input: not read in this version")
    if any(v is not None for v in inputs[5:]):
        raise NotRead("an attention bias or a past sequence length: not read in this version")
    stated = _read_ms_attention(node)
    w = const_array(inputs[1])
    if w is None or w.ndim != 2:
        raise NotRead(f"{inputs[1].name}: the packed qkv weight is not a constant")
    b = const_array(inputs[2]) if inputs[2] is not None else np.zeros(w.shape[1], w.dtype)
    sizes = node.attributes.get_ints("qkv_hidden_sizes", None) or [w.shape[1] // 3] * 3
    if len(sizes) != 3 or sum(sizes) != w.shape[1] or min(sizes) <= 0 or not stated["n_heads"]:
        raise NotRead(f"qkv_hidden_sizes {list(sizes)} and num_heads {stated['n_heads']} do not split a weight of "
                      f"{w.shape[1]} columns into heads")  # fmt: skip
    ends = np.cumsum([0, *sizes])
    block = Block(index, node.name or node.op_type, "ms-attention")
    weights: dict[str, np.ndarray] = {}
    for role, a, e in zip("qkv", ends[:-1], ends[1:]):
        weights[f"{role}_proj.weight"], weights[f"{role}_proj.bias"] = w[:, a:e].T, b[a:e]
    n_heads = stated["n_heads"]
    hd = int(sizes[0]) // n_heads
    block.inputs["x"] = inputs[0].name
    block.dtype = dtype_of(inputs[0])
    block.outputs["y"] = output_projection(node.outputs[0], weights, block).name
    if inputs[3] is not None:
        block.inputs["mask_index"] = inputs[3].name
        block.padding = "right"  # a row's length: its keys past it are padding
    config = AttentionConfig(
        d_model=w.shape[0], n_heads=n_heads, head_dim=hd, n_kv_heads=int(sizes[1]) // hd, bias=True,
        causal=stated["causal"], scale=stated.get("scale") or 1.0 / math.sqrt(hd),
    )  # fmt: skip
    return keep(block, config, weights, keep_weights)


register(CoreGraph("ms-attention", _ms_attention, _read_ms_attention, _read_ms_attention_block))
