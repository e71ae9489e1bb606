"""The buffer form's grouped core: com.microsoft.MultiHeadAttention over the shared cache, a group's query heads as rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from attnx.export._llm import norm_and_rotate
from attnx.export.cores._emit import LOWEST, Emit, packed_projection
from attnx.export.cores._registry import CoreGraph, float_attr, int_attr, present, register
from attnx.export.visibility import visibility
from attnx.model.contract import MS_DOMAIN
from attnx.model.terms import terms_at


def _grouped_mha(e: Emit, qkv: str | None = None) -> str:
    """z of the buffer form by com.microsoft.MultiHeadAttention over the shared cache (past_sequence_length:
    it writes the new keys/values at their positions, in place), the query heads of a group stacked as
    rows: row s*G + j of head n holds query head n*G + j of token s, so that the op reads each key/value
    head once for its whole group. The mask over tokens (causal, a sliding window: visibility, the
    decomposed form's) repeated for a token's G rows is an additive attention_bias [1, 1, S*G, total];
    q/k norms and rope are their own nodes (at the token index: the buffer form has no padding)."""
    c, g = e.c, e.g
    e.ms()
    H, Hkv, G, hd = c.n_heads, c.n_kv_heads, c.group_size, c.head_dim
    qkv = qkv or packed_projection(e)
    g.op("Split", qkv, g.ints("qkv_split", [H * hd, Hkv * hd, Hkv * hd]), outputs=3, axis=-1)
    g.nodes[-1].output[:] = q, k, v = g.stage("q"), g.stage("k"), g.stage("v")
    axis0 = g.ints("axis0", [0])
    shape = g.op("Shape", "x")
    seq = g.op("Squeeze", g.op("Slice", shape, g.ints("d1", [1]), g.ints("d2", [2])), axis0)
    total = g.op("Cast", "total_sequence_length", to=TensorProto.INT64)
    past = g.op("Sub", total, seq)  # positions filled before this call
    if terms_at(c, "qk"):  # their positions, for the terms on q and k
        tokens = g.op("Range", past, total, g.const("one_i64", np.asarray(1, np.int64)))  # [S]: their positions
        batch = g.op("Slice", shape, g.ints("d0", [0]), g.ints("d1", [1]))
        g.op("Expand", g.op("Unsqueeze", tokens, axis0), g.op("Concat", batch, g.op("Unsqueeze", seq, axis0), axis=0),
             name="position_ids")  # fmt: skip
        q, k = norm_and_rotate(g, c, e.weights, q, k, "ort-fused")
    rows = g.op("Transpose", g.op("Reshape", q, g.ints("q_groups", [0, 0, Hkv, G, hd])), perm=[0, 1, 3, 2, 4])
    rows = g.op("Reshape", rows, g.ints("q_rows", [0, -1, Hkv * hd]))  # [B, S*G, Hkv*hd]
    hidden, _ = visibility(g, c, None, True, span_=(past, total))  # [1, 1, S, total]: a step model is causal
    hidden = g.op("Expand", g.op("Unsqueeze", hidden, g.ints("axis3", [3])), g.ints("group_rows", [1, 1, 1, G, 1]))
    hidden = g.op("Reshape", hidden, g.op("Concat", g.ints("rows_shape", [1, 1, -1]), g.op("Unsqueeze", total, axis0),
                                          axis=0))  # [1, 1, S*G, total]: row s*G + j as token s  # fmt: skip
    bias = g.op("Where", hidden, g.const("lowest_f", np.asarray(LOWEST, np.float32)), e.zero())
    past32 = g.op("Reshape", g.op("Cast", past, to=TensorProto.INT32), g.ints("one_d", [1]))
    out = g.op("MultiHeadAttention", rows, k, v, "", "", bias, "past_key", "past_value", past32, outputs=3,
               domain=MS_DOMAIN, num_heads=Hkv, scale=c.softmax_scale)  # fmt: skip
    g.nodes[-1].output[1:] = ["present_key", "present_value"]
    z = g.op("Transpose", g.op("Reshape", out[0], g.ints("z_groups", [0, -1, G, Hkv, hd])), perm=[0, 1, 3, 2, 4])
    return g.op("Reshape", z, g.ints("z_heads", [0, 0, H * hd]), name=g.stage("z"))


def _read_grouped_mha(node: ir.Node) -> dict[str, Any]:
    # the op's heads are the key/value heads; the query heads of a group are its rows
    return {"n_kv_heads": int_attr(node, "num_heads"), "scale": float_attr(node, "scale") or None,
            "kv_cache": present(node, 6)}


register(CoreGraph("grouped-mha", _grouped_mha, _read_grouped_mha, None, lambda node, graph_core: present(node, 8)))
