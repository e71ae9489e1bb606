"""The serving passes (attnx.export.passes.serve) on small hand-built graphs: an RMS norm as torch.onnx exports it
becomes one SimplifiedLayerNormalization and computes the same on ONNX Runtime; a chain that differs is left; a
residual add joins its norm; sibling MatMuls (of constant weights, or int4 MatMulNBits) become one over their
concatenation, their biases added, split, the same columns."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from attnx.export.passes.serve import FuseRmsNorm, FuseSkipRmsNorm, LastLogits, PackMatMuls
from attnx.model.contract import IR_VERSION, MS_DOMAIN
from attnx.model.tolerance import ProblemSize, tolerance_for
from attnx.runtimes.compare import compare_arrays

RNG = np.random.default_rng(0)
D = 16
W = RNG.standard_normal(D).astype(np.float32)  # the norm's weight


def _model(nodes, initializers, outputs=("y",)) -> ir.Model:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", D])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(v, k) for k, v in initializers.items()])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    return ir.from_proto(model)


def _rms_norm(axis: int = -1, exponent: float = 2.0) -> ir.Model:
    """y = w * (x * 1 / sqrt(mean(x^2, axis) + eps)), the node chain torch.onnx writes for LlamaRMSNorm."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["p"]), helper.make_node("ReduceMean", ["p", "axes"], ["m"]),
             helper.make_node("Add", ["m", "eps"], ["a"]), helper.make_node("Sqrt", ["a"], ["r"]),
             helper.make_node("Reciprocal", ["r"], ["i"]), helper.make_node("Mul", ["x", "i"], ["n"]),
             helper.make_node("Mul", ["w", "n"], ["y"])]  # fmt: skip
    return _model(nodes, {"two": np.asarray(exponent, np.float32), "axes": np.asarray([axis], np.int64),
                          "eps": np.asarray(1e-6, np.float32), "w": W})  # fmt: skip


def _run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_an_rms_norm_becomes_one_simplified_layer_normalization_computing_the_same():
    x = RNG.standard_normal((2, 3, D)).astype(np.float32)
    before = _run(_rms_norm(), x)[0]
    model = _rms_norm()
    fuse = FuseRmsNorm()
    assert fuse(model).modified and fuse.notes == ["1 RMS norm(s) fused into SimplifiedLayerNormalization"]
    assert [n.op_type for n in model.graph] == ["SimplifiedLayerNormalization"]
    assert compare_arrays("y", _run(model, x)[0], before, tolerance_for("fp32"), ProblemSize(D))


def test_a_chain_that_differs_is_left_as_it_is():
    for model in (_rms_norm(axis=1), _rms_norm(exponent=3.0)):  # the mean over another axis; a cube
        assert not FuseRmsNorm()(model).modified
        assert len(list(model.graph)) == 7


def test_sibling_matmuls_are_one_over_their_weights_concatenated_then_split():
    weights = {f"w{i}": RNG.standard_normal((D, n)).astype(np.float32) for i, n in enumerate((8, 4, 4))}
    weights["w3"] = RNG.standard_normal((8, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(3)]
    nodes.append(helper.make_node("MatMul", ["y0", "w3"], ["z"]))  # another input: not packed
    x = RNG.standard_normal((2, 3, D)).astype(np.float32)
    before = _run(_model(nodes, weights, ("y0", "y1", "y2", "z")), x)
    model = _model(nodes, weights, ("y0", "y1", "y2", "z"))
    pack = PackMatMuls()
    assert pack(model).modified and pack.notes == ["3 MatMuls packed into 1 (groups of [3])"]
    assert [n.op_type for n in model.graph] == ["Concat", "MatMul", "Split", "MatMul"]
    after = _run(model, x)
    for a, b in zip(after, before):
        assert compare_arrays("y", a, b, tolerance_for("fp32"), ProblemSize(D))
    assert len(ir.to_proto(model).graph.initializer) == 5  # the weights, once each, and the split's sizes


def test_the_logits_of_the_last_position_alone_through_a_final_softcap():
    """logits = tanh(x W / 30) * 30 (Gemma 2's final softcap): the head computed for the last position, the same
    numbers there; logits another op makes are left, with a note."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Div", ["h", "c"], ["d"]),
             helper.make_node("Tanh", ["d"], ["t"]), helper.make_node("Mul", ["t", "c"], ["logits"])]  # fmt: skip
    weights = {"w": RNG.standard_normal((D, 8)).astype(np.float32), "c": np.asarray(30.0, np.float32)}
    x = RNG.standard_normal((2, 5, D)).astype(np.float32)
    before = _run(_model(nodes, weights, ("logits",)), x)[0]
    model = _model(nodes, weights, ("logits",))
    last = LastLogits()
    assert last(model).modified and last.notes == ["logits: the last position's alone (the head computed for one "
                                                   "position)"]  # fmt: skip
    after = _run(model, x)[0]
    assert after.shape == (2, 1, 8)
    assert compare_arrays("logits", after, before[:, -1:], tolerance_for("fp32"), ProblemSize(D))
    other = _model([helper.make_node("Softmax", ["x"], ["logits"], axis=-1)], {}, ("logits",))
    last = LastLogits()
    assert not last(other).modified and last.notes[0].startswith("logits: every position's")


def test_the_last_position_alone_before_an_int4_head_or_a_tied_one():
    """ONNX Runtime's MatMulNBits (an int4 head: the GenAI builder's, attnx's --weights int4) and a MatMul of a
    Transposed table (a tied embedding): the head computed for the last position, the same numbers there (each row
    of the head's input its own row of the output, the int8 rounding of accuracy_level 4 included)."""
    n = 8
    packed = RNG.integers(0, 256, (n, 1, D // 2), dtype=np.uint8)  # [N, K / block, block / 2]: one block of 16
    int4 = [helper.make_node("MatMulNBits", ["x", "q", "s"], ["logits"], domain=MS_DOMAIN, K=D, N=n, bits=4,
                             block_size=D, accuracy_level=4)]  # fmt: skip
    tied = [helper.make_node("Transpose", ["e"], ["et"], perm=[1, 0]), helper.make_node("MatMul", ["x", "et"],
                                                                                       ["logits"])]  # fmt: skip
    cases = [(int4, {"q": packed, "s": RNG.uniform(0.01, 0.1, n).astype(np.float32)}),
             (tied, {"e": RNG.standard_normal((n, D)).astype(np.float32)})]  # fmt: skip
    x = RNG.standard_normal((2, 5, D)).astype(np.float32)
    for nodes, weights in cases:
        model = _model(nodes, weights, ("logits",))
        model.opset_imports[MS_DOMAIN] = 1
        before = _run(model, x)[0]
        last = LastLogits()
        assert last(model).modified, last.notes
        after = _run(model, x)[0]
        assert after.shape == (2, 1, n)
        assert compare_arrays("logits", after, before[:, -1:], tolerance_for("fp32"), ProblemSize(D))


def test_sibling_projections_with_biases_pack_their_biases_before_the_split():
    """q/k/v as Qwen's (a MatMul then an Add of a constant bias each): one MatMul, one Add of the biases
    concatenated, then the Split; the same columns."""
    weights = {f"w{i}": RNG.standard_normal((D, n)).astype(np.float32) for i, n in enumerate((8, 4, 4))}
    weights.update({f"b{i}": RNG.standard_normal(n).astype(np.float32) for i, n in enumerate((8, 4, 4))})
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]) for i in range(3)]
    nodes += [helper.make_node("Add", [f"m{i}", f"b{i}"] if i else [f"b{i}", f"m{i}"], [f"y{i}"]) for i in range(3)]
    x = RNG.standard_normal((2, 3, D)).astype(np.float32)
    before = _run(_model(nodes, weights, ("y0", "y1", "y2")), x)
    model = _model(nodes, weights, ("y0", "y1", "y2"))
    assert PackMatMuls()(model).modified
    assert [n.op_type for n in model.graph] == ["Concat", "MatMul", "Concat", "Add", "Split"]
    for a, b in zip(_run(model, x), before):
        assert compare_arrays("y", a, b, tolerance_for("fp32"), ProblemSize(D))


def _nbits(name: str, n: int, accuracy: int = 4) -> tuple[list, dict]:
    """An int4 MatMulNBits of x ([.., D]) to `n` columns, blocks of 16 (one a column), with zero points."""
    node = helper.make_node("MatMulNBits", ["x", f"{name}q", f"{name}s", f"{name}z"], [f"{name}m"], domain=MS_DOMAIN,
                            K=D, N=n, bits=4, block_size=D, accuracy_level=accuracy)  # fmt: skip
    return [node], {f"{name}q": RNG.integers(0, 256, (n, 1, D // 2), dtype=np.uint8),
                    f"{name}s": RNG.uniform(0.01, 0.1, n).astype(np.float32),
                    f"{name}z": RNG.integers(0, 256, n, dtype=np.uint8)}  # fmt: skip


def test_int4_siblings_are_one_matmulnbits_over_their_blocks_concatenated():
    """MatMulNBits of one input, K, bits, block size and accuracy level (attnx's --weights int4 q/k/v and gate/up):
    one over the packed weights, scales and zero points concatenated along N, the biases added after, then split;
    the same numbers. One of another accuracy level is left alone."""
    nodes, weights = [], {}
    for i, n in enumerate((8, 4, 4)):
        more, tensors = _nbits(f"p{i}", n)
        nodes += more + [helper.make_node("Add", [f"p{i}m", f"b{i}"], [f"y{i}"])]
        weights.update(tensors, **{f"b{i}": RNG.standard_normal(n).astype(np.float32)})
    other, tensors = _nbits("o", 4, accuracy=0)
    nodes += other
    weights.update(tensors)
    outputs = ("y0", "y1", "y2", "om")
    x = RNG.standard_normal((2, 3, D)).astype(np.float32)

    def model():
        m = _model(nodes, weights, outputs)
        m.opset_imports[MS_DOMAIN] = 1
        return m

    before = _run(model(), x)
    packed = model()
    pack = PackMatMuls()
    assert pack(packed).modified and pack.notes == ["3 MatMuls packed into 1 (groups of [3])"]
    kinds = [n.op_type for n in packed.graph]
    assert kinds.count("MatMulNBits") == 2 and kinds.count("Split") == 1
    assert next(n for n in packed.graph if n.name.endswith("/packed")).attributes.get_int("N") == 16
    for a, b in zip(_run(packed, x), before):
        assert compare_arrays("y", a, b, tolerance_for("fp32"), ProblemSize(D))


def test_a_residual_add_and_its_norm_are_one_skip_simplified_layer_normalization():
    """h = x + r; y = rms(h) * w; z = h + y (the residual stream read again): one SkipSimplifiedLayerNormalization
    whose fourth output is h; the same numbers. An Add of a broadcast bias is left."""
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]),
             helper.make_node("SimplifiedLayerNormalization", ["h", "w"], ["y"], axis=-1, epsilon=1e-6),
             helper.make_node("Add", ["h", "y"], ["z"])]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(v, TensorProto.FLOAT, ["b", "s", D])
                                           for v in ("x", "r")],
                              [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in ("y", "z")],
                              [numpy_helper.from_array(W, "w")])  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    proto.ir_version = IR_VERSION
    x, r = (RNG.standard_normal((2, 3, D)).astype(np.float32) for _ in range(2))

    def run(m):
        return ort.InferenceSession(ir.to_proto(m).SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x, "r": r})  # fmt: skip

    before = run(ir.from_proto(proto))
    model = ir.from_proto(proto)
    fuse = FuseSkipRmsNorm()
    assert fuse(model).modified, fuse.notes
    assert [n.op_type for n in model.graph] == ["SkipSimplifiedLayerNormalization", "Add"]
    for a, b in zip(run(model), before):
        assert compare_arrays("y", a, b, tolerance_for("fp32"), ProblemSize(D))
    broadcast = _model([helper.make_node("Add", ["x", "c"], ["h"]),
                        helper.make_node("SimplifiedLayerNormalization", ["h", "w"], ["y"], axis=-1)],
                       {"c": np.ones(D, np.float32), "w": W})  # fmt: skip
    assert not FuseSkipRmsNorm()(broadcast).modified
