"""The quantized forms under their error model: every form passes the parity matrix, and the
bound is tight enough to fail a real fault in the quantized initializers of a built model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from attnx.export import export_onnx, save_model
from attnx.export.passes import lower
from attnx.model.config import AttentionConfig
from attnx.model.weights import init_weights
from attnx.runtimes import ModelSource
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
            model = lower(export_onnx(config, weights), config, attention="ort-fused", dtype=dtype).model
            cache[(name, dtype)] = str(root / f"{name}-{dtype}.onnx")
            save_model(model, cache[(name, dtype)])
        return cache[(name, dtype)]

    return get


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_matrix(quantized, name, dtype):
    """self, cross, causal, key padding (with a fully hidden row), v_head_dim != head_dim."""
    config, weights = CONFIGS[name], weights_for(name)
    path = quantized(name, dtype, weights=weights)
    report = run_parity(ModelSource(config, weights, path, dtype), ["torch", "ort-cpu"], batches=(1, 3),
                        seqs=(1, 7, 128), mem_seqs=(5,) if config.cross else None)  # fmt: skip
    assert report.passed, [c.reason for c in report.cases if c.status != "pass"]
    ort = [c for c in report.cases if c.backend == "ort-cpu"]
    assert len(ort) == 6 and all(c.dtype == dtype for c in ort)
    assert all(c.dtype == "fp32" for c in report.cases if c.backend == "torch")  # the float module, fp32's rule
    for c in report.cases:  # rel RMS and cosine for every case
        assert c.rel_rms is not None and c.cosine is not None
    # the quantization is really there: the error is far above float32's, and far below 100%
    assert all(1e-4 < c.rel_rms < (0.05 if dtype == "int8" else 0.3) for c in ort)


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


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_bound_fails_real_faults(quantized, tmp_path, dtype):
    config = FAULT_CONFIG
    weights = init_weights(config, seed=0)
    path = quantized("fault", dtype, config=config, weights=weights)

    def parity(model_path):
        return run_parity(ModelSource(config, weights, model_path, dtype), ["ort-cpu"], batches=(1, 3), seqs=(7, 128))

    good = parity(path)
    assert good.passed, [c.reason for c in good.cases]
    faults = {
        "zero point off by one (out)": ("out", _zero_point_plus_one),
        "scale off by 2x (v)": ("v", _scale_times_two),
        "transposed block (out)": ("out", _transposed_block),
    }
    for label, (role, fault) in faults.items():
        bad = str(tmp_path / f"bad-{dtype}.onnx")
        _edit(path, bad, role, fault)
        report = parity(bad)
        assert not report.passed, f"{dtype} {label} passed parity: {[c.rel_rms for c in report.cases]}"
