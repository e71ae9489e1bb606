"""Parity on the GPU: ort-cuda over every lowering and torch-cuda, in float32 and float16,
against the float64 reference; and the causal-alignment trap of the standard Attention op.

The trap (onnxruntime issue #29020): with is_causal=1 and q_len != kv_len (no past), ORT's
CPU and CUDA kernels of the opset-23 Attention op have aligned the causal mask differently
(bottom-right on CPU, upper-left on CUDA). The ONNX spec says upper-left: query i sees keys
j <= i. attnx's own models never meet it (causal is self-attention only, so q_len ==
kv_len), but a graph that reaches ORT through the onnx lowering can, so both providers are
checked against the spec on a bare Attention node.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.ort_runner import ort_cuda_unavailable_reason
from attnx.runtimes.parity import run_parity
from attnx.runtimes.torch_runner import torch_cuda_unavailable_reason
from tests.conftest import CONFIGS, weights_for

# Shapes of the trap: fewer queries than keys (decode), more, and square (the control).
CAUSAL_SHAPES = [(2, 5), (1, 4), (5, 2), (3, 3)]
GPU_CONFIGS = ["self", "causal_kpm", "cross_kpm", "kpm"]


@pytest.fixture
def ort_cuda():
    reason = ort_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def torch_cuda():
    reason = torch_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _attention23_model(path: str, q_len: int, kv_len: int, heads: int = 2, head_dim: int = 4) -> None:
    """One opset-23 Attention node with is_causal=1 on fixed 4-D q, k, v."""
    import onnx
    from onnx import TensorProto, helper

    from attnx.model.contract import IR_VERSION

    def value(name: str, length: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, heads, length, head_dim])

    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=1, name="causal_attention")
    graph = helper.make_graph([node], "causal", [value("Q", q_len), value("K", kv_len), value("V", kv_len)],
                              [value("Y", q_len)])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=IR_VERSION), path)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, offset: int) -> np.ndarray:
    """softmax(q k^T / sqrt(d) masked to j <= i + offset) v in float64. offset 0 is the
    spec's upper-left alignment, kv_len - q_len the bottom-right one."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])  # (B, N, T, S)
    i = np.arange(q.shape[2])[:, None]
    j = np.arange(k.shape[2])[None, :]
    scores = np.where(j <= i + offset, scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def _check_causal_alignment(backend: str, tmp_path) -> None:
    rng = np.random.Generator(np.random.PCG64(0))
    for q_len, kv_len in CAUSAL_SHAPES:
        path = str(tmp_path / f"causal-{q_len}-{kv_len}.onnx")
        _attention23_model(path, q_len, kv_len)
        feeds = {n: rng.standard_normal((1, 2, t, 4), dtype=np.float32) for n, t in (("Q", q_len), ("K", kv_len),
                                                                                      ("V", kv_len))}  # fmt: skip
        with create_runner(backend, ModelSource(model_path=path)) as runner:
            y = runner.run(feeds)["Y"]
        upper_left = causal_attention(feeds["Q"], feeds["K"], feeds["V"], offset=0)
        np.testing.assert_allclose(
            y, upper_left, rtol=1e-5, atol=1e-6, err_msg=f"{backend} q_len={q_len} kv_len={kv_len}"
        )
        if q_len < kv_len:  # the shapes where the two alignments differ: the check discriminates
            bottom_right = causal_attention(feeds["Q"], feeds["K"], feeds["V"], offset=kv_len - q_len)
            assert np.abs(upper_left - bottom_right).max() > 1e-2


def test_attention23_causal_alignment_on_cpu_is_the_specs(tmp_path):
    _check_causal_alignment("ort-cpu", tmp_path)


@pytest.mark.cuda
def test_attention23_causal_alignment_on_cuda_is_the_specs(ort_cuda, tmp_path):
    _check_causal_alignment("ort-cuda", tmp_path)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("lowering", ["decomposed", "onnx", "ort-fused"])
@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_ort_cuda_parity_matrix(ort_cuda, exported, name, lowering, dtype):
    config = CONFIGS[name]
    source = ModelSource(config, weights_for(name), exported(name, lowering, dtype), dtype)
    report = run_parity(source, ["ort-cuda"], batches=(1, 3), seqs=(1, 7, 128), mem_seqs=(5, 130) if config.cross
                        else None)  # fmt: skip
    statuses = {c.status for c in report.cases}
    assert statuses == {"pass"}, [c.reason for c in report.cases if c.status != "pass"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_torch_cuda_parity_matrix(torch_cuda, name, dtype):
    config = CONFIGS[name]
    source = ModelSource(config, weights_for(name), None, dtype)
    report = run_parity(source, ["torch-cuda"], batches=(1, 3), seqs=(1, 7, 128), mem_seqs=(5, 130) if config.cross
                        else None)  # fmt: skip
    assert {c.status for c in report.cases} == {"pass"}, [c.reason for c in report.cases if c.status != "pass"]
