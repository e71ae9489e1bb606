"""The grouped core: com.microsoft.MultiHeadAttention with a group's query heads as rows, so that the op reads each
key/value head once for its whole group; over past/present (the growing form) or the shared cache (the buffer form)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from attnx.export._llm import norm_and_rotate
from attnx.export.cores._block import Block, read_separate
from attnx.export.cores._emit import LOWEST, Emit
from attnx.export.cores._registry import CoreGraph, float_attr, int_attr, present, register
from attnx.export.passes.walk import NotRead, is_op
from attnx.export.visibility import visibility
from attnx.model.contract import MS_DOMAIN
from attnx.model.seen import ROWS_PERM
from attnx.model.terms import terms_at


def _as_rows(e: Emit, q: str) -> str:
    """q [B, S, H*hd] as the op's query [B, S*G, Hkv*hd]: row s*G + j of head n holds query head n*G + j of token s."""
    c, g = e.c, e.g
    rows = g.op("Transpose", g.op("Reshape", q, g.ints("q_groups", [0, 0, c.n_kv_heads, c.group_size, c.head_dim])),
                perm=list(ROWS_PERM))  # fmt: skip
    return g.op("Reshape", rows, g.ints("q_rows", [0, -1, c.n_kv_heads * c.head_dim]))


def _from_rows(e: Emit, z: str, name: str | None) -> str:
    """The op's output [B, S*G, Hkv*hd] back as z [B, S, H*hd]."""
    c, g = e.c, e.g
    z = g.op("Transpose", g.op("Reshape", z, g.ints("z_groups", [0, -1, c.group_size, c.n_kv_heads, c.head_dim])),
             perm=list(ROWS_PERM))  # fmt: skip
    return g.op("Reshape", z, g.ints("z_heads", [0, 0, c.n_heads * c.head_dim]), name=name)


def _rows_bias(e: Emit, hidden: str) -> str:
    """The additive attention_bias [B|1, 1, S*G, T] of a mask over tokens, hidden bool [B|1, 1, S, T]: each token's
    entry repeated for its G rows (row s*G + j is token s), lowest where hidden."""
    g = e.g
    hidden = g.op("Expand", g.op("Unsqueeze", hidden, g.ints("axis3", [3])),
                  g.ints("group_rows", [1, 1, 1, e.c.group_size, 1]))  # fmt: skip
    keys = g.op("Shape", hidden, start=4, end=5)  # [1]: T
    hidden = g.op("Reshape", hidden, g.op("Concat", g.ints("rows_shape", [0, 1, -1]), keys, axis=0))
    return g.op("Where", hidden, g.const("lowest_f", np.asarray(LOWEST, np.float32)), e.zero())


def _grouped_mha(e: Emit, qkv: str | None = None) -> str:
    """z of the grouped core: the growing form's over past/present (_grouped_mha_growing), the buffer form's over the
    shared cache (_grouped_mha_buffer)."""
    if e.form == "growing":
        return _grouped_mha_growing(e)
    return _grouped_mha_buffer(e, qkv)


def _grouped_mha_growing(e: Emit) -> str:
    """z of the growing form by com.microsoft.MultiHeadAttention over past_key/past_value (it writes present = past +
    new), the query heads of a group as rows (_as_rows). Every mask over tokens (causal, a window, chunks, the
    padding: visibility, at each token's index) is one additive attention_bias over a token's rows; q/k norms and
    rope are their own nodes at each token's position (position_ids: a left-padded row's own), the terms after them
    in standard ops (Emit.scored). A fully hidden row (padding) is set to 0 after, as the formula says."""
    e.ms()
    q, k, v = e.packed_projections()
    q, k = e.scored(q, k)
    return grouped_mha_attend(e, q, k, v)


def grouped_mha_attend(e: Emit, q: str, k: str, v: str, seen: tuple[str, str] | None = None) -> str:
    """The growing form's attention over q, k and v as projected and scored (_grouped_mha_growing): z. seen: the
    (hidden, visible) grids of visibility, made before (the switch core makes them outside its If, where the audit
    reads them)."""
    c, g = e.c, e.g
    hidden, visible = seen or visibility(g, c, e.kpm, True)  # [B|1, 1, S, T]: a step model is causal, never None
    out = g.op("MultiHeadAttention", _as_rows(e, q), k, v, "", "", _rows_bias(e, hidden), "past_key", "past_value",
               outputs=3, domain=MS_DOMAIN, num_heads=c.n_kv_heads, scale=c.softmax_scale)  # fmt: skip
    g.nodes[-1].output[1:] = ["present_key", "present_value"]
    if e.kpm:
        return e.zero_hidden(_from_rows(e, out[0], None), visible)
    return _from_rows(e, out[0], g.stage("z"))


def _grouped_mha_buffer(e: Emit, qkv: str | None = None) -> str:
    """z of the buffer form by com.microsoft.MultiHeadAttention over the shared cache (past_sequence_length:
    it writes the new keys/values at their positions, in place), the query heads of a group stacked as
    rows: row s*G + j of head n holds query head n*G + j of token s, so that the op reads each key/value
    head once for its whole group. The mask over tokens (causal, a sliding window: visibility, the
    decomposed form's) repeated for a token's G rows is an additive attention_bias [1, 1, S*G, total];
    q/k norms and rope are their own nodes (at the token index: the buffer form has no padding)."""
    c, g = e.c, e.g
    e.ms()
    q, k, v = e.packed_projections(qkv)
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
        q, k = norm_and_rotate(g, c, e.weights, q, k, e.core.term_ops)
    hidden, _ = visibility(g, c, None, True, span_=(past, total))  # [1, 1, S, total]: a step model is causal
    bias = _rows_bias(e, hidden)
    past32 = g.op("Reshape", g.op("Cast", past, to=TensorProto.INT32), g.ints("one_d", [1]))
    out = g.op("MultiHeadAttention", _as_rows(e, q), k, v, "", "", bias, "past_key", "past_value", past32, outputs=3,
               domain=MS_DOMAIN, num_heads=c.n_kv_heads, scale=c.softmax_scale)  # fmt: skip
    g.nodes[-1].output[1:] = ["present_key", "present_value"]
    return _from_rows(e, out[0], g.stage("z"))


def _read_grouped_mha(node: ir.Node) -> dict[str, Any]:
    # the op's heads are the key/value heads; the query heads of a group are its rows
    return {"n_kv_heads": int_attr(node, "num_heads"), "scale": float_attr(node, "scale") or None,
            "kv_cache": present(node, 6)}


def rows_bias_grid(bias: ir.Value | None) -> ir.Value | None:
    """The token grid (bool [B|1, 1, S, T], True where hidden) an additive bias over a token's rows is made from
    (_rows_bias: Where over the grid's rows, reshaped from its Expand), or None."""
    node = bias.producer() if bias is not None else None
    for op in ("Where", "Reshape", "Expand", "Unsqueeze"):
        if not is_op(node, op) or node.inputs[0] is None:
            return None
        value = node.inputs[0]
        node = value.producer() if op != "Unsqueeze" else None
    return value


def _read_grouped_mha_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """The growing form's grouped core (as attnx writes it into a whole model): the query's heads from its projection's
    width (a group of G query heads as rows of each of the op's key/value heads), its own past/present, its mask the
    additive bias over a token's rows."""
    inputs = list(node.inputs) + [None] * (10 - len(node.inputs))
    if present(node, 8):
        raise NotRead("the buffer form's grouped core (past_sequence_length): not read as a block in this version")
    stated = {"n_heads": int_attr(node, "num_heads"), "scale": float_attr(node, "scale") or None, "causal": False,
              "key_padding_mask": False, "kv_cache": present(node, 6)}  # fmt: skip
    cache = (inputs[6], inputs[7], node.outputs[1], node.outputs[2]) if present(node, 6) else None
    return read_separate(index, node, "grouped-mha", stated, inputs[:3], inputs[5], keep_weights, own_cache=cache,
                         grouped_rows=True)  # fmt: skip


register(CoreGraph("grouped-mha", _grouped_mha, _read_grouped_mha, _read_grouped_mha_block))
