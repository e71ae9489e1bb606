"""A block read from a graph (Block: its core node, the config and weights read from it, the graph's tensors at its
boundary), and the pieces the block readers of the cores share: the output projection after a core, the q/k norms,
the cache and the rotary met on q's, k's and v's paths (attnx.export.passes.walk), the hidden state, the copy of
what was read."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export.passes._base import const_array
from attnx.export.passes.walk import (
    NotRead,
    Path,
    flat_gemm,
    flattened_input,
    is_op,
    projection,
    projection_node,
    walk,
)
from attnx.export.terms import Reading, RopeReading, read_paths, stated_terms
from attnx.model.config import AttentionConfig
from attnx.model.contract import MS_DOMAIN
from attnx.model.rope import Rope
from attnx.model.rope_fit import rope_of_table

__all__ = ["Block", "Unread", "UnreadKind", "dtype_of", "hidden_state", "keep", "output_projection", "path_cache", "path_stages",
           "quantization", "read_separate", "rotary_of", "rotary_tables"]


class UnreadKind(enum.Enum):
    """What kind of reason a block was not read for (Unread.kind): what code branches on, never the text."""

    NOT_READ = "not read"  # what the reading needs was not found, not fed, or did not run
    # the term's table was read and no form of the term fits it (a scaled rope no theta fits): a source's layer
    # (a checkpoint) that states the term holds the block instead
    UNFIT_TABLE = "unfit table"


@dataclasses.dataclass(frozen=True)
class Unread:
    """Why a block was not read into a config: `text` for people (never parsed), `kind` and `term` for code."""

    text: str
    kind: UnreadKind = UnreadKind.NOT_READ
    term: str | None = None  # the term whose reading failed, where one did

    def __str__(self) -> str:
        return self.text


@dataclasses.dataclass
class Block:
    """One attention block of a graph: its core node, the config and weights read from it, the graph's
    tensors at its boundary (role -> value name), and what the reading found on the way (its terms' Reading, the
    cache's layout, the masks' tensors)."""

    index: int
    node: str
    core: str
    config: AttentionConfig | None = None
    weights: dict[str, np.ndarray] | None = None
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # x, seqlens_k, total_sequence_length, past_*
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # y, present_key, present_value
    reading: Reading = dataclasses.field(default_factory=Reading)  # what was read of its terms beside the config
    quantization: dict[str, Any] | None = None  # MatMulNBits: bits, block_size, accuracy_level
    unread: Unread | None = None  # why the block was not read into a config
    dtype: str = "fp32"  # what the block computes in: its hidden state's type
    mask: str | None = None  # the tensor of the core's mask input (an additive bias or a key padding mask), if any
    weight_dtype: str = "float32"  # how the graph stores the projections' weights (numpy's name)
    y_bias: np.ndarray | None = None  # the output projection's bias where a fused op after the block adds it
    padding: str = "left"  # how a padded batch is fed: "left" (transformers'), "right" (seqlens_k, a mask_index)
    masks: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (tensor, how it masks), decomposed cores
    # the formula's stages (attnx.model.stages) the graph holds as tensors: stage -> (tensor, its columns or None)
    stages: dict[str, tuple[str, tuple[int, int] | None]] = dataclasses.field(default_factory=dict)
    # (heads, size) of the key cache and of the value cache where they are not n_kv_heads of head_dim and of
    # v_head_dim (MLA's latent parts: cache_sizes(), attnx.workflows.audit.run)
    cache_sizes: tuple[tuple[int, int], tuple[int, int]] | None = None
    ring_cache: bool = False  # the past keeps the window alone, a ring buffer (GroupQueryAttention's sliding_window_cache)
    cache_capacity: int = 0  # the positions its past holds before the first token: a ring's window, else none
    rows_per_token: int = 1  # the grouped core: its mask has a row per query head of a group
    # the length inputs (seqlens_k, ...) the audit computes in the block's cut from the graph inputs, not fed
    computed_inputs: list[str] = dataclasses.field(default_factory=list)
    # a cache the graph keeps as several tensors that one core's cache joins (CacheSpec.parts): part -> (past input,
    # present output); per-head keys and values are inputs["past_key"] and outputs["present_key"] and the like
    cache_parts: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # each quantized projection a core that writes its own projections takes as it is (the latent's): its weight's
    # name -> the MatMulNBits's inputs after x (the graph's tensors, by name) and attributes (nbits_of)
    nbits: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "core": self.core,
                "config": self.config.to_dict() if self.config is not None else None, "inputs": self.inputs,
                "outputs": self.outputs, "reading": self.reading.to_dict(), "quantization": self.quantization,
                "unread": None if self.unread is None else str(self.unread), "dtype": self.dtype, "mask": self.mask,
                "cache": {"sizes": self.cache_sizes, "ring": self.ring_cache, "capacity": self.cache_capacity},
                "rows_per_token": self.rows_per_token, "computed_inputs": self.computed_inputs}  # fmt: skip


def quantization(node: ir.Node) -> dict[str, Any] | None:
    if not is_op(node, "MatMulNBits", (MS_DOMAIN,)):
        return None
    a = node.attributes
    zero_points = len(node.inputs) > 3 and node.inputs[3] is not None
    return {"op": "MatMulNBits", "bits": a.get_int("bits", 4), "block_size": a.get_int("block_size", 32),
            "accuracy_level": a.get_int("accuracy_level", 0), "zero_points": zero_points}  # fmt: skip


# the If a branch graph belongs to, in the branch's meta (mark_branches: onnx-ir's graphs know no parent)
IF_OF_BRANCH = "attnx.if_of_branch"


def mark_branches(node: ir.Node) -> list[ir.Graph]:
    """An If's branch graphs, each marked as `node`'s (IF_OF_BRANCH); [] for any other node."""
    if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
        return []
    graphs = [a.value for a in node.attributes.values() if a.type == ir.AttributeType.GRAPH]
    for graph in graphs:
        graph.meta[IF_OF_BRANCH] = node
    return graphs


def out_of_branch(value: ir.Value) -> ir.Value:
    """Where `value`, an output of an If's branch (marked: mark_branches), leaves it: the If's output of its index
    (attnx's latent step, an If between its prompt's and its step's heads); `value` itself otherwise."""
    node = value.producer()
    graph = node.graph if node is not None else None
    owner = graph.meta.get(IF_OF_BRANCH) if graph is not None else None
    if owner is None or value not in graph.outputs:
        return value
    return owner.outputs[list(graph.outputs).index(value)]


def nbits_of(node: ir.Node) -> dict[str, Any] | None:
    """A MatMulNBits projection as a core may write it again: its inputs after x by name (None: absent) and its
    attributes; None for any other node."""
    if not is_op(node, "MatMulNBits", (MS_DOMAIN,)):
        return None
    return {"inputs": [v.name if v is not None else None for v in node.inputs[1:]],
            "attributes": {name: attr.value for name, attr in node.attributes.items()}}  # fmt: skip


def output_projection(out: ir.Value, weights: dict[str, np.ndarray], block: Block) -> ir.Value:
    """The MatMul (with its bias Add) reading a core's output, through the Reshape/Transpose that merge the
    heads: its weights into `weights` (out_proj.*); returns the block's output value."""
    value = out_of_branch(out)
    while (users := [u for u, _ in value.uses()]) and len(users) == 1 and users[0].domain in ("", "ai.onnx") and (
        users[0].op_type in ("Reshape", "Transpose")
        or (users[0].op_type == "Where" and users[0].inputs[1] is value and const_array(users[0].inputs[2]) is not None)
    ):  # the heads merged; a row no key may see set to a constant; an If's branch left by its output
        value = out_of_branch(users[0].outputs[0])
    o_node = next((u for u in users if is_op(u, "MatMul") or is_op(u, "MatMulNBits", (MS_DOMAIN,))
                   or flat_gemm(u) is not None), None)  # fmt: skip
    if o_node is None:
        raise NotRead(f"{out.name}: no output projection reads it (used by {', '.join(u.op_type for u in users)})")
    y = o_node.outputs[0]
    if is_op(o_node, "Gemm") and len(shaped := [u for u, _ in y.uses()]) == 1 and is_op(shaped[0], "Reshape"):
        y = shaped[0].outputs[0]  # torch's addmm: the tokens shaped back
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
    block.stages.update(z=(flattened_input(o_node).name, None), y=(y.name, None))
    weights["out_proj.weight"] = o_proj[0].T
    weights["out_proj.bias"] = o_proj[1] if o_proj[1] is not None else np.zeros(o_proj[0].shape[1])
    return y


_DTYPES = {ir.DataType.FLOAT: "fp32", ir.DataType.FLOAT16: "fp16", ir.DataType.BFLOAT16: "bf16"}


def dtype_of(value: ir.Value) -> str:
    """The tolerance table's name of a hidden state's type (fp32 where the graph does not say)."""
    return _DTYPES.get(value.dtype, "fp32") if value.dtype is not None else "fp32"


def path_stages(block: Block, paths: dict[str, Path], biased_apart: bool = False) -> None:
    """The projection (q, k, v) and rotation (q_rope, k_rope) stages met on the paths to a core; not the projections
    when the core adds their bias itself (biased_apart)."""
    for role, path in paths.items():
        if not biased_apart:
            block.stages[role] = (path.projection.name, None)
        if isinstance(path.rotary, ir.Node):
            block.stages[f"{role}_rope"] = (path.rotary.outputs[0].name, None)


def path_cache(block: Block, paths: dict[str, Path]) -> None:
    """The cache met on k's and v's paths (present = Concat(past, new)) as the block's past/present; one alone is not
    read."""
    for role, kv in (("key", "k"), ("value", "v")):
        if (paths[kv].past is None) != (paths["k"].past is None):
            raise NotRead("a cache on the key or the value alone")
        if paths[kv].past is not None:
            block.inputs[f"past_{role}"], block.outputs[f"present_{role}"] = paths[kv].past.name, paths[kv].present.name


def hidden_state(block: Block, proj_node: ir.Node) -> None:
    """The block's input (the q projection's), its dtype, and the projection's quantization."""
    block.quantization = quantization(proj_node)
    x = flattened_input(proj_node)
    block.inputs["x"] = x.name
    block.dtype = dtype_of(x)


def keep(block: Block, config: AttentionConfig, weights: dict[str, np.ndarray], keep_weights: bool) -> Block:
    """The block with its config and weights: copies, never views of the graph's memory-mapped tensors (iter_blocks
    releases them after each block); without keep_weights none is copied, so none of their pages is read. A rope
    that no theta fits is said (Block.unread)."""
    block.config = config
    block.weight_dtype = np.asarray(weights["out_proj.weight"]).dtype.name  # (a latent block has no q_proj)
    block.weights = {k: np.array(v, np.float32, order="C") for k, v in weights.items()} if keep_weights else None
    fit = block.reading.rope.fit
    if config.rope is None and fit is not None and fit.unread is not None:
        block.unread = Unread(f"rope {fit.unread}", UnreadKind.UNFIT_TABLE, "rope")
    return block


def rotary_tables(node: ir.Node) -> tuple[ir.Value, ir.Value, bool, str | None]:
    """(cos, sin, interleaved, position input's name) of a RotaryEmbedding node: com.microsoft's (x, position_ids,
    cos, sin) or ONNX's (x, cos, sin, position_ids); cos/sin constant caches, or tensors the graph computes."""
    ms = node.domain == MS_DOMAIN
    cos, sin = (node.inputs[2], node.inputs[3]) if ms else (node.inputs[1], node.inputs[2])
    positions = node.inputs[1] if ms else (node.inputs[3] if len(node.inputs) > 3 else None)
    interleaved = bool(node.attributes.get_int("interleaved", 0))
    return cos, sin, interleaved, positions.name if positions is not None and positions.is_graph_input() else None


def rotary_of(paths: dict[str, Path], block: Block) -> Rope | None:
    """The rope of the RotaryEmbedding nodes met on q's and k's way (one table for both), or None, read into the
    block's Reading.rope; tables the graph computes are named (RopeReading.tensors) for the audit to read by running
    them."""
    rope = None
    if (paths["q"].rotary is None) != (paths["k"].rotary is None):
        raise NotRead(f"a RotaryEmbedding on {'q' if paths['q'].rotary is not None else 'k'} alone")
    if paths["q"].rotary is not None:
        cos_v, sin_v, interleaved, positions = rotary_tables(paths["q"].rotary)
        k_cos_v, k_sin_v, k_interleaved, _ = rotary_tables(paths["k"].rotary)
        cos, sin, k_cos, k_sin = (const_array(v) for v in (cos_v, sin_v, k_cos_v, k_sin_v))
        computed = any(a is None for a in (cos, sin, k_cos, k_sin))
        same = (cos_v is k_cos_v and sin_v is k_sin_v) or (not computed and np.array_equal(cos, k_cos)
                                                           and np.array_equal(sin, k_sin))  # fmt: skip
        if (not same and not computed) or interleaved != k_interleaved:
            raise NotRead("q and k rotated by different tables")
        if computed:  # tables the graph computes (from position_ids): the audit reads them by running them
            block.reading.rope = RopeReading(
                interleaved=interleaved, tensors=(cos_v.name, sin_v.name),
                k_tensors=None if same else (k_cos_v.name, k_sin_v.name),  # computed apart: the audit holds k's to q's
            )  # fmt: skip
        else:
            rope, fit = rope_of_table(cos, sin, interleaved)
            # copies: the graph's tensors are released
            block.reading.rope = RopeReading(tables=(np.array(cos), np.array(sin)), interleaved=interleaved, fit=fit)
        if positions is not None:
            block.inputs["position_ids"] = positions
    return rope


def read_separate(index: int, node: ir.Node, core: str, stated: Mapping[str, Any], qkv: list[ir.Value | None],
                   mask: ir.Value | None, keep_weights: bool, packed_bias: ir.Value | None = None,
                   own_cache: tuple[ir.Value, ...] | None = None, grouped_rows: bool = False,
                   z: ir.Value | None = None) -> Block:  # fmt: skip
    """A core taking query, key and value apart: each walked back to its projection through a RotaryEmbedding, a
    per-head norm, the cache's Concat(past, new) and the repeat of a GQA group; the mask tensor is named for the
    audit, which reads its terms by running it. stated: the config keys the node states (its core's CoreGraph.read:
    n_heads, causal, scale, its terms'). grouped_rows: the op's heads are the key/value heads and a group's query
    heads are rows of its query (the grouped core): the query's heads come from its projection's width, and the mask
    has a row per query head of a group (Block.rows_per_token). z: the value the output projection reads where it is
    not the op's own output (an If's, around the op's branch)."""
    block = Block(index, node.name or node.op_type, core)
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
    path_stages(block, paths, biased_apart=packed_bias is not None)
    if packed_bias is not None:  # the op's [Dq | Dk | Dv] bias, added after the projections
        ends = np.cumsum([0] + [weights[f"{r}_proj.weight"].shape[0] for r in "qkv"])
        for role, a, e in zip("qkv", ends[:-1], ends[1:]):
            weights[f"{role}_proj.bias"] = weights[f"{role}_proj.bias"] + packed_bias[a:e]
    n_heads = stated["n_heads"]
    if grouped_rows:  # the op's heads are the key/value heads: each holds q's width / k's width query heads
        group = weights["q_proj.weight"].shape[0] // weights["k_proj.weight"].shape[0]
        n_heads = n_heads * group
        block.rows_per_token = group
    if n_heads is None:  # a 4D query [batch, heads, tokens, head_dim]: the op's attributes do not say
        shape = qkv[0].shape
        if shape is None or len(shape) != 4 or not isinstance(shape[1], int):
            raise NotRead(f"query {qkv[0].name}: its heads are neither an attribute nor a static dimension")
        n_heads = shape[1]
    hd = weights["q_proj.weight"].shape[0] // n_heads
    n_kv = weights["k_proj.weight"].shape[0] // hd
    proj_node = projection_node(paths["q"].projection)
    hidden_state(block, proj_node)
    path_terms = read_paths(paths, weights, block.reading)  # the terms met on q's and k's paths (the norms)
    block.outputs["y"] = output_projection(node.outputs[0] if z is None else z, weights, block).name
    if own_cache is not None:
        if paths["k"].past is not None:
            raise NotRead("a cache both in the op and before it")
        past_k, past_v, present_k, present_v = own_cache
        block.inputs.update(past_key=past_k.name, past_value=past_v.name)
        block.outputs.update(present_key=present_k.name, present_value=present_v.name)
    path_cache(block, paths)
    rope = rotary_of(paths, block)
    block.mask = mask.name if mask is not None else None
    config = AttentionConfig(
        d_model=weights["q_proj.weight"].shape[1], n_heads=n_heads, head_dim=hd, n_kv_heads=n_kv, bias=True,
        causal=stated["causal"], scale=stated.get("scale") or 1.0 / math.sqrt(hd), rope=rope,
        **path_terms, **stated_terms(stated),
    )  # fmt: skip
    return keep(block, config, weights, keep_weights)
