"""The int8 and int4 forms: the pass replaces the four projections (found by the names every attnx graph
gives their weights), records its parameters in the metadata (int8's weight width too: 7 or 8 bits), and
the probe still reads the lowering and the weights of a quantized model."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from attnx.errors import UsageError
from attnx.export import build_model, export_onnx, qk_weights, save_model, v_weights
from attnx.export.passes import convert_precision
from attnx.export.passes.quantize import quantize_int8
from attnx.model import init_weights, preset, reference_attention
from attnx.model.contract import INT8_BITS_KEY, IR_VERSION, MS_DOMAIN, QUANT_KEY, describe
from attnx.model.inputs import make_inputs
from attnx.model.int8 import INT8_WEIGHT_MAX, has_vnni, int8_bits_of
from attnx.runtimes import ModelSource, create_runner
from attnx.workflows import export_model
from tests.conftest import CONFIGS, weights_for

OPS = {"int8": f"{MS_DOMAIN}.DynamicQuantizeMatMul", "int4": f"{MS_DOMAIN}.MatMulNBits"}


def quantize(name, attention, dtype, tmp_path, **options):
    """`name` in `attention` and `dtype`: the torch export and its passes (decomposed), or written from
    the registry (attnx.export.build_model); saved, its path."""
    config, weights = CONFIGS[name], weights_for(name)
    if attention == "decomposed":
        model = convert_precision(export_onnx(config, weights), dtype, **options).model
    else:
        model = ir.from_proto(build_model(config, weights, attention, "full", dtype, **options))
    out = str(tmp_path / f"{name}-{attention}-{dtype}.onnx")
    save_model(model, out)
    return out


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("key", [("cross_kpm", "ort-fused"), ("causal", "decomposed")])
def test_the_four_projections_are_quantized_and_recorded(key, dtype, tmp_path):
    name, attention = key
    path = quantize(name, attention, dtype, tmp_path)
    info = describe(path)
    assert info.lowering == attention  # the probe reads the core of a quantized graph
    assert info.dtype == dtype and info.io_dtype == "fp32"
    assert info.operators[OPS[dtype]] == 4
    assert info.operators.get("MatMul", 0) == (2 if attention == "decomposed" else 0)  # q.k and p.v stay float
    assert info.ir_version == IR_VERSION and info.opsets[MS_DOMAIN] == 1
    record = json.loads(info.metadata[QUANT_KEY])
    assert record["dtype"] == dtype and record["op"] == OPS[dtype]
    assert set(record["projections"]) == {"q", "k", "v", "out"}
    assert record["block_size"] == (32 if dtype == "int4" else None)
    assert record["per_channel"] == (dtype == "int8")
    assert info.quantization == record and "quantization" in info.to_dict()
    # int8's row scales: one per distinct projection input (x, memory for cross-attention, z)
    inputs = 3 if CONFIGS[name].cross else 2
    row_maxes = [n for n in ir.load(path).graph if n.op_type == "ReduceMax" and n.outputs[0].name.endswith("/row_max")]
    assert len(row_maxes) == (inputs if dtype == "int8" else 0)
    assert ("per row" in record["activations"]) == (dtype == "int8")
    with create_runner("ort-cpu", ModelSource(model_path=path, dtype=dtype)) as runner:  # loads in the pinned ORT
        assert runner.inputs[0].dtype == "fp32"


def test_int8_quantizes_each_row_of_its_input_on_its_own_scale(tmp_path):
    """A token 1000x larger than the rest leaves their error as it was: the input is quantized per
    row (per tensor, the large row's range would round every other row to a few steps)."""
    k, n = 64, 32
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n)).astype(np.float32) / 8
    x = ir.Value(name="x", shape=ir.Shape([2, 5, k]), type=ir.TensorType(ir.DataType.FLOAT))
    weight = ir.Value(name="q_proj.weight.T", shape=ir.Shape([k, n]), type=ir.TensorType(ir.DataType.FLOAT),
                      const_value=ir.tensor(w, name="q_proj.weight.T"))  # fmt: skip
    node = ir.node("MatMul", [x, weight], name="proj")
    node.outputs[0].name, node.outputs[0].shape = "y", ir.Shape([2, 5, n])
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=[weight], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=IR_VERSION)
    from attnx.export.passes import QuantizeProjections

    QuantizeProjections("int8")(model)
    path = str(tmp_path / "one.onnx")
    save_model(model, path)
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = rng.standard_normal((2, 5, k)).astype(np.float32)
    feed[0, 2] *= 1000  # one loud token
    feed[1, 4] = 0  # and a silent one: 0 / FLT_MIN, not a NaN
    y = session.run(None, {"x": feed})[0]
    ref = feed.astype(np.float64) @ w
    rel = np.sqrt(np.mean((y - ref) ** 2, axis=-1) / np.maximum(np.mean(ref**2, axis=-1), 1e-300))
    assert np.all(np.isfinite(y)) and np.all(y[1, 4] == 0)
    quiet = np.delete(rel.reshape(-1), [2, 9])  # every other row keeps int8's ~1% error
    assert rel[0, 2] < 0.05 and quiet.max() < 0.05, rel


@pytest.mark.parametrize("dtype", ["int8-7", "int8-8", "int4"])
def test_dequantized_weights_are_within_half_a_step(dtype, tmp_path):
    """The probe reads the weights a quantized node computes with: every one within half its
    step of the float weight (the error model's premise), and the recorded step is the scales'."""
    name = "cross_kpm"  # kv_dim 40: int4's last block of k and v is padded
    dtype, _, bits = dtype.partition("-")
    path = quantize(name, "ort-fused", dtype, tmp_path, block_size=16, **({"int8_bits": bits} if bits else {}))
    model = ir.load(path)
    got = {**qk_weights(model), **v_weights(model)}
    record = json.loads(model.metadata_props[QUANT_KEY])
    want = weights_for(name)
    for role in ("q", "k", "v"):
        w, ref = got[f"{role}_proj.weight"], want[f"{role}_proj.weight"]
        assert w.shape == ref.shape
        err = np.abs(w - ref)
        step = record["projections"][role]["step_rms"]
        assert 0 < err.max() and float(np.sqrt(np.mean(err**2))) <= step / np.sqrt(12) * 1.3
        limit = np.abs(ref).max(axis=1, keepdims=True) / INT8_WEIGHT_MAX[int(bits)] if dtype == "int8" else None
        if limit is not None:
            assert (err <= limit / 2 * (1 + 1e-5)).all()


def test_int4_parameters_are_recorded_and_checked(tmp_path):
    path = quantize("self", "ort-fused", "int4", tmp_path, block_size=16, accuracy_level=0)
    record = describe(path).quantization
    assert (record["block_size"], record["accuracy_level"], record["activations"]) == (16, 0, "none")
    with pytest.raises(UsageError, match="block-size"):
        quantize("self", "ort-fused", "int4", tmp_path, block_size=24)


def test_bf16_is_refused_saying_where_it_runs(tmp_path):
    with pytest.raises(UsageError, match="OpenVINO") as e:
        export_model(CONFIGS["self"], tmp_path / "m.onnx", dtype="bf16")
    assert "fp32" in str(e.value) and not (tmp_path / "m.onnx").exists()


def test_ort_attention_is_not_quantized():
    """com.microsoft Attention holds its q/k/v weights: the registry builds it in float only."""
    with pytest.raises(UsageError, match="com.microsoft.Attention .* is not built in int8"):
        build_model(CONFIGS["self"], weights_for("self"), "ort-attention", "full", "int8")


@pytest.mark.parametrize("bits", [7, 8])
def test_quantize_int8_spans_its_width_and_rounds_to_half_a_step(bits):
    """7 bits: [-63, 63] (no int16 overflow in a CPU's u8s8 kernel without VNNI); 8 bits: [-127, 127]. Each
    column reaches its range at its largest weight, and every weight comes back within half its step."""
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    w[:, 3] = 0  # an all-zero column stays exact
    q, scale, zp = quantize_int8(w, bits)
    qmax = {7: 63, 8: 127}[bits]
    assert q.dtype == np.int8 and scale.dtype == np.float32 and not zp.any()
    assert np.abs(q).max() == qmax and (np.abs(q).max(axis=0)[w.any(axis=0)] == qmax).all()
    back = q.astype(np.float64) * scale
    assert (np.abs(back - w) <= scale / 2 * (1 + 1e-6)).all() and not back[:, 3].any()
    # rounding to the nearest step leaves an error of RMS step / sqrt(12) (the error model's premise)
    nonzero = w.any(axis=0)
    assert np.sqrt(np.mean(((back - w) / scale)[:, nonzero] ** 2) * 12) == pytest.approx(1.0, rel=0.1)
    with pytest.raises(UsageError, match="7 or 8 bits, not 6"):
        quantize_int8(w, 6)


@pytest.mark.parametrize(("bits", "vnni", "want"), [("7", True, 7), ("8", False, 8), ("auto", True, 8),
                                                    ("auto", False, 7)])  # fmt: skip
def test_the_int8_width_is_recorded_in_the_metadata(bits, vnni, want, cpu_host, tmp_path):
    """The width written (auto: this host's, read from its cpuinfo) is the model's INT8_BITS_KEY, and its
    quantization record says it; describe() shows it; int4 records none."""
    cpu_host(vnni)
    info = describe(quantize("self", "ort-fused", "int8", tmp_path, int8_bits=bits))
    assert info.metadata[INT8_BITS_KEY] == str(want) and int8_bits_of(info.metadata) == want
    assert info.quantization["weights"] == f"symmetric {want}-bit per output channel (int8 storage)"
    assert INT8_BITS_KEY in info.to_dict()["metadata"]  # attnx inspect shows it
    model = ir.load(quantize("self", "decomposed", "int8", tmp_path, int8_bits=bits))  # the torch export's passes
    assert model.metadata_props[INT8_BITS_KEY] == str(want)
    assert INT8_BITS_KEY not in describe(quantize("self", "ort-fused", "int4", tmp_path)).metadata
    with pytest.raises(UsageError, match="--int8-bits 8 is for --dtype int8"):
        quantize("self", "ort-fused", "int4", tmp_path, int8_bits="8")


def test_a_model_without_the_width_key_is_read_as_7_bits_and_runs_anywhere(cpu_host, tmp_path):
    """A model written before the key (7-bit weights then): read as 7, loaded on a host without VNNI."""
    model = ir.load(quantize("self", "ort-fused", "int8", tmp_path, int8_bits=7))
    del model.metadata_props[INT8_BITS_KEY]
    path = str(tmp_path / "old.onnx")
    save_model(model, path)
    info = describe(path)
    assert INT8_BITS_KEY not in info.metadata and int8_bits_of(info.metadata) == 7
    cpu_host(vnni=False)
    with create_runner("ort-cpu", ModelSource(model_path=path, dtype="int8")) as runner:
        assert runner.inputs[0].name == "x"


@pytest.mark.skipif(not has_vnni(), reason="this CPU has no VNNI (avx512_vnni, avx_vnni, amx_int8): 8-bit int8 "
                    "weights saturate ONNX Runtime's u8s8 GEMM here, so their accuracy is not measurable")  # fmt: skip
def test_8_bit_weights_are_more_accurate_than_7_on_a_host_with_vnni():
    """On a CPU with VNNI the int8 model's error against the float64 formula shrinks with 8-bit weights
    (measurements/int8_range: d_model 1024, Gaussian weights, 2.45% at 7 bits, 1.51% at 8)."""
    import onnxruntime as ort

    config = preset("tiny")
    weights = init_weights(config, 1)
    rng = np.random.default_rng(1)
    for name, w in weights.items():  # Gaussian weights: their tails set each column's scale
        if name.endswith("_proj.weight"):
            weights[name] = (rng.standard_normal(w.shape) / np.sqrt(3 * w.shape[1])).astype(np.float32)
    feeds = make_inputs(config, 2, 64, seed=2)
    ref = reference_attention(config, weights, **feeds)
    error = {}
    for bits in (7, 8):
        model = build_model(config, weights, "ort-fused", "full", "int8", int8_bits=bits)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        y = session.run(["y"], feeds)[0]
        error[bits] = float(np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2)))
    assert error[8] < 0.8 * error[7] and error[7] < 0.02, error
