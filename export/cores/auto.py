"""The switch core: an If on the call, the grouped core for a step, GroupQueryAttention for a prompt. The buffer form:
on the call's token count. The growing form: on the token count and the padding (a padded call takes the grouped
core, which masks each row as its padding asks)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from attnx.export._graph import call_seq, call_tokens, span
from attnx.export.cores._block import Block, read_separate
from attnx.export.cores._emit import Emit, branches_of, packed_projection
from attnx.export.cores._registry import CoreGraph, float_attr, int_attr, present, register
from attnx.export.cores.gqa import _gqa_buffer, gqa_attend
from attnx.export.cores.grouped_mha import _grouped_mha, grouped_mha_attend, rows_bias_grid
from attnx.export.passes.walk import NotRead
from attnx.export.visibility import visibility
from attnx.model.contract import MS_DOMAIN


def _auto(e: Emit) -> str:
    if e.form == "growing":
        return _auto_growing(e)
    return _auto_buffer(e)


def _auto_growing(e: Emit) -> str:
    """z of the growing form's switch core: q, k and v projected (one packed MatMul) and scored (their norms and
    rotation at each row's positions) once, then an If: a step (one token), a chunk after a past or a padded call
    takes the grouped core, which reads each key/value head once and masks each row as its padding asks (an additive
    bias over a token's rows, a fully hidden row set to 0); a prompt with no padding takes GroupQueryAttention with
    no bias at all (causal, its window as an attribute), which needs none of the rows' work."""
    c, g = e.c, e.g
    e.ms()
    q, k, v = e.packed_projections()
    q, k = e.scored(q, k)
    past, _ = span(g, True)  # scalar: the cache's length before the call
    tokens = call_seq(g)  # scalar: the call's token count
    # GroupQueryAttention takes more than one token after a past for batch 1 alone (ONNX Runtime 1.31: "batch_size
    # must be 1 when sequence_length > 1 and past context is given"): a chunk after a past takes the grouped core
    zero = g.const("zero_i64", np.asarray(0, np.int64))  # the scalar the other nodes name zero_i64
    one = g.const("one_i64", np.asarray(1, np.int64))
    grouped = g.op("Or", g.op("Equal", tokens, one), g.op("Greater", past, zero))
    if e.kpm:  # a padded call: any key hidden by the padding mask
        padded = g.op("ReduceMax", g.op("Cast", e.kpm, to=TensorProto.INT32), keepdims=0)
        grouped = g.op("Or", grouped, g.op("Cast", padded, to=TensorProto.BOOL))
    unpadded = dataclasses.replace(e, c=dataclasses.replace(c, key_padding_mask=False))  # the same graph, no mask
    seen = visibility(g, c, e.kpm, True)  # the grouped branch's grid, outside the If: what the audit reads and runs
    branches = branches_of(e, {"grouped-mha": lambda: grouped_mha_attend(e, q, k, v, seen),
                             "gqa": lambda: gqa_attend(unpadded, q, k, v)})  # fmt: skip
    g.op("If", grouped, outputs=3, then_branch=branches["grouped-mha"], else_branch=branches["gqa"])
    g.nodes[-1].output[:] = [z := g.stage("z"), "present_key", "present_value"]
    return z


def _auto_buffer(e: Emit) -> str:
    """z of the buffer form's switch core: an If on the call's token count, the grouped core for one
    token, GroupQueryAttention's for more; the faster of the two for each on the CPU (docs/concepts/step-forms.md, "The buffer form"). Each branch writes the shared cache in place as its op does alone: ONNX Runtime
    hands the If's outputs, bound to the cache, to the branch's op. A branch's values carry its core's
    name (q/grouped-mha, ...), so that no name is made twice; the constants stay in the main graph,
    which both branches read."""
    g = e.g
    qkv = packed_projection(e)
    branches = branches_of(e, {"grouped-mha": lambda: _grouped_mha(e, qkv), "gqa": lambda: _gqa_buffer(e, qkv)})
    tokens = call_tokens(g)  # [1]: the call's token count
    one_token = g.op("Squeeze", g.op("Equal", tokens, g.ints("one_token", [1])), g.ints("axis0", [0]))
    g.op("If", one_token, outputs=3, then_branch=branches["grouped-mha"], else_branch=branches["gqa"])
    g.nodes[-1].output[:] = [z := g.stage("z"), "present_key", "present_value"]
    return z


def _branch_ops(node: ir.Node) -> tuple[ir.Node | None, ir.Node | None]:
    """The growing form's auto If's MultiHeadAttention (its grouped branch, a group's heads as rows over its own
    past) and GroupQueryAttention (its other branch), each None where the branch has none."""
    ops: dict[str, ir.Node] = {}
    for branch in ("then_branch", "else_branch"):
        attr = node.attributes.get(branch)
        if attr is None or attr.type != ir.AttributeType.GRAPH:
            continue
        for n in attr.value:
            if n.domain == MS_DOMAIN and n.op_type in ("MultiHeadAttention", "GroupQueryAttention"):
                ops.setdefault(n.op_type, n)
    return ops.get("MultiHeadAttention"), ops.get("GroupQueryAttention")


def _read_auto(node: ir.Node) -> dict[str, Any]:
    mha, _ = _branch_ops(node)
    return {"n_kv_heads": int_attr(mha, "num_heads"), "scale": float_attr(mha, "scale") or None,
            "kv_cache": present(mha, 6)}  # fmt: skip


def _read_auto_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """The growing form's switch core as attnx writes it into a whole model, read through its grouped branch (which
    computes every call; the other branch the same formula for a prompt with no padding, held to it by the audit's
    runs, which take both): q, k and v and the cache from outside the If, the If's outputs the block's z and
    presents, its mask the token grid the branch's bias is made from (outside the If, where the audit runs it)."""
    mha, _ = _branch_ops(node)
    inputs = list(mha.inputs) + [None] * (10 - len(mha.inputs))
    grid = rows_bias_grid(inputs[5])
    if grid is None or grid.producer() is not None and grid.producer().graph is not node.graph:
        raise NotRead(f"{node.name}: the grouped branch's bias is not made from a token grid outside the If")
    stated = {"n_heads": int_attr(mha, "num_heads"), "scale": float_attr(mha, "scale") or None, "causal": False,
              "key_padding_mask": False, "kv_cache": True}  # fmt: skip
    block = read_separate(index, mha, "switch", stated, inputs[:3], grid, keep_weights,
                          own_cache=(inputs[6], inputs[7], node.outputs[1], node.outputs[2]), grouped_rows=True,
                          z=node.outputs[0])  # fmt: skip
    block.node = node.name or node.op_type
    block.masks = [(grid.name, "where-masked")]  # True where hidden
    return block


register(CoreGraph("switch", _auto, _read_auto, _read_auto_block))
