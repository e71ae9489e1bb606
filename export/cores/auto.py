"""The buffer form's auto core: an If on the call's token count, grouped-mha for one token, gqa for more."""

from __future__ import annotations

from onnx import TensorProto, helper

from attnx.export.cores._emit import Emit, packed_projection
from attnx.export.cores._registry import CoreGraph, register
from attnx.export.cores.gqa import _gqa_buffer
from attnx.export.cores.grouped_mha import _grouped_mha


def _auto(e: Emit) -> str:
    """z of the buffer form's auto core: an If on the call's token count, the grouped core for one
    token, GroupQueryAttention's for more; the faster of the two for each on the CPU (docs/concepts/step-forms.md, "The buffer form"). Each branch writes the shared cache in place as its op does alone: ONNX Runtime
    hands the If's outputs, bound to the cache, to the branch's op. A branch's values carry its core's
    name (q/grouped-mha, ...), so that no name is made twice; the constants stay in the main graph,
    which both branches read."""
    g = e.g
    qkv = packed_projection(e)
    branches, main_stages = {}, set(g.stages)
    for core, build in (("grouped-mha", _grouped_mha), ("gqa", _gqa_buffer)):
        start = len(g.nodes)
        z = build(e, qkv)
        nodes, g.nodes[start:] = g.nodes[start:], []
        renamed = {out: f"{out}/{core}" for node in nodes for out in node.output if out}
        for node in nodes:
            node.input[:] = [renamed.get(i, i) for i in node.input]
            node.output[:] = [renamed.get(o, o) for o in node.output]
            node.name = f"{node.name}/{core}"
        outputs = [helper.make_tensor_value_info(renamed[v], TensorProto.FLOAT, None) for v in (z, "present_key", "present_value")]
        branches[core] = helper.make_graph(nodes, core, [], outputs)
    for name in set(g.stages) - main_stages:  # the branches' stages are not the main graph's
        del g.stages[name]
    tokens = g.op("Shape", "x", start=1, end=2)  # [1]: the call's token count
    one_token = g.op("Squeeze", g.op("Equal", tokens, g.ints("one_token", [1])), g.ints("axis0", [0]))
    g.op("If", one_token, outputs=3, then_branch=branches["grouped-mha"], else_branch=branches["gqa"])
    g.nodes[-1].output[:] = [z := g.stage("z"), "present_key", "present_value"]
    return z


register(CoreGraph("auto", _auto))
