"""A tiny ONNX graph builder shared by the hand-built graphs (the step model, the modern-LLM
full-sequence forms): nodes, initializers, unique names, and the formula's names (docs/reference/onnx-graph.md, "Names"):
the builder names the stages, weights and constants as it makes them (Graph.stage, linear) and
named() gives every node and intermediate the name of the stage it leads to, as NameStages does
for the exporter's graphs (attnx.export.passes._names.name_graph, the one scheme)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from attnx.export.passes._names import name_graph, stages_json
from attnx.model.contract import all_nodes
from attnx.model.stages import STAGES_KEY

__all__ = ["Graph", "call_seq", "call_tokens", "heads", "linear", "named", "span", "token_indices"]


class Graph:
    """Nodes, initializers and unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0
        self.stages: dict[str, str] = {}  # {stage: layout} of the stages the graph names
        # the inputs whose axis 1 states the call's token count and every key's count (total_from: None, the cache's
        # length + the tokens): the model's own inputs where it has them (position_ids, the padding mask), which a
        # whole model's blocks share, so that what is computed from the lengths is computed once for the model
        # (attnx.export.passes.share); x and past_key are one block's own
        self.seq_from = "x"
        self.total_from: str | None = None
        self.cache_from = "past_key"  # the cache input whose axis 2 is its length (the config's first cache_specs)

    def stage(self, name: str, layout: str = "b t (h d)") -> str:
        """`name`, recorded as a stage the graph holds in `layout` (attnx.model.stages): for the
        name= of the op that computes it."""
        self.stages[name] = layout
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", name: str | None = None,
           **attrs) -> str | list[str]:  # fmt: skip
        self.n += 1
        outs = [name] if name and outputs == 1 else [f"{op_type.lower()}_{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self.n}", domain=domain,
                                           **attrs))  # fmt: skip
        return outs[0] if outputs == 1 else outs

    def const(self, name: str, value: np.ndarray) -> str:
        if any(t.name == name for t in self.inits):  # one initializer per name
            return name
        self.inits.append(helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape,
                                             value.tobytes(), raw=True))  # fmt: skip
        return name

    def ints(self, name: str, values: list[int]) -> str:
        return self.const(name, np.asarray(values, dtype=np.int64))


def linear(g: Graph, x: str, weights: Mapping[str, np.ndarray], name: str, bias: bool, out: str | None = None) -> str:
    """x @ W^T (+ b) for the torch-convention weights `name`.weight/.bias, W^T stored as
    `name`.weight.T; out names the result."""
    w = g.const(f"{name}.weight.T", np.ascontiguousarray(np.asarray(weights[f"{name}.weight"], np.float32).T))
    y = g.op("MatMul", x, w, name=None if bias else out)
    if bias:
        y = g.op("Add", y, g.const(f"{name}.bias", np.asarray(weights[f"{name}.bias"], np.float32)), name=out)
    return y


def heads(g: Graph, x: str, n: int, d: int, label: str) -> str:
    """[B, S, n*d] -> [B, n, S, d]."""
    return g.op("Transpose", g.op("Reshape", x, g.ints(f"{label}_shape", [0, 0, n, int(d)])), perm=[0, 2, 1, 3])


def named(model: onnx.ModelProto, g: Graph, readable: bool = True) -> onnx.ModelProto:
    """`model`, built by `g`, with every node and intermediate named after the stage it leads to and
    its metadata's STAGES_KEY (name_graph); the stages, weights and constants keep the names `g`
    gave them. The names are written back into the proto: its tensors are not copied. readable=False:
    STAGES_KEY alone (the stages are named already), for a graph no person reads (localisation's look
    inside: the renaming is most of its build time)."""
    if not readable:
        produced = {out for node in model.graph.node for out in node.output}
        layouts = {s: layout for s, layout in g.stages.items() if s in produced}
        model.metadata_props.add(key=STAGES_KEY, value=stages_json(layouts, [o.name for o in model.graph.output]))
        return model
    irm = ir.from_proto(model)
    values = {v.name: v for n in irm.graph for v in n.outputs}
    values.update(irm.graph.initializers)
    stages = {s: (values[s], layout) for s, layout in g.stages.items() if s in values}
    projections = {n: n.inputs[1].name.removesuffix("_proj.weight.T") for n in irm.graph
                   if n.op_type == "MatMul" and n.inputs[1] is not None and n.inputs[1].name.endswith("_proj.weight.T")}  # fmt: skip
    before = [list(proto.output) for proto in model.graph.node]
    name_graph(irm, stages, projections, {v: v.name for v in irm.graph.initializers.values()})
    renamed = {}
    for proto, node, old in zip(model.graph.node, irm.graph, before):
        proto.name = node.name
        proto.input[:] = [v.name if v is not None else "" for v in node.inputs]
        proto.output[:] = [v.name for v in node.outputs]
        renamed.update((a, b) for a, b in zip(old, proto.output) if a != b)
    if renamed:  # a subgraph (an If's branch) reads main-graph values by name: the new names
        _rename_subgraph_inputs(model.graph, renamed)
    del model.metadata_props[:]
    for key, value in irm.metadata_props.items():
        model.metadata_props.add(key=key, value=value)
    return model


def _rename_subgraph_inputs(graph: onnx.GraphProto, renamed: Mapping[str, str]) -> None:
    """The inputs of every node in `graph`'s subgraphs (If, Loop, Scan bodies, at any depth: all_nodes)
    that name an outer value in `renamed`, given its new name. The main graph's own nodes are named
    already (an old name there may be another value's new one)."""
    # each subgraph found from the main graph's nodes, not by id(): a protobuf message's Python wrapper is made
    # afresh at each access, so the ids of the main graph's nodes may come back as a subgraph node's
    for node in graph.node:
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subgraphs:
                for inner in all_nodes(sub):
                    inner.input[:] = [renamed.get(i, i) for i in inner.input]


def call_tokens(g: Any) -> str:
    """[1] int64: the call's token count (axis 1 of Graph.seq_from)."""
    return g.op("Shape", g.seq_from, start=1, end=2)


def call_seq(g: Any) -> str:
    """The call's token count as an int64 scalar."""
    return g.op("Squeeze", call_tokens(g), g.ints("axis0b", [0]))


def span(g: Any, step: bool) -> tuple[str, str]:
    """(past_seq, T) as int64 scalars: the cache's length and every key's count (past_seq 0 and T the call's length
    without a cache); T from Graph.total_from where it states it (the padding mask over every key: past_seq = T - S),
    else the cache's length + S."""
    seq = call_seq(g)  # scalar S
    if not step:
        return g.const("zero_i64", np.asarray(0, np.int64)), seq
    if g.total_from is not None:
        total = g.op("Squeeze", g.op("Shape", g.total_from, start=1, end=2), g.ints("axis0b", [0]))
        return g.op("Sub", total, seq), total
    past = g.op("Squeeze", g.op("Shape", g.cache_from, start=2, end=3), g.ints("axis0", [0]))
    return past, g.op("Add", past, seq)


def token_indices(g: Any, past: str, total: str, rank: int = 2) -> tuple[str, str]:
    """(qcol [S, 1], krow [1, T]) int64: the token indices of this call's queries (past_seq + i) and of every key;
    rank 4: [1, 1, S, 1] and [1, 1, 1, T]."""
    one = g.const("one_i64", np.asarray(1, np.int64))
    qpos = g.op("Range", past, total, one)  # [S]
    kpos = g.op("Range", g.const("zero_i64", np.asarray(0, np.int64)), total, one)  # [T]
    if rank == 4:
        return g.op("Unsqueeze", qpos, g.ints("axes_013", [0, 1, 3])), g.op("Unsqueeze", kpos, g.ints("axes_012",
                                                                                                        [0, 1, 2]))
    return g.op("Unsqueeze", qpos, g.ints("axes_1", [1])), g.op("Unsqueeze", kpos, g.ints("axes_0", [0]))
