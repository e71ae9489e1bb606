"""The limits of the attention cores' kernels beyond the terms (attnx.model.cores.Core.limits and cuda_limits): the
measured refusals of ONNX Runtime's operators, each a reason naming what is missing. No torch and no onnx here."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from attnx.model.config import AttentionConfig

__all__ = ["Limits", "QUANTIZED", "MS_DOMAIN", "no_limits", "mha_limits", "gqa_limits", "grouped_mha_limits",
           "switch_limits", "gqa_cuda_limits", "grouped_mha_cuda_limits", "switch_cuda_limits", "decomposed_limits"]

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib operators
QUANTIZED = ("int8", "int4")  # the projections quantized, the core float32 (attnx.model.contract.QUANTIZATIONS)
Limits = Callable[[AttentionConfig, str, str], Iterable[str]]


def no_limits(config: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    return ()


def _same_head_sizes(c: AttentionConfig, what: str) -> Iterable[str]:
    if c.v_head_dim != c.head_dim:
        # measured: MultiHeadAttention's past_value and GroupQueryAttention's value refuse it
        yield f"{what} needs v_head_dim == head_dim (this config: {c.v_head_dim} and {c.head_dim})"


def mha_limits(c: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    if form == "growing":
        yield from _same_head_sizes(c, f"{MS_DOMAIN}.MultiHeadAttention with a cache")


def gqa_limits(c: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    yield from _same_head_sizes(c, f"{MS_DOMAIN}.GroupQueryAttention")
    if c.head_dim % 8:  # measured: 'head_size must be a multiple of 8'
        yield f"{MS_DOMAIN}.GroupQueryAttention needs a head_dim that is a multiple of 8 (this config: {c.head_dim})"
    if form == "buffer" and c.rope is not None:
        yield from _gqa_table_rope(c)


def _gqa_table_rope(c: AttentionConfig) -> Iterable[str]:
    """GroupQueryAttention rotating q and k itself (do_rotary, the buffer form) reads one cos/sin table."""
    if c.rope.switch_at is not None:
        yield (f"GroupQueryAttention's rotation (do_rotary) cannot express {c.rope.rope_type}: its factors switch for a whole "
               "call once the call's largest position passes original_max_position_embeddings, and the op rotates "
               "from one cos/sin table")  # fmt: skip
    if (c.rope.dim // 2) % 8:  # measured: 'cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8'
        yield (f"GroupQueryAttention's rotation (do_rotary) cannot rotate rope dim {c.rope.dim}: it takes a cos/sin "
               "table of width dim/2 that is a multiple of 8 only")  # fmt: skip


def grouped_mha_limits(c: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    yield from _same_head_sizes(c, f"{MS_DOMAIN}.MultiHeadAttention with a cache")


def switch_limits(c: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    yield from gqa_limits(c, dtype, form)
    if form == "growing":
        yield from grouped_mha_limits(c, dtype, form)


# What ONNX Runtime's CUDA kernels refuse, measured on an H200 with onnxruntime-gpu 1.31.1 (2026-12-04, python -m
# attnx.bench.gpu_check and the cuda-marked tests): a refusal the CPU kernels do not share.
def gqa_cuda_limits(c: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    if dtype == "fp32":  # the session placed the fp32 op on CPUExecutionProvider
        yield f"ONNX Runtime's CUDA {MS_DOMAIN}.GroupQueryAttention has no fp32 kernel (it runs fp16)"


def grouped_mha_cuda_limits(c: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    if form == "buffer":  # CUDA error 700 (an illegal memory access) at the first step, the process aborted
        yield (f"ONNX Runtime's CUDA {MS_DOMAIN}.MultiHeadAttention writes a cache in place only with "
               "cache_indirection (beam search): over past_sequence_length alone it writes past the buffer")


def switch_cuda_limits(c: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    yield from gqa_cuda_limits(c, dtype, form)
    yield from grouped_mha_cuda_limits(c, dtype, form)


def decomposed_limits(c: AttentionConfig, dtype: str, form: str) -> Iterable[str]:
    if c.latent is not None and dtype in QUANTIZED:
        # the quantization pass finds q_proj, k_proj, v_proj and out_proj (attnx.export.passes.quantize)
        yield (f"latent in {dtype}: attnx quantizes q_proj, k_proj, v_proj and out_proj, not the latent's "
               "projections (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj)")
