"""Reading a lowered graph back: which lowering it is, and its q/k projection weights.

lowering_of() names the form of the attention core a graph holds, from the graph itself,
so the metadata never claims a fusion that did not happen. qk_weights() finds the q and k
projections that feed the core (in any of the forms attnx writes) and returns them in the
torch convention of the weights file: the tolerance of a parity check depends on the
largest attention score (attnx.model.tolerance.problem_size), and a model file is all
`attnx optimize` has.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnx.export.passes._masks import const_array
from attnx.export.passes.quantize import dequantize_node
from attnx.model.contract import MS_DOMAIN, lowering_from_nodes

__all__ = ["lowering_of", "qk_weights", "v_weights"]

_STD = ("", "ai.onnx")


def _is(node: ir.Node | None, op_type: str, domain: tuple[str, ...] = _STD) -> bool:
    return node is not None and node.op_type == op_type and node.domain in domain


def lowering_of(model: ir.Model) -> str:
    """'ort-attention', 'ort-fused-packed', 'ort-fused', 'onnx' or 'decomposed': the contract's
    one probe (lowering_from_nodes), over this onnx-ir graph."""

    def first_producer(node: ir.Node) -> str | None:
        source = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        return source.op_type if source is not None else None

    nodes = ir.traversal.RecursiveGraphIterator(model.graph)  # an If's branches too
    return lowering_from_nodes((n.domain, n.op_type, first_producer(n)) for n in nodes)


def _strip_layout(value: ir.Value) -> ir.Value:
    """Back through the Reshapes and Transposes that split a projection into heads."""
    while (node := value.producer()) is not None and node.op_type in ("Reshape", "Transpose") and node.domain in _STD:
        value = node.inputs[0]
    return value


def _projection(value: ir.Value) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(W [in, out], bias or None) for value = [Add(] MatMul(x, W) [, b)], or a column slice
    of a packed MatMul through Split."""
    bias = None
    node = value.producer()
    if _is(node, "Add"):
        for i in (0, 1):
            b = const_array(node.inputs[1 - i])
            if b is not None and b.ndim == 1:
                bias, value, node = b, node.inputs[i], node.inputs[i].producer()
                break
        else:
            return None
    if _is(node, "Split"):
        index = list(node.outputs).index(value)
        sizes = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        packed = _projection(node.inputs[0])
        if sizes is None or packed is None:
            return None
        start = int(np.sum(sizes[:index]))
        w, b = packed
        cols = slice(start, start + int(sizes[index]))
        return w[:, cols], (b[cols] if b is not None else bias)
    if _is(node, "Mul"):  # int8's row rescale: DynamicQuantizeMatMul(x / r, ...) * r
        inner = next((i.producer() for i in node.inputs if i is not None and i.producer() is not None
                      and i.producer().op_type == "DynamicQuantizeMatMul"), None)  # fmt: skip
        node = inner if inner is not None else node
    if node is not None and node.domain == MS_DOMAIN and node.op_type in ("DynamicQuantizeMatMul", "MatMulNBits"):
        w = dequantize_node(node)  # a quantized projection: the weights it computes with
        return (w, bias) if w is not None else None
    if not _is(node, "MatMul"):
        return None
    w = const_array(node.inputs[1])
    return (w, bias) if w is not None and w.ndim == 2 else None


def _scores_operand(value: ir.Value) -> ir.Value:
    """From a Softmax input back to q k^T: through the mask's Where and the scaling."""
    while (node := value.producer()) is not None and node.domain in _STD:
        if node.op_type == "Where":
            value = node.inputs[2]
        elif node.op_type in ("Mul", "Div"):
            value = node.inputs[0] if const_array(node.inputs[0]) is None else node.inputs[1]
        else:
            break
    return value


def _core_qk(model: ir.Model) -> tuple[tuple, tuple] | None:
    """((Wq, bq), (Wk, bk)) of the first attention core found."""
    for node in model.graph:
        if _is(node, "MultiHeadAttention", (MS_DOMAIN,)):
            q, k = _projection(node.inputs[0]), _projection(node.inputs[1])
            if q is None or k is None:
                return None
            bias = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
            if bias is not None:  # the op's packed bias: [Dq | Dk | Dv]
                dq = q[0].shape[1]
                q, k = (q[0], bias[:dq]), (k[0], bias[dq : 2 * dq])
            return q, k
        if _is(node, "Attention", (MS_DOMAIN,)):
            packed = _packed_attention(node)
            return (packed[0], packed[1]) if packed is not None else None
        if _is(node, "Attention"):
            q, k = _projection(_strip_layout(node.inputs[0])), _projection(_strip_layout(node.inputs[1]))
            return (q, k) if q is not None and k is not None else None
        if _is(node, "Softmax"):
            scores = _scores_operand(node.inputs[0]).producer()
            if not _is(scores, "MatMul"):
                return None
            q, k = _projection(_strip_layout(scores.inputs[0])), _projection(_strip_layout(scores.inputs[1]))
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
        if _is(node, "MultiHeadAttention", (MS_DOMAIN,)) and len(node.inputs) > 2:
            found = _projection(node.inputs[2])
            bias = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
            if found is not None and bias is not None:  # the op's packed bias: [Dq | Dk | Dv]
                found = (found[0], bias[bias.shape[0] - found[0].shape[1] :])
        elif _is(node, "Attention", (MS_DOMAIN,)):
            packed = _packed_attention(node)
            found = packed[2] if packed is not None else None
        elif _is(node, "Attention") and len(node.inputs) > 2:
            found = _projection(_strip_layout(node.inputs[2]))
        elif _is(node, "Softmax"):
            uses = [use for use, _ in node.outputs[0].uses() if _is(use, "MatMul")]
            found = _projection(_strip_layout(uses[0].inputs[1])) if uses else None
        if found is not None:
            w, b = found
            return {"v_proj.weight": np.asarray(w, np.float32).T,
                    "v_proj.bias": np.asarray(b if b is not None else np.zeros(w.shape[1]), np.float32)}  # fmt: skip
    return None
