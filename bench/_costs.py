"""The cost models: the FLOPs of one attention call and of the GEMM that measures the
machine's limit, and the memory a case needs (to skip one the machine cannot hold).

Counted as 2 FLOPs per multiply-add of the four projections and of the two attention
matmuls, for batch b, t queries, s keys (s = t and kv_dim = d_model in self-attention),
N heads:

    q:                   2 * b * t * d_model * N * head_dim
    k and v:             2 * b * s * kv_dim * N * (head_dim + v_head_dim)
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
    "estimate_peak_bytes",
    "available_memory_bytes",
    "meminfo_bytes",
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
    kv = 2 * b * s * c.kv_dim * c.n_heads * (c.head_dim + c.v_head_dim)
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


# Memory -----------------------------------------------------------------------------------------
def _materializes_scores(config: AttentionConfig, attention: str) -> bool:
    """Whether the lowering holds the whole (b, N, t, s) score matrix: the decomposed form and
    ORT's Attention-23 on CPU do (README, "CPU baseline": 8.96 and 8.7 GB at seq 8192 for the
    large preset); the fused kernels stream it, and so does torch's SDPA unless a padding
    mask sends it to its math path."""
    if attention in ("decomposed", "onnx"):
        return True
    return attention == "sdpa" and config.key_padding_mask


def estimate_peak_bytes(
    config: AttentionConfig, backend: str, attention: str, batch: int, seq: int, mem_seq: int | None, dtype: str
) -> int:
    """A rough estimate of a case's peak memory: the float32 weights (the torch module shares
    the numpy arrays; an fp16 model holds less), the projections' activations, and two score
    matrices (scores and probabilities) where the lowering materialises them. A guard against
    starting a case the machine cannot hold, not a measurement."""
    item = 2 if dtype == "fp16" else 4
    c = config
    s = (mem_seq or seq) if c.cross else seq
    weights = c.n_params * 4
    acts = 2 * batch * (seq * (c.d_model + c.q_dim + c.d_model) + s * (c.kv_dim + c.q_dim + c.v_dim)) * item
    scores = 2 * batch * c.n_heads * seq * s * item if _materializes_scores(c, attention) else 0
    return weights + acts + scores


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no /proc."""
    return meminfo_bytes("MemAvailable")


def meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None
