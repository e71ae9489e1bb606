"""Passes over the rest of a whole model's graph for the form generate serves (after BufferForm): fewer, larger
kernels a decode step, the weights kept where they are.

    FuseRmsNorm   Pow(x, 2) -> ReduceMean(last axis) -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x, .) -> Mul(w, .)
                  (the RMS norm as torch.onnx exports transformers' LlamaRMSNorm in float32) -> one
                  SimplifiedLayerNormalization(x, w, epsilon): seven kernels a norm become one
    PackMatMuls   MatMuls of one input whose weights are constant [K, N_i] (a block's q/k/v projections, an MLP's
                  gate and up) -> one MatMul over Concat(W_1..W_n, axis 1), then Split: one GEMV a step reads them
                  all; the Concat is of the model's own initializers, which ONNX Runtime folds when it loads the
                  model, so the package holds each weight once
    LastLogits    the logits of the last position alone: the hidden state sliced to its last token before the
                  language-model head (a MatMul of constant weights, or ONNX Runtime's MatMulNBits: an int4 or
                  int8 head; logits [batch, 1, vocab]): a prompt's only logits generation reads, its head
                  (a tenth of a Llama-shaped prompt's flops) computed for one position instead of all

Measured on a Llama-shaped model (hidden 1024, 4 layers, AMD EPYC, 2 threads, ONNX Runtime 1.31, a shared host): a
one-row step 7.2 ms with the first two against 8.8 ms without, in one run; later runs put the fused norms' gain at
0.6-0.7 ms and could not tell the packing from the host's noise (+-10%). LastLogits: a 300-token prompt 184 -> 172 ms.
The graph computes what it did up to rounding: the norm's mean and square root in another order (2.5e-6 on that
model's logits), the MatMuls' columns unchanged; the buffer form's proof holds the result to the model's own I/O
(attnx.workflows._buffer_form).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnx.export.passes._base import AttnxPass, const_array, matmul_weight
from attnx.export.passes.walk import is_op
from attnx.model.contract import MS_DOMAIN

__all__ = ["FuseRmsNorm", "LastLogits", "PackMatMuls", "LOGITS"]

LOGITS = "logits"
# what may lie between the head's MatMul and the logits output: the same on every position (a final softcap)
_POSITIONWISE = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast")


def _only_use(value: ir.Value, op_type: str) -> ir.Node | None:
    """The one node that reads `value`, when it is an `op_type` of the default domain."""
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and is_op(uses[0].node, op_type) else None


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """A two-input node's input other than `value`."""
    ins = list(node.inputs)
    return ins[1] if ins[0] is value else ins[0] if len(ins) == 2 and ins[1] is value else None


def _replace(old: ir.Value, new: ir.Value) -> None:
    """Every use of `old` reading `new`; where `old` is a graph output, `new` takes its place and its name."""
    if old.is_graph_output():
        name, old.name = old.name, f"{old.name}/replaced"
        new.name = name
    old.replace_all_uses_with(new, replace_graph_outputs=True)


def _last_axis(reduce: ir.Node, rank: int | None) -> bool:
    """Whether a ReduceMean reduces the last axis alone, keeping it (axes as its input, opset 18+, or attribute)."""
    axes = const_array(reduce.inputs[1]) if len(reduce.inputs) > 1 and reduce.inputs[1] is not None else None
    if axes is None and "axes" in reduce.attributes:
        axes = np.asarray(reduce.attributes.get_ints("axes"))
    if axes is None or axes.size != 1 or not reduce.attributes.get_int("keepdims", 1):
        return False
    axis = int(axes.reshape(-1)[0])
    return axis == -1 or (rank is not None and axis == rank - 1)


class FuseRmsNorm(AttnxPass):
    """The module doc's first pass, in place; a chain that differs in any step is left as it is."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        g = model.graph
        fused = 0
        for power in list(g):
            exponent = const_array(power.inputs[1]) if is_op(power, "Pow") else None
            if exponent is None or exponent.size != 1 or float(exponent) != 2.0:
                continue
            x = power.inputs[0]
            mean = _only_use(power.outputs[0], "ReduceMean")
            if mean is None or not _last_axis(mean, len(x.shape) if x.shape is not None else None):
                continue
            add = _only_use(mean.outputs[0], "Add")
            eps = const_array(_other(add, mean.outputs[0])) if add is not None else None
            sqrt = _only_use(add.outputs[0], "Sqrt") if eps is not None and eps.size == 1 else None
            inverse = _only_use(sqrt.outputs[0], "Reciprocal") if sqrt is not None else None
            scale = _only_use(inverse.outputs[0], "Mul") if inverse is not None else None
            if scale is None or _other(scale, inverse.outputs[0]) is not x:
                continue
            weigh = _only_use(scale.outputs[0], "Mul")
            weight = _other(weigh, scale.outputs[0]) if weigh is not None else None
            if weight is None:
                continue
            norm = ir.node("SimplifiedLayerNormalization", [x, weight], attributes={"axis": -1, "epsilon": float(eps)},
                           name=f"{weigh.name or 'rms'}/SimplifiedLayerNormalization")  # fmt: skip
            g.insert_after(weigh, norm)
            _replace(weigh.outputs[0], norm.outputs[0])
            fused += 1
        if fused:
            from onnx_ir.passes.common import RemoveUnusedNodesPass

            RemoveUnusedNodesPass()(model)
            self.notes.append(f"{fused} RMS norm(s) fused into SimplifiedLayerNormalization")
        return ir.passes.PassResult(model, modified=bool(fused))


class PackMatMuls(AttnxPass):
    """The module doc's second pass, in place: every group of two or more MatMuls of one input and constant [K, N]
    weights of one dtype."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        g = model.graph
        groups: dict[int, list[ir.Node]] = {}
        for node in g:
            weight = node.inputs[1] if is_op(node, "MatMul") else None
            if weight is not None and weight.const_value is not None and weight.shape is not None \
                    and len(weight.shape) == 2:  # fmt: skip
                groups.setdefault(id(node.inputs[0]), []).append(node)
        packed = []
        for nodes in groups.values():
            weights = [n.inputs[1] for n in nodes]
            if len(nodes) < 2 or len({w.dtype for w in weights}) != 1 or len({w.shape[0] for w in weights}) != 1:
                continue
            first = nodes[0]
            name = first.name or "matmul"
            concat = ir.node("Concat", weights, attributes={"axis": 1}, name=f"{name}/packed_weight")
            matmul = ir.node("MatMul", [first.inputs[0], concat.outputs[0]], name=f"{name}/packed")
            sizes = ir.Value(name=f"{name}/packed_split", const_value=ir.tensor(np.asarray([w.shape[1] for w in weights],
                                                                                         np.int64)))  # fmt: skip
            g.register_initializer(sizes)
            split = ir.node("Split", [matmul.outputs[0], sizes], attributes={"axis": -1}, num_outputs=len(nodes),
                            name=f"{name}/packed_split")  # fmt: skip
            g.insert_before(first, [concat, matmul, split])
            for node, out in zip(nodes, split.outputs):
                _replace(node.outputs[0], out)
            packed.append(len(nodes))
        if packed:
            from onnx_ir.passes.common import RemoveUnusedNodesPass

            RemoveUnusedNodesPass()(model)
            self.notes.append(f"{sum(packed)} MatMuls packed into {len(packed)} (groups of {sorted(set(packed))})")
        return ir.passes.PassResult(model, modified=bool(packed))


def _is_head(node: ir.Node | None) -> bool:
    """A language-model head: a MatMul of constant weights (or of a Transpose of them: a tied embedding table), or
    ONNX Runtime's MatMulNBits of constant packed weights (an int4 or int8 head); each row of its input its own
    row of the output."""
    if is_op(node, "MatMulNBits", (MS_DOMAIN,)):
        return node.inputs[1] is not None and node.inputs[1].const_value is not None
    return is_op(node, "MatMul") and matmul_weight(node.inputs[1])[0] is not None


class LastLogits(AttnxPass):
    """The module doc's third pass, in place: the head's input sliced to the last position, where the logits output
    comes from a MatMul of constant weights through position-wise ops alone (else left, with a note)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        g = model.graph
        out = next((v for v in g.outputs if v.name == LOGITS), None)
        node = out.producer() if out is not None else None
        while node is not None and node.op_type in _POSITIONWISE and node.domain in ("", "ai.onnx"):
            computed = [v for v in node.inputs if v is not None and const_array(v) is None]
            node = computed[0].producer() if len(computed) == 1 else None
        if out is None or not _is_head(node) or (out.shape is not None and len(out.shape) != 3):
            self.notes.append("logits: every position's (the head is not a MatMul or MatMulNBits of constant weights "
                              "before them)")  # fmt: skip
            return ir.passes.PassResult(model, modified=False)
        bounds = {"starts": -1, "ends": np.iinfo(np.int64).max, "axes": 1}
        values = [ir.Value(name=f"{LOGITS}/last_{k}", const_value=ir.tensor(np.asarray([v], np.int64)))
                  for k, v in bounds.items()]  # fmt: skip
        for value in values:
            g.register_initializer(value)
        last = ir.node("Slice", [node.inputs[0], *values], name=f"{LOGITS}/last_position")
        g.insert_before(node, last)
        node.replace_input_with(0, last.outputs[0])
        if out.shape is not None:
            out.shape = ir.Shape([out.shape[0], 1, out.shape[2]])
        self.notes.append("logits: the last position's alone (the head computed for one position)")
        return ir.passes.PassResult(model, modified=True)


