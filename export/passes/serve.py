"""Passes over the rest of a whole model's graph for the form generate serves (after its blocks are written in the
buffer form: attnx.workflows.rewrite.serve): fewer, larger kernels a decode step, the weights kept where they are.

    FuseRmsNorm   Pow(x, 2) -> ReduceMean(last axis) -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x, .) -> Mul(w, .)
                  (the RMS norm as torch.onnx exports transformers' LlamaRMSNorm in float32) -> one
                  SimplifiedLayerNormalization(x, w, epsilon): seven kernels a norm become one
    FuseSkipRmsNorm  Add(a, b) -> SimplifiedLayerNormalization -> one SkipSimplifiedLayerNormalization(a, b, w)
                  whose fourth output is the sum (the residual stream): two kernels a norm become one
    PackMatMuls   MatMuls of one input whose weights are constant [K, N_i] (a block's q/k/v projections, an MLP's
                  gate and up), or int4/int8 MatMulNBits of one K and form -> one over the weights concatenated
                  along N (and the biases where each has one), then Split: one GEMV a step reads them all; the
                  Concat is of the model's own initializers, which ONNX Runtime folds when it loads the model, so
                  the package holds each weight once
    PackedQkv     after PackMatMuls: a GroupQueryAttention whose q, k and v are the three outputs of a Split takes
                  the Split's input as its packed query: the op splits it itself, with no copy
    LastLogits    the logits of the last position alone: the hidden state sliced to its last token before the
                  language-model head (a MatMul of constant weights, or ONNX Runtime's MatMulNBits: an int4 or
                  int8 head; logits [batch, 1, vocab]): a prompt's only logits generation reads, its head
                  (a tenth of a Llama-shaped prompt's flops) computed for one position instead of all

Measured on a Llama-shaped model (hidden 1024, 4 layers, AMD EPYC, 2 threads, ONNX Runtime 1.31, a shared host): a
one-row step 7.2 ms with the first two against 8.8 ms without, in one run; later runs put the fused norms' gain at
0.6-0.7 ms and could not tell the packing from the host's noise (+-10%). LastLogits: a 300-token prompt 184 -> 172 ms.
On the Qwen2.5-0.5B shape at int4 (attnx's --weights int4; 2 threads, AMD EPYC, idle), FuseSkipRmsNorm and the packing
of MatMulNBits with their biases: a one-row step 31-35 -> 25-27 ms (169 MatMulNBits a step -> 97, 48 Adds -> 0).
The graph computes what it did up to rounding: the norm's mean and square root in another order (2.5e-6 on that
model's logits), the MatMuls' columns unchanged; the buffer form's proof holds the result to the model's own I/O
(attnx.workflows._buffer_form).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export.passes._base import AttnxPass, const_array, matmul_weight
from attnx.export.passes.walk import is_op
from attnx.model.contract import MS_DOMAIN

__all__ = ["FuseRmsNorm", "FuseSkipRmsNorm", "LastLogits", "PackMatMuls", "PackedQkv", "LOGITS"]

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


def _bias(node: ir.Node, columns: int | None) -> tuple[ir.Node, ir.Value] | None:
    """The Add of a constant bias of `columns` values that alone reads a MatMul's output (a q/k/v projection's bias),
    with the bias."""
    add = _only_use(node.outputs[0], "Add")
    bias = _other(add, node.outputs[0]) if add is not None else None
    if bias is None or bias.const_value is None or columns is None or tuple(bias.const_value.shape) != (columns,):
        return None
    return add, bias


def _packable(node: ir.Node) -> tuple[Any, ...] | None:
    """What must be equal for MatMuls of one input to be packed (None: not packable): a MatMul of a constant [K, N]
    weight, its dtype and K; or ONNX Runtime's MatMulNBits of constant packed weights, scales and zero points (no
    group index or bias of its own), its K, bits, block size, accuracy level and which of those it has."""
    if is_op(node, "MatMul"):
        weight = node.inputs[1]
        if weight is None or weight.const_value is None or weight.shape is None or len(weight.shape) != 2:
            return None
        return "MatMul", weight.dtype, weight.shape[0]
    if is_op(node, "MatMulNBits", (MS_DOMAIN,)):
        constants = list(node.inputs[1:])
        if len(constants) < 2 or len(constants) > 3 or any(v is not None and v.const_value is None for v in constants) \
                or constants[0] is None or constants[1] is None:  # fmt: skip
            return None
        a = node.attributes
        return ("MatMulNBits", a.get_int("K"), a.get_int("bits", 4), a.get_int("block_size"),
                a.get_int("accuracy_level", 0), *(v.dtype if v is not None else None for v in constants))
    return None


def _columns(node: ir.Node) -> int | None:
    if node.op_type == "MatMulNBits":
        return node.attributes.get_int("N")
    return node.inputs[1].shape[1] if isinstance(node.inputs[1].shape[1], int) else None


class PackMatMuls(AttnxPass):
    """The module doc's second pass, in place: every group of two or more MatMuls of one input and constant [K, N]
    weights of one dtype, or of ONNX Runtime's MatMulNBits of one K, bits, block size and accuracy level (their
    packed weights, scales and zero points concatenated along N, which are the rows of each); where each of a
    group's outputs is read by an Add of a constant bias alone (Qwen's q/k/v), the biases too, added before the
    Split."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        g = model.graph
        groups: dict[tuple[Any, ...], list[ir.Node]] = {}
        for node in g:
            key = _packable(node)
            if key is not None:
                groups.setdefault((id(node.inputs[0]), *key), []).append(node)
        packed = []
        for nodes in groups.values():
            columns = [_columns(n) for n in nodes]
            if len(nodes) < 2 or None in columns:
                continue
            first = nodes[0]
            name = first.name or "matmul"
            made = []
            if first.op_type == "MatMul":
                concat = ir.node("Concat", [n.inputs[1] for n in nodes], attributes={"axis": 1},
                                 name=f"{name}/packed_weight")  # fmt: skip
                matmul = ir.node("MatMul", [first.inputs[0], concat.outputs[0]], name=f"{name}/packed")
                made += [concat, matmul]
            else:  # MatMulNBits: each tensor's first axis is N (its rows, or row-major flat: the scales may be 1-D)
                constants = []
                for i in range(1, len(first.inputs)):
                    if first.inputs[i] is None:
                        constants.append(None)
                        continue
                    concat = ir.node("Concat", [n.inputs[i] for n in nodes], attributes={"axis": 0},
                                     name=f"{name}/packed_{i}")  # fmt: skip
                    made.append(concat)
                    constants.append(concat.outputs[0])
                attributes = {k: a.value for k, a in first.attributes.items()}
                attributes["N"] = sum(columns)
                matmul = ir.node("MatMulNBits", [first.inputs[0], *constants], attributes=attributes, domain=MS_DOMAIN,
                                 name=f"{name}/packed")  # fmt: skip
                made.append(matmul)
            ends = [n.outputs[0] for n in nodes]
            biases = [_bias(n, c) for n, c in zip(nodes, columns)]
            out = matmul.outputs[0]
            if all(b is not None for b in biases):
                concat = ir.node("Concat", [b[1] for b in biases], attributes={"axis": 0}, name=f"{name}/packed_bias")
                add = ir.node("Add", [out, concat.outputs[0]], name=f"{name}/packed_add")
                made += [concat, add]
                out = add.outputs[0]
                ends = [b[0].outputs[0] for b in biases]
            sizes = ir.Value(name=f"{name}/packed_split", const_value=ir.tensor(np.asarray(columns, np.int64)))
            g.register_initializer(sizes)
            split = ir.node("Split", [out, sizes], attributes={"axis": -1}, num_outputs=len(nodes),
                            name=f"{name}/packed_split")  # fmt: skip
            g.insert_before(first, [*made, split])
            for end, value in zip(ends, split.outputs):
                _replace(end, value)
            packed.append(len(nodes))
        if packed:
            from onnx_ir.passes.common import RemoveUnusedNodesPass

            RemoveUnusedNodesPass()(model)
            self.notes.append(f"{sum(packed)} MatMuls packed into {len(packed)} (groups of {sorted(set(packed))})")
        return ir.passes.PassResult(model, modified=bool(packed))


def _same_shape(a: ir.Shape | None, b: ir.Shape | None) -> bool:
    """Whether two values of rank 3 are of one shape, no axis broadcast: each axis equal, or symbolic in both (two
    names for the batch, as a spliced block's output and the model's own, are one size where they are added)."""
    if a is None or b is None or len(a) != 3 or len(b) != 3:
        return False
    return all(x == y or not isinstance(x, int) and not isinstance(y, int) for x, y in zip(a, b))


class FuseSkipRmsNorm(AttnxPass):
    """Add(a, b) -> SimplifiedLayerNormalization (a residual sum, then the next norm) -> one ONNX Runtime
    SkipSimplifiedLayerNormalization(a, b, w), whose fourth output is the sum where anything else reads it (the
    residual stream): a step's residual adds become part of its norms. Where a and b are not of one shape of rank 3
    ([batch, sequence, hidden]: no broadcasting; _same_shape), or the norm is over another axis, it is left."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        g = model.graph
        fused = 0
        for norm in list(g):
            if not is_op(norm, "SimplifiedLayerNormalization") or norm.attributes.get_int("axis", -1) not in (-1, 2) \
                    or len(norm.outputs) != 1 or len(norm.inputs) != 2:  # fmt: skip
                continue
            add = norm.inputs[0].producer()
            if not is_op(add, "Add") or any(const_array(v) is not None for v in add.inputs):
                continue
            a, b = add.inputs
            if not _same_shape(a.shape, b.shape) or norm.inputs[1] is None or norm.inputs[1].const_value is None:
                continue
            skip = ir.node("SkipSimplifiedLayerNormalization", [a, b, norm.inputs[1]], domain=MS_DOMAIN,
                           attributes={"epsilon": norm.attributes.get_float("epsilon", 1e-5)}, num_outputs=4,
                           name=f"{norm.name or 'rms'}/SkipSimplifiedLayerNormalization")  # fmt: skip
            skip.outputs[1].name = skip.outputs[2].name = ""  # not computed: the mean and inverse deviation
            for new, old in ((skip.outputs[0], norm.outputs[0]), (skip.outputs[3], add.outputs[0])):
                new.shape, new.type = old.shape or a.shape, old.type or a.type
            g.insert_after(add, skip)  # where the sum was: whatever reads it comes after
            others = [u for u in add.outputs[0].uses() if u.node is not norm]
            _replace(norm.outputs[0], skip.outputs[0])
            if others or add.outputs[0].is_graph_output():
                _replace(add.outputs[0], skip.outputs[3])
            fused += 1
        if fused:
            from onnx_ir.passes.common import RemoveUnusedNodesPass

            RemoveUnusedNodesPass()(model)
            self.notes.append(f"{fused} residual add(s) fused into their norm (SkipSimplifiedLayerNormalization)")
        return ir.passes.PassResult(model, modified=bool(fused))


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


class PackedQkv(AttnxPass):
    """After the packing of sibling MatMuls (attnx.export.passes.serve.PackMatMuls): a GroupQueryAttention whose q,
    k and v are the three outputs, in order, of a Split it alone reads takes the Split's input as its packed query
    (key and value empty): the op splits it itself, with no copy."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        packed = 0
        for core in list(model.graph):
            if not is_op(core, "GroupQueryAttention", (MS_DOMAIN,)) or len(core.inputs) < 3 or core.inputs[1] is None:
                continue
            split = core.inputs[0].producer()
            if not is_op(split, "Split") or len(split.outputs) != 3 \
                    or [core.inputs[i] for i in range(3)] != list(split.outputs) \
                    or any(len(list(v.uses())) != 1 for v in split.outputs):  # fmt: skip
                continue
            core.replace_input_with(0, split.inputs[0])
            core.replace_input_with(1, None)
            core.replace_input_with(2, None)
            packed += 1
        if packed:
            from onnx_ir.passes.common import RemoveUnusedNodesPass

            RemoveUnusedNodesPass()(model)
            self.notes.append(f"{packed} GroupQueryAttention(s) take the packed q/k/v projection")
        return ir.passes.PassResult(model, modified=bool(packed))
