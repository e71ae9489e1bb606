"""The one walker of attention in a graph, whoever wrote it: from an attention node or a Softmax back to q, k and v
and the projections they come from. Every reader (attnx.export._read, the block readers of attnx.export.cores) and
pass (NameStages) reads a core through it:

    score_chain(softmax)     the Softmax's chain: q.k, the scalings, the masks, a sink, the probabilities, p.v
    walk(value)              a fused op's input back to its projection: the cache's Concat, a RotaryEmbedding, a norm
    find_projection(value)   the same for a decomposed core, breadth first (a rotation's arithmetic, an RMS norm's)
    projection(value)        the weights [in, out] and bias of a projection's output (a packed one's columns)

What is not followed raises NotRead, saying what and where.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export.passes._base import const_array
from attnx.export.passes.quantize import dequantize_node
from attnx.model.contract import MS_DOMAIN

__all__ = ["NotRead", "Path", "ScoreChain", "find_projection", "head_dim", "is_op", "last_axis_slice", "past_cache",
           "computed_from", "flat_gemm", "flattened_input", "pairs_interleaved", "plain_norm", "position_factor", "positions_of",
           "projection", "projection_node", "reaches_matmul", "rms_norm", "score_chain",
           "sink_logits", "strip_layout", "walk"]

STD = ("", "ai.onnx")


class NotRead(Exception):
    """A structure a reader does not follow (a walk, a mask attnx.export.passes._masks does not recognise: never
    guessed at); the message says what and where, and goes in the report."""


def is_op(node: ir.Node | None, op_type: str, domain: tuple[str, ...] = STD) -> bool:
    return node is not None and node.op_type == op_type and node.domain in domain


def strip_layout(value: ir.Value) -> ir.Value:
    """Back through the Reshapes and Transposes that split a projection into heads."""
    while (node := value.producer()) is not None and node.op_type in ("Reshape", "Transpose") and node.domain in STD:
        value = node.inputs[0]
    return value


def past_cache(value: ir.Value) -> ir.Value:
    """Through a step model's Concat onto the cache (present = Concat(past, new)): the new values."""
    node = value.producer()
    return node.inputs[-1] if is_op(node, "Concat") and len(node.inputs) == 2 else value


def last_axis_slice(node: ir.Node) -> slice | None:
    """The columns a Slice takes on its input's last axis (constant starts, ends and axes, step 1), or None."""
    starts, ends = (const_array(node.inputs[i]) if len(node.inputs) > i else None for i in (1, 2))
    axes = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    rank = len(node.inputs[0].shape) if node.inputs[0].shape is not None else None
    if starts is None or ends is None or axes is None or starts.size != 1 or ends.size != 1 or axes.size != 1:
        return None
    if (steps is not None and int(steps.ravel()[0]) != 1) or int(axes.ravel()[0]) not in (-1, (rank or 0) - 1):
        return None
    start, end = int(starts.ravel()[0]), int(ends.ravel()[0])
    return slice(start, end) if 0 <= start < end else None


def flat_gemm(node: ir.Node | None) -> ir.Node | None:
    """The Gemm of torch's addmm projection (GPT-2's Conv1D): x flattened to [tokens, in], Gemm(x, W, b), shaped
    back: from the Reshape back (or the Gemm itself), the Gemm; None for anything else. Only the plain product
    (alpha and beta 1, x not transposed) with constant weights."""
    if is_op(node, "Reshape") and node.inputs[0] is not None:
        node = node.inputs[0].producer()
    if not is_op(node, "Gemm"):
        return None
    a = node.attributes
    if a.get_float("alpha", 1.0) != 1.0 or a.get_float("beta", 1.0) != 1.0 or a.get_int("transA", 0):
        return None
    return node if const_array(node.inputs[1]) is not None else None


def _gemm_projection(node: ir.Node) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(W [in, out], bias or None) of a flat_gemm node: its B (transposed where transB), its C where a vector."""
    w = const_array(node.inputs[1])
    if w.ndim != 2:
        return None
    w = w.T if node.attributes.get_int("transB", 0) else w
    bias = const_array(node.inputs[2]) if len(node.inputs) > 2 else None
    if len(node.inputs) > 2 and node.inputs[2] is not None and (bias is None or bias.shape != (w.shape[1],)):
        return None  # a C that is not the projection's bias vector
    return w, bias


def flattened_input(node: ir.Node) -> ir.Value:
    """A projection node's input, before the flattening to [tokens, in] of torch's addmm (flat_gemm)."""
    x = node.inputs[0]
    if is_op(node, "Gemm") and is_op(x.producer(), "Reshape"):
        return x.producer().inputs[0]
    return x


def projection(value: ir.Value) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(W [in, out], bias or None) for value = [Add(] MatMul(x, W) [, b)] (or torch's addmm, flat_gemm), or a column
    slice of a packed one through Split or Slice."""
    bias = None
    node = value.producer()
    if (gemm := flat_gemm(node)) is not None:
        return _gemm_projection(gemm)
    if is_op(node, "Add"):
        for i in (0, 1):
            b = const_array(node.inputs[1 - i])
            if b is not None and b.ndim == 1:
                bias, value, node = b, node.inputs[i], node.inputs[i].producer()
                break
        else:
            return None
    if is_op(node, "Split"):
        index = list(node.outputs).index(value)
        sizes = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        packed = projection(node.inputs[0])
        if packed is None:
            return None
        w, b = packed
        if sizes is None and (parts := node.attributes.get_int("num_outputs", 0)):  # opset 18's even split
            chunk = -(-w.shape[1] // parts)  # ONNX: chunks of ceil(n / parts), the last one what is left
            sizes = np.array([chunk] * (parts - 1) + [w.shape[1] - chunk * (parts - 1)])
        if sizes is None:
            return None
        axis, rank = node.attributes.get_int("axis", 0), node.inputs[0].shape and len(node.inputs[0].shape)
        if int(np.sum(sizes)) != w.shape[1] or (rank and axis not in (-1, rank - 1)):
            return None  # not the packed projection's columns
        start = int(np.sum(sizes[:index]))
        cols = slice(start, start + int(sizes[index]))
        return w[:, cols], (b[cols] if b is not None else bias)
    if is_op(node, "Slice") and (cols := last_axis_slice(node)) is not None:  # a packed MatMul's columns
        packed = projection(node.inputs[0])
        if packed is None:
            return None
        w, b = packed
        return w[:, cols], (b[cols] if b is not None else bias)
    if is_op(node, "Mul"):  # int8's row rescale: DynamicQuantizeMatMul(x / r, ...) * r
        inner = next((i.producer() for i in node.inputs if i is not None and i.producer() is not None
                      and i.producer().op_type == "DynamicQuantizeMatMul"), None)  # fmt: skip
        node = inner if inner is not None else node
    if node is not None and node.domain == MS_DOMAIN and node.op_type in ("DynamicQuantizeMatMul", "MatMulNBits"):
        w = dequantize_node(node)  # a quantized projection: the weights it computes with
        return (w, bias) if w is not None else None
    if not is_op(node, "MatMul"):
        return None
    w = const_array(node.inputs[1])
    return (w, bias) if w is not None and w.ndim == 2 else None


def projection_node(value: ir.Value) -> ir.Node:
    """The MatMul (or MatMulNBits) of a projection's output, through a bias Add and a Split."""
    node = value.producer()
    if (gemm := flat_gemm(node)) is not None:
        return gemm
    if is_op(node, "Add"):
        node = next((i.producer() for i in node.inputs if i is not None and const_array(i) is None), None)
    if is_op(node, "Split") or (is_op(node, "Slice") and last_axis_slice(node) is not None):
        return projection_node(node.inputs[0])
    if is_op(node, "MatMul") or is_op(node, "MatMulNBits", (MS_DOMAIN,)):
        return node
    raise NotRead(f"{value.name}: not a projection (MatMul, MatMulNBits, Gemm, with a bias Add or a Split), "
                  f"made by {node.op_type if node is not None else 'a graph input'}")  # fmt: skip


# what lies between a core's query/key/value input and its projection: the heads' layout, a GQA group's
# repeat (Expand, Tile), casts, a RotaryEmbedding, a per-head norm, the cache's Concat(past, new)
PASS_OPS = ("Reshape", "Transpose", "Expand", "Unsqueeze", "Squeeze", "Cast", "Identity", "Tile")


@dataclasses.dataclass
class Path:
    projection: ir.Value  # the projection's output (with its bias)
    rotary: Any = None  # the RotaryEmbedding node; for a decomposed rotary, its {"Cos": table, "Sin": table}
    norm: tuple[np.ndarray, float] | None = None
    past: ir.Value | None = None  # the graph input the cache Concat appends to
    present: ir.Value | None = None  # that Concat's output
    scale: float = 1.0  # constant scalings met (a decomposed core's sqrt(scale) on q and on k)
    plain_norm: float | None = None  # the eps of a norm without weights met (x / sqrt(mean(x^2) + eps): Llama 4's)
    factor: ir.Value | None = None  # a factor the graph computes per position, not from the hidden state (a Log in it)
    interleaved: bool = False  # the rotation reads pairs (2i, 2i + 1): a Gather of 0/1 or a Slice of step 2, last axis


def walk(value: ir.Value) -> Path:
    """Back from a core's input to its projection, noting the rotary, norm and cache met on the way."""
    path = Path(value)
    while (node := value.producer()) is not None:
        if is_op(node, "Concat") and len(node.inputs) == 2 and node.inputs[0] is not None \
                and node.inputs[0].is_graph_input():  # fmt: skip
            path.past, path.present, value = node.inputs[0], node.outputs[0], node.inputs[1]
        elif node.op_type == "RotaryEmbedding" and node.domain in (MS_DOMAIN, "", "ai.onnx"):
            path.rotary, value = node, node.inputs[0]
        elif node.op_type in ("SimplifiedLayerNormalization", "RMSNormalization") and node.domain in (
            MS_DOMAIN, "", "ai.onnx"
        ):  # fmt: skip
            weight = const_array(node.inputs[1])
            if weight is None:
                raise NotRead(f"node {node.name}: a norm whose weight is not a constant")
            path.norm, value = (weight, node.attributes.get_float("epsilon", 1e-5)), node.inputs[0]
        elif node.op_type in PASS_OPS and node.domain in ("", "ai.onnx"):
            value = node.inputs[0]
        elif is_op(node, "Div") or is_op(node, "Mul"):  # a norm without weights, a factor per position (Llama 4's)
            computed = [i for i in node.inputs if i is not None and const_array(i) is None]
            if len(computed) != 2:
                break
            if path.plain_norm is None and (norm := plain_norm(node)) is not None:
                path.plain_norm, value = norm
            elif is_op(node, "Mul") and path.factor is None and (f := next(
                    (i for i in computed if position_factor(i)), None)) is not None:  # fmt: skip
                path.factor, value = f, next(i for i in computed if i is not f)
            else:
                break
        else:
            break
    path.projection = value
    return path


# The decomposed core: MatMul(q, k^T), scale, masks, Softmax, MatMul(p, v), as attnx and torch.onnx write it --------
PROJECTION_OPS = (("MatMul", ("", "ai.onnx")), ("MatMulNBits", (MS_DOMAIN,)))


def is_projection(node: ir.Node) -> bool:
    return any(is_op(node, op, domain) for op, domain in PROJECTION_OPS) and (
        const_array(node.inputs[1]) is not None or node.op_type == "MatMulNBits"
    )


def feeds_from(value: ir.Value, ops: tuple[str, ...], depth: int = 4) -> ir.Node | None:
    """The node of one of `ops` that `value` comes from within a few layout steps (Unsqueeze, Cast, Reshape,
    Expand, Transpose, Squeeze), or None."""
    for _ in range(depth + 1):
        node = value.producer()
        if node is None:
            return None
        if node.op_type in ops:
            return node
        if node.op_type not in ("Unsqueeze", "Cast", "Reshape", "Expand", "Transpose", "Squeeze"):
            return None
        value = node.inputs[0]
    return None


def rms_norm(node: ir.Node) -> tuple[np.ndarray, float] | None:
    """(weight, eps) of a decomposed RMS norm ending at `node`: Mul(x * rsqrt(mean(x^2) + eps), weight), the weight
    a constant vector; None when the Mul is not one."""
    weight = next((c for i in node.inputs if (c := const_array(i)) is not None and c.ndim == 1 and c.size > 1), None)
    if weight is None:
        return None
    seen, queue, eps, mean = set(), [i for i in node.inputs if const_array(i) is None], None, False
    while queue and len(seen) < 12:
        n = queue.pop(0).producer()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op_type == "ReduceMean":
            mean = True
        elif n.op_type == "Add" and (c := next((const_array(i) for i in n.inputs if const_array(i) is not None), None)) is not None \
                and c.size == 1:  # fmt: skip
            eps = float(c.ravel()[0])
        if n.op_type in ("Mul", "Div", "Sqrt", "Reciprocal", "Add", "ReduceMean", "Pow", "Cast"):
            queue += [i for i in n.inputs if i is not None and const_array(i) is None]
    return (weight, eps if eps is not None else 1e-6) if mean else None


# the operators whose inputs past the first are a shape, axes, indices or sizes
SHAPED_OPS = ("Reshape", "Expand", "Tile", "Slice", "Unsqueeze", "Squeeze", "Pad", "Gather", "ConstantOfShape", "Range")


def find_projection(value: ir.Value, limit: int = 96) -> tuple[ir.Value, Path]:
    """The nearest projection (a MatMul of constant weights) above `value`, breadth first, with its bias Add, and what
    lies between: the cache's Concat(past, new), the rotary's Cos/Sin (their Mul by a constant, the attention factor,
    kept), a decomposed RMS norm, and constant scalings (the square root of the scale that transformers' sdpa puts on
    q and on k): for any arrangement of the rotation's Slice/Neg/Mul/Add/Concat. Nothing above a projection is read."""
    path = Path(value)
    path.scale = 1.0
    found = None
    seen, queue = set(), [value]
    while queue and len(seen) < limit:
        v = queue.pop(0)
        node = v.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if is_op(node, "Slice") and last_axis_slice(node) is not None and projection(node.outputs[0]) is not None:
            found = found or node.outputs[0]  # a packed projection's columns (q | k | v in one MatMul)
            continue
        if is_op(node, "Split") and projection(v) is not None:
            found = found or v  # a packed projection split into q | k | v (GPT-2's c_attn)
            continue
        if is_projection(node):
            if found is None:
                out = node.outputs[0]
                adds = [u for u, _ in out.uses() if is_op(u, "Add") and any(
                    (c := const_array(i)) is not None and c.ndim == 1 for i in u.inputs)]  # fmt: skip
                found = adds[0].outputs[0] if adds else out
            continue  # the hidden state and the layers before: not this block's
        if is_op(node, "Concat") and len(node.inputs) == 2 and node.inputs[0] is not None \
                and node.inputs[0].is_graph_input() and path.past is None:  # fmt: skip
            path.past, path.present = node.inputs[0], node.outputs[0]
            queue.append(node.inputs[1])
            continue
        if node.op_type in ("Cos", "Sin") and node.domain in ("", "ai.onnx"):
            table = node.outputs[0]
            users = [u for u, _ in table.uses()]
            if len(users) == 1 and is_op(users[0], "Mul") and any(const_array(i) is not None for i in users[0].inputs):
                table = users[0].outputs[0]  # the attention factor
            path.rotary = path.rotary or {}
            path.rotary[node.op_type] = table
            continue  # the table's own inputs (position_ids, inv_freq) hold no projection
        if node.op_type in ("Shape", "Size"):
            continue  # a size, not values: the shape arithmetic above it is not the block's
        if pairs_interleaved(node):
            path.interleaved = True
        if node.op_type in ("Mul", "Div") and node.domain in ("", "ai.onnx"):
            consts = [c for i in node.inputs if (c := const_array(i)) is not None]
            computed = [i for i in node.inputs if i is not None and const_array(i) is None]
            if not consts and len(computed) == 2 and path.plain_norm is None and (norm := plain_norm(node)):
                path.plain_norm = norm[0]
                queue.append(norm[1])
                continue
            if node.op_type == "Mul" and not consts and len(computed) == 2 and path.factor is None:
                factor = next((i for i in computed if position_factor(i)), None)
                if factor is not None:
                    path.factor = factor
                    queue += [i for i in computed if i is not factor]
                    continue
            divisor = node.op_type == "Mul" or const_array(node.inputs[1]) is not None
            if consts and consts[0].size == 1 and consts[0].dtype.kind == "f" and len(computed) == 1 and divisor:
                # not a table's attention factor, nor the arithmetic of a table (Llama 4's complex product)
                if feeds_from(computed[0], ("Cos", "Sin")) is None and not computed_from(computed[0], ("Cos", "Sin")):
                    c = float(consts[0].ravel()[0])
                    path.scale *= c if node.op_type == "Mul" else 1.0 / c
            elif node.op_type == "Mul" and consts and path.norm is None and (norm := rms_norm(node)) is not None:
                path.norm = norm
                queue += rms_input(node)
                continue
        data = node.inputs[:1] if node.op_type in SHAPED_OPS else node.inputs  # not the shape, axes or indices
        queue += [i for i in data if i is not None and const_array(i) is None]
    if found is None:
        raise NotRead(f"{value.name}: no projection (a MatMul of constant weights) found above it")
    path.projection = found
    return found, path


def plain_norm(node: ir.Node) -> tuple[float, ir.Value] | None:
    """(eps, x) of x * 1 / sqrt(mean(x^2) + eps) (a Mul by a Reciprocal of the Sqrt, or a Div by the Sqrt) with no
    weights, or None."""
    pairs = [(node.inputs[0], node.inputs[1])] if node.op_type == "Div" else \
        [(node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])]  # fmt: skip
    for x, denominator in pairs:
        n, inverted, eps = denominator.producer(), node.op_type == "Div", None
        while n is not None and n.op_type in ("Reciprocal", "Sqrt", "Add", "Cast") and n.domain in STD:
            inverted ^= n.op_type == "Reciprocal"
            if n.op_type == "Add":
                c = next((const_array(i) for i in n.inputs if const_array(i) is not None), None)
                if c is None or c.size != 1:
                    break
                eps = float(c.ravel()[0])
                n = next(i for i in n.inputs if const_array(i) is None).producer()
            else:
                n = n.inputs[0].producer()
        if not (inverted and eps is not None and is_op(n, "ReduceMean")):
            continue
        square = n.inputs[0].producer()
        if is_op(square, "Pow") and square.inputs[0] is x and (c := const_array(square.inputs[1])) is not None \
                and float(c.ravel()[0]) == 2.0:  # fmt: skip
            return eps, x
        if is_op(square, "Mul") and square.inputs[0] is x and square.inputs[1] is x:
            return eps, x
    return None


def computed_from(value: ir.Value, ops: tuple[str, ...], limit: int = 48) -> bool:
    """Whether `value` is computed from positions alone through one of `ops` (a rotary table's Cos or Sin, a
    temperature's Log): one of them above it and no projection (no hidden state) in all of its at most `limit` nodes
    (more: not known, so not)."""
    seen, queue, met = set(), [value], False
    while queue:
        node = queue.pop(0).producer()
        if node is None or id(node) in seen:
            continue
        if len(seen) == limit or node.op_type in ("MatMul", "MatMulNBits", "Gemm"):
            return False
        seen.add(id(node))
        met |= node.op_type in ops
        if node.op_type not in ("Shape", "Size"):  # a size, not values: what it measures is not read
            queue += [i for i in node.inputs if i is not None and const_array(i) is None]
    return met


# ops that carry a tensor's values through unchanged, only laid out again (their data input is the first)
_LAYOUT_ONLY = ("Unsqueeze", "Squeeze", "Reshape", "Expand", "Identity", "Cast", "Flatten")


def positions_of(value: ir.Value, limit: int = 48) -> ir.Value | None:
    """The positions a rotary table the graph computes (`value`, its cos or sin) is computed from: the integer
    tensor a Cast turns into the angle's factor, followed up through layout ops (_LAYOUT_ONLY) to where the
    positions are made: a graph input (position_ids) or a Range (positions counted from the cache's length, as
    Optimum's exports without a position_ids input count them). None where no such source lies within `limit`
    nodes above it."""
    seen, queue = set(), [value]
    while queue and len(seen) < limit:
        node = queue.pop(0).producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if is_op(node, "Cast"):
            source = node.inputs[0]
            while (maker := source.producer()) is not None and maker.op_type in _LAYOUT_ONLY and maker.domain in STD:
                source = maker.inputs[0]
            if (maker is None and source.is_graph_input()) or is_op(maker, "Range"):
                return source
        queue += [i for i in node.inputs if i is not None and const_array(i) is None]
    return None


def position_factor(value: ir.Value) -> bool:
    """Whether `value` is a factor computed per position, as a temperature is (a Log above it, no hidden state)."""
    return computed_from(value, ("Log",))


def pairs_interleaved(node: ir.Node) -> bool:
    """A rotation's read of pairs (2i, 2i + 1): a Gather of index 0 or 1 on the last axis, or a Slice of step 2 on it."""
    if is_op(node, "Gather") and (index := const_array(node.inputs[1])) is not None and index.size == 1 \
            and int(index.ravel()[0]) in (0, 1):  # fmt: skip
        axis, shape = node.attributes.get_int("axis", 0), node.inputs[0].shape
        return shape is not None and len(shape) >= 4 and axis in (-1, len(shape) - 1)  # [B, S, heads, .., 2]
    if is_op(node, "Slice") and len(node.inputs) > 4 and (steps := const_array(node.inputs[4])) is not None:
        axes = const_array(node.inputs[3]) if node.inputs[3] is not None else None
        shape = node.inputs[0].shape
        last = axes is not None and axes.size == 1 and (int(axes.ravel()[0]) == -1 or (
            shape is not None and int(axes.ravel()[0]) == len(shape) - 1))  # fmt: skip
        return last and steps.size == 1 and int(steps.ravel()[0]) == 2
    return False


def rms_input(node: ir.Node) -> list[ir.Value]:
    """The value a decomposed RMS norm normalizes (the input of its Pow or of its first Mul), to walk on from."""
    seen, queue = set(), [i for i in node.inputs if const_array(i) is None]
    while queue and len(seen) < 12:
        v = queue.pop(0)
        n = v.producer()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op_type == "Pow" or (n.op_type == "Mul" and n.inputs[0] is n.inputs[1]):  # x^2, or x * x (attnx's)
            return [n.inputs[0]]
        if n.op_type in ("Mul", "Div", "Sqrt", "Reciprocal", "Add", "ReduceMean", "Cast"):
            queue += [i for i in n.inputs if i is not None and const_array(i) is None]
    return [i for i in node.inputs if const_array(i) is None]


def head_dim(value: ir.Value) -> int | None:
    """A query's head size: its last static dimension, else the last entry of a constant 4-or-more-axis Reshape
    above it (the split into heads)."""
    if value.shape is not None and len(value.shape) >= 3 and isinstance(value.shape[-1], int):
        return value.shape[-1]
    seen, queue = set(), [value]
    while queue and len(seen) < 32:
        node = queue.pop(0).producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if is_op(node, "Reshape"):
            shape = const_array(node.inputs[1])
            maker = node.inputs[1].producer()
            if shape is None and is_op(maker, "Concat") and len(maker.inputs) >= 3:  # a shape of computed dims
                shape = const_array(maker.inputs[-1])
                shape = shape if shape is not None and shape.size == 1 else None
            elif shape is not None and shape.size < 4:
                shape = None
            if shape is not None and shape.ravel()[-1] > 0:
                return int(shape.ravel()[-1])
        queue += [i for i in node.inputs if i is not None and const_array(i) is None]
    return None


def sink_logits(value: ir.Value) -> np.ndarray | None:
    """A head sink's logits: the constant behind a column concatenated after the scores before the Softmax (through
    its Expand/Reshape/Cast to the scores' shape), or None without one."""
    node = value.producer()
    if not (is_op(node, "Concat") and len(node.inputs) == 2):
        return None
    seen, queue = set(), [node.inputs[1]]
    while queue and len(seen) < 12:
        v = queue.pop(0)
        if (c := const_array(v)) is not None and c.dtype.kind == "f" and c.size > 1:
            return np.array(c, np.float32)
        n = v.producer()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        queue += list(n.inputs[:1]) if n.op_type in SHAPED_OPS else [i for i in n.inputs if i is not None]
    raise NotRead(f"{node.inputs[1].name}: a column after the scores (a sink) whose logits are not a constant")


# the steps between q.k and a Softmax: scalings, caps, masks, layouts, a sink's column
SCORE_STEPS = ("Mul", "Div", "Reshape", "Tanh", "Cast", "Transpose", "Add", "Sub", "Where", "Concat", "Clip", "Max",
                "Min", "Neg", "Identity", "Expand", "Squeeze", "Unsqueeze")


def reaches_matmul(value: ir.Value, depth: int = 6) -> bool:
    """Whether `value` comes from a MatMul of two computed operands (q.k) within a few scaling, masking and layout
    steps: the scores' side of an Add, or a Softmax that is attention's."""
    frontier = [value]
    for _ in range(depth):
        nxt = []
        for v in frontier:
            node = v.producer()
            if node is None or node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "MatMul" and const_array(node.inputs[1]) is None and const_array(node.inputs[0]) is None:
                return True
            if node.op_type in SCORE_STEPS:
                nxt += [i for i in node.inputs if i is not None and const_array(i) is None]
        frontier = nxt
    return False

@dataclasses.dataclass
class ScoreChain:
    """What lies between a Softmax and attention's two MatMuls, walked once (score_chain): from the Softmax back to
    q.k through the scalings (the scale, a softcap's c * tanh(s / c)), the masks, a sink's column, layouts and casts;
    and forward to the MatMul with the values through a sink's column dropped, casts and a guard zeroing a row of
    NaN. What each reader and pass reads of the core is read from this one walk."""

    softmax: ir.Node
    qk: ir.Node | None = None  # MatMul(q, k^T); None where the walk stops before one (at `end`)
    end: ir.Value | None = None  # the value the walk back stopped at, where it found no q.k
    steps: list[ir.Node] = dataclasses.field(default_factory=list)  # from the Softmax back to qk, in that order
    # ("scale", factor, node, its constant) or ("tanh", 0.0, node, None), from the Softmax back
    scalings: list[tuple[str, float, ir.Node, ir.Value | None]] = dataclasses.field(default_factory=list)
    masks: list[tuple[ir.Node, ir.Value, str]] = dataclasses.field(default_factory=list)  # (node, tensor, how)
    constant_bias: bool = False  # a constant other than zero added to the scores (a folded mask or a position bias)
    sink: ir.Node | None = None  # the Concat joining a sink's column after the scores
    probs: ir.Value | None = None  # the probabilities the values are weighted by
    pv: ir.Node | None = None  # MatMul(p, v)


def _scalar(node: ir.Node) -> tuple[float, ir.Value] | None:
    const = next((i for i in node.inputs if i is not None and const_array(i) is not None), None)
    if const is None or const_array(const).size != 1:
        return None
    return float(const_array(const).ravel()[0]), const


def score_chain(softmax: ir.Node) -> ScoreChain:
    """The chain around a Softmax (ScoreChain). A mask is how it hides: "where-masked" (Where(hide, lowest,
    scores)), "where-kept" (Where(keep, scores, lowest)) or "additive" (a computed tensor added to the scores, on
    the side that does not reach q.k)."""
    chain = ScoreChain(softmax)
    value = softmax.inputs[0]
    while (node := value.producer()) is not None and node.domain in STD:
        if node.op_type == "MatMul":
            chain.qk = node
            break
        chain.steps.append(node)
        if node.op_type in ("Mul", "Div") and (scalar := _scalar(node)) is not None:
            factor, const = scalar
            chain.scalings.append(("scale", factor if node.op_type == "Mul" else 1.0 / factor, node, const))
        elif node.op_type == "Tanh":
            chain.scalings.append(("tanh", 0.0, node, None))
        if node.op_type == "Where":
            first, second = node.inputs[1], node.inputs[2]
            if const_array(first) is not None:  # Where(hide, lowest, scores)
                chain.masks.append((node, node.inputs[0], "where-masked"))
                value = second
            else:  # Where(keep, scores, lowest)
                chain.masks.append((node, node.inputs[0], "where-kept"))
                value = first
        elif node.op_type == "Add":
            a, bb = node.inputs[0], node.inputs[1]
            constant = const_array(bb) if const_array(bb) is not None else const_array(a)
            if constant is not None:  # a constant added to the scores
                chain.constant_bias |= bool(np.any(constant))
                value = a if const_array(bb) is not None else bb
                continue
            scores_side = a if reaches_matmul(a) else bb
            chain.masks.append((node, bb if scores_side is a else a, "additive"))
            value = scores_side
        elif node.op_type in ("Mul", "Div", "Reshape", "Tanh", "Cast", "Transpose", "Identity"):
            value = next(i for i in node.inputs if i is not None and const_array(i) is None)
        elif node.op_type == "Concat" and len(node.inputs) == 2:  # a sink's column after the scores
            chain.sink = node
            value = node.inputs[0]
        else:
            break
    if chain.qk is None:
        chain.end = value
    probs = softmax.outputs[0]
    while (users := [u for u, _ in probs.uses() if u.op_type != "IsNaN"]) and len(users) == 1 and (
        users[0].op_type in ("Reshape", "Slice", "Cast", "Dropout", "Identity")
        or (users[0].op_type == "Where" and probs in users[0].inputs[1:] and any(
            const_array(i) is not None for i in users[0].inputs[1:]))
    ):  # the layout, a sink's column dropped, a guard setting a row of NaN (no key visible) to 0
        probs = users[0].outputs[0]
    chain.probs = probs
    chain.pv = next((u for u in users if is_op(u, "MatMul") and u.inputs[0] is probs), None)
    return chain
