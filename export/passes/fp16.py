"""ConvertToFloat16: an onnx-ir pass that turns a float32 attention graph into float16.

Why a pass of our own rather than onnxruntime.transformers.float16 (the onnxconverter-common
converter that ships inside onnxruntime-gpu)? It was run on the three graphs attnx writes
(decomposed, opset-23 Attention, com.microsoft MultiHeadAttention) and its numbers agree
with the reference as well as ours. But with keep_io_types it appends its boundary Casts
at the end of the node list, which the onnx checker rejects ("Nodes in a graph must be
topologically sorted"); it works on a ModelProto with every tensor loaded and runs onnx
shape inference on it (a model saved with external data and loaded without it fails; the
gpt3 preset is past protobuf's 2 GB), so the onnx-ir pipeline would round-trip through
protobuf; and it clamps every value into float16's range, which handles the mask fill but
silently changes a weight that does not fit. What this graph needs is small and explicit:
retype float values, convert constants, rewrite Cast targets, saturate the mask fill, and
optionally keep float32 at the boundary. The onnx-ir pass does exactly that on the
in-memory model (lazy and external tensors included) and checks its result.

Rotary positions (a config with rope): the angle of pair i at position p, p * inv_freq_i, is
computed in float32 and so are its cos and sin, as transformers does and as the tolerance table's
rope term assumes (float16's eps times p = 8192 would be whole radians). The pass keeps that region
float32, the nodes fed by position_ids and constants alone, with float32 copies of the constants it
reads, and casts its cos and sin to float16 where the half-precision graph reads them.

The mask: the decomposed export fills hidden scores with float32's lowest finite value
(torch's masked_fill with finfo(float32).min). Cast to float16 that is -inf, and a query
whose keys are all hidden would get softmax(-inf, ..., -inf) = NaN. Rewritten to float16's
lowest finite value (-65504) the row's softmax stays finite (uniform) and the Where after
the attention core zeroes it, as the contract asks (y = out bias there).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from attnx.errors import UsageError
from attnx.model.contract import DTYPE_KEY, IO_DTYPE_KEY

__all__ = ["ConvertToFloat16", "FP16_MAX"]

logger = logging.getLogger(__name__)

FLOAT = ir.DataType.FLOAT
FLOAT16 = ir.DataType.FLOAT16
FP16_MAX = float(np.finfo(np.float16).max)  # 65504
_FP32_MAX = float(np.finfo(np.float32).max)

# Ops whose attribute names the dtype of what they produce (standard domain). Cast is the
# one the exported graphs use; the others would silently keep producing float32.
_DTYPE_ATTRIBUTES = {
    "Cast": "to",
    "EyeLike": "dtype",
    "RandomNormal": "dtype",
    "RandomNormalLike": "dtype",
    "RandomUniform": "dtype",
    "RandomUniformLike": "dtype",
    "Bernoulli": "dtype",
}


class ConvertToFloat16(ir.passes.InPlacePass):
    """Convert every float32 tensor of the model to float16, in place.

    Initializers, Constant and ConstantOfShape values, Cast targets, value types and the
    graph's inputs and outputs become float16; integer and bool tensors (shapes, the
    key padding mask, MultiHeadAttention's int32 mask) are left alone. With keep_io_fp32
    the float inputs and outputs stay float32 and Cast nodes convert at the boundary.
    """

    def __init__(self, keep_io_fp32: bool = False) -> None:
        super().__init__()
        self.keep_io_fp32 = keep_io_fp32
        self._angles: set[ir.Value] = set()  # the rotary angle's values, kept float32 (module doc)
        self.notes: list[str] = []  # one line per kind of change, for the pipeline's report

    def requires(self, model: ir.Model) -> None:
        if model.functions:
            # Function bodies carry no value types to check; the exporter inlines them.
            raise ir.passes.PreconditionError(
                f"ConvertToFloat16 converts graphs only; inline the model's {len(model.functions)} functions first"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.notes = []
        if model.metadata_props.get(DTYPE_KEY) == "fp16":
            # Converting again would retype the float32 boundary this pass may have made.
            self.notes.append("the model is float16 already (metadata attnx.dtype): nothing to do")
            return ir.passes.PassResult(model, False)
        counts = {"values": 0, "tensors": 0, "casts": 0, "saturated": 0}
        self._angles = _angle_region(model.graph)
        counts["angle"] = len(self._angles)
        for graph in _graphs(model.graph):
            self._convert_graph(graph, counts)
        if self._angles:
            _cast_angles(model.graph, self._angles)
        if self.keep_io_fp32:
            counts["boundary"] = self._keep_io_fp32(model.graph)
        modified = any(counts.values())
        if modified:
            model.metadata_props[DTYPE_KEY] = "fp16"
            model.metadata_props[IO_DTYPE_KEY] = "fp32" if self.keep_io_fp32 else "fp16"
        self.notes = [
            f"{counts['values']} float32 values retyped and {counts['tensors']} tensors converted to float16",
            f"{counts['casts']} Cast targets float32 -> float16",
            f"{counts['saturated']} fill values beyond float16's range (the mask's float32 lowest) set to "
            f"+-{FP16_MAX:g}",
        ]
        if self.keep_io_fp32:
            self.notes.append(f"float32 inputs and outputs kept, {counts['boundary']} Casts at the boundary")
        if counts["angle"]:
            self.notes.append(f"{counts['angle']} values of the rotary angle kept float32 (cos and sin cast to float16)")
        for note in self.notes:
            logger.info("fp16: %s", note)
        return ir.passes.PassResult(model, modified)

    def ensures(self, model: ir.Model) -> None:
        """No float32 is left but a kept boundary (an input only cast to float16, an output
        cast from float16); every constant's tensor has its value's dtype."""
        for graph in _graphs(model.graph):
            for value in _values(graph):
                if value.dtype == FLOAT and not _is_boundary(value) and value not in self._angles:
                    raise ir.passes.PostconditionError(f"value {value.name!r} is still float32")
                if value.const_value is not None and value.dtype is not None and value.const_value.dtype != value.dtype:
                    raise ir.passes.PostconditionError(
                        f"initializer {value.name!r} is typed {value.dtype} but holds {value.const_value.dtype}"
                    )
            for node in graph:
                attr = node.attributes.get(_DTYPE_ATTRIBUTES.get(node.op_type, "")) if node.domain == "" else None
                if attr is not None and attr.value == FLOAT and not _is_boundary(node.outputs[0]) and \
                        node.outputs[0] not in self._angles:
                    raise ir.passes.PostconditionError(f"{node.op_type} node {node.name!r} still produces float32")

    # The conversion --------------------------------------------------------------------
    def _convert_graph(self, graph: ir.Graph, counts: dict[str, int]) -> None:
        for value in _values(graph):
            if value in self._angles:
                continue
            if value.dtype == FLOAT:
                value.dtype = FLOAT16
                counts["values"] += 1
            tensor = value.const_value
            if tensor is not None and tensor.dtype == FLOAT:
                value.const_value = _to_fp16(tensor, value.name, counts)
                counts["tensors"] += 1
        for node in graph:
            if node.domain != "" or any(o in self._angles for o in node.outputs):
                continue  # contrib ops (MultiHeadAttention) have float tensors only as inputs; the angle stays
            if node.op_type == "Constant":
                self._convert_constant(node, counts)
            elif node.op_type == "ConstantOfShape":
                attr = node.attributes.get("value")
                if attr is None:  # the default fill is a float32 zero
                    node.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.zeros(1, np.float16)))
                    counts["tensors"] += 1
                elif attr.value.dtype == FLOAT:
                    node.attributes["value"] = ir.AttrTensor("value", _to_fp16(attr.value, node.name, counts))
                    counts["tensors"] += 1
            elif node.op_type in _DTYPE_ATTRIBUTES:
                name = _DTYPE_ATTRIBUTES[node.op_type]
                attr = node.attributes.get(name)
                if attr is not None and attr.value == FLOAT:
                    node.attributes[name] = ir.AttrInt64(name, FLOAT16)
                    counts["casts"] += 1

    def _convert_constant(self, node: ir.Node, counts: dict[str, int]) -> None:
        attrs = node.attributes
        if "value" in attrs and attrs["value"].value.dtype == FLOAT:
            attrs["value"] = ir.AttrTensor("value", _to_fp16(attrs["value"].value, node.name, counts))
        elif "value_float" in attrs:  # a float32 scalar by definition: becomes a float16 tensor
            array = np.array(attrs.pop("value_float").value, dtype=np.float32)
            attrs["value"] = ir.AttrTensor("value", _to_fp16(ir.tensor(array), node.name, counts))
        elif "value_floats" in attrs:
            array = np.array(attrs.pop("value_floats").value, dtype=np.float32)
            attrs["value"] = ir.AttrTensor("value", _to_fp16(ir.tensor(array), node.name, counts))
        else:
            return
        counts["tensors"] += 1

    @staticmethod
    def _keep_io_fp32(graph: ir.Graph) -> int:
        """Give the graph float32 inputs and outputs again, with Casts at the boundary. The
        names of the graph's inputs and outputs do not change."""
        taken = {v.name for v in _values(graph)}
        n = 0
        for i, inner in enumerate(list(graph.inputs)):
            if inner.dtype != FLOAT16:
                continue
            outer = ir.Value(name=inner.name, type=ir.TensorType(FLOAT), shape=inner.shape)
            inner.name = _fresh(f"{outer.name}_fp16", taken)
            graph.inputs[i] = outer  # inner is now an ordinary value: the Cast produces it
            cast = ir.Node("", "Cast", [outer], {"to": ir.AttrInt64("to", FLOAT16)}, name=f"{outer.name}_to_fp16")
            inner.replace_all_uses_with(cast.outputs[0])
            cast.outputs[0].name, cast.outputs[0].dtype, cast.outputs[0].shape = inner.name, FLOAT16, inner.shape
            graph.insert_before(graph[0], cast)
            n += 1
        for i, inner in enumerate(list(graph.outputs)):
            if inner.dtype != FLOAT16:
                continue
            name = inner.name
            inner.name = _fresh(f"{name}_fp16", taken)
            cast = ir.Node("", "Cast", [inner], {"to": ir.AttrInt64("to", FLOAT)}, name=f"{name}_to_fp32")
            outer = cast.outputs[0]
            outer.name, outer.dtype, outer.shape = name, FLOAT, inner.shape
            graph.outputs[i] = outer
            graph.append(cast)
            n += 1
        return n


def _to_fp16(tensor: ir.TensorProtocol, name: str | None, counts: dict[str, int]) -> ir.Tensor:
    """The tensor in float16. A finite value beyond float16's range would become inf: that
    is right only for fill values that mean "as large as there is" (float32's lowest or
    largest finite value anywhere, or a lone scalar constant such as -1e9), which are
    saturated to +-65504. Anything else that does not fit (a weight) is an error."""
    array = tensor.numpy()
    over = np.isfinite(array) & (np.abs(array) > FP16_MAX)
    if over.any():
        sentinel = np.abs(array) == _FP32_MAX
        if array.size > 1 and not sentinel[over].all():
            worst = float(np.abs(array[over & ~sentinel]).max())
            raise UsageError(
                f"tensor {name!r} has {int((over & ~sentinel).sum())} values outside float16's range "
                f"(largest magnitude {worst:.4g} > {FP16_MAX:g}): it cannot be stored in fp16"
            )
        array = np.where(over, np.sign(array) * FP16_MAX, array)
        counts["saturated"] += int(over.sum())
        logger.debug("fp16: saturated %d values of %r to +-%g", int(over.sum()), name, FP16_MAX)
    return ir.Tensor(array.astype(np.float16), name=tensor.name, doc_string=tensor.doc_string)


def _angle_region(graph: ir.Graph) -> set[ir.Value]:
    """The float values of the rotary angle (module doc): computed by nodes whose inputs are all
    position_ids, values of the region, or constants; a constant such a node shares with the rest of
    the graph is given a float32 copy of its own first."""
    start = next((v for v in graph.inputs if v.name == "position_ids"), None)
    if start is None:
        return set()
    derived: set[ir.Value] = {start}  # position_ids and what is computed from it (and constants) alone
    region: set[ir.Value] = set()
    for node in list(graph):
        inputs = [i for i in node.inputs if i is not None]
        if node.domain != "" or not any(i in derived for i in inputs):
            continue
        if not all(i in derived or _is_constant(i) for i in inputs):
            continue
        derived.update(node.outputs)
        for i, value in enumerate(node.inputs):
            if value is None or value in derived or value.dtype != FLOAT:
                continue
            if any(u.node is not node for u in value.uses()):  # shared: a float32 copy for the angle
                copy = ir.Value(name=f"{value.name}.fp32", type=ir.TensorType(FLOAT), shape=value.shape,
                                const_value=value.const_value)  # fmt: skip
                if value.const_value is not None and value.is_initializer():
                    graph.register_initializer(copy)
                    node.replace_input_with(i, copy)
                    value = copy
            region.add(value)
        region.update(o for o in node.outputs if o.dtype == FLOAT)
    return region


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


def _cast_angles(graph: ir.Graph, region: set[ir.Value]) -> None:
    """A Cast to float16 wherever a node outside the angle region reads one of its values."""
    casts: dict[ir.Value, ir.Value] = {}  # one Cast a value
    for node in list(graph):
        if any(o in region for o in node.outputs):
            continue
        for i, value in enumerate(node.inputs):
            if value is None or value not in region or value.is_initializer():
                continue
            if value not in casts:
                cast = ir.Node("", "Cast", [value], {"to": ir.AttrInt64("to", FLOAT16)}, name=f"{value.name}/to_fp16")
                cast.outputs[0].name, cast.outputs[0].dtype, cast.outputs[0].shape = (
                    f"{value.name}.fp16", FLOAT16, value.shape)  # fmt: skip
                graph.insert_before(node, cast)
                casts[value] = cast.outputs[0]
            node.replace_input_with(i, casts[value])


def _is_boundary(value: ir.Value) -> bool:
    """A float32 graph input whose every use is a Cast to float16, or a float32 graph
    output made by a Cast from float16: what keep_io_fp32 leaves."""
    if value.is_graph_input():
        return all(u.node.op_type == "Cast" and u.node.attributes["to"].value == FLOAT16 for u in value.uses())
    producer = value.producer()
    return (
        value.is_graph_output()
        and producer is not None
        and producer.op_type == "Cast"
        and producer.inputs[0] is not None
        and producer.inputs[0].dtype == FLOAT16
    )


def _graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """The graph and every subgraph inside it (If/Loop/Scan bodies)."""
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    yield from _graphs(sub)


def _values(graph: ir.Graph) -> Iterator[ir.Value]:
    """Every value defined in this graph (not its subgraphs): inputs, initializers, node outputs."""
    seen: set[ir.Value] = set()
    for value in [*graph.inputs, *graph.initializers.values()]:
        if value not in seen:
            seen.add(value)
            yield value
    for node in graph:
        for value in node.outputs:
            if value not in seen:
                seen.add(value)
                yield value


def _fresh(name: str, taken: set[str | None]) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate
