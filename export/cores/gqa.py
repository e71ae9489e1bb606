"""com.microsoft.GroupQueryAttention: the full-sequence and growing forms, and the buffer form on one shared cache."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from attnx.errors import UsageError
from attnx.export._graph import call_tokens, span
from attnx.export._llm import norm_and_rotate, rope_table
from attnx.export.cores._block import Block, hidden_state, keep, output_projection, path_stages, rotary_of
from attnx.export.cores._emit import Emit, packed_projection
from attnx.export.cores._registry import CoreGraph, float_attr, int_attr, present, register
from attnx.export.passes._base import const_array
from attnx.export.passes.walk import NotRead, Path, projection, projection_node, strip_layout, walk
from attnx.export.terms import (
    GRAPH_TERMS,
    MaskReading,
    RopeReading,
    read_attributes,
    read_inputs,
    read_paths,
    stated_terms,
    term_attributes,
    term_inputs,
)
from attnx.export.visibility import hidden_by, score_bias, visibility
from attnx.model.config import AttentionConfig
from attnx.model.contract import DEFAULT_ROPE_POSITIONS, MS_DOMAIN, ROPE_POSITIONS_KEY
from attnx.model.rope_fit import rope_of_table
from attnx.model.terms import terms_at


def _gqa_attrs(c: AttentionConfig) -> dict[str, object]:
    """GroupQueryAttention's attributes for `c`: heads, scale, and the modern-LLM terms it runs itself (their
    entries' attributes: the window as local_window_size, the softcap)."""
    attrs: dict[str, object] = {"num_heads": c.n_heads, "kv_num_heads": c.n_kv_heads, "scale": c.softmax_scale}
    if not c.causal:
        attrs["causal"] = 0
    return {**attrs, **term_attributes(c, "gqa")}  # the terms it states by attributes (attnx.export.terms)


def _gqa(e: Emit) -> str:
    """com.microsoft.GroupQueryAttention: kv_num_heads, softcap, local_window_size and head_sink as its
    own; q/k norms and rope as their own nodes (the op's rotation, do_rotary, reads only position_ids[0, 0]
    of a prompt for every row (measured on a left-padded batch: measurements/facts.md), so it cannot take Hugging
    Face's per-row positions). seqlens_k says every row is as long as the cache: left padding is an
    additive attention_bias (the op adds it after its softcap: measured), so the op's token index is
    attnx's, and so is its window. The buffer form: _gqa_buffer."""
    if e.form == "buffer":
        return _gqa_buffer(e)
    e.ms()
    q, k, v = e.projections()
    q, k = e.scored(q, k)
    return gqa_attend(e, q, k, v)


def gqa_attend(e: Emit, q: str, k: str, v: str) -> str:
    """The full-sequence and growing forms' attention over q, k and v as projected and scored (_gqa): z."""
    c, g = e.c, e.g
    seq, batch = call_tokens(g), g.op("Shape", "x", start=0, end=1)  # [1]
    _, total = span(g, e.step)  # int64 scalar: every key's count
    total32 = g.op("Cast", total, to=TensorProto.INT32)
    seqlens = g.op("Expand", g.op("Sub", total32, g.const("one_i32_1", np.asarray([1], np.int32))), batch)  # [B]
    inputs = [q, k, v, "past_key" if e.step else "", "past_value" if e.step else "", seqlens, total32, "", "", "", "", ""]
    # an additive bias [B, 1, S, T], lowest where a key is padding or hidden by a mask term the op has no attribute
    # for (chunks: each entry's hides)
    grid = [t for t in terms_at(c, "mask") if t in GRAPH_TERMS and GRAPH_TERMS[t].hides is not None and t != "causal"
            and "gqa" not in GRAPH_TERMS[t].attributes]  # fmt: skip
    hidden = hidden_by(g, c, grid, e.kpm, e.step)  # [B|1, 1, S, T]
    if e.kpm:
        padded = g.op("Unsqueeze", e.kpm, g.ints("axes_12", [1, 2]))  # [B, 1, 1, T]
        hidden = padded if hidden is None else g.op("Or", hidden, padded)
    if hidden is not None:
        bias = g.op("Where", hidden, e.lowest(), e.zero())
        rows = g.op("Concat", batch, g.ints("one1", [1]), seq, g.op("Unsqueeze", total, g.ints("axis0", [0])), axis=0)
        inputs[10] = g.op("Expand", bias, rows)
    bias = score_bias(g, c, e.step)  # the terms' bias [1, H, S, T] in the same input (added after its softcap)
    if bias is not None:
        inputs[10] = g.op("Add", inputs[10], bias) if inputs[10] else bias
    for slot, value in term_inputs(g, c, e.weights, "gqa").items():  # the terms it takes as inputs (head_sink)
        inputs[slot] = value
    while inputs[-1] == "":
        inputs.pop()
    z = g.op("GroupQueryAttention", *inputs, outputs=3, domain=MS_DOMAIN, **_gqa_attrs(c))[0]
    gqa = g.nodes[-1]
    if e.step:
        gqa.output[1:] = ["present_key", "present_value"]
    if e.kpm:
        return e.zero_hidden(z, visibility(g, c, e.kpm, e.step)[1])
    gqa.output[0] = g.stage("z")
    return "z"


def _gqa_buffer(e: Emit, qkv: str | None = None) -> str:
    """z of the buffer form by GroupQueryAttention on the shared cache (seqlens_k: it writes the new
    keys/values at their positions, in place), rotating q and k itself (do_rotary) from a table of
    `rope_positions` rows (recorded in the metadata), each token at its token index: the buffer form has
    no padding, so that is its position. A position past the table is the op's error, never a number."""
    c, g = e.c, e.g
    e.ms()
    apart = qkv is None and e.bound == "separate"  # the model's own q, k, v: taken apart, as bound
    qkv = qkv or (None if apart else packed_projection(e))
    qkv_inputs = ["q", "k", "v"] if apart else [qkv, "", ""]
    if set(terms_at(c, "qk")) - {"rope"}:  # a term on q and k besides the op's own rotation (do_rotary), the
        # norms: they need q and k apart, so the packed projection is split
        q, k, v = qkv_inputs if apart else e.packed_projections(qkv)
        # rope=None: the op itself rotates (do_rotary)
        q, k = norm_and_rotate(g, dataclasses.replace(c, rope=None), e.weights, q, k, e.core.term_ops)
        qkv_inputs = [q, k, v]
    inputs = [*qkv_inputs, "past_key", "past_value", "seqlens_k", "total_sequence_length", "", "", "", "", ""]
    attrs = _gqa_attrs(c)
    if c.rope is not None:
        positions = DEFAULT_ROPE_POSITIONS if e.rope_positions is None else e.rope_positions
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
            raise UsageError(f"rope_positions must be a positive integer, got {positions!r}")
        cos, sin = rope_table(c, positions)
        inputs[7], inputs[8] = g.const("rope_cos_cache", cos), g.const("rope_sin_cache", sin)
        attrs.update(do_rotary=1, rotary_interleaved=int(c.rope.interleaved))
        if (ROPE_POSITIONS_KEY, str(positions)) not in e.metadata:
            e.metadata.append((ROPE_POSITIONS_KEY, str(positions)))
    if e.ring_cache:  # the past keeps the window alone (a ring buffer), as the cache it is bound to
        attrs["sliding_window_cache"] = 1
    for slot, value in term_inputs(g, c, e.weights, "gqa").items():
        inputs[slot] = value
    while inputs[-1] == "":
        inputs.pop()
    g.op("GroupQueryAttention", *inputs, outputs=3, domain=MS_DOMAIN, **attrs)
    g.nodes[-1].output[:] = [z := g.stage("z"), "present_key", "present_value"]
    return z


def _read_gqa(node: ir.Node) -> dict[str, Any]:
    """The config keys a GroupQueryAttention node states (its rotary is read with its block: _read_gqa_block)."""
    return {"n_heads": int_attr(node, "num_heads"), "n_kv_heads": int_attr(node, "kv_num_heads"),
            "scale": float_attr(node, "scale") or None, "causal": bool(int_attr(node, "causal", 1)),
            **read_attributes(node, "gqa"), **read_inputs(node, "gqa")[0], "kv_cache": present(node, 3)}  # fmt: skip


def _read_gqa_block(index: int, node: ir.Node, keep_weights: bool = True) -> Block:
    stated = _read_gqa(node)
    block = Block(index, node.name or node.op_type, "gqa")
    n_heads, n_kv = stated["n_heads"], stated["n_kv_heads"]
    inputs = list(node.inputs) + [None] * (12 - len(node.inputs))
    weights: dict[str, np.ndarray] = {}
    paths: dict[str, Path] = {}
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
        path_stages(block, paths)
        proj_node = projection_node(paths["q"].projection)
    hidden_state(block, proj_node)
    block.outputs = {"y": output_projection(node.outputs[0], weights, block).name, "present_key": node.outputs[1].name,
                     "present_value": node.outputs[2].name}  # fmt: skip
    for role, i in (("past_key", 3), ("past_value", 4), ("seqlens_k", 5), ("total_sequence_length", 6)):
        if inputs[i] is not None:
            block.inputs[role] = inputs[i].name
    block.padding = "right"  # a row's length in seqlens_k: its keys past it are padding
    if inputs[10] is not None:  # an attention bias (a key padding mask, as attnx writes it): read by the audit
        block.mask = inputs[10].name
    rope = None
    if int_attr(node, "do_rotary", 0):
        cos, sin = const_array(inputs[7]), const_array(inputs[8])
        interleaved = bool(int_attr(node, "rotary_interleaved", 0))
        # the op's own cos/sin caches (attnx optimize binds them)
        caches = (inputs[7].name, inputs[8].name) if inputs[7] is not None and inputs[8] is not None else None
        if cos is None or sin is None:  # caches the graph computes (the builder's longrope: an If on the length)
            if caches is None:
                raise NotRead("do_rotary without cos/sin caches")
            block.reading.rope = RopeReading(interleaved=interleaved, tensors=caches, caches=caches)
        else:
            rope, fit = rope_of_table(cos, sin, interleaved)
            # copies: the graph's tensors are released
            block.reading.rope = RopeReading(tables=(np.array(cos), np.array(sin)), interleaved=interleaved, fit=fit,
                                             caches=caches)  # fmt: skip
    elif paths:  # a RotaryEmbedding of its own before the core (as attnx writes it)
        rope = rotary_of(paths, block)
    input_terms, term_weights = read_inputs(node, "gqa")  # the terms it takes as inputs (head_sink)
    weights.update(term_weights)
    window = node.attributes.get_int("local_window_size", -1)
    block.reading.mask = MaskReading(local_window_size=window)
    block.ring_cache = bool(node.attributes.get_int("sliding_window_cache", 0))
    # a window kept in a ring buffer: the past the op takes holds the window's keys, whatever the step
    block.cache_capacity = max(window, 0) if block.ring_cache else 0
    config = AttentionConfig(
        d_model=weights["q_proj.weight"].shape[1], n_heads=n_heads, head_dim=hd, n_kv_heads=n_kv,
        bias=True, causal=stated["causal"], scale=stated.get("scale") or 1.0 / math.sqrt(hd), rope=rope,
        **stated_terms(stated), **input_terms, **read_paths(paths, weights, block.reading),
    )  # fmt: skip
    return keep(block, config, weights, keep_weights)


register(CoreGraph("gqa", _gqa, _read_gqa, _read_gqa_block))
