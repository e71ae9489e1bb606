"""A gallery of faults planted into one layer of a whole model another tool exported, for `attnx audit`'s rule that a
fault is found in its own layer and in no other (tests/workflows/test_audit_gallery.py).

Each fault changes one layer L of a copy of the model and nothing shared with another layer: a tensor the layers
share (a constant the exporter deduplicated) is copied for layer L's node before it is changed. The tensors are
found by their values (the checkpoint's layer L, as attnx's importer reads it), never by names, so one fault serves
every source: the GenAI builder's packed or separate projections, torch.onnx's and Optimum's `val_*`/`onnx::MatMul_*`
initializers ([in, out], the Linear's weight transposed). Each fault says the finding that names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from attnx.model.importers import import_weights

# a fault: (the model, its layer, the checkpoint's layers) -> the start of the finding that names it, or None where
# the fault does not apply to this model
Plant = Callable[[onnx.ModelProto, int, list], "str | None"]


@dataclasses.dataclass
class Columns:
    """Where a projection's weight lies in the graph: an initializer [in, out...] and its columns there."""

    tensor: onnx.TensorProto
    start: int
    width: int

    def get(self) -> np.ndarray:
        return numpy_helper.to_array(self.tensor)

    def put(self, array: np.ndarray) -> None:
        self.tensor.CopyFrom(numpy_helper.from_array(array.astype(self.get().dtype), self.tensor.name))

    def change(self, edit: Callable[[np.ndarray], np.ndarray]) -> None:
        whole = self.get().astype(np.float64)
        whole[:, self.start : self.start + self.width] = edit(whole[:, self.start : self.start + self.width].copy())
        self.put(whole)


def checkpoint_layers(folder: str) -> list:
    """Every layer's attention as attnx imports it (config, weights [out, in])."""
    import json
    import os

    with open(os.path.join(folder, "config.json")) as f:
        n = json.load(f)["num_hidden_layers"]
    return [import_weights(folder, layer=i) for i in range(n)]


def find_columns(proto: onnx.ModelProto, weight: np.ndarray) -> Columns | None:
    """The initializer [in, out] holding `weight` [out, in] (transposed), alone or among other columns (a packed
    q|k|v), by value (within fp16's rounding)."""
    w = np.asarray(weight, np.float64).T  # [in, out]
    for tensor in proto.graph.initializer:
        if len(tensor.dims) != 2 or tensor.dims[0] != w.shape[0] or tensor.dims[1] < w.shape[1]:
            continue
        if tensor.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            continue
        array = numpy_helper.to_array(tensor).astype(np.float64)
        bound = 2e-3 * np.abs(w).max()
        for start in range(array.shape[1] - w.shape[1] + 1):
            if np.abs(array[:, start : start + w.shape[1]] - w).max() <= bound:
                return Columns(tensor, start, w.shape[1])
    return None


def find_vector(proto: onnx.ModelProto, values: np.ndarray) -> onnx.TensorProto | None:
    """The initializer holding `values` (a norm's weight, a head's sinks), by value."""
    v = np.asarray(values, np.float64).ravel()
    for tensor in proto.graph.initializer:
        if int(np.prod(tensor.dims)) != v.size or tensor.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            continue
        if np.allclose(numpy_helper.to_array(tensor).astype(np.float64).ravel(), v, rtol=2e-3, atol=1e-6):
            return tensor
    return None


def attention_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The attention nodes in graph order (a fused op, else the Softmax of q.k): one per layer."""
    fused = [n for n in proto.graph.node if n.op_type in ("GroupQueryAttention", "MultiHeadAttention", "Attention")]
    if fused:
        return fused
    producers = {o: n for n in proto.graph.node for o in n.output}

    def from_matmul(node: onnx.NodeProto, depth: int = 8) -> bool:
        todo = [(node, 0)]
        while todo:
            n, d = todo.pop()
            if n.op_type == "MatMul":
                return True
            if d < depth:
                todo += [(producers[i], d + 1) for i in n.input if i in producers]
        return False

    return [n for n in proto.graph.node if n.op_type == "Softmax" and from_matmul(n)]


def set_attribute(node: onnx.NodeProto, name: str, value) -> None:
    for a in node.attribute:
        if a.name == name:
            node.attribute.remove(a)
            break
    node.attribute.append(onnx.helper.make_attribute(name, value))


def get_attribute(node: onnx.NodeProto, name: str, default=None):
    a = next((a for a in node.attribute if a.name == name), None)
    return onnx.helper.get_attribute_value(a) if a is not None else default


def _heads(layers: list, L: int) -> tuple[int, int, int]:
    c = layers[L].config
    return c.n_heads, c.n_kv_heads, c.head_dim


def q_head_negated(proto, L, layers):
    n, _, hd = _heads(layers, L)
    where = find_columns(proto, layers[L].weights["q_proj.weight"])
    if where is None or n < 2:
        return None
    where.change(lambda w: np.concatenate([w[:, :hd], -w[:, hd : 2 * hd], w[:, 2 * hd :]], axis=1))
    return f"layer {L}: q_proj.weight differs"


def k_scaled(proto, L, layers):
    where = find_columns(proto, layers[L].weights["k_proj.weight"])
    if where is None:
        return None
    where.change(lambda w: w * 1.25)
    return f"layer {L}: k_proj.weight differs"


def v_head_scaled(proto, L, layers):
    _, _, hd = _heads(layers, L)
    where = find_columns(proto, layers[L].weights["v_proj.weight"])
    if where is None:
        return None
    where.change(lambda w: np.concatenate([w[:, :hd] * 1.5, w[:, hd:]], axis=1))
    return f"layer {L}: v_proj.weight differs"


def o_head_zeroed(proto, L, layers):
    _, _, hd = _heads(layers, L)
    where = find_columns(proto, layers[L].weights["out_proj.weight"])
    if where is None:
        return None
    array = where.get().astype(np.float64)  # [N * hd, d_model]: head 0's rows
    array[:hd, where.start : where.start + where.width] = 0.0
    where.put(array)
    return f"layer {L}: out_proj.weight differs"


def q_norm_of_another_layer(proto, L, layers):
    weights = layers[L].weights
    if "q_norm.weight" not in weights:
        return None
    other = layers[(L + 1) % len(layers)].weights["q_norm.weight"]
    tensor = find_vector(proto, weights["q_norm.weight"])
    if tensor is None:  # Gemma's folded (1 + w) is stored as the weight transformers keeps: w
        return None
    tensor.CopyFrom(numpy_helper.from_array(np.asarray(other).astype(numpy_helper.to_array(tensor).dtype), tensor.name))
    return f"layer {L}: q_norm.weight differs"


def sinks_doubled(proto, L, layers):
    weights = layers[L].weights
    if "sinks" not in weights:
        return None
    tensor = find_vector(proto, weights["sinks"])
    if tensor is None:
        return None
    array = numpy_helper.to_array(tensor)
    tensor.CopyFrom(numpy_helper.from_array((array * 2 + 0.5).astype(array.dtype), tensor.name))
    return f"layer {L}: sinks differs"


def scale_changed(proto, L, layers):
    """The scale the layer's op states (GroupQueryAttention, MultiHeadAttention, Attention), or the scalar constant
    nearest its Softmax on the scores' side (a decomposed core), copied for that node and multiplied by 1.2."""
    node = attention_nodes(proto)[L]
    if node.op_type != "Softmax":
        scale = get_attribute(node, "scale", 0.0) or 1.0 / np.sqrt(layers[L].config.head_dim)
        set_attribute(node, "scale", float(scale) * 1.2)
        return f"layer {L}: scale"
    producers = {o: n for n in proto.graph.node for o in n.output}
    consumers = {i: n for n in proto.graph.node for i in n.input}
    constants = {t.name: t for t in proto.graph.initializer}
    constants.update({n.output[0]: n.attribute[0].t for n in proto.graph.node if n.op_type == "Constant"
                      and n.attribute and n.attribute[0].name == "value"})  # fmt: skip
    todo, seen = [node], set()
    while todo:
        n = todo.pop(0)
        if id(n) in seen:
            continue
        seen.add(id(n))
        softcap = any(producers.get(i) is not None and producers[i].op_type == "Tanh" for i in n.input) or (
            consumers.get(n.output[0]) is not None and consumers[n.output[0]].op_type == "Tanh")  # c * tanh(s / c)
        if n.op_type in ("Mul", "Div") and not softcap:
            for k, name in enumerate(n.input):
                t = constants.get(name)
                if t is not None and int(np.prod(t.dims)) == 1 and t.data_type in (1, 10):
                    value = numpy_helper.to_array(t)
                    copy = f"planted_scale_{L}"
                    factor = 1.2 if n.op_type == "Mul" else 1 / 1.2
                    proto.graph.initializer.append(numpy_helper.from_array((value * factor).astype(value.dtype), copy))
                    n.input[k] = copy
                    return f"layer {L}: scale"
        if n.op_type in ("Softmax", "Add", "Where", "Mul", "Div", "MatMul", "Tanh", "Reshape", "Transpose", "Cast"):
            todo += [producers[i] for i in n.input if i in producers]
    return None


def window_changed(proto, L, layers):
    node = attention_nodes(proto)[L]
    if node.op_type != "GroupQueryAttention":
        return None  # a decomposed core's window lies in a mask the layers share
    window = get_attribute(node, "local_window_size", -1)
    set_attribute(node, "local_window_size", window - 1 if window > 2 else 4)
    return f"layer {L}: window"


def softcap_changed(proto, L, layers):
    node = attention_nodes(proto)[L]
    if node.op_type not in ("GroupQueryAttention", "Attention"):
        return None
    softcap = get_attribute(node, "softcap", 0.0)
    set_attribute(node, "softcap", float(softcap) * 0.6 if softcap else 20.0)
    return f"layer {L}: softcap"


def rotary_interleaved(proto, L, layers):
    node = attention_nodes(proto)[L]
    if node.op_type == "GroupQueryAttention" and get_attribute(node, "do_rotary", 0):
        set_attribute(node, "rotary_interleaved", 1 - get_attribute(node, "rotary_interleaved", 0))
        return f"layer {L}: rotary_interleaved"
    return None


FAULTS: dict[str, Plant] = {
    "q head negated": q_head_negated, "k scaled": k_scaled, "v head scaled": v_head_scaled,
    "o head zeroed": o_head_zeroed, "q norm of another layer": q_norm_of_another_layer, "sinks changed": sinks_doubled,
    "scale x1.2": scale_changed, "window changed": window_changed, "softcap changed": softcap_changed,
    "rotary interleaved": rotary_interleaved,
}  # fmt: skip


def int4_scale_doubled(proto, L, layers):
    """A MatMulNBits block scale of layer L's first k row doubled (the builder's packed q|k|v, int4)."""
    node = attention_nodes(proto)[L]
    producers = {o: n for n in proto.graph.node for o in n.output}
    n = producers.get(node.input[0])
    for _ in range(12):  # up the query's path: its bias, norm, split into heads
        if n is None or n.op_type == "MatMulNBits":
            break
        n = producers.get(n.input[0])
    if n is None or n.op_type != "MatMulNBits":
        return None
    tensor = next(t for t in proto.graph.initializer if t.name == n.input[2])
    scales = numpy_helper.to_array(tensor).copy()
    heads, _, hd = _heads(layers, L)
    scales.reshape(get_attribute(n, "N"), -1)[heads * hd, 0] *= 2
    tensor.CopyFrom(numpy_helper.from_array(scales, tensor.name))
    return f"layer {L}: k_proj.weight differs from the checkpoint's by more than its 4-bit step"


FAULTS["int4 block scale doubled"] = int4_scale_doubled


@dataclasses.dataclass(frozen=True)
class Model:
    """What decides which faults apply, read cheaply (the graph without its data, the checkpoint's config.json)."""

    ops: frozenset[str]
    model_type: str
    n_heads: int
    windowed: bool

    @classmethod
    def read(cls, path: str, checkpoint: str) -> Model:
        import json
        import os

        proto = onnx.load(path, load_external_data=False)
        with open(os.path.join(checkpoint, "config.json")) as f:
            hf = json.load(f)
        windowed = bool(hf.get("sliding_window")) and hf.get("use_sliding_window", True) is not False
        return cls(frozenset(n.op_type for n in proto.graph.node), hf["model_type"], hf["num_attention_heads"], windowed)

    @property
    def int4(self) -> bool:
        return "MatMulNBits" in self.ops

    @property
    def core(self) -> str:
        return next((op for op in ("GroupQueryAttention", "MultiHeadAttention", "Attention") if op in self.ops), "Softmax")


def applies(fault: str, model: Model) -> bool:
    """Whether `fault` can be planted in `model` (its planting then must succeed: a gallery that declares a fault it
    cannot plant fails)."""
    weights = ("q head negated", "k scaled", "v head scaled", "o head zeroed", "q norm of another layer", "sinks changed")
    if fault in weights:
        if model.int4 or (fault == "q head negated" and model.n_heads < 2):
            return False
        if fault == "q norm of another layer":
            return model.model_type == "qwen3"  # stored as transformers keeps it (Gemma 3's 1 + w: not by value)
        return fault != "sinks changed" or model.model_type == "gpt_oss"
    return {"scale x1.2": True, "window changed": model.core == "GroupQueryAttention",
            "softcap changed": model.core in ("GroupQueryAttention", "Attention"),
            "rotary interleaved": model.core == "GroupQueryAttention" and "RotaryEmbedding" not in model.ops,
            "int4 block scale doubled": model.int4 and model.core == "GroupQueryAttention"}[fault]  # fmt: skip


# Faults that leave their layer unread: a step between q.k and the Softmax that no term of the formula explains (a
# scaling of the capped scores: c * tanh(s / c) * 1.25 is no softcap c' * tanh(scale * s / c')). The block is not
# read, so it is not checked: the audit names it as not read (its reason) and the checkpoint layer no block pairs with;
# never a pass. Each returns that reason, or None where the model has no decomposed softcap.
def plant_on_scores(proto: onnx.ModelProto, L: int, op: str, value: float, where: str) -> bool:
    """`op` (Mul, Div, Add) by the scalar `value` planted on layer L's scores of a decomposed core with a softcap
    (Softmax(c * tanh(s / c) + mask)): "after the mask" (into the Softmax), "before the mask" (between the softcap's
    multiply and the mask's Add), "after the tanh" (between the tanh and the softcap's multiply), "before the tanh"
    (between the divide by c and the tanh). False where the layer has no such chain."""
    node = attention_nodes(proto)[L]
    if node.op_type != "Softmax":
        return False
    producers = {o: n for n in proto.graph.node for o in n.output}
    mask = producers.get(node.input[0])
    tanh, todo = None, [node]
    for _ in range(6):  # back from the Softmax to the softcap's Tanh
        todo = [producers[i] for n in todo for i in n.input if i in producers]
        tanh = next((n for n in todo if n.op_type == "Tanh"), None)
        if tanh is not None:
            break
    cap = next((n for n in proto.graph.node if tanh is not None and tanh.output[0] in n.input), None)
    if tanh is None or cap is None or cap.op_type != "Mul" or mask is None or mask.op_type != "Add":
        return False
    edge = {"after the mask": (node, node.input[0]), "before the mask": (mask, cap.output[0]),
            "after the tanh": (cap, tanh.output[0]), "before the tanh": (tanh, tanh.input[0])}[where]  # fmt: skip
    consumer, scores = edge
    planted = f"planted_{op}_{L}"
    proto.graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), planted))
    proto.graph.node.insert(list(proto.graph.node).index(consumer),
                            onnx.helper.make_node(op, [scores, planted], [f"{planted}_scores"]))  # fmt: skip
    consumer.input[list(consumer.input).index(scores)] = f"{planted}_scores"
    return True


def _unread(op: str, value: float, where: str, reason: str) -> Plant:
    return lambda proto, L, layers: reason if plant_on_scores(proto, L, op, value, where) else None


UNREAD_FAULTS: dict[str, Plant] = {
    "scores x1.25 after the softcap's mask": _unread("Mul", 1.25, "after the mask",
                                                     "a Mul by 1.25 after the softcap: no term explains it"),
    "scores x1.25 before the softcap's mask": _unread("Mul", 1.25, "before the mask",
                                                      "a Mul by 1.25 after the softcap: no term explains it"),
    "scores / 0.8 after the softcap": _unread("Div", 0.8, "after the mask",
                                              "a Div by 0.8 after the softcap: no term explains it"),
    "x1.25 between the tanh and the cap": _unread("Mul", 1.25, "after the tanh", "a Mul by 1.25 between the tanh "
                                                  "and the softcap's multiply by"),
    "0.5 added after the softcap": _unread("Add", 0.5, "after the mask", "a constant added to the scores"),
}  # fmt: skip


def applies_unread(model: Model) -> bool:
    """Whether the UNREAD_FAULTS can be planted in `model`: a decomposed core with a softcap (a Tanh in the graph)."""
    return model.core == "Softmax" and "Tanh" in model.ops
