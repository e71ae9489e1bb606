"""Reading attnx's own step of multi-head latent attention back (the absorbed form attnx.export._latent writes: the
step model of the decomposed core, and the blocks attnx optimize splices into a model another tool exported) into
its config and weights, as export.cores._latent_block reads the expanded form other tools write.

The decomposed core's reader has found the Softmax between q.k and p.v, and both read one tensor, the latents. From
there:

    the latents     <- the cache's Concat(past, new) <- new: [the turned rope key | the RMS norm kv_a_layernorm of
                       columns [0, kv_lora_rank) of kv_a_proj_with_mqa]; the past a graph input, or (spliced into a
                       model that keeps them apart) a Concat of the graph's two cache inputs, [rope key | compressed
                       kv], and the present's two Slices its graph outputs
    q               <- [q's turned rope part | q_nope W_uk] <- q_nope: columns of q_b_proj's (or q_proj's) heads, as
                       the expanded form's q (_latent_block.read_q)
    the output      <- (p v)'s compressed kv columns times W_uv, each head's, then o_proj

kv_b_proj is each head's [W_uk rows | W_uv^T rows], as transformers lays it out. What does not fit raises NotRead.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnx.export.cores._block import Block, hidden_state, keep, output_projection
from attnx.export.cores._latent_block import read_compressed_kv, read_q, rope_tables
from attnx.export.passes._base import const_array
from attnx.export.passes.walk import NotRead, is_op, last_axis_slice, projection
from attnx.model.config import COMPRESSED_KV, ROPE_KEY

__all__ = ["absorbed_latents", "read_absorbed_block"]

_LAYOUT = ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Cast")


def _back(value: ir.Value, through: tuple[str, ...] = _LAYOUT) -> ir.Value:
    while (node := value.producer()) is not None and node.op_type in through and node.domain in ("", "ai.onnx"):
        value = node.inputs[0]
    return value


def absorbed_latents(qk: ir.Node, pv: ir.Node) -> ir.Value | None:
    """The latents that are both q.k's keys and p.v's values (attnx's absorbed step), or None."""
    k, v = _back(qk.inputs[1]), _back(pv.inputs[1])
    return k if k is v else None


def read_absorbed_block(block: Block, latents: ir.Value, qk: ir.Node, pv: ir.Node, scale: float,
                        keep_weights: bool) -> Block:  # fmt: skip
    """The block whose q.k (`qk`) and p.v (`pv`) both read `latents` (absorbed_latents); scale: the scores' scale."""
    new, past, present = latents, None, None
    node = latents.producer()
    if is_op(node, "Concat") and len(node.inputs) == 2:  # the cache's Concat(past, new) along the tokens
        past, new, present = node.inputs[0], node.inputs[1], latents
    joined = _back(new).producer()
    if not is_op(joined, "Concat") or len(joined.inputs) != 2:
        raise NotRead(f"{latents.name}: the latents are not [rope key | compressed kv] joined")
    # [rope key | compressed kv]: the rope key is found from kv_a_proj_with_mqa
    kv = read_compressed_kv(joined.inputs[1])
    R, r = kv.rank, kv.rope_dim
    q_rope, q_lat = _absorbed_q(qk.inputs[0])
    w_uk = const_array(q_lat.inputs[1])  # [H, nope, R]
    if w_uk is None or w_uk.ndim != 3 or w_uk.shape[2] != R:
        raise NotRead(f"{q_lat.name}: q_nope's W_uk is not a constant [heads, nope, {R}]")
    n_heads, nope = int(w_uk.shape[0]), int(w_uk.shape[1])
    q_value = _q_projection(q_lat.inputs[0])
    q_lora, weights, first = read_q(q_value, kv.x, kv.eps)
    finish = _finish(pv, r, R)
    w_uv = const_array(finish.inputs[1])  # [H, R, v_head_dim]
    if w_uv is None or w_uv.ndim != 3 or w_uv.shape[:2] != (n_heads, R):
        raise NotRead(f"{finish.name}: W_uv is not a constant [{n_heads}, {R}, v_head_dim]")
    v_head_dim = int(w_uv.shape[2])
    kv_b = np.concatenate([w_uk, np.asarray(w_uv).transpose(0, 2, 1)], axis=1).reshape(n_heads * (nope + v_head_dim), R)
    weights.update(kv.weights(kv_b))
    hidden_state(block, first)
    block.outputs["y"] = output_projection(finish.outputs[0], weights, block).name
    block.reading.rope = rope_tables(kv.rope_part, q_rope)
    interleaved = block.reading.rope.interleaved
    if past is not None:
        _cache(block, past, present, r, R)
        block.cache_sizes = ((1, R), (1, r))  # (heads, size) of the key cache and the value cache
    config = kv.config(n_heads, nope + r, v_head_dim, scale, interleaved, q_lora)
    return keep(block, config, weights, keep_weights)


def _absorbed_q(q: ir.Value) -> tuple[ir.Value, ir.Node]:
    """(q's turned rope part, the MatMul q_nope W_uk) of the absorbed q [rope | q_nope W_uk] that q.k reads."""
    joined = _back(q).producer()
    if not is_op(joined, "Concat") or len(joined.inputs) != 2 or not is_op(joined.inputs[1].producer(), "MatMul"):
        raise NotRead(f"{q.name}: q is not [its rope part | q_nope W_uk] (the absorbed form)")
    rope = joined.inputs[0]
    # back through the Slice of q's heads and their layout to the turned rope part, then to its turned columns
    return _turned(rope), joined.inputs[1].producer()


def _turned(value: ir.Value) -> ir.Value:
    """q's rope part before it was turned: the columns of q's heads the rotation reads (a Slice of q's heads)."""
    for _ in range(24):
        node = value.producer()
        if node is None:
            break
        if is_op(node, "Concat") and len(node.inputs) == 2:  # [turned rope | nope], q laid out as the core scores it
            value = node.inputs[0]
            continue
        if is_op(node, "Slice") and projection(_back(node.inputs[0])) is not None:
            return value  # the columns of q's heads that are rope
        if node.op_type in (*_LAYOUT, "Slice") and node.domain in ("", "ai.onnx"):
            value = node.inputs[0]
            continue
        # the rotation's own ops (Mul by cos and sin, Sub, Add, the pairs' Slices): back along the first operand
        value = node.inputs[0]
    raise NotRead(f"{value.name}: q's rope part is not traced back to the columns of q's heads")


def _q_projection(nope: ir.Value) -> ir.Value:
    """q's projection output that q_nope's columns are taken from (through the heads' layout and q's [rope | nope]
    join, its nope part: the Concat's last input)."""
    value = nope
    for _ in range(12):
        if projection(value) is not None:
            return value
        node = value.producer()
        if node is None:
            break
        value = node.inputs[-1] if is_op(node, "Concat") else node.inputs[0]
    raise NotRead(f"{nope.name}: q_nope is not traced back to q's projection")


def _finish(pv: ir.Node, r: int, R: int) -> ir.Node:
    """The MatMul by W_uv of p.v's compressed kv columns (r, r + R)."""
    value = pv.outputs[0]
    for _ in range(4):
        users = [u for u, _ in value.uses()]
        if len(users) != 1:
            break
        user = users[0]
        if is_op(user, "Slice") and (cols := last_axis_slice(user)) is not None and (cols.start, cols.stop) == (r, r + R):
            after = [u for u, _ in user.outputs[0].uses()]
            if len(after) == 1 and is_op(after[0], "MatMul"):
                return after[0]
            break
        if user.op_type not in _LAYOUT:
            break
        value = user.outputs[0]
    raise NotRead(f"{pv.outputs[0].name}: p.v's compressed kv columns are not multiplied by W_uv")


def _cache(block: Block, past: ir.Value, present: ir.Value, r: int, R: int) -> None:
    """The block's cache: a model's two cache tensors joined as the latent [rope key | compressed kv] (attnx optimize's
    splice), their presents the latent's two Slices."""
    joined = past.producer()
    if not (is_op(joined, "Concat") and len(joined.inputs) == 2 and all(i.is_graph_input() for i in joined.inputs)):
        raise NotRead(f"{past.name}: the latent cache is not the model's rope key and compressed kv inputs joined "
                      "(attnx's own step model: its config is its metadata's)")  # fmt: skip
    past_rope, past_kv = joined.inputs
    presents = {}
    for user, _ in present.uses():
        cols = last_axis_slice(user) if is_op(user, "Slice") else None
        if cols is not None and user.outputs[0].is_graph_output():
            presents[(cols.start, cols.stop)] = user.outputs[0]
    if set(presents) != {(0, r), (r, r + R)}:
        raise NotRead(f"{present.name}: the latent's presents are not its rope key and compressed kv columns")
    present_rope, present_kv = presents[0, r], presents[r, r + R]
    block.inputs.update(past_key=past_kv.name, past_value=past_rope.name)
    block.outputs.update(present_key=present_kv.name, present_value=present_rope.name)
    block.cache_parts = {COMPRESSED_KV: (past_kv.name, present_kv.name), ROPE_KEY: (past_rope.name, present_rope.name)}
