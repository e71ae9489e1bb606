"""The quantized forms under their error model: every form passes the parity matrix, and the
bound is tight enough to fail a real fault in the quantized initializers of a built model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from attnx.export import build_model
from attnx.model.config import AttentionConfig
from attnx.model.contract import QUANTIZATIONS
from attnx.model.tolerance import ProblemSize, tolerance_for
from attnx.model.weights import init_weights
from attnx.runtimes import ModelSource
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.parity import run_parity
from tests.conftest import CONFIGS, weights_for


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized(name, dtype, config=None, weights=None) -> path: ort-fused, quantized, cached."""
    root = tmp_path_factory.mktemp("quantized")
    cache: dict = {}

    def get(name, dtype, config=None, weights=None):
        if (name, dtype) not in cache:
            config = config or CONFIGS[name]
            model = build_model(config, weights, "ort-fused", "full", dtype)
            cache[(name, dtype)] = str(root / f"{name}-{dtype}.onnx")
            onnx.save(model, cache[(name, dtype)])
        return cache[(name, dtype)]

    return get


# The runtimes that run the quantized graphs: ONNX Runtime, and OpenVINO where installed (its own
# quantization of the inputs, its own rows of the tolerance table).
RUNTIMES = ["ort-cpu"] + (["openvino"] if backend_unavailable_reason("openvino") is None else [])


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_matrix(quantized, name, dtype):
    """self, cross, causal, key padding (with a fully hidden row), v_head_dim != head_dim; on
    ONNX Runtime and, where installed, OpenVINO (its own quantization of the inputs, its own rows)."""
    config, weights = CONFIGS[name], weights_for(name)
    path = quantized(name, dtype, weights=weights)
    report = run_parity(ModelSource(config, weights, path, dtype), ["torch", *RUNTIMES], batches=(1, 3),
                        seqs=(1, 7, 128), mem_seqs=(5,) if config.cross else None)  # fmt: skip
    assert report.passed, [c.reason for c in report.cases if c.status != "pass"]
    assert all(c.dtype == "fp32" for c in report.cases if c.backend == "torch")  # the float module, fp32's rule
    for c in report.cases:  # rel RMS and cosine for every case
        assert c.rel_rms is not None and c.cosine is not None
    for backend in RUNTIMES:
        cases = [c for c in report.cases if c.backend == backend]
        assert len(cases) == 6 and all(c.dtype == dtype and c.status == "pass" for c in cases)
        # the quantization is really there: the error is far above float32's, and far below 100%
        assert all(1e-4 < c.rel_rms < (0.05 if dtype == "int8" else 0.3) for c in cases), backend
    if "openvino" in RUNTIMES:
        assert {c.precision for c in report.cases if c.backend == "openvino"} == {"fp32, inputs int8 in groups of 32"}


# Faults, each in the quantized initializers of one projection ---------------------------------------
FAULT_CONFIG = AttentionConfig(d_model=64, n_heads=4)  # the tiny preset: two int4 blocks of K per column


def _edit(path, out, role, fault):
    model = onnx.load(path)
    inits = {i.name: i for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.name.startswith(f"{role}_proj"))
    arrays = [numpy_helper.to_array(inits[name]) for name in node.input[1:4]]
    for name, array in zip(node.input[1:4], fault(node.op_type, *arrays)):
        inits[name].CopyFrom(numpy_helper.from_array(array, name))
    onnx.save(model, out)


def _zero_point_plus_one(op, q, scale, zp):
    if op == "DynamicQuantizeMatMul":
        return q, scale, (zp + 1).astype(np.int8)
    low, high = np.minimum((zp & 15) + 1, 15), np.minimum((zp >> 4) + 1, 15)  # two 4-bit zero points a byte
    return q, scale, (low | (high << 4)).astype(np.uint8)


def _scale_times_two(op, q, scale, zp):
    return q, (scale * 2).astype(np.float32), zp


def _transposed_block(op, q, scale, zp):
    """A 32 x 32 tile of the quantized weights transposed (output channels <-> inputs)."""
    if op == "DynamicQuantizeMatMul":  # q [K, N]
        q = q.copy()
        q[:32, :32] = q[:32, :32].T.copy()
        return q, scale, zp
    n = q.shape[0]
    values = np.stack([q & 15, q >> 4], axis=-1).reshape(n, -1)  # (N, K): unpacked 4-bit values
    values[:32, :32] = values[:32, :32].T.copy()
    values = values.reshape(q.shape[0], q.shape[1], -1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8), scale, zp


# Two models of FAULT_CONFIG: "flat", the seeded weights (score RMS 0.3-0.4: attention nearly
# uniform, q and k barely move y), and "peaked", q and k doubled (score RMS ~1.5, max ~10, as a
# trained model's attention is). A fault moves y only as much as its projection matters: in the
# flat model a zero point off by one in q moves y less than the quantization's own noise, and no
# comparison of outputs can see it there; in the peaked one the noise of q and k grows with the
# scores and hides the out projection's. Each fault must fail in the model where it shows, and
# every scale and transposed-block fault in both.
FAULT_MODELS = {"flat": 1.0, "peaked": 2.0}
ZERO_POINT_SHOWS = {"q": ("peaked",), "v": ("flat", "peaked"), "out": ("flat",)}
# A zero point off by one in k is not among them: it adds step * sum_k x_k to every key, and the
# part common to all keys (from the inputs' mean) moves every score of a query by the same amount,
# which the softmax removes; what is left is a random walk 3.5x k's rounding noise, within the noise.


@pytest.mark.slow
@pytest.mark.parametrize("model", list(FAULT_MODELS))
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_bound_fails_real_faults(quantized, tmp_path, dtype, model):
    """The parity cases alternate zero-mean and shifted inputs (run_parity's DEFAULT_MEANS): a zero
    point off by one shifts a whole weight column, which only an input with a mean shows (its
    error is step * sum_k x_k)."""
    config = FAULT_CONFIG
    weights = init_weights(config, seed=0)
    for name in ("q_proj.weight", "k_proj.weight"):
        weights[name] = weights[name] * np.float32(FAULT_MODELS[model])
    path = quantized(f"fault-{model}", dtype, config=config, weights=weights)

    def parity(model_path, localise="failing"):
        return run_parity(ModelSource(config, weights, model_path, dtype), RUNTIMES, batches=(1, 3), seqs=(7, 128),
                          localise=localise)  # fmt: skip

    good = parity(path)
    assert good.passed, [c.reason for c in good.cases]
    assert {c.input_mean for c in good.cases} == {0.0, 0.5}
    faults = {f"zero point off by one ({role})": (role, _zero_point_plus_one)
              for role, models in ZERO_POINT_SHOWS.items() if model in models}  # fmt: skip
    faults.update({
        "scale off by 2x (q)": ("q", _scale_times_two),
        "scale off by 2x (v)": ("v", _scale_times_two),
        "transposed block (k)": ("k", _transposed_block),
        "transposed block (out)": ("out", _transposed_block),
    })  # fmt: skip
    for label, (role, fault) in faults.items():
        bad = str(tmp_path / f"bad-{dtype}.onnx")
        _edit(path, bad, role, fault)
        report = parity(bad, localise="off")  # the verdict is the point; where it diverges is localise's tests'
        for backend in RUNTIMES:  # each runtime's own bound catches it
            cases = [c for c in report.cases if c.backend == backend]
            assert any(c.status == "fail" for c in cases), \
                f"{dtype} {model}: {label} passed parity on {backend}: {[c.rel_rms for c in cases]}"


def test_the_error_model_reads_int8s_row_scales_and_the_records_written_before_them():
    """int8 quantizes its input per row: step 2 rms_rows(max |x|)/255; a model or package written
    when int8 was per tensor keeps that model (its metadata says so), and a golden case recorded
    then (three numbers per input) reads the tensor's max |x| as every row's."""
    old = ProblemSize.from_dict({"k": 64, "score_max": 1.0, "score_rms": 0.5, "activations": {"x": [1.0, -4.0, 3.0]}})
    assert old.activation("x") == (1.0, -4.0, 3.0, 4.0)
    size = ProblemSize(64, 1.0, 0.5, (("x", 1.0, -4.0, 3.0, 2.5), ("z", 0.1, -0.4, 0.3, 0.25)))
    assert ProblemSize.from_dict(size.to_dict()) == size
    projections = {role: {"k": 64, "n": 64, "rel_error": 0.0, "weight_rms": 1.0} for role in ("v", "out")}
    per_row = tolerance_for("int8", quantization={"activations": QUANTIZATIONS["int8"].activations,
                                                  "projections": projections})  # fmt: skip
    per_tensor = tolerance_for("int8", quantization={"activations": "dynamic uint8 per tensor",
                                                     "projections": projections})  # fmt: skip
    assert per_row.activations == "uint8 per row" and per_tensor.activations == "uint8 per tensor"
    # v reads x, out reads z: each input's step / sqrt(12) / its rms, added in squares
    row = [2 * 2.5 / 255 / 1.0, 2 * 0.25 / 255 / 0.1]
    tensor = [7.0 / 255 / 1.0, 0.7 / 255 / 0.1]
    assert per_row.rel_sigma(size) == pytest.approx(float(np.hypot(*row)) / np.sqrt(12))
    assert per_tensor.rel_sigma(size) == pytest.approx(float(np.hypot(*tensor)) / np.sqrt(12))
