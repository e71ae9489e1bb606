"""Reading a graph back: the core it holds, what each core's node says of the config, and its weights.

The other half of each core's entry (attnx.model.cores): its module in attnx.export.cores writes a node
(emit) and reads back (read) what that node implies of the config: heads, scale, the masks and
terms the node itself carries. read_cores() reads every core of a graph; read_weights() reads the
weights of a graph attnx wrote back into the weights file's contract (by the names every attnx graph
gives them: docs/reference/onnx-graph.md, "Names"), which is how `attnx optimize` writes another lowering of a model file.

lowering_of() names the form of the attention core a graph holds, from the graph itself, so the
metadata never claims a lowering that is not there. qk_weights() finds the q and k projections that
feed the core (in any of the forms attnx writes, quantized too) and returns them in the torch
convention of the weights file: the tolerance of a parity check depends on the largest attention
score (attnx.model.tolerance.problem_size).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.errors import UsageError
from attnx.export.cores import GRAPH_CORES, core_of_graph, core_of_node, seen
from attnx.export.passes._base import const_array
from attnx.export.passes.walk import (
    is_op,
    past_cache,
    projection,
    score_chain,
    strip_layout,
)
from attnx.model.config import AttentionConfig
from attnx.model.contract import MS_DOMAIN, lowering_from_nodes
from attnx.model.weights import weight_shapes

__all__ = ["CoreReading", "core_of", "lowering_of", "qk_weights", "read_cores", "read_weights",
           "v_weights"]

_STD = ("", "ai.onnx")


def lowering_of(model: ir.Model) -> str:
    """'ort-attention', 'ort-fused-packed', 'ort-fused', 'onnx' or 'decomposed': the contract's
    one probe (lowering_from_nodes), over this onnx-ir graph."""
    return lowering_from_nodes(seen(node) for node in model.graph)


def core_of(model: ir.Model) -> str:
    """The registry's core the graph holds (attnx.model.recognise.graph_core)."""
    return core_of_graph(model.graph)


def _core_qk(model: ir.Model) -> tuple[tuple, tuple] | None:
    """((Wq, bq), (Wk, bk)) of the first attention core found."""
    for node in model.graph:
        if is_op(node, "MultiHeadAttention", (MS_DOMAIN,)):
            q, k = projection(node.inputs[0]), projection(node.inputs[1])
            if q is None or k is None:
                return None
            bias = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
            if bias is not None:  # the op's packed bias: [Dq | Dk | Dv]
                dq = q[0].shape[1]
                q, k = (q[0], bias[:dq]), (k[0], bias[dq : 2 * dq])
            return q, k
        if is_op(node, "Attention", (MS_DOMAIN,)):
            packed = _packed_attention(node)
            return (packed[0], packed[1]) if packed is not None else None
        if is_op(node, "Attention"):
            q, k = projection(strip_layout(node.inputs[0])), projection(strip_layout(node.inputs[1]))
            return (q, k) if q is not None and k is not None else None
        if is_op(node, "Softmax"):
            scores = score_chain(node).qk
            if scores is None:
                return None
            q = projection(strip_layout(scores.inputs[0]))
            k = projection(strip_layout(past_cache(strip_layout(scores.inputs[1]))))
            return (q, k) if q is not None and k is not None else None
    return None


def _packed_attention(node: ir.Node) -> tuple[tuple, ...] | None:
    """((Wq, bq), (Wk, bk), (Wv, bv)) of com.microsoft Attention: one weight [in, Dq + Dk + Dv] and
    one bias, split by qkv_hidden_sizes (equal thirds when absent)."""
    w = const_array(node.inputs[1])
    b = const_array(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    if w is None:
        return None
    sizes = node.attributes.get_ints("qkv_hidden_sizes", None) or [w.shape[1] // 3] * 3
    ends = np.cumsum([0, *sizes])
    return tuple((w[:, a:e], b[a:e] if b is not None else None) for a, e in zip(ends[:-1], ends[1:]))


def qk_weights(model: ir.Model) -> dict[str, np.ndarray] | None:
    """The q and k projections feeding the attention core, as {"q_proj.weight" [out, in],
    "q_proj.bias", "k_proj.weight", "k_proj.bias"} (torch's Linear convention), or None
    when the graph is not one attnx recognises."""
    found = _core_qk(model)
    if found is None:
        return None
    out: dict[str, np.ndarray] = {}
    for name, (w, b) in zip(("q_proj", "k_proj"), found):
        out[f"{name}.weight"] = np.asarray(w, dtype=np.float32).T
        out[f"{name}.bias"] = np.asarray(b if b is not None else np.zeros(w.shape[1]), dtype=np.float32)
    return out


def v_weights(model: ir.Model) -> dict[str, np.ndarray] | None:
    """The v projection feeding the attention core ({"v_proj.weight" [out, in], "v_proj.bias"}),
    for a quantized form's error model (the attention output it quantizes); None when not found."""
    found = None
    for node in model.graph:
        if is_op(node, "MultiHeadAttention", (MS_DOMAIN,)) and len(node.inputs) > 2:
            found = projection(node.inputs[2])
            bias = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
            if found is not None and bias is not None:  # the op's packed bias: [Dq | Dk | Dv]
                found = (found[0], bias[bias.shape[0] - found[0].shape[1] :])
        elif is_op(node, "Attention", (MS_DOMAIN,)):
            packed = _packed_attention(node)
            found = packed[2] if packed is not None else None
        elif is_op(node, "Attention") and len(node.inputs) > 2:
            found = projection(strip_layout(node.inputs[2]))
        elif is_op(node, "Softmax"):
            pv = score_chain(node).pv
            found = projection(strip_layout(past_cache(pv.inputs[1]))) if pv is not None else None
        if found is not None:
            w, b = found
            return {"v_proj.weight": np.asarray(w, np.float32).T,
                    "v_proj.bias": np.asarray(b if b is not None else np.zeros(w.shape[1]), np.float32)}  # fmt: skip
    return None


# Reading each core's node: what it says of the config -------------------------------------------
@dataclasses.dataclass
class CoreReading:
    """One attention core found in a graph: its registry name, its node, and the config keys the node
    itself states (`stated`: its core's CoreGraph.read; the rest of a config, the projections' widths and weights, is
    read beside it)."""

    core: str
    node: str
    stated: dict[str, Any]


def read_cores(model: ir.Model) -> list[CoreReading]:
    """Every attention core of the graph (an If's branches included), in graph order, with what its
    node states (its GRAPH_CORES entry's read); the switch core's If is read as its two branches' cores. The graph's
    values are typed first where they are not (onnx's shape inference: a mask is read by its type)."""
    if any(v.type is None for node in model.graph for v in node.outputs):
        from onnx_ir.passes.common import ShapeInferencePass

        ShapeInferencePass()(model)
    out = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        name = core_of_node(node)
        if name is not None:
            out.append(CoreReading(name, node.name or node.op_type, GRAPH_CORES[name].read(node)))
    return out


# The weights of a graph attnx wrote, back in the weights file's contract ------------------------------
def read_weights(model: ir.Model, config: AttentionConfig) -> dict[str, np.ndarray]:
    """The weights of `config` read back from a float graph attnx wrote, by the names it gives them
    (docs/reference/onnx-graph.md, "Names": q_proj.weight.T [in, out], the packed qkv_proj.weight.T and qkv_proj.bias,
    q_norm.weight, sinks, ...), float32 in the torch convention. A tensor not found is a UsageError
    naming it (a quantized graph holds no float weights: optimize the float model it came from)."""
    values: dict[str, np.ndarray] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.inputs:
            if value is not None and value.name and value.name not in values:
                array = const_array(value)
                if array is not None:
                    values[value.name] = np.asarray(array, np.float32)
    c, out = config, {}
    sizes = {"q": c.q_dim, "k": c.kv_q_dim, "v": c.kv_v_dim}
    for name, shape in weight_shapes(c).items():
        role, _, kind = name.partition("_proj.")
        if kind == "weight" and f"{name}.T" in values:
            out[name] = values[f"{name}.T"].T
        elif kind == "bias" and name in values:
            out[name] = values[name]
        elif kind and role in sizes and f"qkv_proj.{kind}{'.T' if kind == 'weight' else ''}" in values:
            packed = values[f"qkv_proj.{kind}{'.T' if kind == 'weight' else ''}"]
            start = sum(sizes[r] for r in "qkv"[: "qkv".index(role)])
            part = packed[..., start : start + sizes[role]]
            out[name] = part.T if kind == "weight" else part
        elif not kind and name in values:
            out[name] = values[name].reshape(shape)
        if name not in out:
            raise UsageError(f"the graph holds no tensor for {name!r} (read by its name: a float graph written by attnx)")
        out[name] = np.ascontiguousarray(out[name], np.float32).reshape(shape)
    return out
