"""The form a whole model is served in (attnx build --model, generate): its blocks' plans written again in the buffer
form, by each core's own emitter, into the model as it came, never found again in what attnx wrote.

    growing form (attnx optimize)                      buffer form (this module)
    past_key_values.N.* [B, heads, past, size] in      the same names, [B, heads, max_sequence_length, size]: the
                                                       buffer; a latent kept as two tensors by the graph is one
                                                       buffer past_key_values.N.latent, as the core keeps it
    present.N.* = past + new, a new tensor             present.N.*: the same buffer, the new tokens written in place
    attention_mask [B, total]: left padding            none: row b's keys are its first seqlens_k[b] + 1 positions
    (lengths from the cache and the mask)              seqlens_k int32 [B] (positions filled after the call, minus 1)
                                                       and total_sequence_length int32 [] (their largest), as inputs

Each block is written by the first buffer core, in the plan's lowerings' order, that reads each row's own length
and computes its formula (plan.LENGTHS_CORES; GroupQueryAttention rotates q and k itself from a table of `positions`
rows, recorded in the metadata). A call of several tokens is one row's, from position 0 (the buffer cores' rule).
What does not fit raises NotBufferable, saying why, before anything is written: a cache a block attnx did not rewrite
reads, a block no buffer core computes, attention_mask or a cache still read by the rest of the graph.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from attnx.model.contract import DECODE_KEY, LOWERINGS, ROPE_POSITIONS_KEY
from attnx.model.cores import why_not
from attnx.workflows.rewrite.plan import LENGTHS_CORES, LOWERINGS_TRIED, Plan
from attnx.workflows.rewrite.splice import splice_blocks

__all__ = ["CACHE_IN", "CAPACITY_DIM", "MASK", "SEQLENS", "TOTAL", "NotBufferable", "buffer_plan", "splice_served"]

SEQLENS, TOTAL, MASK = "seqlens_k", "total_sequence_length", "attention_mask"
CAPACITY_DIM = "max_sequence_length"
CACHE_IN = "past_key_values"


class NotBufferable(Exception):
    """A whole model the buffer form cannot be written for; the message says why."""


def buffer_plan(plan: Plan, positions: int) -> Plan:
    """`plan` in the buffer form: its core the first buffer core that reads each row's length and computes it, bound
    to the model's lengths (SEQLENS, TOTAL), its rotary table `positions` rows; NotBufferable where none computes it."""
    config = dataclasses.replace(plan.config, kv_cache=True, key_padding_mask=False)
    reasons = []
    for lowering in LOWERINGS_TRIED:
        for core in LOWERINGS[lowering].cores.get("buffer", ()):
            if core not in LENGTHS_CORES:
                continue
            why = why_not(core, config, plan.dtype, "buffer")
            if not why:
                binds = {**plan.binds, SEQLENS: SEQLENS, TOTAL: TOTAL}
                return dataclasses.replace(plan, config=config, form="buffer", lowering=lowering, core=core,
                                           binds=binds, rope_positions=positions)  # fmt: skip
            reasons += why
    raise NotBufferable(f"block {plan.block.index}: no buffer core that reads each row's length computes it: "
                        + "; ".join(dict.fromkeys(reasons)))  # fmt: skip


def splice_served(model: ir.Model, plans: list[Plan], positions: int) -> list[Plan]:
    """The buffer form (the module doc) of `model` (the model as it came: the plans' blocks in it), in place: each
    plan written in the buffer form; returns the plans as written (buffer_plan). NotBufferable where the form does not fit (what the
    plans say, before `model` is changed; what the rest of the graph reads, after: give it a model of its own)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    g = model.graph
    inputs = {v.name: v for v in g.inputs}
    caches = [v for v in g.inputs if v.name.startswith(CACHE_IN)]
    if not caches:
        raise NotBufferable(f"the model takes no cache ({CACHE_IN}.*)")
    if SEQLENS in inputs or TOTAL in inputs:
        raise NotBufferable(f"the model already takes {SEQLENS} / {TOTAL}")
    owned = {name for plan in plans for role, name in plan.block.inputs.items() if role.startswith("past_")}
    owned |= {past for plan in plans for past, _ in plan.block.cache_parts.values()}
    if not_ours := [v.name for v in caches if v.name not in owned]:
        raise NotBufferable(f"the cache input {not_ours[0]} is read by a block attnx did not rewrite: its buffer form "
                            "is not attnx's to write")  # fmt: skip
    served = [buffer_plan(plan, positions) for plan in plans]
    batch = caches[0].shape[0] if caches[0].shape is not None else "batch"
    g.inputs.extend([ir.Value(name=SEQLENS, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([batch])),
                     ir.Value(name=TOTAL, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))])  # fmt: skip
    written = {id(node) for node in splice_blocks(model, served)}
    RemoveUnusedNodesPass()(model)
    outputs = {v.name: v for v in g.outputs}
    for past in [v for v in g.inputs if v.name.startswith(CACHE_IN)]:  # the buffer: the same dims in and out
        shape = list(past.shape)
        shape[2] = CAPACITY_DIM
        past.shape = ir.Shape(shape)
        outputs["present" + past.name[len(CACHE_IN):]].shape = ir.Shape(shape)
    left = [f"{use.node.op_type} {use.node.name}" for v in caches for use in v.uses() if id(use.node) not in written]
    if left:
        raise NotBufferable(f"the cache is still read by {', '.join(left)}")
    mask = inputs.get(MASK)
    if mask is not None:
        if readers := [f"{use.node.op_type} {use.node.name}" for use in mask.uses()]:
            raise NotBufferable(f"{MASK} is still read by {', '.join(readers)}: the buffer form takes no padding mask")
        g.inputs.remove(mask)
    model.metadata_props[DECODE_KEY] = "buffer"
    if any(plan.config.rope is not None for plan in served):  # a run past the table is refused before its first call
        model.metadata_props[ROPE_POSITIONS_KEY] = str(positions)
    return served
