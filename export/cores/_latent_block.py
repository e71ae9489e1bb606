"""Reading an exported block of multi-head latent attention (the latent term, attnx.model.terms.Latent: DeepSeek-V2/V3's
MLA, as transformers' DeepseekV3Attention computes it and torch.onnx writes it) into its config and weights.

The decomposed core's reader (export.cores.decomposed) has found the Softmax between q.k and p.v, and k and v made by
one projection (kv_b_proj) that widens a low-rank input into both. From there, back to the hidden state:

    kv_b_proj       <- [the cache's Concat(past, new)] <- the RMS norm kv_a_layernorm <- the compressed kv, columns
                       [0, kv_lora_rank) of kv_a_proj_with_mqa (a Split or a Slice of its output)
    the rope key    <- columns [kv_lora_rank, kv_lora_rank + rope dim) of kv_a_proj_with_mqa, turned by the graph's
                       cos and sin tables, [the cache's Concat(past, new)]
    q               <- q_b_proj <- the RMS norm q_a_layernorm <- q_a_proj <- x (q_lora_rank), or q_proj <- x

and each head's q laid out [nope | rope] as transformers' projection writes it (attnx.model.terms.latent). What is read
is the structure and the numbers (weights, both norms' eps, the scale, which tables turn the rope parts, whether the rope
part is read in pairs); how the graph turns, joins and scores them is what the audit's proof holds against the float64
formula. The cache, where the graph has one, is two tensors (transformers': the normed compressed kv as the key, the
turned rope key as the value, each [batch, 1, tokens, size]): named as the block's past/present key and value, their
sizes in Block.cache_sizes. What does not fit raises NotRead naming it.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from attnx.export.cores._block import Block, hidden_state, keep, nbits_of, output_projection
from attnx.export.passes._base import const_array
from attnx.export.passes.walk import (
    NotRead,
    is_op,
    last_axis_slice,
    pairs_interleaved,
    projection,
    projection_node,
    rms_input,
    rms_norm,
)
from attnx.export.terms import RopeReading
from attnx.model.config import COMPRESSED_KV, ROPE_KEY, AttentionConfig, Latent
from attnx.model.rope import Rope

__all__ = ["CompressedKv", "read_compressed_kv", "read_latent_block"]

_LAYOUT = ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Cast")


def read_latent_block(block: Block, q_value: ir.Value, kv_b: ir.Node, pv: ir.Node, head_dim: int,
                      scale: float, keep_weights: bool) -> Block:  # fmt: skip
    """The block of `kv_b` (the MatMul expanding the compressed kv into each head's [k_nope | v]) and `q_value` (q's
    projection output), its core's p.v `pv`, the scale its core's reader found."""
    w_kvb, b_kvb = _projection_of(kv_b.outputs[0], "kv_b_proj")
    if b_kvb is not None and np.any(b_kvb):
        raise NotRead(f"{kv_b.name}: kv_b_proj with a bias, which the latent term has not")
    normed, past_kv, present_kv = _through_cache(kv_b.inputs[0])
    kv = read_compressed_kv(normed)
    R, r, rope_part = kv.rank, kv.rope_dim, kv.rope_part
    q_lora, weights, first = read_q(q_value, kv.x, kv.eps)
    weights.update(kv.weights(w_kvb.T))
    q_width = next(w for k, w in weights.items() if k in ("q_proj.weight", "q_b_proj.weight")).shape[0]
    if q_width % head_dim or head_dim <= r:
        raise NotRead(f"q {q_width} wide is not heads of {head_dim} with a rope part of {r} in each")
    n_heads, nope = q_width // head_dim, head_dim - r
    v_head_dim = w_kvb.shape[1] // n_heads - nope
    if w_kvb.shape[1] % n_heads or v_head_dim <= 0:
        raise NotRead(f"kv_b_proj {w_kvb.shape[1]} wide is not {n_heads} heads' k_nope ({nope}) and v")
    hidden_state(block, first)
    y = output_projection(pv.outputs[0], weights, block)
    block.outputs["y"] = y.name
    block.reading.rope = _rope_tables(rope_part, q_value)
    interleaved = block.reading.rope.interleaved
    past_rope, present_rope = _rope_cache(rope_part)
    if (past_kv is None) != (past_rope is None):
        raise NotRead("a cache of the compressed kv or of the rope key alone")
    if past_kv is not None:
        block.inputs.update(past_key=past_kv.name, past_value=past_rope.name)
        block.outputs.update(present_key=present_kv.name, present_value=present_rope.name)
        block.cache_sizes = ((1, R), (1, r))  # (heads, size) of the key cache and the value cache
        block.cache_parts = {COMPRESSED_KV: (past_kv.name, present_kv.name),
                             ROPE_KEY: (past_rope.name, present_rope.name)}  # fmt: skip
    config = kv.config(n_heads, head_dim, v_head_dim, scale, interleaved, q_lora)
    # the quantized projections as they are, for a core that writes its own projections (plan_block, splice)
    projections = {"kv_b_proj": kv_b, "kv_a_proj_with_mqa": kv.node, "q_b_proj" if q_lora is not None else "q_proj":
                   projection_node(q_value), **({"q_a_proj": first} if q_lora is not None else {})}  # fmt: skip
    with contextlib.suppress(NotRead):  # an output projection of torch's addmm (a Gemm): none to take as it is
        projections["out_proj"] = projection_node(y)
    for name, node in projections.items():
        if node is not None and (nbits := nbits_of(node)) is not None:
            block.nbits[f"{name}.weight"] = nbits
    return keep(block, config, weights, keep_weights)


class CompressedKv(NamedTuple):
    """kv_a_proj_with_mqa and kv_a_layernorm as read back from the norm's output (read_compressed_kv): the norm's
    weight and eps, the projection's weight [d_model, kv_lora_rank + rope dim] and bias, the rope key's columns of its
    output, and the hidden state it projects."""

    norm: np.ndarray
    eps: float
    weight: np.ndarray
    bias: np.ndarray | None
    rope_part: ir.Value
    x: ir.Value
    node: ir.Node | None = None  # kv_a_proj_with_mqa's MatMul (or MatMulNBits)

    @property
    def rank(self) -> int:
        """kv_lora_rank: the compressed kv's columns."""
        return int(self.norm.shape[0])

    @property
    def rope_dim(self) -> int:
        return self.weight.shape[1] - self.rank

    def weights(self, kv_b: np.ndarray) -> dict[str, np.ndarray]:
        """Its weights and kv_b_proj's ([heads x (k_nope + v), kv_lora_rank]) under transformers' names."""
        return {"kv_a_proj_with_mqa.weight": self.weight.T, "kv_a_proj_with_mqa.bias": _bias(self.bias, self.weight),
                "kv_a_layernorm.weight": self.norm, "kv_b_proj.weight": kv_b}  # fmt: skip

    def config(self, n_heads: int, head_dim: int, v_head_dim: int, scale: float, interleaved: bool | None,
               q_lora: int | None) -> AttentionConfig:  # fmt: skip
        """The block's config: every head's k and v from the one latent. The rope's frequencies are read from the
        graph's tables by running them (the audit's read_computed_terms), which replaces this one (theta unread:
        10000 until then)."""
        return AttentionConfig(
            d_model=self.weight.shape[0], n_heads=n_heads, head_dim=head_dim, v_head_dim=v_head_dim,
            n_kv_heads=n_heads, bias=True, causal=False, scale=scale, rope=Rope(10000.0, self.rope_dim, interleaved),
            latent=Latent(self.rank, q_lora, self.eps),
        )  # fmt: skip


def read_compressed_kv(normed: ir.Value) -> CompressedKv:
    """Back from `normed` (kv_a_layernorm's output) to the RMS norm, the first kv_lora_rank columns of
    kv_a_proj_with_mqa it normalizes, the projection, and the rope key's columns after them."""
    norm, eps, compressed = _norm_of(normed, "kv_a_layernorm")
    split, kv_a_value = _columns(compressed)
    weight, bias = _projection_of(kv_a_value, "kv_a_proj_with_mqa")
    R = int(norm.shape[0])
    r = weight.shape[1] - R
    if _part_columns(split, compressed) != (0, R) or r <= 0 or r % 2:
        raise NotRead(f"{compressed.name}: not the first {R} columns of kv_a_proj_with_mqa ({weight.shape[1]} wide) "
                      "with an even rope part after them")  # fmt: skip
    rope_part = _other_part(split, compressed, (R, R + r))
    node = projection_node(kv_a_value)
    return CompressedKv(norm, eps, weight, bias, rope_part, node.inputs[0], node)


def read_q(q_value: ir.Value, x: ir.Value, eps: float) -> tuple[int | None, dict[str, np.ndarray], ir.Node]:
    """q's projections back from `q_value` (q_b_proj's or q_proj's output) to the hidden state `x`: (q_lora_rank or
    None for a plain q_proj, their weights under transformers' names, the first projection's node)."""
    q_node = projection_node(q_value)  # its MatMul, past a bias Add
    if q_node.inputs[0] is x:  # q_proj from the hidden state
        w_q, b_q = _projection_of(q_value, "q_proj")
        return None, {"q_proj.weight": w_q.T, "q_proj.bias": _bias(b_q, w_q)}, q_node
    w_qb, b_qb = _projection_of(q_value, "q_b_proj")  # q_a_proj, q_a_layernorm, q_b_proj
    if b_qb is not None and np.any(b_qb):
        raise NotRead(f"{q_node.name}: q_b_proj with a bias, which the latent term has not")
    q_norm, q_eps, q_a = _norm_of(q_node.inputs[0], "q_a_layernorm")
    if q_eps != eps:
        raise NotRead(f"q_a_layernorm's eps {q_eps!r} and kv_a_layernorm's {eps!r} differ: the latent term has one")
    w_qa, b_qa = _projection_of(q_a, "q_a_proj")
    first = projection_node(q_a)
    if first.inputs[0] is not x:
        raise NotRead(f"q_a_proj reads {first.inputs[0].name}, kv_a_proj_with_mqa {x.name}: not one hidden state")
    return int(q_norm.shape[0]), {"q_a_proj.weight": w_qa.T, "q_a_proj.bias": _bias(b_qa, w_qa),
                                  "q_a_layernorm.weight": q_norm, "q_b_proj.weight": w_qb.T}, first  # fmt: skip


def _projection_of(value: ir.Value, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    found = projection(value)
    if found is None:
        raise NotRead(f"{name} {value.name}: not read as a projection of constant weights")
    return found


def _bias(b: np.ndarray | None, w: np.ndarray) -> np.ndarray:
    return b if b is not None else np.zeros(w.shape[1], np.float32)


def _through_cache(value: ir.Value) -> tuple[ir.Value, ir.Value | None, ir.Value | None]:
    """Back from kv_b_proj's input through the heads' layout and the cache's Concat(past, new): (the new latents,
    the past graph input, the Concat's output) or (value, None, None) without a cache."""
    past = present = None
    while (node := value.producer()) is not None:
        if is_op(node, "Concat") and len(node.inputs) == 2 and node.inputs[0].is_graph_input() and past is None:
            past, present, value = node.inputs[0], node.outputs[0], node.inputs[1]
        elif node.op_type in _LAYOUT and node.domain in ("", "ai.onnx"):
            value = node.inputs[0]
        else:
            break
    return value, past, present


def _norm_of(value: ir.Value, name: str) -> tuple[np.ndarray, float, ir.Value]:
    """(weight, eps, the normed input) of the RMS norm `name` whose output is `value`."""
    node = value.producer()
    read = rms_norm(node) if is_op(node, "Mul") else None
    if read is None:
        raise NotRead(f"{name} {value.name}: not read as an RMS norm (made by {node.op_type if node else 'an input'})")
    weight, eps = read
    normed = rms_input(node)
    if len(normed) != 1:
        raise NotRead(f"{name} {value.name}: the value it normalizes is not one tensor")
    value = normed[0]
    while is_op(value.producer(), "Cast"):
        value = value.producer().inputs[0]
    return np.asarray(weight), eps, value


def _columns(part: ir.Value) -> tuple[ir.Node, ir.Value]:
    """The Split or Slice that takes `part` from a projection's output, and that output."""
    node = part.producer()
    if is_op(node, "Split") or (is_op(node, "Slice") and last_axis_slice(node) is not None):
        return node, node.inputs[0]
    raise NotRead(f"{part.name}: not columns of kv_a_proj_with_mqa (made by {node.op_type if node else 'an input'})")


def _part_columns(node: ir.Node, part: ir.Value) -> tuple[int, int] | None:
    if node.op_type == "Slice":
        cols = last_axis_slice(node)
        return cols.start, cols.stop
    sizes = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if sizes is None:
        return None
    index = list(node.outputs).index(part)
    start = int(np.sum(sizes[:index]))
    return start, start + int(sizes[index])


def _other_part(node: ir.Node, part: ir.Value, cols: tuple[int, int]) -> ir.Value:
    """The rope key: the Split's other output, or a Slice of the same projection output, at columns `cols`."""
    if node.op_type == "Split":
        others = [o for o in node.outputs if o is not part]
        if len(others) == 1 and _part_columns(node, others[0]) == cols:
            return others[0]
    else:
        for user, _ in node.inputs[0].uses():
            if is_op(user, "Slice") and (s := last_axis_slice(user)) is not None and (s.start, s.stop) == cols:
                return user.outputs[0]
    raise NotRead(f"kv_a_proj_with_mqa's columns {cols[0]}..{cols[1]} (the rope key): not taken apart")


def _forward(value: ir.Value, limit: int = 24) -> tuple[list[ir.Node], bool]:
    """The Muls reached from `value` through layout, Slice, Gather and Concat ops (breadth first: rotate_half's
    cat(-x2, x1) of the half-split pairs before its Mul by sin), and whether a Slice or a
    Gather on the way reads pairs (2i, 2i + 1) (walk's rule: an interleaved rotation)."""
    seen, queue, muls, pairs = set(), [value], [], False
    while queue and len(seen) < limit:
        for user, _ in queue.pop(0).uses():
            if id(user) in seen:
                continue
            seen.add(id(user))
            if is_op(user, "Mul"):
                muls.append(user)
            elif user.op_type in (*_LAYOUT, "Slice", "Gather", "Neg", "Split", "Concat") and user.domain in ("", "ai.onnx"):
                pairs = pairs or pairs_interleaved(user)
                queue += list(user.outputs)
    return muls, pairs


def _table_op(value: ir.Value, limit: int = 8) -> ir.Node | None:
    """The Cos or Sin node a table value is computed by, through the layout, Slice and Gather ops."""
    for _ in range(limit):
        node = value.producer()
        if node is None:
            return None
        if node.op_type in ("Cos", "Sin"):
            return node
        if is_op(node, "Mul") and (scaled := [i for i in node.inputs if const_array(i) is None]) and len(scaled) == 1:
            value = scaled[0]  # a table times a constant (attnx's: yarn's attention factor)
            continue
        if node.op_type not in (*_LAYOUT, "Slice", "Gather", "Expand"):
            return None
        value = node.inputs[0] if node.op_type != "Gather" or const_array(node.inputs[0]) is None else node.inputs[1]
    return None


def _tables_turning(value: ir.Value) -> tuple[dict[str, ir.Value], bool]:
    """The cos and sin values of the Muls that turn `value` (a rope part), and whether it is read in pairs
    (transformers' rope_interleave: Slices of step 2)."""
    found: dict[str, ir.Value] = {}
    muls, pairs = _forward(value)
    for mul in muls:
        for i in mul.inputs:
            op = _table_op(i)
            if op is not None:
                found.setdefault(op.op_type, i)
    if set(found) != {"Cos", "Sin"}:
        raise NotRead(f"{value.name}: the rope part is not turned by a cos and a sin table")
    return found, pairs


def _rope_tables(rope_key: ir.Value, q_value: ir.Value) -> RopeReading:
    """The tables turning the rope key and q's rope parts (the same Cos and Sin), named (RopeReading.tensors) for the
    audit to read by running them, and whether the parts are read in pairs (RopeReading.interleaved)."""
    q_parts = [o for node in _q_splits(q_value) for o in node.outputs[1:]]
    if not q_parts:
        raise NotRead(f"{q_value.name}: q's heads are not taken apart into nope and rope parts")
    return rope_tables(rope_key, q_parts[0])


def rope_tables(rope_key: ir.Value, q_rope: ir.Value) -> RopeReading:
    """_rope_tables of q's rope part `q_rope` found."""
    k_tables, k_pairs = _tables_turning(rope_key)
    q_tables, q_pairs = _tables_turning(q_rope)
    if {k: _table_op(v) for k, v in k_tables.items()} != {k: _table_op(v) for k, v in q_tables.items()} \
            or k_pairs != q_pairs:  # fmt: skip
        raise NotRead("q's rope parts and the rope key are turned by different tables")
    return RopeReading(interleaved=k_pairs, tensors=(k_tables["Cos"].name, k_tables["Sin"].name))


def _q_splits(q_value: ir.Value) -> list[ir.Node]:
    """The Split (or the Slices) taking each head of q apart into its nope and rope parts, below the heads' layout."""
    value = q_value
    while (users := [u for u, _ in value.uses()]) and len(users) == 1 and users[0].op_type in _LAYOUT:
        value = users[0].outputs[0]
    return [u for u, _ in value.uses() if is_op(u, "Split") and len(u.outputs) == 2]


def _rope_cache(rope_key: ir.Value) -> tuple[ir.Value | None, ir.Value | None]:
    """The cache's Concat(past, new) of the turned rope key, where the graph has one: (past input, present)."""
    seen, queue = set(), [rope_key]
    while queue and len(seen) < 32:
        for user, i in queue.pop(0).uses():
            if id(user) in seen:
                continue
            seen.add(id(user))
            if is_op(user, "Concat") and len(user.inputs) == 2 and user.inputs[0].is_graph_input() and i == 1:
                return user.inputs[0], user.outputs[0]
            if user.op_type in (*_LAYOUT, "Slice", "Mul", "Sub", "Add", "Neg", "Concat") and user.domain in ("", "ai.onnx"):
                queue += list(user.outputs)
    return None, None
