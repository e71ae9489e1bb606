"""The GEMM that measures the machine's limit, beside the FLOPs of one attention call
(attnx.model.resources.attention_flops: counted there with the memory a case needs, the one
estimator of both, so that layers below the harness size their work by the same count).
"""

from __future__ import annotations

from attnx.model.config import AttentionConfig
from attnx.model.resources import attention_flops

__all__ = [
    "attention_flops",
    "gemm_flops",
    "GEMM_ROWS",
    "gemm_shape",
]

# Rows of the GEMM that measures the machine's matmul throughput: enough to fill the cores
# without being a long-sequence problem of its own (measurements/cpu_baseline measured ORT CPU
# at 512 x 1024 x 1024).
GEMM_ROWS = 512


def gemm_shape(config: AttentionConfig) -> tuple[int, int, int]:
    """(m, k, n) of the roofline GEMM: GEMM_ROWS tokens through the q projection
    (d_model -> N * head_dim), the model's own projection size."""
    return GEMM_ROWS, config.d_model, config.q_dim


def gemm_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an [m, k] x [k, n] matrix product."""
    return 2 * m * k * n
