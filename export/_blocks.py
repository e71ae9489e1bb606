"""The attention blocks of a whole model another tool exported, read back into attnx's contract.

A block is one attention core (attnx.model.cores: read by CORE_READERS, attnx.export._read) with
what belongs to it: the q/k/v projections (packed or separate, with biases, float or MatMulNBits),
the q/k norms, the rotary tables, the output projection and the cache. read_blocks() reads each
into an AttentionConfig and the weights of the weights file's contract, and names the graph's own
tensors at the block's boundary (the hidden state in, the block's output and presents out), which
is where `attnx audit` cuts it out to run (attnx.workflows._audit). What is not read is said, with
the node and why, never skipped in silence (Block.unread, and Blocks.unread for cores not read).

Read today: com.microsoft GroupQueryAttention blocks, as ONNX Runtime GenAI's model builder writes
them (packed qkv MatMul or MatMulNBits, Split, q/k SimplifiedLayerNormalization, the op's own rotary
from cos/sin caches, window, softcap, head sinks). Other cores are named as not read yet.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export._read import CORE_READERS, _core_of_node, _is, _projection, _strip_layout
from attnx.export.passes._base import const_array
from attnx.model.config import AttentionConfig
from attnx.model.contract import MS_DOMAIN
from attnx.model.rope import Rope, rope_frequencies
from attnx.model.terms import QKNorm

__all__ = ["Block", "Blocks", "iter_blocks", "read_blocks", "fit_rope", "release_external", "rope_table_error"]


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

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "core": self.core,
                "config": self.config.to_dict() if self.config is not None else None, "inputs": self.inputs,
                "outputs": self.outputs, "facts": _jsonable(self.facts), "quantization": self.quantization,
                "unread": self.unread}  # fmt: skip


@dataclasses.dataclass
class Blocks:
    blocks: list[Block]
    unread: list[str]  # "node X: a Softmax not read as attention: ..."


def _jsonable(facts: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)) for k, v in facts.items()}


class NotRead(Exception):
    """A block's structure that the reader does not follow; the message says what and where."""


def _projection_node(value: ir.Value) -> ir.Node:
    """The MatMul (or MatMulNBits) of a projection's output, through a bias Add and a Split."""
    node = value.producer()
    if _is(node, "Add"):
        node = next((i.producer() for i in node.inputs if i is not None and const_array(i) is None), None)
    if _is(node, "Split"):
        return _projection_node(node.inputs[0])
    if _is(node, "MatMul") or _is(node, "MatMulNBits", (MS_DOMAIN,)):
        return node
    raise NotRead(f"{value.name}: not a projection (MatMul, MatMulNBits, with a bias Add or a Split), "
                  f"made by {node.op_type if node is not None else 'a graph input'}")  # fmt: skip


def _quantization(node: ir.Node) -> dict[str, Any] | None:
    if not _is(node, "MatMulNBits", (MS_DOMAIN,)):
        return None
    a = node.attributes
    zero_points = len(node.inputs) > 3 and node.inputs[3] is not None
    return {"op": "MatMulNBits", "bits": a.get_int("bits", 4), "block_size": a.get_int("block_size", 32),
            "accuracy_level": a.get_int("accuracy_level", 0), "zero_points": zero_points}  # fmt: skip


def _norm(value: ir.Value) -> tuple[ir.Value, np.ndarray | None, float | None]:
    """(the value before it, weight, eps) for a per-head RMSNorm (SimplifiedLayerNormalization between
    Reshapes), else (value, None, None)."""
    inner = _strip_layout(value)
    node = inner.producer()
    if _is(node, "SimplifiedLayerNormalization") or _is(node, "SimplifiedLayerNormalization", (MS_DOMAIN,)) or _is(
        node, "RMSNormalization"
    ):
        weight = const_array(node.inputs[1])
        eps = node.attributes.get_float("epsilon", 1e-5)
        return _strip_layout(node.inputs[0]), weight, eps
    return value, None, None


# A rotary table against the exact cos/sin of its frequencies: float32 storage (ROPE_TABLE_ATOL) plus the
# float32 arithmetic a builder computes the angles with (inv_freq rounded, then position * inv_freq rounded:
# a few ulps of the angle, growing with the position: ROPE_ANGLE_RTOL of the angle). A theta or a scaling
# that moves a frequency by a relative 1e-6 or more exceeds it on the table's far rows.
ROPE_TABLE_ATOL, ROPE_ANGLE_RTOL = 1e-5, 8 * 2.0**-24


def rope_table_error(cos: np.ndarray, sin: np.ndarray, inv_freq: np.ndarray, factor: float = 1.0) -> tuple[float, float]:
    """(max |difference|, max difference / its bound) of a table cos/sin [positions, k] against
    factor * cos/sin(position * inv_freq[:k]) in float64: a ratio above 1 is a table of other frequencies."""
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    angles = np.arange(cos.shape[0], dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, : cos.shape[1]]
    diff = np.maximum(np.abs(np.cos(angles) * factor - cos), np.abs(np.sin(angles) * factor - sin))
    bound = abs(factor) * (ROPE_TABLE_ATOL + ROPE_ANGLE_RTOL * np.abs(angles))
    return float(diff.max()), float((diff / bound).max())


def fit_rope(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, float]:
    """The frequencies and attention factor of a rotary table cos/sin [positions, dim/2] (row p, column
    i: cos(p * inv_freq_i) * factor): read at position 1 (every frequency is below pi), then refined at the
    last row (its angle is p * inv_freq plus whole turns, which position 1's estimate tells apart), where
    the table's rounding is the smallest part of the angle."""
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    inv_freq = np.arctan2(sin[1], cos[1])
    last = cos.shape[0] - 1
    if last > 1:
        far = np.arctan2(sin[last], cos[last])
        turns = np.round((last * inv_freq - far) / (2 * np.pi))
        inv_freq = (far + 2 * np.pi * turns) / last
    return inv_freq, float(np.hypot(cos[1], sin[1]).mean())


def _fit_theta(inv_freq: np.ndarray, dim: int, last: int) -> float:
    """theta of inv_freq_i = theta^(-2i/dim), least squares in log space, each frequency weighted by how
    well the table states it (a frequency whose angle stays small over the table is known to fewer digits)."""
    x = np.arange(inv_freq.shape[0], dtype=np.float64) * 2 / dim
    angle = np.maximum(last, 1) * inv_freq
    w = (angle / (1 + angle)) ** 2
    return float(np.exp(-np.sum(w * x * np.log(inv_freq)) / np.sum(w * x * x)))


def _rope_of(cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> tuple[Rope | None, dict[str, Any]]:
    """A Rope(theta, dim) whose table matches the graph's (within rope_table_error's bound), with the fit's
    error; None (and why) when the table is not theta^(-2i/dim) for any theta (a scaled rope: read against
    a checkpoint's)."""
    inv_freq, factor = fit_rope(cos, sin)
    dim = 2 * inv_freq.shape[0]
    facts: dict[str, Any] = {"rope_positions": int(cos.shape[0]), "rope_dim": dim}
    if dim < 4 or np.any(inv_freq[1:] <= 0):
        return None, {**facts, "rope": "not read: fewer than 2 frequencies, or one not positive"}
    theta = _fit_theta(inv_freq, dim, cos.shape[0] - 1)
    rope = Rope(theta=theta, dim=dim, interleaved=interleaved)
    expected, _ = rope_frequencies(rope)
    error, ratio = rope_table_error(cos, sin, expected)
    facts.update(rope_theta=theta, rope_fit_error=error, rope_fit_bound_ratio=ratio, rope_factor=factor)
    if ratio > 1 or abs(factor - 1.0) > 1e-4:
        return None, {**facts, "rope": f"not read: the table is not theta^(-2i/{dim}) of any theta (max error "
                                       f"{error:.2g}, {ratio:.3g} times its bound; factor {factor:.4g}): a scaled "
                                       "rope"}  # fmt: skip
    return rope, facts


def _read_gqa_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    facts = CORE_READERS["gqa"](node)
    block = Block(index, node.name or node.op_type, "gqa", facts=facts)
    n_heads, n_kv = facts["n_heads"], facts["n_kv_heads"]
    inputs = list(node.inputs) + [None] * (12 - len(node.inputs))
    weights: dict[str, np.ndarray] = {}
    qk_norm = None
    if inputs[1] is None:  # packed: query holds q | k | v
        proj = _projection(inputs[0])
        if proj is None:
            raise NotRead(f"query {inputs[0].name}: not read as a packed qkv projection")
        w, b = proj
        hd = w.shape[1] // (n_heads + 2 * n_kv)
        parts = np.cumsum([0, n_heads * hd, n_kv * hd, n_kv * hd])
        proj_node = _projection_node(inputs[0])
        for role, a, e in zip("qkv", parts[:-1], parts[1:]):
            weights[f"{role}_proj.weight"] = w[:, a:e].T
            weights[f"{role}_proj.bias"] = b[a:e] if b is not None else np.zeros(e - a)
    else:
        norms = {}
        for role, value in zip("qkv", inputs[:3]):
            before, nw, eps = _norm(value) if role != "v" else (value, None, None)
            if nw is not None:
                norms[role] = (nw, eps)
            proj = _projection(before)
            if proj is None:
                maker = before.producer()
                raise NotRead(f"{'query key value'.split()['qkv'.index(role)]} {value.name}: made by "
                              f"{maker.op_type if maker is not None else 'a graph input'}, not read as a projection"
                              + (" (a rotary step of its own before the core: not read yet)"
                                 if maker is not None and maker.op_type == "RotaryEmbedding" else ""))  # fmt: skip
            w, b = proj
            weights[f"{role}_proj.weight"] = w.T
            weights[f"{role}_proj.bias"] = b if b is not None else np.zeros(w.shape[1])
        hd = weights["q_proj.weight"].shape[0] // n_heads
        proj_node = _projection_node(_norm(inputs[0])[0])
        if norms:
            if set(norms) != {"q", "k"}:
                raise NotRead(f"a norm on {' and '.join(sorted(norms))} alone")
            weights["q_norm.weight"], weights["k_norm.weight"] = norms["q"][0], norms["k"][0]
            qk_norm = QKNorm(eps=float(norms["q"][1]))
            facts["qk_norm_eps"] = [float(norms["q"][1]), float(norms["k"][1])]
    block.quantization = _quantization(proj_node)
    block.inputs["x"] = proj_node.inputs[0].name
    # the output projection: the MatMul reading the core's output, with its bias
    out = node.outputs[0]
    users = [u for u, _ in out.uses()]
    o_node = next((u for u in users if _is(u, "MatMul") or _is(u, "MatMulNBits", (MS_DOMAIN,))), None)
    if o_node is None:
        raise NotRead(f"{out.name}: no output projection reads it (used by {', '.join(u.op_type for u in users)})")
    y = o_node.outputs[0]
    o_proj = _projection(y)
    adds = [u for u, _ in y.uses() if _is(u, "Add") and any(const_array(i) is not None for i in u.inputs)]
    if adds:
        o_proj = _projection(adds[0].outputs[0])
        y = adds[0].outputs[0]
    if o_proj is None:
        raise NotRead(f"{o_node.name}: the output projection's weights are not constants")
    weights["out_proj.weight"] = o_proj[0].T
    weights["out_proj.bias"] = o_proj[1] if o_proj[1] is not None else np.zeros(o_proj[0].shape[1])
    block.outputs = {"y": y.name, "present_key": node.outputs[1].name, "present_value": node.outputs[2].name}
    for role, i in (("past_key", 3), ("past_value", 4), ("seqlens_k", 5), ("total_sequence_length", 6)):
        if inputs[i] is not None:
            block.inputs[role] = inputs[i].name
    rope = None
    if facts.pop("rope_interleaved", None) is not None:
        cos, sin = const_array(inputs[7]), const_array(inputs[8])
        if cos is None or sin is None:
            raise NotRead("do_rotary with cos/sin caches that are not constants")
        facts["rotary_interleaved"] = bool(node.attributes.get_int("rotary_interleaved", 0))
        rope, rope_facts = _rope_of(cos, sin, facts["rotary_interleaved"])
        facts.update(rope_facts)
        facts["rope_tables"] = (np.array(cos), np.array(sin))  # copies: the graph's tensors are released
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
        bias=True, causal=True, scale=facts.get("scale") or 1.0 / math.sqrt(hd), rope=rope,
        sliding_window=facts.get("sliding_window"), softcap=facts.get("softcap"), qk_norm=qk_norm,
        sinks=sinks is not None,
    )  # fmt: skip
    block.config = config
    # copies, never views of the graph's memory-mapped tensors (iter_blocks releases them after each block);
    # without keep_weights none is copied, so none of their pages is read
    block.weights = {k: np.array(v, np.float32, order="C") for k, v in weights.items()} if keep_weights else None
    if rope is None and "rope" in facts:
        block.unread = f"rope {facts['rope']}"
    return block


_BLOCK_READERS = {"gqa": _read_gqa_block}


def iter_blocks(model: ir.Model, unread: list[str], wanted: Callable[[int], bool] | None = None) -> Iterator[Block]:
    """Every attention block of the graph in graph order, read one at a time (its weights read from the
    graph's tensors as it is reached, and the tensors released when the next block is read: a model larger
    than memory is read a layer at a time), each where its core has a block reader; what is not read is
    appended to `unread` with the node and why. wanted(index) false: the block is read (its structure,
    config and index) without its weights (Block.weights None), whose bytes are then never read."""
    index = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        core = _core_of_node(node, "")
        if core is None:
            continue
        name = node.name or node.op_type
        reader = _BLOCK_READERS.get(core)
        if reader is None:
            unread.append(f"node {name}: a {node.op_type} ({core} core) not read as a block: attnx audit reads "
                          f"{', '.join(_BLOCK_READERS)} blocks in this version")  # fmt: skip
            continue
        try:
            block = reader(index, node, wanted is None or wanted(index))
        except NotRead as e:
            unread.append(f"node {name}: not read as attention: {e}")
            continue
        finally:
            release_external(model)
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
