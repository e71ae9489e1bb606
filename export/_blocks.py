"""The attention blocks of a whole model another tool exported, read back into attnx's contract.

A block is one attention core (attnx.model.cores: read by CORE_READERS, attnx.export._read) with
what belongs to it: the q/k/v projections (packed or separate, with biases, float or MatMulNBits),
the q/k norms, the rotary tables, the output projection and the cache. read_blocks() reads each
into an AttentionConfig and the weights of the weights file's contract, and names the graph's own
tensors at the block's boundary (the hidden state in, the block's output and presents out), which
is where `attnx audit` cuts it out to run (attnx.workflows.audit). What is not read is said, with
the node and why, never skipped in silence (Block.unread, and Blocks.unread for cores not read).

Readers (_BLOCK_READERS), one per core: GroupQueryAttention (ONNX Runtime GenAI's builder: packed or separate
qkv, MatMulNBits, the op's own rotary from cos/sin caches, window, softcap, sinks; attnx's: a RotaryEmbedding of its
own before it), MultiHeadAttention (the builder's fp16 models), ONNX's opset-23 Attention, com.microsoft Attention
(BERT as ONNX Runtime's optimizer fuses it) and the decomposed MatMul-Softmax-MatMul (attnx, torch.onnx, Optimum).
From a core, each of q, k and v is followed back to its projection (_walk for the fused ops' inputs, _find_projection
breadth first for the decomposed form), noting the rotation, norm, cache and scalings met. What the graph computes
rather than states (rotary tables from position_ids, masks from attention_mask) is named for the audit, which reads it
by running it (Block.facts["rope_tensors"], Block.mask, Block.masks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export._read import CORE_READERS, _core_of_node
from attnx.export.passes._base import const_array
from attnx.export.passes.walk import (
    NotRead,
    Path,
    find_projection,
    head_dim,
    is_op,
    projection,
    projection_node,
    reaches_matmul,
    scale_and_softcap,
    score_chain,
    sink_logits,
    strip_layout,
    walk,
)
from attnx.model.config import AttentionConfig
from attnx.model.contract import MS_DOMAIN
from attnx.model.rope import Rope
from attnx.model.rope_fit import rope_of_table
from attnx.model.terms import QKNorm

__all__ = ["Block", "Blocks", "block_nodes", "iter_blocks", "read_blocks", "release_external"]


@dataclasses.dataclass
class Block:
    """One attention block of a graph: its core node, the config and weights read from it, the graph's
    tensors at its boundary (role -> value name), and what the reading found on the way."""

    index: int
    node: str
    core: str
    config: AttentionConfig | None = None
    weights: dict[str, np.ndarray] | None = None
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # x, seqlens_k, total_sequence_length, past_*
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # y, present_key, present_value
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)  # as the node states them (local_window_size, ...)
    quantization: dict[str, Any] | None = None  # MatMulNBits: bits, block_size, accuracy_level
    unread: str | None = None  # why the block was not read into a config
    dtype: str = "fp32"  # what the block computes in: its hidden state's type
    mask: str | None = None  # the tensor of the core's mask input (an additive bias or a key padding mask), if any
    weight_dtype: str = "float32"  # how the graph stores the projections' weights (numpy's name)
    y_bias: np.ndarray | None = None  # the output projection's bias where a fused op after the block adds it
    padding: str = "left"  # how a padded batch is fed: "left" (transformers'), "right" (seqlens_k, a mask_index)
    masks: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (tensor, how it masks), decomposed cores
    # the formula's stages (attnx.model.stages) the graph holds as tensors: stage -> (tensor, its columns or None)
    stages: dict[str, tuple[str, tuple[int, int] | None]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "core": self.core,
                "config": self.config.to_dict() if self.config is not None else None, "inputs": self.inputs,
                "outputs": self.outputs, "facts": _jsonable(self.facts), "quantization": self.quantization,
                "unread": self.unread, "dtype": self.dtype, "mask": self.mask}  # fmt: skip


@dataclasses.dataclass
class Blocks:
    blocks: list[Block]
    unread: list[str]  # "node X: a Softmax not read as attention: ..."


def _jsonable(facts: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)) for k, v in facts.items()}


def _quantization(node: ir.Node) -> dict[str, Any] | None:
    if not is_op(node, "MatMulNBits", (MS_DOMAIN,)):
        return None
    a = node.attributes
    zero_points = len(node.inputs) > 3 and node.inputs[3] is not None
    return {"op": "MatMulNBits", "bits": a.get_int("bits", 4), "block_size": a.get_int("block_size", 32),
            "accuracy_level": a.get_int("accuracy_level", 0), "zero_points": zero_points}  # fmt: skip


def _read_gqa_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    facts = CORE_READERS["gqa"](node)
    block = Block(index, node.name or node.op_type, "gqa", facts=facts)
    n_heads, n_kv = facts["n_heads"], facts["n_kv_heads"]
    inputs = list(node.inputs) + [None] * (12 - len(node.inputs))
    weights: dict[str, np.ndarray] = {}
    paths: dict[str, Path] = {}
    qk_norm = None
    if inputs[1] is None:  # packed: query holds q | k | v
        proj = projection(inputs[0])
        if proj is None:
            raise NotRead(f"query {inputs[0].name}: not read as a packed qkv projection")
        w, b = proj
        hd = w.shape[1] // (n_heads + 2 * n_kv)
        parts = np.cumsum([0, n_heads * hd, n_kv * hd, n_kv * hd])
        proj_node = projection_node(inputs[0])
        for role, a, e in zip("qkv", parts[:-1], parts[1:]):
            block.stages[role] = (strip_layout(inputs[0]).name, (int(a), int(e)))
            weights[f"{role}_proj.weight"] = w[:, a:e].T
            weights[f"{role}_proj.bias"] = b[a:e] if b is not None else np.zeros(e - a)
    else:
        for role, value in zip("qkv", inputs[:3]):
            path = paths[role] = walk(value)
            proj = projection(path.projection)
            if proj is None:
                maker = path.projection.producer()
                raise NotRead(f"{'query key value'.split()['qkv'.index(role)]} {value.name}: made by "
                              f"{maker.op_type if maker is not None else 'a graph input'} ({path.projection.name}), "
                              "not read as a projection")  # fmt: skip
            w, b = proj
            weights[f"{role}_proj.weight"] = w.T
            weights[f"{role}_proj.bias"] = b if b is not None else np.zeros(w.shape[1])
        hd = weights["q_proj.weight"].shape[0] // n_heads
        _path_stages(block, paths)
        proj_node = projection_node(paths["q"].projection)
        qk_norm = _qk_norm(paths, weights, facts)
    _hidden_state(block, proj_node)
    block.outputs = {"y": _output_projection(node.outputs[0], weights, block).name, "present_key": node.outputs[1].name,
                     "present_value": node.outputs[2].name}  # fmt: skip
    for role, i in (("past_key", 3), ("past_value", 4), ("seqlens_k", 5), ("total_sequence_length", 6)):
        if inputs[i] is not None:
            block.inputs[role] = inputs[i].name
    if inputs[10] is not None:  # an attention bias (a key padding mask, as attnx writes it): read by the audit
        block.mask = inputs[10].name
    rope = None
    if facts.pop("rope_interleaved", None) is not None:
        cos, sin = const_array(inputs[7]), const_array(inputs[8])
        facts["rotary_interleaved"] = bool(node.attributes.get_int("rotary_interleaved", 0))
        if cos is None or sin is None:  # caches the graph computes (the builder's longrope: an If on the length)
            if inputs[7] is None or inputs[8] is None:
                raise NotRead("do_rotary without cos/sin caches")
            facts["rope_tensors"] = (inputs[7].name, inputs[8].name)
        else:
            rope, rope_facts = rope_of_table(cos, sin, facts["rotary_interleaved"])
            facts.update(rope_facts)
            facts["rope_tables"] = (np.array(cos), np.array(sin))  # copies: the graph's tensors are released
    elif paths:  # a RotaryEmbedding of its own before the core (as attnx writes it)
        rope = _rotary_of(paths, facts, block)
    sinks = None
    if facts.get("sinks"):
        sinks = const_array(inputs[11])
        if sinks is None:
            raise NotRead("head_sink is not a constant")
        weights["sinks"] = sinks
    facts["local_window_size"] = node.attributes.get_int("local_window_size", -1)
    facts["sliding_window_cache"] = node.attributes.get_int("sliding_window_cache", 0)
    config = AttentionConfig(
        d_model=weights["q_proj.weight"].shape[1], n_heads=n_heads, head_dim=hd, n_kv_heads=n_kv,
        bias=True, causal=facts["causal"], scale=facts.get("scale") or 1.0 / math.sqrt(hd), rope=rope,
        sliding_window=facts.get("sliding_window"), softcap=facts.get("softcap"), qk_norm=qk_norm,
        sinks=sinks is not None,
    )  # fmt: skip
    return _keep(block, config, weights, keep_weights)


def _output_projection(out: ir.Value, weights: dict[str, np.ndarray], block: Block) -> ir.Value:
    """The MatMul (with its bias Add) reading a core's output, through the Reshape/Transpose that merge the
    heads: its weights into `weights` (out_proj.*); returns the block's output value."""
    value = out
    while (users := [u for u, _ in value.uses()]) and len(users) == 1 and users[0].domain in ("", "ai.onnx") and (
        users[0].op_type in ("Reshape", "Transpose")
        or (users[0].op_type == "Where" and users[0].inputs[1] is value and const_array(users[0].inputs[2]) is not None)
    ):  # the heads merged; a row no key may see set to a constant
        value = users[0].outputs[0]
    o_node = next((u for u in users if is_op(u, "MatMul") or is_op(u, "MatMulNBits", (MS_DOMAIN,))), None)
    if o_node is None:
        raise NotRead(f"{out.name}: no output projection reads it (used by {', '.join(u.op_type for u in users)})")
    y = o_node.outputs[0]
    o_proj = projection(y)
    adds = [u for u, _ in y.uses() if is_op(u, "Add") and any(const_array(i) is not None for i in u.inputs)]
    if adds:
        o_proj = projection(adds[0].outputs[0])
        y = adds[0].outputs[0]
    if o_proj is None:
        raise NotRead(f"{o_node.name}: the output projection's weights are not constants")
    skip = [u for u, _ in y.uses() if is_op(u, "SkipLayerNormalization", (MS_DOMAIN,)) and len(u.inputs) > 4]
    if not adds and skip and (bias := const_array(skip[0].inputs[4])) is not None:
        o_proj = (o_proj[0], bias)  # ONNX Runtime's optimizer moves the bias into the SkipLayerNormalization after
        block.y_bias = np.array(bias, np.float32)
    block.stages.update(z=(o_node.inputs[0].name, None), y=(y.name, None))
    weights["out_proj.weight"] = o_proj[0].T
    weights["out_proj.bias"] = o_proj[1] if o_proj[1] is not None else np.zeros(o_proj[0].shape[1])
    return y


_DTYPES = {ir.DataType.FLOAT: "fp32", ir.DataType.FLOAT16: "fp16", ir.DataType.BFLOAT16: "bf16"}


def _dtype_of(value: ir.Value) -> str:
    """The tolerance table's name of a hidden state's type (fp32 where the graph does not say)."""
    return _DTYPES.get(value.dtype, "fp32") if value.dtype is not None else "fp32"


def _path_stages(block: Block, paths: dict[str, Path], biased_apart: bool = False) -> None:
    """The projection (q, k, v) and rotation (q_rope, k_rope) stages met on the paths to a core; not the projections
    when the core adds their bias itself (biased_apart)."""
    for role, path in paths.items():
        if not biased_apart:
            block.stages[role] = (path.projection.name, None)
        if isinstance(path.rotary, ir.Node):
            block.stages[f"{role}_rope"] = (path.rotary.outputs[0].name, None)


def _qk_norm(paths: dict[str, Path], weights: dict[str, np.ndarray], facts: dict[str, Any]) -> QKNorm | None:
    """The per-head RMS norms met on q's and k's paths (their weights into `weights`), or None; one alone is not read."""
    q, k = paths["q"].norm, paths["k"].norm
    if q is None and k is None:
        return None
    if q is None or k is None:
        raise NotRead(f"a norm on {'q' if q is not None else 'k'} alone")
    (weights["q_norm.weight"], q_eps), (weights["k_norm.weight"], k_eps) = q, k
    facts["qk_norm_eps"] = [float(q_eps), float(k_eps)]
    return QKNorm(eps=float(q_eps))


def _path_cache(block: Block, paths: dict[str, Path]) -> None:
    """The cache met on k's and v's paths (present = Concat(past, new)) as the block's past/present; one alone is not
    read."""
    for role, kv in (("key", "k"), ("value", "v")):
        if (paths[kv].past is None) != (paths["k"].past is None):
            raise NotRead("a cache on the key or the value alone")
        if paths[kv].past is not None:
            block.inputs[f"past_{role}"], block.outputs[f"present_{role}"] = paths[kv].past.name, paths[kv].present.name


def _hidden_state(block: Block, proj_node: ir.Node) -> None:
    """The block's input (the q projection's), its dtype, and the projection's quantization."""
    block.quantization = _quantization(proj_node)
    block.inputs["x"] = proj_node.inputs[0].name
    block.dtype = _dtype_of(proj_node.inputs[0])


def _keep(block: Block, config: AttentionConfig, weights: dict[str, np.ndarray], keep_weights: bool) -> Block:
    """The block with its config and weights: copies, never views of the graph's memory-mapped tensors (iter_blocks
    releases them after each block); without keep_weights none is copied, so none of their pages is read. A rope
    that no theta fits is said (Block.unread)."""
    block.config = config
    block.weight_dtype = np.asarray(weights["q_proj.weight"]).dtype.name
    block.weights = {k: np.array(v, np.float32, order="C") for k, v in weights.items()} if keep_weights else None
    if config.rope is None and "rope" in block.facts:
        block.unread = f"rope {block.facts['rope']}"
    return block


def _rotary_tables(node: ir.Node) -> tuple[ir.Value, ir.Value, bool, str | None]:
    """(cos, sin, interleaved, position input's name) of a RotaryEmbedding node: com.microsoft's (x, position_ids,
    cos, sin) or ONNX's (x, cos, sin, position_ids); cos/sin constant caches, or tensors the graph computes."""
    ms = node.domain == MS_DOMAIN
    cos, sin = (node.inputs[2], node.inputs[3]) if ms else (node.inputs[1], node.inputs[2])
    positions = node.inputs[1] if ms else (node.inputs[3] if len(node.inputs) > 3 else None)
    interleaved = bool(node.attributes.get_int("interleaved", 0))
    return cos, sin, interleaved, positions.name if positions is not None and positions.is_graph_input() else None


def _read_mha_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """com.microsoft MultiHeadAttention with separate query, key and value (as the GenAI builder writes its fp16
    CPU models)."""
    inputs = list(node.inputs) + [None] * (10 - len(node.inputs))
    if inputs[1] is None or inputs[2] is None:
        raise NotRead("a packed query/key/value MultiHeadAttention: not read in this version")
    if inputs[6] is not None or inputs[7] is not None:
        raise NotRead("the op's own past_key/past_value inputs: not read in this version")
    mask = inputs[5] if inputs[5] is not None else inputs[4]  # an additive bias, else a key padding mask
    return _read_separate(index, node, "mha", CORE_READERS["mha"](node), inputs[:3], mask, keep_weights,
                          packed_bias=inputs[3])


def _read_attention23_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """ONNX's Attention (opset 23): query, key and value, a mask input (boolean: True attends; or additive), the op's
    own past_key/past_value -> present_key/present_value, is_causal."""
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    facts = CORE_READERS["attention23"](node)
    facts["causal"] = bool(facts.get("causal"))
    cache = None
    if inputs[4] is not None:
        if not (inputs[4].is_graph_input() and inputs[5] is not None and inputs[5].is_graph_input()):
            raise NotRead("past_key/past_value that are not graph inputs")
        cache = (inputs[4], inputs[5], node.outputs[1], node.outputs[2])
    return _read_separate(index, node, "attention23", facts, inputs[:3], inputs[3], keep_weights, own_cache=cache)


def _rotary_of(paths: dict[str, Path], facts: dict[str, Any], block: Block) -> Rope | None:
    """The rope of the RotaryEmbedding nodes met on q's and k's way (one table for both), or None; tables the graph
    computes are named in facts["rope_tensors"] for the audit to read by running them."""
    rope = None
    if (paths["q"].rotary is None) != (paths["k"].rotary is None):
        raise NotRead(f"a RotaryEmbedding on {'q' if paths['q'].rotary is not None else 'k'} alone")
    if paths["q"].rotary is not None:
        cos_v, sin_v, interleaved, positions = _rotary_tables(paths["q"].rotary)
        k_cos_v, k_sin_v, k_interleaved, _ = _rotary_tables(paths["k"].rotary)
        cos, sin, k_cos, k_sin = (const_array(v) for v in (cos_v, sin_v, k_cos_v, k_sin_v))
        computed = any(a is None for a in (cos, sin, k_cos, k_sin))
        same = (cos_v is k_cos_v and sin_v is k_sin_v) or (not computed and np.array_equal(cos, k_cos)
                                                           and np.array_equal(sin, k_sin))  # fmt: skip
        if (not same and not computed) or interleaved != k_interleaved:
            raise NotRead("q and k rotated by different tables")
        facts["rotary_interleaved"] = interleaved
        if computed:  # tables the graph computes (from position_ids): the audit reads them by running them
            facts["rope_tensors"] = (cos_v.name, sin_v.name)
            if not same:  # computed apart for q and k: the audit holds k's to q's
                facts["k_rope_tensors"] = (k_cos_v.name, k_sin_v.name)
        else:
            rope, rope_facts = rope_of_table(cos, sin, interleaved)
            facts.update(rope_facts)
            facts["rope_tables"] = (np.array(cos), np.array(sin))  # copies: the graph's tensors are released
        if positions is not None:
            block.inputs["position_ids"] = positions
    return rope


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
    facts = CORE_READERS["ms-attention"](node)
    w = const_array(inputs[1])
    if w is None or w.ndim != 2:
        raise NotRead(f"{inputs[1].name}: the packed qkv weight is not a constant")
    b = const_array(inputs[2]) if inputs[2] is not None else np.zeros(w.shape[1], w.dtype)
    sizes = node.attributes.get_ints("qkv_hidden_sizes", None) or [w.shape[1] // 3] * 3
    if len(sizes) != 3 or sum(sizes) != w.shape[1] or min(sizes) <= 0 or not facts["n_heads"]:
        raise NotRead(f"qkv_hidden_sizes {list(sizes)} and num_heads {facts['n_heads']} do not split a weight of "
                      f"{w.shape[1]} columns into heads")  # fmt: skip
    ends = np.cumsum([0, *sizes])
    block = Block(index, node.name or node.op_type, "ms-attention", facts=facts)
    weights: dict[str, np.ndarray] = {}
    for role, a, e in zip("qkv", ends[:-1], ends[1:]):
        weights[f"{role}_proj.weight"], weights[f"{role}_proj.bias"] = w[:, a:e].T, b[a:e]
    n_heads = facts["n_heads"]
    hd = int(sizes[0]) // n_heads
    block.inputs["x"] = inputs[0].name
    block.dtype = _dtype_of(inputs[0])
    block.outputs["y"] = _output_projection(node.outputs[0], weights, block).name
    if inputs[3] is not None:
        block.inputs["mask_index"] = inputs[3].name
        block.padding = "right"  # a row's length: its keys past it are padding
    config = AttentionConfig(
        d_model=w.shape[0], n_heads=n_heads, head_dim=hd, n_kv_heads=int(sizes[1]) // hd, bias=True,
        causal=facts["causal"], scale=facts.get("scale") or 1.0 / math.sqrt(hd),
    )  # fmt: skip
    return _keep(block, config, weights, keep_weights)


def _read_separate(index: int, node: ir.Node, core: str, facts: dict[str, Any], qkv: list[ir.Value | None],
                   mask: ir.Value | None, keep_weights: bool, packed_bias: ir.Value | None = None,
                   own_cache: tuple[ir.Value, ...] | None = None) -> Block:  # fmt: skip
    """A core taking query, key and value apart: each walked back to its projection through a RotaryEmbedding, a
    per-head norm, the cache's Concat(past, new) and the repeat of a GQA group; the mask tensor is named for the
    audit, which reads its terms by running it."""
    block = Block(index, node.name or node.op_type, core, facts=facts)
    weights: dict[str, np.ndarray] = {}
    paths = {}
    for role, value in zip("qkv", qkv):
        path = paths[role] = walk(value)
        proj = projection(path.projection)
        if proj is None:
            maker = path.projection.producer()
            raise NotRead(f"{role} {value.name}: made by {maker.op_type if maker is not None else 'a graph input'} "
                          f"({path.projection.name}), not read as a projection")  # fmt: skip
        w, b = proj
        weights[f"{role}_proj.weight"] = w.T
        weights[f"{role}_proj.bias"] = b if b is not None else np.zeros(w.shape[1])
    packed_bias = const_array(packed_bias)
    _path_stages(block, paths, biased_apart=packed_bias is not None)
    if packed_bias is not None:  # the op's [Dq | Dk | Dv] bias, added after the projections
        ends = np.cumsum([0] + [weights[f"{r}_proj.weight"].shape[0] for r in "qkv"])
        for role, a, e in zip("qkv", ends[:-1], ends[1:]):
            weights[f"{role}_proj.bias"] = weights[f"{role}_proj.bias"] + packed_bias[a:e]
    n_heads = facts["n_heads"]
    if n_heads is None:  # a 4D query [batch, heads, tokens, head_dim]: the op's attributes do not say
        shape = qkv[0].shape
        if shape is None or len(shape) != 4 or not isinstance(shape[1], int):
            raise NotRead(f"query {qkv[0].name}: its heads are neither an attribute nor a static dimension")
        n_heads = facts["n_heads"] = shape[1]
    hd = weights["q_proj.weight"].shape[0] // n_heads
    n_kv = weights["k_proj.weight"].shape[0] // hd
    facts["n_kv_heads"] = n_kv
    proj_node = projection_node(paths["q"].projection)
    _hidden_state(block, proj_node)
    qk_norm = _qk_norm(paths, weights, facts)
    block.outputs["y"] = _output_projection(node.outputs[0], weights, block).name
    if own_cache is not None:
        if paths["k"].past is not None:
            raise NotRead("a cache both in the op and before it")
        past_k, past_v, present_k, present_v = own_cache
        block.inputs.update(past_key=past_k.name, past_value=past_v.name)
        block.outputs.update(present_key=present_k.name, present_value=present_v.name)
    _path_cache(block, paths)
    rope = _rotary_of(paths, facts, block)
    block.mask = mask.name if mask is not None else None
    config = AttentionConfig(
        d_model=weights["q_proj.weight"].shape[1], n_heads=n_heads, head_dim=hd, n_kv_heads=n_kv, bias=True,
        causal=facts["causal"], scale=facts.get("scale") or 1.0 / math.sqrt(hd), rope=rope,
        qk_norm=qk_norm, softcap=facts.get("softcap"),
    )  # fmt: skip
    return _keep(block, config, weights, keep_weights)


def _read_decomposed_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    """A Softmax between MatMul(q, k^T) and MatMul(p, v): the projections found above each side (through the heads'
    layout, a GQA repeat, a decomposed rotary and the cache's Concat), the scale and softcap as the reader of attnx's
    core reads them, each mask tensor named for the audit to read by running it."""
    facts: dict[str, Any] = {}
    chain = score_chain(node)
    if chain.constant_bias:
        raise NotRead("a constant added to the scores (a folded mask or a position bias): not read in this version")
    if chain.qk is None:
        maker = chain.end.producer()
        raise NotRead(f"{chain.end.name}: the Softmax's scores are not traced back to MatMul(q, k^T) "
                      f"(made by {maker.op_type if maker is not None else 'a graph input'})")  # fmt: skip
    qk, pv = chain.qk, chain.pv
    masks = [(tensor.name, how) for _, tensor, how in chain.masks]
    scale, softcap = scale_and_softcap(chain.scalings)
    sinks = sink_logits(node.inputs[0])
    if pv is None:
        raise NotRead(f"{node.outputs[0].name}: the probabilities are not multiplied by values")
    block = Block(index, node.name or node.op_type, "decomposed", facts=facts)
    weights: dict[str, np.ndarray] = {}
    paths = {}
    for role, value in (("q", qk.inputs[0]), ("k", qk.inputs[1]), ("v", pv.inputs[1])):
        found, paths[role] = find_projection(value)
        proj = projection(found)
        if proj is None:
            raise NotRead(f"{role} {found.name}: not read as a projection")
        w, b = proj
        weights[f"{role}_proj.weight"] = w.T
        weights[f"{role}_proj.bias"] = b if b is not None else np.zeros(w.shape[1])
    for role in "qkv":
        block.stages[role] = (paths[role].projection.name, None)
    hd = head_dim(qk.inputs[0])
    if hd is None:
        raise NotRead(f"{qk.inputs[0].name}: the head size is neither a static dimension nor a constant Reshape")
    n_heads, n_kv = weights["q_proj.weight"].shape[0] // hd, weights["k_proj.weight"].shape[0] // hd
    facts.update(n_heads=n_heads, n_kv_heads=n_kv, scale=scale * paths["q"].scale * paths["k"].scale, softcap=softcap)
    qk_norm = _qk_norm(paths, weights, facts)
    proj_node = projection_node(paths["q"].projection)
    if any(projection_node(paths[r].projection).inputs[0] is not proj_node.inputs[0] for r in "kv"):
        raise NotRead("q, k and v projected from different tensors (a cross attention): not read in this version")
    _hidden_state(block, proj_node)
    block.outputs["y"] = _output_projection(pv.outputs[0], weights, block).name
    _path_cache(block, paths)
    if (paths["q"].rotary is None) != (paths["k"].rotary is None):
        raise NotRead(f"a rotary on {'q' if paths['q'].rotary is not None else 'k'} alone")
    if paths["q"].rotary is not None:
        tables = paths["q"].rotary
        if set(tables) != {"Cos", "Sin"}:
            raise NotRead("a rotary with a cos or a sin table alone")
        facts["rotary_interleaved"] = False  # rotate_half's (i, i + dim/2) pairs, as transformers and attnx write it
        facts["rope_tensors"] = (tables["Cos"].name, tables["Sin"].name)
    block.masks = masks
    block.mask = masks[0][0] if masks else None
    config = AttentionConfig(
        d_model=weights["q_proj.weight"].shape[1], n_heads=n_heads, head_dim=hd, n_kv_heads=n_kv, bias=True,
        causal=False, scale=facts["scale"], softcap=softcap, qk_norm=qk_norm, sinks=sinks is not None,
    )  # fmt: skip
    if sinks is not None:
        if sinks.size != n_heads:
            raise NotRead(f"a sink column of {sinks.size} logits for {n_heads} heads")
        weights["sinks"] = sinks.reshape(n_heads)
    return _keep(block, config, weights, keep_weights)


_BLOCK_READERS = {"gqa": _read_gqa_block, "mha": _read_mha_block, "attention23": _read_attention23_block,
                  "decomposed": _read_decomposed_block, "ms-attention": _read_ms_attention_block}


def iter_blocks(model: ir.Model, unread: list[str], wanted: Callable[[int], bool] | None = None,
                others: list[str] | None = None) -> Iterator[Block]:  # fmt: skip
    """Every attention block of the graph in graph order, read one at a time (its weights read from the
    graph's tensors as it is reached, and the tensors released when the next block is read: a model larger
    than memory is read a layer at a time), each where its core has a block reader; what is not read is
    appended to `unread` with the node and why; a Softmax of no q.k (a router's, a classifier's) to `others`.
    wanted(index) false: the block is read (its structure, config and index) without its weights (Block.weights
    None), whose bytes are then never read."""
    index = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        core = _core_of_node(node, "")
        if core is None:
            continue
        name = node.name or node.op_type
        if core == "decomposed" and not reaches_matmul(node.inputs[0], depth=16):
            if others is not None:
                others.append(f"node {name}: a Softmax whose input comes from no MatMul of two computed operands "
                              "(q.k): not read as attention")  # fmt: skip
            continue
        reader = _BLOCK_READERS.get(core)
        if reader is None:
            unread.append(f"node {name}: a {node.op_type} ({core} core) not read as a block: attnx audit reads "
                          f"{', '.join(_BLOCK_READERS)} blocks in this version")  # fmt: skip
            continue
        block, why = None, None
        try:
            block = reader(index, node, wanted is None or wanted(index))
        except NotRead as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - an untrusted graph's values (heads 0, sizes that do not add up)
            why = f"{type(e).__name__}: {e}"
        release_external(model)  # after the exception and its traceback (views of the mapped data) are gone
        if block is None:
            unread.append(f"node {name}: not read as attention: {why}")
            continue
        index += 1
        yield block


def release_external(model: ir.Model) -> int:
    """Unmap every external tensor of `model` that a read mapped (onnx_ir maps the data file when a tensor
    is read, and keeps it mapped: the pages read stay in the process's memory until released), and return
    how many were. A block keeps copies of what it read, so none is in use."""
    released = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and tensor.raw is not None:
            tensor.release()
            released += 1
    return released


def read_blocks(model: ir.Model) -> Blocks:
    """Every attention block of the graph (iter_blocks), all held at once."""
    unread: list[str] = []
    return Blocks(list(iter_blocks(model, unread)), unread)


def block_nodes(model: ir.Model) -> list[str]:
    """The names of the nodes iter_blocks reads as blocks (a core with a block reader), in graph order, from the
    graph alone (no weight read): how many blocks a model has before any is read. A node its reader then
    refuses is still listed here (iter_blocks names it as unread and numbers the blocks after it one lower)."""
    return [node.name or node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if (core := _core_of_node(node, "")) in _BLOCK_READERS
            and (core != "decomposed" or reaches_matmul(node.inputs[0], depth=16))]  # fmt: skip
