"""Reading the attention masks of an exported graph: which keys a boolean mask hides.

The exporter writes the mask of the formula (docs/concepts/formula.md) as a small boolean subgraph
(`hidden`, True = the key is hidden from the query, broadcastable to [B, 1, S, L]):

    causal:        Unsqueeze(Greater(Unsqueeze(r, [0]), Unsqueeze(r, [1])), [0, 1]),  r = Range(0, S, 1)
    key padding:   Unsqueeze(key_padding_mask, [1, 2])
    both:          Or(causal, key padding)

com.microsoft MultiHeadAttention cannot take such a tensor without materialising it at
[B, S, L]; it takes the same information as `unidirectional=1` and an int32 key padding
mask of shape [B, L]. classify_hidden() recognises the forms above and returns that
information, or raises NotRead with the reason, so that a mask it does not understand
is never guessed at.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from attnx.export.passes._base import const_array
from attnx.export.passes.walk import NotRead

__all__ = ["KeyMask", "classify_hidden", "classify_attend", "classify_any_visible", "const_array"]


@dataclasses.dataclass(frozen=True)
class KeyMask:
    """Which keys are hidden: causally (key j > query i), and/or by a key padding input."""

    causal: bool = False
    key_padding: ir.Value | None = None  # the graph's bool [B, L] input, True hides

    def __or__(self, other: KeyMask) -> KeyMask:
        if self.key_padding is not None and other.key_padding is not None and self.key_padding is not other.key_padding:
            raise NotRead("the mask combines two different key padding inputs")
        return KeyMask(self.causal or other.causal, self.key_padding or other.key_padding)

    @property
    def empty(self) -> bool:
        return not self.causal and self.key_padding is None

    def describe(self) -> str:
        parts = (["causal"] if self.causal else []) + (
            [f"key padding mask {self.key_padding.name!r}"] if self.key_padding is not None else []
        )
        return " + ".join(parts) or "no mask"


def _ints(value: ir.Value | None) -> list[int] | None:
    arr = const_array(value)
    return None if arr is None else [int(v) for v in np.ravel(arr)]


def _op(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The producer of `value` when it is a standard-domain `op_type` node."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _same_dim(a: object, b: object) -> bool:
    """Two dims known equal: the same int, or the same named symbol."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim) and a.value is not None and a == b


def _dim(value: ir.Value, axis: int) -> object:
    if value.shape is None or value.shape.rank() <= axis:
        return None
    return value.shape[axis]


def _producer_name(value: ir.Value) -> str:
    node = value.producer()
    if node is None:
        return f"graph input {value.name!r}" if value.is_graph_input() else f"{value.name!r}"
    return f"{node.op_type} ({value.name!r})"


def classify_hidden(hidden: ir.Value, q_len: object, kv_len: object) -> KeyMask:
    """What the boolean `hidden` (True hides) means, for queries of length q_len and keys
    of length kv_len (dims of the attention's inputs). Raises NotRead otherwise."""
    if hidden.dtype != ir.DataType.BOOL:
        raise NotRead(f"the mask {hidden.name!r} is {hidden.dtype}, not a boolean mask")
    if (node := _op(hidden, "Or")) is not None:
        return classify_hidden(node.inputs[0], q_len, kv_len) | classify_hidden(node.inputs[1], q_len, kv_len)
    node = _op(hidden, "Unsqueeze")
    if node is None:
        raise NotRead(f"the mask is built by {_producer_name(hidden)}, neither a causal nor a key padding mask")
    source, axes = node.inputs[0], _ints(node.inputs[1])
    if source.is_graph_input() and axes == [1, 2]:
        # [B, L] -> [B, 1, 1, L]: one flag per key, the same for every query and head.
        if source.dtype != ir.DataType.BOOL or source.shape is None or source.shape.rank() != 2:
            raise NotRead(f"input {source.name!r} is not a boolean [batch, keys] key padding mask")
        if not _same_dim(_dim(source, 1), kv_len):
            raise NotRead(f"key padding mask {source.name!r} has {_dim(source, 1)} keys, the attention {kv_len}")
        return KeyMask(key_padding=source)
    if axes == [0, 1] and _is_causal_grid(source, q_len, kv_len):
        return KeyMask(causal=True)
    raise NotRead(f"the mask {hidden.name!r} is neither a causal nor a key padding mask")


def _is_causal_grid(grid: ir.Value, q_len: object, kv_len: object) -> bool:
    """grid[i, j] = j > i for i, j in range(S), with S the query and the key length."""
    node = _op(grid, "Greater")
    if node is not None:
        cols, rows = node.inputs[0], node.inputs[1]  # Greater(j, i)
    elif (node := _op(grid, "Less")) is not None:
        rows, cols = node.inputs[0], node.inputs[1]  # Less(i, j)
    else:
        return False
    col_node, row_node = _op(cols, "Unsqueeze"), _op(rows, "Unsqueeze")
    if col_node is None or row_node is None:
        return False
    # j runs along the last axis ([1, S]), i along the first ([S, 1]), over the same range.
    if _ints(col_node.inputs[1]) != [0] or _ints(row_node.inputs[1]) != [1]:
        return False
    r = col_node.inputs[0]
    if r is not row_node.inputs[0] or (range_node := _op(r, "Range")) is None:
        return False
    if _ints(range_node.inputs[0]) != [0] or _ints(range_node.inputs[2]) != [1]:
        return False
    # Range(0, n, 1) with n the query length, which must also be the key length: the shape
    # symbols of the exporter say so (a causal mask only means one thing for self-attention).
    return _same_dim(_dim(r, 0), q_len) and _same_dim(q_len, kv_len)


def classify_attend(attend: ir.Value, q_len: object, kv_len: object) -> KeyMask:
    """The opset-23 Attention op's boolean attn_mask (True attends): Not(hidden), possibly
    broadcast by an Expand (which repeats values and changes none)."""
    if attend.dtype != ir.DataType.BOOL:
        raise NotRead(f"the attention mask {attend.name!r} is {attend.dtype}, not boolean (an additive mask)")
    if (node := _op(attend, "Expand")) is not None:
        attend = node.inputs[0]
    node = _op(attend, "Not")
    if node is None:
        raise NotRead(f"the attention mask is built by {_producer_name(attend)}, not Not(hidden)")
    return classify_hidden(node.inputs[0], q_len, kv_len)


def classify_any_visible(visible: ir.Value, q_len: object, kv_len: object) -> KeyMask:
    """The condition of the Where that zeroes fully hidden queries:
    Not(Cast(ReduceMin(Cast(hidden, int), axes=[-1], keepdims=1), bool)) = "some key visible".
    Returns the KeyMask of that `hidden`."""
    not_node = _op(visible, "Not")
    cast_bool = _op(not_node.inputs[0], "Cast") if not_node is not None else None
    reduce = _op(cast_bool.inputs[0], "ReduceMin") if cast_bool is not None else None
    cast_int = _op(reduce.inputs[0], "Cast") if reduce is not None else None
    if cast_int is None:
        raise NotRead(f"the zeroing condition {visible.name!r} is not 'not all keys hidden'")
    axes = _ints(reduce.inputs[1]) if len(reduce.inputs) > 1 else None
    keepdims = reduce.attributes.get_int("keepdims", 1)
    rank = cast_int.inputs[0].shape.rank() if cast_int.inputs[0].shape is not None else None
    if axes is None or len(axes) != 1 or rank is None or axes[0] % rank != rank - 1 or keepdims != 1:
        raise NotRead(f"the zeroing condition {visible.name!r} does not reduce over the keys")
    if cast_bool.attributes.get_int("to") != ir.DataType.BOOL:
        raise NotRead(f"the zeroing condition {visible.name!r} is not boolean")
    return classify_hidden(cast_int.inputs[0], q_len, kv_len)
