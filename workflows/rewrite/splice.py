"""Each planned block's new core spliced into the whole model at the block's own tensors, in place, through onnx-ir;
what the old block leaves dead removed."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnx.export import build_model
from attnx.workflows.rewrite.plan import LOWERING

__all__ = ["splice_blocks"]


def splice_blocks(model: ir.Model, plans: list[tuple]) -> None:
    """Each planned block's core (block, config, weights, core) spliced into `model` in place of the block (the module doc), then what is dead
    removed."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    g = model.graph
    values = {v.name: v for node in g for v in node.outputs} | {v.name: v for v in g.inputs}
    binds: dict[str, ir.Value] = {}
    if "attention_mask" in values:  # attnx's key_padding_mask: True where transformers' mask is 0
        zero = ir.Value(name="attnx/zero_i64", const_value=ir.tensor(np.asarray(0, np.int64)))
        g.register_initializer(zero)
        kpm = ir.node("Equal", [values["attention_mask"], zero], outputs=[ir.Value(name="attnx/key_padding_mask")])
        g.append(kpm)
        binds["key_padding_mask"] = kpm.outputs[0]
    if "position_ids" in values:
        binds["position_ids"] = values["position_ids"]
    for block, config, weights, core in plans:
        sub = ir.from_proto(build_model(config, weights, LOWERING, "growing" if config.kv_cache else "full", core=core))
        for domain, version in sub.opset_imports.items():
            model.opset_imports[domain] = max(model.opset_imports.get(domain, version), version)
        prefix = f"attnx/block{block.index}/"
        bound = {**binds, "x": values[block.inputs["x"]]}
        for role in ("past_key", "past_value"):
            if role in block.inputs:
                bound[role] = values[block.inputs[role]]
        ours = {v.name: v for v in sub.graph.inputs}
        initializers = list(sub.graph.initializers.values())
        for value in initializers:
            sub.graph.initializers.pop(value.name)
        for value in initializers:
            value.name = prefix + value.name
            g.register_initializer(value)
        nodes = list(sub.graph)
        outputs = {v.name: v for v in sub.graph.outputs}
        sub.graph.outputs.clear()
        for node in nodes:
            sub.graph.remove(node)
        for node in nodes:
            node.name = prefix + (node.name or node.op_type)
            for i, value in enumerate(node.inputs):
                if value is not None and ours.get(value.name) is value:
                    node.replace_input_with(i, bound[value.name])
            for value in node.outputs:
                value.name = prefix + value.name
            g.append(node)
        y = outputs["y"]
        if block.y_bias is not None and y.producer() is not None and y.producer().op_type == "Add":
            # the graph adds the output bias after the block (a SkipLayerNormalization): the block ends at the output
            # projection's MatMul, before its bias Add (linear), which is then dead
            y = y.producer().inputs[0]
        values[block.outputs["y"]].replace_all_uses_with(y)
        for role in ("present_key", "present_value"):
            if role not in block.outputs:
                continue
            old = values[block.outputs[role]]
            name, at = old.name, list(g.outputs).index(old)
            old.name = f"{prefix}replaced/{name}"
            outputs[role].name = name
            outputs[role].shape, outputs[role].type = old.shape, old.type  # the interface's own dims, as they were
            g.outputs[at] = outputs[role]
    RemoveUnusedNodesPass()(model)
    g.sort()  # the spliced nodes were appended: back into an order where each comes after what it reads
