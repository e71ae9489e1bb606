"""A computation the graph repeats, made once: each node that repeats an earlier one (the same op and attributes, over
the same inputs) reads that node's outputs instead, and is then dead.

    ShareRepeated   inputs are the same where they are the same value, or constants equal in dtype, shape and every
                    element (each block's own copy of a table attnx writes under its name: attnx/block0/axes_12,
                    attnx/block1/axes_12); a deterministic op over the same inputs computes the same outputs, so
                    the graph computes exactly what it did. A whole model's rewritten blocks each compute their
                    rotary tables and their mask grid from the model's own inputs (position_ids, the padding mask):
                    once for the model instead of once a block.

Nodes whose outputs are graph outputs, nodes with subgraphs (an If's branches) and ops that draw random numbers are
never merged. `prefix`: only nodes whose names start with it (attnx's own, attnx/...), the rest of the graph kept as
it is.
"""

from __future__ import annotations

import onnx_ir as ir

from attnx.export.passes._base import AttnxPass

__all__ = ["ShareRepeated"]

# ops whose outputs are not a function of their inputs
_RANDOM = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"})  # fmt: skip
# the largest constant compared by content (tables and shapes; a weight is its own block's)
_LARGEST_COMPARED = 1 << 16


def _attribute_key(attr: ir.Attr) -> tuple | None:
    """A hashable form of an attribute, or None for one this pass does not compare (a graph, a tensor)."""
    if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS, ir.AttributeType.TENSOR,
                     ir.AttributeType.TENSORS, ir.AttributeType.SPARSE_TENSOR, ir.AttributeType.SPARSE_TENSORS):
        return None  # fmt: skip
    value = attr.value
    return (attr.name, attr.type, tuple(value) if isinstance(value, (list, tuple)) else value)


class ShareRepeated(AttnxPass):
    """The module doc's pass, in place."""

    def __init__(self, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix

    def _value_key(self, value: ir.Value | None) -> tuple:
        if value is None:
            return ("absent",)
        tensor = value.const_value
        if value.producer() is None and value.is_initializer() and tensor is not None \
                and not value.is_graph_input() and tensor.size <= _LARGEST_COMPARED:  # fmt: skip
            return ("constant", tensor.dtype, tuple(tensor.shape), tensor.tobytes())
        return ("value", id(value))

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        g = model.graph
        g.sort()  # each node after what it reads: a repeat's inputs are already the first's when it is met
        first: dict[tuple, ir.Node] = {}
        shared = 0
        for node in list(g):
            if not (node.name or "").startswith(self.prefix) or node.op_type in _RANDOM \
                    or any(v.is_graph_output() for v in node.outputs):  # fmt: skip
                continue
            attributes = [_attribute_key(a) for a in node.attributes.values()]
            if any(a is None for a in attributes):
                continue
            key = (node.domain, node.op_type, node.overload, len(node.outputs), tuple(sorted(attributes, key=str)),
                   tuple(self._value_key(v) for v in node.inputs))  # fmt: skip
            if key not in first:
                first[key] = node
                continue
            for old, new in zip(node.outputs, first[key].outputs):
                old.replace_all_uses_with(new)
            shared += 1
        if shared:
            from onnx_ir.passes.common import RemoveUnusedNodesPass

            RemoveUnusedNodesPass()(model)
            self.notes.append(f"{shared} node(s) repeating another's computation read its outputs instead")
        return ir.passes.PassResult(model, modified=bool(shared))
