"""QuantizeWeights: an onnx-ir pass that quantizes a whole model's MatMul weights (attnx optimize / build --model
--weights int4|int8), with ONNX Runtime's own quantizer.

Every MatMul of the main graph whose second operand is a constant 2-D float32 weight [K, N], or the Transpose of one
(a tied LM head, as torch.onnx writes it), (each projection, the MLP's, the LM head) becomes one com.microsoft MatMulNBits, as onnxruntime.quantization's MatMulNBitsQuantizer
writes it: the packed blocks, scales and zero points come from its DefaultWeightOnlyQuantizer (round to nearest,
per block of `block_size` along K, ONNX Runtime's C++ kernels), and the node's attributes are its (K, N, bits,
block_size, accuracy_level). The pass is onnx-ir's, not the quantizer's ModelProto walk, so a model past protobuf's
2 GB is quantized tensor by tensor with its external data. At 4 bits the embeddings' Gather of a constant float32
table becomes com.microsoft GatherBlockQuantized (the table's int4 blocks along the hidden size, by the same
quantizer: the GenAI builder's form; a tied table is then held twice in int4, for the Gather and for the head,
instead of once in float32). What it leaves is stated (WeightsRecord): an int8 run's embeddings, and any MatMul
whose weight is not a constant 2-D float32 tensor, stay as they are.

Defaults are the GenAI builder's for CPU: symmetric 4-bit blocks of 32, accuracy_level 4 (the input quantized to
int8 per block and multiplied in int8: what the audit's error model holds, attnx.model.tolerance).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export.passes._base import matmul_weight
from attnx.model.contract import MS_DOMAIN

__all__ = ["WEIGHT_BITS", "QuantizeWeights", "WeightsRecord"]

WEIGHT_BITS = {"int4": 4, "int8": 8}  # --weights: the MatMulNBits width


@dataclasses.dataclass
class WeightsRecord:
    """What QuantizeWeights did: its settings, the MatMuls quantized (the LM head among them, by name), what was
    kept in float32 and why."""

    weights: str
    bits: int
    block_size: int
    accuracy_level: int
    symmetric: bool
    quantized: list[str] = dataclasses.field(default_factory=list)
    lm_head: str | None = None  # the MatMul whose N is the logits' width, where one is quantized
    kept: list[str] = dataclasses.field(default_factory=list)  # "name: why"
    embeddings: str | None = None  # the Gather's table quantized (int4: GatherBlockQuantized), where one was
    # the Gathers' tables kept float32 (each also in `kept`, with why)
    embeddings_kept: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def said(self) -> str:
        head = "quantized" if self.lm_head is not None else "kept float32"
        table = (f"quantized ({self.bits} bits, blocks of {self.block_size} along the hidden size: "
                 "GatherBlockQuantized)" if self.embeddings is not None
                 else "kept float32 (a Gather)" if self.embeddings_kept
                 else "not found as a Gather of a constant table")  # fmt: skip
        return (f"{self.weights}: {len(self.quantized)} MatMul weight(s) quantized by ONNX Runtime's MatMulNBits "
                f"quantizer ({self.bits} bits, {'symmetric' if self.symmetric else 'asymmetric'} blocks of "
                f"{self.block_size}, accuracy_level {self.accuracy_level}); the LM head {head}; the embeddings "
                f"{table}; {len(self.kept) - len(self.embeddings_kept)} other weight(s) kept")  # fmt: skip


class QuantizeWeights(ir.passes.InPlacePass):
    """The module doc: `weights` "int4" or "int8"; `record` says what was done."""

    def __init__(self, weights: str, block_size: int = 32, accuracy_level: int = 4, symmetric: bool = True) -> None:
        super().__init__()
        self.record = WeightsRecord(weights, WEIGHT_BITS[weights], block_size, accuracy_level, symmetric)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

        r = self.record
        quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
            block_size=r.block_size, is_symmetric=r.symmetric, accuracy_level=r.accuracy_level, bits=r.bits))  # fmt: skip
        graph = model.graph
        vocab = _logits_width(graph)
        for node in list(graph):
            if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node.inputs[0] is not None \
                    and node.inputs[0].const_value is not None and len(node.inputs[0].shape or ()) == 2:  # fmt: skip
                if r.bits == 4 and r.symmetric and self._gather(graph, node, quantizer):
                    continue
                r.kept.append(f"{node.inputs[0].name}: a Gather's table (the embeddings)")
                r.embeddings_kept.append(node.inputs[0].name)
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
                continue
            weight = node.inputs[1]
            tensor, transposed = matmul_weight(weight)
            if tensor is None:
                continue  # two activations (the attention core's scores and values): not a weight
            if len(tensor.shape) != 2 or tensor.dtype != ir.DataType.FLOAT:
                r.kept.append(f"{weight.name}: a {tensor.dtype.name} weight of shape {list(tensor.shape)}")
                continue
            array = tensor.numpy().T if transposed else tensor.numpy()
            k, n = (int(d) for d in array.shape)
            packed, scales, zero_points = quantizer.qbits_block_quant(np.ascontiguousarray(array))
            inputs = [node.inputs[0], _initializer(graph, f"{weight.name}_Q{r.bits}", packed),
                      _initializer(graph, f"{weight.name}_scales", scales)]  # fmt: skip
            if not r.symmetric:
                inputs.append(_initializer(graph, f"{weight.name}_zero_points", zero_points))
            attributes = {"K": k, "N": n, "bits": r.bits, "block_size": r.block_size}
            if r.accuracy_level:  # as the quantizer writes it: absent at 0
                attributes["accuracy_level"] = r.accuracy_level
            nbits = ir.node("MatMulNBits", inputs, attributes, domain=MS_DOMAIN, name=f"{node.name}_Q{r.bits}",
                            num_outputs=1)  # fmt: skip
            ir.convenience.replace_nodes_and_values(graph, node, [node], [nbits], node.outputs, nbits.outputs)
            r.quantized.append(node.name or weight.name)
            if n == vocab:
                r.lm_head = node.name or weight.name
        if r.quantized or r.embeddings:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            ir.passes.common.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=bool(r.quantized or r.embeddings))


    def _gather(self, graph: ir.Graph, node: ir.Node, quantizer: Any) -> bool:
        """A Gather of rows of a constant float32 table [V, H] (the embeddings) -> com.microsoft GatherBlockQuantized
        of its int4 blocks along H, as ONNX Runtime's quantizer writes it (quantize_ndarray: symmetric, each block's
        scale its largest magnitude / -8), the GenAI builder's form; False (left) for another axis or dtype."""
        r = self.record
        table = node.inputs[0]
        tensor = table.const_value
        if tensor.dtype != ir.DataType.FLOAT or node.attributes.get_int("axis", 0) != 0 \
                or int(tensor.shape[1]) % r.block_size:  # fmt: skip
            return False
        array = tensor.numpy()
        with np.errstate(invalid="ignore", divide="ignore"):  # a block of zeros (a padding row): scale 0, codes 0
            packed, scales, _ = quantizer.quantize_ndarray(array, 1, r.block_size, True)
        data = ir.Value(name=f"{table.name}_Q4", const_value=ir.PackedTensor(
            packed, ir.DataType.INT4, shape=array.shape, name=f"{table.name}_Q4"))  # fmt: skip
        data.shape, data.type = data.const_value.shape, ir.TensorType(ir.DataType.INT4)
        graph.register_initializer(data)
        inputs = [data, node.inputs[1], _initializer(graph, f"{table.name}_scales", scales)]
        attributes = {"gather_axis": 0, "quantize_axis": 1, "block_size": r.block_size}
        gather = ir.node("GatherBlockQuantized", inputs, attributes, domain=MS_DOMAIN, name=f"{node.name}_Q4",
                         num_outputs=1)  # fmt: skip
        ir.convenience.replace_nodes_and_values(graph, node, [node], [gather], node.outputs, gather.outputs)
        r.embeddings = table.name
        return True


def _initializer(graph: ir.Graph, name: str, array: Any) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    value.shape, value.type = value.const_value.shape, ir.TensorType(value.const_value.dtype)
    graph.register_initializer(value)
    return value


def _logits_width(graph: ir.Graph) -> int | None:
    """The last dim of the model's logits output (its first output, where none is named logits), where fixed."""
    outputs = {v.name: v for v in graph.outputs}
    logits = outputs.get("logits") or (graph.outputs[0] if len(graph.outputs) else None)
    shape = logits.shape if logits is not None else None
    last = shape[-1] if shape is not None and len(shape) else None
    return last if isinstance(last, int) else None
