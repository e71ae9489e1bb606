"""Each planned block's new core spliced into the whole model at the block's own tensors, in place, through onnx-ir;
what the old block leaves dead removed."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export import build_model
from attnx.export.passes.share import ShareRepeated
from attnx.model.config import CacheSpec
from attnx.model.contract import MS_DOMAIN
from attnx.workflows.rewrite.plan import Plan

__all__ = ["splice_blocks"]

# the core model's tables that a plan may bind to the graph's own (GroupQueryAttention's cos/sin caches)
_BOUND_TABLES = ("rope_cos_cache", "rope_sin_cache")


def splice_blocks(model: ir.Model, plans: list[Plan]) -> list[ir.Node]:
    """Each planned block's core (Plan, its core chosen) spliced into `model` in place of the block: the core's model
    (attnx.export.build_model: the whole block, or the core alone at the graph's projections) with each input bound
    to the graph's tensor the plan names (transformers' attention_mask as its padding mask, positions the graph
    computes expanded to [batch, seq]), its output replacing the block's (y) or feeding the graph's output projection
    (z), its presents the graph's outputs under their own names and dims; then what is dead removed. Returns the
    nodes it wrote (the blocks' cores, what they share)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    g = model.graph
    values = {v.name: v for node in g for v in node.outputs} | {v.name: v for v in g.inputs}
    values |= dict(g.initializers)
    shared: dict[str, ir.Value] = {}  # what blocks share: the padding mask, positions expanded
    written: list[ir.Node] = []
    tables: dict[tuple[str, bytes], ir.Value] = {}  # the rotary tables written, by their bytes
    for plan in plans:
        block = plan.block
        sub = ir.from_proto(build_model(plan.config, plan.weights, plan.lowering, plan.form, plan.dtype, core=plan.core,
                                        bound=plan.bound, ring_cache=plan.ring_cache,
                                        rope_positions=plan.rope_positions))  # fmt: skip
        for domain, version in sub.opset_imports.items():
            model.opset_imports[domain] = max(model.opset_imports.get(domain, version), version)
        prefix = f"attnx/block{block.index}/"
        bound = {name: values[tensor] for name, tensor in plan.binds.items() if name not in ("z", "position_ids")}
        ours = {v.name: v for v in sub.graph.inputs}
        if "key_padding_mask" in ours:  # attnx's key_padding_mask: True where transformers' mask is 0
            zero = _const(g, "attnx/zero_i64", np.asarray(0, np.int64))
            bound["key_padding_mask"] = _shared(g, shared, "attnx/key_padding_mask", "Equal",
                                                [values["attention_mask"], zero])  # fmt: skip
        if "position_ids" in plan.binds and "position_ids" in ours:
            positions = bound["position_ids"] = values[plan.binds["position_ids"]]
            if plan.positions_expand:  # the graph's own positions ([seq] or [1, seq]) for every row: [batch, seq]
                x = values["input_ids"] if "input_ids" in values else values[plan.binds["x"]]  # [batch, seq, ...]
                dims = _shared(g, shared, f"attnx/batch_seq/{x.name}", "Shape", [x], start=0, end=2)
                bound["position_ids"] = _shared(g, shared, f"attnx/position_ids/{positions.name}/{x.name}", "Expand",
                                                [positions, dims])  # fmt: skip
        joined: dict[str, ir.Value] = {}  # the buffer form's one buffer in place of the graph's parts, by spec
        for spec in plan.config.cache_specs():  # a cache the graph keeps apart, joined as the core keeps it
            if spec.parts and spec.name in ours:
                parts = [values[block.cache_parts[part][0]] for part, _ in spec.parts]
                if plan.form == "buffer":  # written in place: one buffer, an input of the model's own
                    bound[spec.name] = joined[spec.role] = _joined_input(g, parts, spec)
                else:  # joined each call: the model's I/O as it was
                    bound[spec.name] = _append(g, "Concat", parts, f"{prefix}{spec.name}", axis=-1)
        initializers = list(sub.graph.initializers.values())
        for value in initializers:
            sub.graph.initializers.pop(value.name)
        for value in initializers:
            if value.name in _BOUND_TABLES and value.name not in bound:  # a rotary table a block before wrote alike:
                key = (value.name, value.const_value.tobytes())  # one for them all (its bytes the same)
                if key in tables:
                    bound[value.name] = tables[key]
                else:
                    tables[key] = value
            if value.name in _BOUND_TABLES and value.name in bound:
                ours[value.name] = value  # bound to the graph's own table, or to the one written: not copied
                continue
            value.name = prefix + value.name
            g.register_initializer(value)
        nodes = list(sub.graph)
        outputs = {v.name: v for v in sub.graph.outputs}
        sub.graph.outputs.clear()
        for node in nodes:
            sub.graph.remove(node)
        inner = [n for node in nodes for attr in node.attributes.values() if attr.type == ir.AttributeType.GRAPH
                 for n in ir.traversal.RecursiveGraphIterator(attr.value)]  # an If's branches (the auto core's)
        for node in nodes + inner:
            node.name = prefix + (node.name or node.op_type)
            for i, value in enumerate(node.inputs):
                if value is not None and ours.get(value.name) is value:
                    node.replace_input_with(i, bound[value.name])
            for value in node.outputs:
                value.name = prefix + value.name
        for node in nodes:
            g.append(node)
        if plan.nbits:
            nodes, taken = _take_nbits(g, nodes, prefix, plan.nbits)
            outputs = {name: taken.get(id(value), value) for name, value in outputs.items()}
        written += nodes + inner  # an If's branches read the cache too (the switch core)
        if plan.bound == "x":
            y = outputs["y"]
            if block.y_bias is not None and y.producer() is not None and y.producer().op_type == "Add":
                # the graph adds the output bias after the block (a SkipLayerNormalization): the block ends at the
                # output projection's MatMul, before its bias Add (linear), which is then dead
                y = y.producer().inputs[0]
            old = values[block.outputs["y"]]
            if old in g.outputs:  # a model that is one layer (attnx's own export): y keeps its name and dims
                name = old.name
                old.name = f"{prefix}replaced/{name}"
                old.replace_all_uses_with(y, replace_graph_outputs=True)
                y.name, y.shape, y.type = name, old.shape, old.type
            else:
                old.replace_all_uses_with(y)
        else:  # the core alone: its z into the graph's own output projection
            values[plan.binds["z"]].replace_all_uses_with(outputs["z"])
        for spec in plan.config.cache_specs(prefix="present_"):  # each present under the graph's own name
            if spec.name not in outputs:
                continue
            if not spec.parts:
                if spec.name in block.outputs:
                    _replace_output(g, values[block.outputs[spec.name]], outputs[spec.name], prefix)
                continue
            if spec.role in joined:  # the buffer form: one output, the buffer, in place of the parts'
                olds = [values[block.cache_parts[part][1]] for part, _ in spec.parts]
                new = outputs[spec.name]
                new.name = _common(o.name for o in olds) + spec.role
                new.shape = ir.Shape(joined[spec.role].shape)
                new.type = olds[0].type
                g.outputs[list(g.outputs).index(olds[0])] = new
                for old in olds[1:]:
                    g.outputs.remove(old)
                for old in olds:
                    old.name = f"{prefix}replaced/{old.name}"
                continue
            start = 0
            for part, width in spec.parts:  # the graph's tensors: the core's columns of each part
                cols = [_const(g, f"attnx/cols_{n}", np.asarray([n], np.int64)) for n in (start, start + width, -1)]
                piece = _append(g, "Slice", [outputs[spec.name], *cols], f"{prefix}{spec.name}/{part}")
                _replace_output(g, values[block.cache_parts[part][1]], piece, prefix)
                start += width
    RemoveUnusedNodesPass()(model)
    g.sort()  # the spliced nodes were appended: back into an order where each comes after what it reads
    # what every block computes alike from the model's own inputs (rotary tables from position_ids, the token grid
    # from the padding mask and the lengths): computed once, the rest of the graph untouched
    ShareRepeated(prefix="attnx/")(model)
    return written


def _take_nbits(g: ir.Graph, nodes: list[ir.Node], prefix: str,
                nbits: dict[str, dict[str, Any]]) -> tuple[list[ir.Node], dict[int, ir.Value]]:  # fmt: skip
    """`nodes` with each projection MatMul of a weight `nbits` names (the core wrote it in float32, from the graph's
    dequantized weights) replaced by the graph's own MatMulNBits of it: the same tensors, by name, and attributes;
    and each replaced output's replacement, by id (the core's y where no bias follows its output projection)."""
    out, taken = [], {}
    for node in nodes:
        weight = node.inputs[1] if node.op_type == "MatMul" and len(node.inputs) == 2 else None
        name = weight.name.removeprefix(prefix).removesuffix(".T") if weight is not None else None
        if name not in nbits:
            out.append(node)
            continue
        own = nbits[name]  # the graph's own MatMulNBits of it: its tensors by name, its attributes
        inputs = [node.inputs[0], *(g.initializers[n] if n is not None else None for n in own["inputs"])]
        new = ir.node("MatMulNBits", inputs, own["attributes"], domain=MS_DOMAIN, name=f"{node.name}/MatMulNBits")
        new.outputs[0].shape, new.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
        g.insert_before(node, new)
        node.outputs[0].replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
        new.outputs[0].name, node.outputs[0].name = node.outputs[0].name, f"{node.outputs[0].name}/float"
        g.remove(node, safe=True)
        if not weight.uses() and weight.name in g.initializers:
            del g.initializers[weight.name]
        out.append(new)
        taken[id(node.outputs[0])] = new.outputs[0]
    return out, taken


def _common(names: Iterable[str]) -> str:
    """The names' common prefix (past_key_values.0. of past_key_values.0.key and .value)."""
    return os.path.commonprefix(list(names))


def _joined_input(g: ir.Graph, parts: list[ir.Value], spec: CacheSpec) -> ir.Value:
    """The buffer form's one cache input in place of the graph's `parts` inputs (their columns joined as `spec`
    lays them out), named as theirs are with the spec's role (past_key_values.0.latent); the parts leave the inputs."""
    dims = list(parts[0].shape)
    dims[-1] = sum(width for _, width in spec.parts)
    value = ir.Value(name=_common(p.name for p in parts) + spec.role, type=parts[0].type, shape=ir.Shape(dims))
    at = list(g.inputs).index(parts[0])
    for part in parts:
        g.inputs.remove(part)
    g.inputs.insert(at, value)
    return value


def _replace_output(g: ir.Graph, old: ir.Value, new: ir.Value, prefix: str) -> None:
    """`new` the graph output `old` was: its name, place, dims and type (the interface as it was)."""
    name, at = old.name, list(g.outputs).index(old)
    old.name = f"{prefix}replaced/{name}"
    new.name = name
    new.shape, new.type = old.shape, old.type
    g.outputs[at] = new


def _append(g: ir.Graph, op_type: str, inputs: list[ir.Value], name: str, **attributes: int) -> ir.Value:
    """The output `name` of a new node of the graph."""
    node = ir.node(op_type, inputs, attributes, outputs=[ir.Value(name=name)], name=name)
    g.append(node)
    return node.outputs[0]


def _const(g: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    if name not in g.initializers:
        g.register_initializer(ir.Value(name=name, const_value=ir.tensor(array)))
    return g.initializers[name]


def _shared(g: ir.Graph, shared: dict[str, ir.Value], name: str, op_type: str, inputs: list[ir.Value],
            **attributes: int) -> ir.Value:  # fmt: skip
    """The output `name` of a node the blocks share (appended to the graph once)."""
    if name not in shared:
        node = ir.node(op_type, inputs, attributes, outputs=[ir.Value(name=name)])
        g.append(node)
        shared[name] = node.outputs[0]
    return shared[name]
