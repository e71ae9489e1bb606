"""What ONNX Runtime's CUDA kernels refuse beyond the CPU's, found on an H200 (onnxruntime-gpu 1.31.1, 2026-12-04):
the cores' entries say it (Core.cuda_limits, why_not_on_cuda), and a model whose MultiHeadAttention would write its
cache past the buffer is refused before its first CUDA run (runtimes.cuda.cuda_kernel_problems). Tested here on the
CPU: the refusals are read off the entries and the graph, no GPU needed."""

from __future__ import annotations

import onnx
import pytest

from attnx.export import build_model
from attnx.model import AttentionConfig, init_weights
from attnx.model.contract import BUFFER_CORES
from attnx.model.cores import LOWERING_OF_CORE, why_not, why_not_on_cuda
from attnx.runtimes.cuda import cuda_kernel_problems

STEP = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=True, key_padding_mask=False, kv_cache=True)


def test_the_cores_say_what_their_cuda_kernels_refuse():
    assert why_not("gqa", STEP, "fp32", "buffer") == []  # the CPU runs it
    assert any("no fp32 kernel" in r for r in why_not_on_cuda("gqa", STEP, "fp32", "buffer"))
    assert why_not_on_cuda("gqa", STEP, "fp16", "buffer") == []
    assert why_not("grouped-mha", STEP, "fp32", "buffer") == []
    assert any("cache_indirection" in r for r in why_not_on_cuda("grouped-mha", STEP, "fp32", "buffer"))
    assert why_not_on_cuda("grouped-mha", STEP, "fp32", "growing") == []  # its growing form is not refused
    auto = why_not_on_cuda("switch", STEP, "fp32", "buffer")
    assert any("no fp32 kernel" in r for r in auto) and any("cache_indirection" in r for r in auto)


@pytest.mark.parametrize("core", BUFFER_CORES)
def test_a_cache_cuda_would_write_past_is_found_in_the_graph(tmp_path, core):
    path = str(tmp_path / f"{core}.onnx")
    onnx.save(build_model(STEP, init_weights(STEP, 0), LOWERING_OF_CORE[core], "buffer", buffer_core=core), path)
    problems = cuda_kernel_problems(path)
    if any("cache_indirection" in r for r in why_not_on_cuda(core, STEP, "fp32", "buffer")):
        # the grouped core's MultiHeadAttention, also inside the auto core's If branches
        assert problems and all("MultiHeadAttention" in p and "past_sequence_length" in p for p in problems)
    else:
        assert problems == []
