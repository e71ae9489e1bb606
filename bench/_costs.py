"""The cost model: the FLOPs of one attention call and of the GEMM that measures the machine's
limit. (The memory a case needs is attnx.model.resources', the one estimator.)

Counted as 2 FLOPs per multiply-add of the four projections and of the two attention
matmuls, for batch b, t queries, s keys (s = t and kv_dim = d_model in self-attention),
N heads of which Nkv key/value heads (grouped-query attention: Nkv < N):

    q:                   2 * b * t * d_model * N * head_dim
    k and v:             2 * b * s * kv_dim * Nkv * (head_dim + v_head_dim)
    scores, weighted sum: 2 * b * N * t * s * (head_dim + v_head_dim)
    output:              2 * b * t * N * v_head_dim * d_model

Biases, the scale and the softmax are left out (they are O(b*N*t*s), not O(... * head_dim)).
The score term counts the whole t x s matrix even for a causal model: it is the work a
dense kernel does, and the number stays comparable between lowerings that do and do not
skip the masked half.
"""

from __future__ import annotations

from attnx.model.config import AttentionConfig

__all__ = [
    "attention_flops",
    "gemm_flops",
    "GEMM_ROWS",
    "gemm_shape",
]

# Rows of the GEMM that measures the machine's matmul throughput: enough to fill the cores
# without being a long-sequence problem of its own (the README's CPU baseline measured ORT CPU
# at 512 x 1024 x 1024).
GEMM_ROWS = 512


def attention_flops(config: AttentionConfig, batch: int, seq: int, mem_seq: int | None = None) -> int:
    """FLOPs of one forward call at (batch, seq[, mem_seq]), by the model in the module docstring."""
    c = config
    b, t = batch, seq
    s = (mem_seq if mem_seq is not None else seq) if c.cross else seq
    q = 2 * b * t * c.d_model * c.n_heads * c.head_dim
    kv = 2 * b * s * c.kv_dim * c.n_kv_heads * (c.head_dim + c.v_head_dim)  # grouped heads: Nkv projections
    core = 2 * b * c.n_heads * t * s * (c.head_dim + c.v_head_dim)
    out = 2 * b * t * c.n_heads * c.v_head_dim * c.d_model
    return q + kv + core + out


def gemm_shape(config: AttentionConfig) -> tuple[int, int, int]:
    """(m, k, n) of the roofline GEMM: GEMM_ROWS tokens through the q projection
    (d_model -> N * head_dim), the model's own projection size."""
    return GEMM_ROWS, config.d_model, config.q_dim


def gemm_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an [m, k] x [k, n] matrix product."""
    return 2 * m * k * n
