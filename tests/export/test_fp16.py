"""ConvertToFloat16: fp16 graphs that load, stay finite on a fully masked row, and agree
with the float64 reference under the fp16 row of the tolerance table."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attnx.errors import UsageError
from attnx.export import build_model, export_onnx, save_model
from attnx.export.passes.fp16 import FP16_MAX, ConvertToFloat16
from attnx.model import AttentionConfig, reference_attention
from attnx.model.contract import IR_VERSION
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays
from attnx.workflows import check_model_file, validate_against_torch
from tests.conftest import CONFIGS, weights_for

LOWERINGS = ["decomposed", "onnx"]
# (batch, seq, mem_seq): seq 1, a batch of 3 with the fully masked element 1, a longer one.
SHAPES = [(1, 1, 3), (3, 7, 5), (2, 33, 17)]
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)


# Helpers ---------------------------------------------------------------------------------
_FP32_EXPORTS: dict[tuple[str, str], bytes] = {}


def _fp32_export(name: str, attention: str) -> ir.Model:
    """A fresh copy of the float32 model (the pass works in place; exporting is the slow part): the torch
    export (decomposed), or the registry's emitter (onnx)."""
    key = (name, attention)
    if key not in _FP32_EXPORTS:
        if attention == "decomposed":
            proto = ir.to_proto(export_onnx(CONFIGS[name], weights_for(name)))
        else:
            proto = build_model(CONFIGS[name], weights_for(name), attention)
        _FP32_EXPORTS[key] = proto.SerializeToString()
    return ir.from_proto(onnx.load_from_string(_FP32_EXPORTS[key]))


@pytest.fixture(scope="module")
def fp16_model(tmp_path_factory):
    """fp16_model(name, attention, keep_io_fp32) -> path of the converted, saved model."""
    root = tmp_path_factory.mktemp("fp16")
    cache: dict[tuple[str, str, bool], str] = {}

    def get(name: str, attention: str, keep: bool) -> str:
        key = (name, attention, keep)
        if key not in cache:
            result = ConvertToFloat16(keep_io_fp32=keep)(_fp32_export(name, attention))
            assert result.modified
            path = os.path.join(root, f"{name}-{attention}-{'io32' if keep else 'io16'}.onnx")
            save_model(result.model, path)
            cache[key] = path
        return cache[key]

    return get


def _session_with_every_float_value(path: str) -> ort.InferenceSession:
    """A session whose outputs are y and every float intermediate, to look for NaN/inf
    inside the graph (a NaN the final Where hides is still a NaN on another backend)."""
    proto = onnx.load(path)
    # onnx's inference does not type ONNX Runtime's contrib ops: their first output takes their first
    # input's type (the attention ops), then inference types what follows them
    known = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.value_info]}
    known.update((t.name, t.data_type) for t in proto.graph.initializer)
    proto = onnx.shape_inference.infer_shapes(proto)
    known.update((v.name, v.type.tensor_type.elem_type) for v in proto.graph.value_info)
    for node in proto.graph.node:
        if node.domain == "com.microsoft" and node.output[0] not in known and node.input[0] in known:
            proto.graph.value_info.append(helper.make_tensor_value_info(node.output[0], known[node.input[0]], None))
            known[node.output[0]] = known[node.input[0]]
    proto = onnx.shape_inference.infer_shapes(proto)
    outputs = {o.name for o in proto.graph.output}
    for info in proto.graph.value_info:
        if info.name not in outputs and info.type.tensor_type.elem_type in FLOAT_TYPES:
            proto.graph.output.append(info)
            outputs.add(info.name)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _check_runs(path: str, config: AttentionConfig, weights: dict, io_dtype: str) -> None:
    """At every shape: nothing non-finite anywhere in the graph, y agrees with the
    reference under the fp16 tolerance, and a fully masked query gets exactly the fp16
    out bias."""
    session = _session_with_every_float_value(path)
    names = [o.name for o in session.get_outputs()]
    assert len(names) > 5, "the instrumented session should expose the graph's intermediates"
    bias = weights["out_proj.bias"] if config.bias else np.zeros(config.d_model, np.float32)
    for batch, seq, mem_seq in SHAPES:
        feeds = make_inputs(config, batch, seq, mem_seq if config.cross else None, dtype=io_dtype, seed=seq)
        values = dict(zip(names, session.run(None, feeds), strict=True))
        bad = [n for n, v in values.items() if not np.isfinite(v).all()]
        assert not bad, f"non-finite values at batch={batch} seq={seq}: {bad}"
        y = values["y"]
        assert y.dtype == np.dtype(np.float32 if io_dtype == "fp32" else np.float16)
        ref = reference_attention(config, weights, **feeds)
        cmp = compare_arrays("y", y, ref, tolerance_for("fp16"), problem_size(config, weights, feeds))
        assert cmp, f"batch={batch} seq={seq}: {cmp}"
        if config.key_padding_mask and batch > 1:  # make_inputs hides every key of element 1
            np.testing.assert_array_equal(y[1], np.broadcast_to(bias.astype(np.float16), y[1].shape))


# The exported graphs ---------------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True], ids=["io16", "io32"])
@pytest.mark.parametrize("attention", LOWERINGS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp16_export_loads_and_agrees(fp16_model, name, attention, keep):
    config = CONFIGS[name]
    path = fp16_model(name, attention, keep)
    check_model_file(path, config)  # onnx checker, contract dims, onnxruntime loads it
    proto = onnx.load(path)
    assert proto.ir_version == IR_VERSION
    assert not [t.name for t in proto.graph.initializer if t.data_type == TensorProto.FLOAT]
    io_type = TensorProto.FLOAT if keep else TensorProto.FLOAT16
    io = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]}
    for spec in config.inputs() + config.outputs():
        assert io[spec.name] == (TensorProto.BOOL if spec.dtype == "bool" else io_type), spec.name
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["attnx.dtype"] == "fp16" and meta["attnx.io_dtype"] == ("fp32" if keep else "fp16")
    _check_runs(path, config, weights_for(name), "fp32" if keep else "fp16")


@pytest.mark.parametrize("attention", LOWERINGS)
def test_fp16_export_agrees_with_torch_fp16(fp16_model, attention):
    # The lead's check that export_model runs for --dtype fp16: torch's own fp16 module on
    # CPU, at the validation shapes (seq 1 and 1031 among them). Both masks, both I/O
    # dtypes; export_model below runs it on cross-attention too.
    name = "causal_kpm"
    config = CONFIGS[name]
    results = validate_against_torch(fp16_model(name, attention, False), config, weights_for(name), dtype="fp16")
    assert results and all(results)
    results = validate_against_torch(
        fp16_model(name, attention, True), config, weights_for(name), dtype="fp16", io_dtype="fp32"
    )
    assert results and all(results)


def test_mask_fill_becomes_fp16_lowest_and_inf_would_be_caught(tmp_path):
    """The decomposed graph's masked_fill value (float32's lowest) is -65504 after the pass.
    Put -inf back (what a plain cast gives) and the check of every intermediate sees it: the
    masked scores are -inf, and the fully masked row's softmax is NaN."""
    config = CONFIGS["kpm"]
    model = ConvertToFloat16()(_fp32_export("kpm", "decomposed")).model
    (where,) = [n for n in model.graph if n.op_type == "Where" and n.inputs[1].const_value is not None
                and n.inputs[1].const_value.numpy().size == 1 and n.inputs[1].const_value.numpy() < 0]  # fmt: skip
    fill = where.inputs[1].const_value.numpy()
    assert fill.dtype == np.float16 and float(fill) == -FP16_MAX
    save_model(model, tmp_path / "ok.onnx")
    _check_runs(str(tmp_path / "ok.onnx"), config, weights_for("kpm"), "fp16")

    where.inputs[1].const_value = ir.tensor(np.array(-np.inf, dtype=np.float16))
    save_model(model, tmp_path / "inf.onnx")
    with pytest.raises(AssertionError, match="non-finite values at batch=1 seq=1"):
        _check_runs(str(tmp_path / "inf.onnx"), config, weights_for("kpm"), "fp16")


def test_weight_outside_fp16_range_is_an_error():
    model = _fp32_export("self", "decomposed")
    bias = model.graph.initializers["q_proj.bias"]
    array = bias.const_value.numpy().copy()
    array[3] = 1e5  # does not fit in fp16: saturating it would silently change the model
    bias.const_value = ir.tensor(array, name="q_proj.bias")
    with pytest.raises(UsageError, match=r"tensor 'q_proj.bias' has 1 values outside float16's range"):
        ConvertToFloat16()(model)


def test_model_loaded_with_external_data(tmp_path):
    """A model read back from disk with its weights in a data file (as the gpt3 preset is):
    the pass converts the external tensors, and the fp16 model is written whole."""
    save_model(_fp32_export("kpm", "decomposed"), tmp_path / "w.onnx", external_data=True)
    assert (tmp_path / "w.onnx.data").exists()
    model = ir.load(tmp_path / "w.onnx")
    assert any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    ConvertToFloat16()(model)
    save_model(model, tmp_path / "h.onnx")
    _check_runs(str(tmp_path / "h.onnx"), CONFIGS["kpm"], weights_for("kpm"), "fp16")


def test_constant_nodes_casts_and_fill_scalars(tmp_path):
    """The forms the exporter does not use today but a rewritten graph may: Constant with
    value_float(s) and a tensor, ConstantOfShape's float32 default, Cast to float, a
    scalar fill of -1e9 (saturated), and a second run that finds nothing to do."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    nodes = [
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node("Constant", [], ["half"], value_floats=[0.5]),
        helper.make_node("Constant", [], ["fill"], value=helper.make_tensor("f", TensorProto.FLOAT, [], [-1e9])),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        helper.make_node("Add", ["x", "two"], ["a"]),
        helper.make_node("Add", ["a", "zeros"], ["b"]),
        helper.make_node("Cast", ["b"], ["i"], to=TensorProto.INT64),
        helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Less", ["x", "zeros"], ["neg"]),
        helper.make_node("Where", ["neg", "fill", "f"], ["g"]),
        helper.make_node("Mul", ["g", "half"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = ir.from_proto(proto)
    assert ConvertToFloat16()(model).modified
    assert not ConvertToFloat16()(model).modified  # already fp16: nothing to do
    save_model(model, tmp_path / "c.onnx")
    session = ort.InferenceSession(str(tmp_path / "c.onnx"), providers=["CPUExecutionProvider"])
    feed = np.array([-1.0, 0.25, 3.5], np.float16)
    (out,) = session.run(None, {"x": feed})
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, np.array([-FP16_MAX / 2, 1.0, 2.5], np.float16))


# A com.microsoft MultiHeadAttention graph, as the ort-fused lowering writes ---------------
def _mha_model(config: AttentionConfig, weights: dict) -> ir.Model:
    """y = (MHA(x Wq, m Wk, m Wv, bias, key_padding_mask as int32 keep-mask), zeroed where
    every key is hidden) Wo + bo. Causal configs use unidirectional=1 (no padding mask)."""
    assert not (config.causal and config.key_padding_mask)
    c = config
    inputs = [helper.make_tensor_value_info(s.name, TensorProto.BOOL if s.dtype == "bool" else TensorProto.FLOAT,
                                            list(s.shape)) for s in c.inputs()]  # fmt: skip
    mem = "memory" if c.cross else "x"
    # torch Linear's W is [out, in]; MatMul wants [in, out].
    inits = [helper.make_tensor(f"W{p}", TensorProto.FLOAT, weights[f"{p}_proj.weight"].T.shape,
                                np.ascontiguousarray(weights[f"{p}_proj.weight"].T).ravel())
             for p in ("q", "k", "v", "out")]  # fmt: skip
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("MatMul", [mem, "Wk"], ["k"]),
        helper.make_node("MatMul", [mem, "Wv"], ["v"]),
    ]
    mha_inputs = ["q", "k", "v", ""]
    if c.bias:
        packed = np.concatenate([weights["q_proj.bias"], weights["k_proj.bias"], weights["v_proj.bias"]])
        inits.append(helper.make_tensor("qkv_bias", TensorProto.FLOAT, packed.shape, packed))
        mha_inputs[3] = "qkv_bias"
    attention_out = "z"
    if c.key_padding_mask:
        inits += [helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
                  helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])]  # fmt: skip
        nodes += [
            helper.make_node("Not", ["key_padding_mask"], ["keep"]),
            helper.make_node("Cast", ["keep"], ["keep_i32"], to=TensorProto.INT32),  # MHA's mask: 1 = attend
            helper.make_node("ReduceMax", ["keep_i32", "last"], ["any_i32"], keepdims=1),  # (B, 1)
            helper.make_node("Cast", ["any_i32"], ["any"], to=TensorProto.BOOL),
            helper.make_node("Unsqueeze", ["any", "last"], ["any3"]),  # (B, 1, 1)
        ]
        mha_inputs.append("keep_i32")
        attention_out = "z_raw"
    mha = helper.make_node("MultiHeadAttention", mha_inputs, [attention_out], domain="com.microsoft",
                           num_heads=c.n_heads, scale=c.softmax_scale, unidirectional=int(c.causal))  # fmt: skip
    nodes.append(mha)
    if c.key_padding_mask:
        nodes.append(helper.make_node("Where", ["any3", "z_raw", "zero"], ["z"]))
    nodes.append(helper.make_node("MatMul", ["z", "Wout"], ["zo"] if c.bias else ["y"]))
    if c.bias:
        ob = weights["out_proj.bias"]
        inits.append(helper.make_tensor("bo", TensorProto.FLOAT, ob.shape, ob))
        nodes.append(helper.make_node("Add", ["zo", "bo"], ["y"]))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", c.d_model])
    infos = [helper.make_tensor_value_info(attention_out, TensorProto.FLOAT, ["batch", "seq", c.v_dim])]
    graph = helper.make_graph(nodes, "mha", inputs, [y], inits, value_info=infos)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    proto = helper.make_model(graph, opset_imports=opsets)
    return ir.from_proto(onnx.shape_inference.infer_shapes(proto))  # typed, as the exporter's graphs are


@pytest.mark.parametrize("name", ["self", "cross", "causal", "kpm", "cross_kpm"])
def test_fp16_multi_head_attention_graph(tmp_path, name):
    config, weights = CONFIGS[name], weights_for(name)
    fp32_path = tmp_path / "mha32.onnx"
    save_model(_mha_model(config, weights), fp32_path)
    session = ort.InferenceSession(str(fp32_path), providers=["CPUExecutionProvider"])
    feeds = make_inputs(config, 3, 7, 5 if config.cross else None)
    ref = reference_attention(config, weights, **feeds)  # the builder itself is right in fp32
    size = problem_size(config, weights, feeds)
    assert compare_arrays("y", session.run(None, feeds)[0], ref, tolerance_for("fp32"), size)

    for keep in (False, True):
        model = ConvertToFloat16(keep_io_fp32=keep)(_mha_model(config, weights)).model
        (mha,) = [n for n in model.graph if n.op_type == "MultiHeadAttention"]
        assert mha.domain == "com.microsoft" and mha.attributes["num_heads"].value == config.n_heads
        if config.key_padding_mask:
            mask = mha.inputs[4]  # stays int32, and so does the Cast that makes it
            assert mask.dtype == ir.DataType.INT32 and mask.producer().attributes["to"].value == ir.DataType.INT32
        path = tmp_path / f"mha16-{keep}.onnx"
        save_model(model, path)
        assert onnx.load(path).ir_version == IR_VERSION
        _check_runs(str(path), config, weights, "fp32" if keep else "fp16")


# Through the registry's emitters and export_model -------------------------------------
@pytest.mark.parametrize("lowering", ["ort-fused", "ort-attention"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp16_after_the_fused_lowerings(tmp_path, name, lowering):
    """The fp16 pass after the fused cores: com.microsoft MultiHeadAttention (or packed Attention) in
    float16, masks and all."""
    from attnx.export.passes import count_ops
    from attnx.model.cores import lowerings_for
    from attnx.workflows import lower

    config = CONFIGS[name]
    if lowering not in lowerings_for(config, "fp16"):
        pytest.skip(f"{lowering} does not compute {name}")
    result = lower(config, weights_for(name), attention=lowering, dtype="fp16")
    fused = [op for op in count_ops(ir.from_proto(result.model)) if op.startswith("com.microsoft.")]
    assert fused, f"{lowering} left no com.microsoft op: {result.lines()}"
    assert any("float16" in line for line in result.lines())  # the pass's notes reach the report
    path = str(tmp_path / "m.onnx")
    onnx.save(result.model, path)
    _check_runs(path, config, weights_for(name), "fp16")


def test_export_model_fp16_end_to_end(exported):
    # exported() runs export_model: export, ort-fused, fp16, save, checker, torch fp16 check.
    name = "cross_kpm"
    path = exported(name, "ort-fused", "fp16")
    proto = onnx.load(path)
    assert any(n.op_type == "MultiHeadAttention" for n in proto.graph.node)
    assert proto.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    _check_runs(path, CONFIGS[name], weights_for(name), "fp16")


def test_export_model_fp16_keeping_fp32_io(tmp_path):
    from attnx.workflows import export_model

    config, weights = CONFIGS["kpm"], weights_for("kpm")
    path = str(tmp_path / "kpm.onnx")
    report = export_model(config, path, weights, attention="ort-fused", dtype="fp16", keep_io_fp32=True)
    assert report.dtype == "fp16" and report.validation and all(report.validation)
    proto = onnx.load(path)
    assert [v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]] == [
        TensorProto.FLOAT, TensorProto.BOOL, TensorProto.FLOAT,
    ]  # fmt: skip
    _check_runs(path, config, weights, "fp32")


@pytest.mark.parametrize("name", ["llm", "llama"])
def test_fp16_of_a_rope_layer_keeps_its_angle_float32(name, tmp_path, monkeypatch):
    """The rotary angle p * inv_freq in float32 (its cos and sin cast to float16): the half-precision
    graph then passes parity at position 8192 under fp16's rule plus the rope term; with the angle in
    float16 (the region switched off) it fails there, by whole radians at the fast pairs."""
    from attnx.export.passes import fp16 as fp16_module
    from attnx.runtimes import ModelSource
    from attnx.runtimes.parity import run_parity
    from tests.conftest import LLM_CONFIGS

    config = LLM_CONFIGS[name]
    weights = weights_for(name)

    def report(path):
        model = export_onnx(config, weights)
        passes = ConvertToFloat16()
        passes(model)
        save_model(model, path)
        return passes, run_parity(ModelSource(config, weights, str(path), "fp16"), ["ort-cpu"], batches=(3,),
                                  seqs=(1, 9), position_offset=8192, localise="off")  # fmt: skip

    passes, right = report(tmp_path / "right.onnx")
    assert any("rotary angle kept float32" in n for n in passes.notes)
    assert right.passed, [c.reason for c in right.cases]
    model = onnx.load(tmp_path / "right.onnx")
    cos = next(n for n in model.graph.node if n.op_type == "Cos")
    kept = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    assert kept.get(cos.output[0], TensorProto.FLOAT) == TensorProto.FLOAT  # cos of a float32 angle
    monkeypatch.setattr(fp16_module, "_angle_region", lambda graph: set())
    _, wrong = report(tmp_path / "wrong.onnx")
    assert not wrong.passed


@pytest.mark.parametrize("attention", ["onnx", "ort-fused"])
def test_fp16_of_the_built_llm_lowerings_keeps_the_angle_float32(attention, tmp_path, monkeypatch):
    """The onnx and ort-fused graphs of a modern-LLM config are built node by node, then converted
    like the exporter's: their rotary angle stays float32 and they pass at position 8192 (with it in
    float16 they fail there); OpenVINO, which computes that region in f16 under its f16 hint, is
    skipped with the reason."""
    from attnx.export.passes import fp16 as fp16_module
    from attnx.model.weights import init_weights
    from attnx.runtimes import ModelSource
    from attnx.runtimes.parity import run_parity
    from attnx.workflows import export_model
    from tests.conftest import LLM_FUSED_CONFIGS

    config = LLM_FUSED_CONFIGS[attention]
    weights = init_weights(config, seed=1)

    def report(path, **kw):
        export = export_model(config, path, weights, attention=attention, dtype="fp16", **kw)
        return export, run_parity(ModelSource(config, weights, str(path), "fp16"), ["ort-cpu", "openvino"],
                                  batches=(3,), seqs=(1, 9), position_offset=8192, localise="off")  # fmt: skip

    export, right = report(tmp_path / "right.onnx")  # validated against torch fp16 by the export too
    assert export.dtype == "fp16" and any("rotary angle kept float32" in line for line in export.passes)
    ran = [c for c in right.cases if c.backend == "ort-cpu"]
    assert ran and all(c.status == "pass" for c in ran), [c.reason for c in ran]
    assert all(c.status == "skipped" for c in right.cases if c.backend == "openvino")
    if attention == "onnx" and not any("is unavailable" in (c.reason or "") for c in right.cases):
        assert all("rotary angle" in c.reason for c in right.cases if c.backend == "openvino")
    export_model(config, tmp_path / "io32.onnx", weights, attention=attention, dtype="fp16", keep_io_fp32=True)
    monkeypatch.setattr(fp16_module, "_angle_region", lambda graph: set())
    _, wrong = report(tmp_path / "wrong.onnx", validate=False)
    assert any(c.status == "fail" for c in wrong.cases if c.backend == "ort-cpu")
