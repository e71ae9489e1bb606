"""The tolerance table: how far two computations of the same formula may differ.

One rule, set from each dtype's precision and the problem size, never tuned per test:

    atol = ulps[dtype] * eps[dtype] * (sqrt(K) + S) * scale       rtol = ulps[dtype] * eps[dtype]

K is the longest reduction in the formula (the widest projection input or the number of
keys): rounding errors of a K-term sum grow like sqrt(K) ulps. S is the largest |score|
(scale * q.k) of the case: softmax turns an absolute error in a score into the same
relative error in its probability, and a score's rounding error grows with its size, so
peaked attention (large scores, as trained models and large weights give) is that much
worse conditioned. scale is the reference output's RMS, so the rule holds for weights of
any magnitude (those made outside attnx included). A pair passes when
|out - ref| <= atol + rtol * |ref| everywhere (attnx.runtimes.compare applies it).
ulps counts the roundings that stack along the chain (four matmuls, a softmax, and for
half precision the rounding of inputs, weights and every stored intermediate).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from attnx.model.config import AttentionConfig

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "tolerance_for",
    "reduction_length",
    "ProblemSize",
    "problem_size",
]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    dtype: str
    eps: float  # machine epsilon of the compute dtype
    ulps: float  # how many eps of error the chain may stack up

    def atol(self, size: ProblemSize, scale: float) -> float:
        return self.ulps * self.eps * (math.sqrt(size.k) + size.score_max) * scale

    @property
    def rtol(self) -> float:
        return self.ulps * self.eps


# The table. Keyed by the compute dtype; a (dtype, backend) key overrides where a backend
# must differ (none needs to yet: TF32 is switched off for parity runs on CUDA).
TOLERANCES: dict[str | tuple[str, str], Tolerance] = {
    "fp64": Tolerance("fp64", float(np.finfo(np.float64).eps), ulps=8.0),
    "fp32": Tolerance("fp32", float(np.finfo(np.float32).eps), ulps=8.0),
    # Half precision (fp16 eps 2^-10, bf16 eps 2^-7): every backend here multiplies in the
    # half dtype but sums in float32 (ORT CPU runs fp16 MatMul/Softmax through float32
    # kernels, torch CPU and cuBLAS accumulate in float32), so the error is that of storing
    # x, the weights and each intermediate in the half dtype: about 0.5 eps RMS and at most
    # ~3.5 eps times rms(ref) per element (S ~ 1), whatever K (measured for K = 2 .. 1024:
    # the CONFIGS, "base", "large"; exact math on half-rounded weights gives the same). That
    # floor does not shrink with K, and at K = 2 (sqrt(K) + S ~ 2.2) ulps = 4 puts atol at
    # ~9 eps * rms: 2.8x over the worst error measured, the least margin of all cases. Fewer
    # ulps would leave none at small K; the sqrt(K) growth that makes the rule looser for
    # large K is what an accumulation in the half dtype itself would need. bf16 errors
    # measure the same number of its eps. (Issue 3 report: worst max_abs/atol 0.36 at K = 2,
    # <= 0.13 from K = 32 up, fp16 and bf16.)
    "fp16": Tolerance("fp16", float(np.finfo(np.float16).eps), ulps=4.0),
    "bf16": Tolerance("bf16", 2.0**-7, ulps=4.0),
}


def tolerance_for(dtype: str, backend: str | None = None) -> Tolerance:
    if backend is not None and (dtype, backend) in TOLERANCES:
        return TOLERANCES[(dtype, backend)]
    return TOLERANCES[dtype]


def reduction_length(config: AttentionConfig, kv_len: int) -> int:
    """K: the longest sum in the formula for this config and number of keys."""
    return max(config.d_model, config.kv_dim, config.q_dim, config.v_dim, kv_len)


@dataclasses.dataclass(frozen=True)
class ProblemSize:
    """What the tolerance of one case depends on besides the dtype (see the module doc)."""

    k: int  # the longest reduction
    score_max: float = 0.0  # the largest |scale * q.k| of the case

    def to_dict(self) -> dict[str, float]:
        return {"k": self.k, "score_max": self.score_max}


def problem_size(config: AttentionConfig, weights: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray]) -> ProblemSize:
    """K and the largest attention score for these weights and inputs (float32 is plenty
    for a bound; masked scores are included, which can only make the bound larger)."""
    x = np.asarray(feeds["x"], dtype=np.float32)
    m = np.asarray(feeds["memory"], dtype=np.float32) if config.cross else x
    q = x @ np.asarray(weights["q_proj.weight"], np.float32).T  # (B, T, N*hd)
    k = m @ np.asarray(weights["k_proj.weight"], np.float32).T  # (B, S, Nkv*hd)
    if config.bias:
        q += np.asarray(weights["q_proj.bias"], np.float32)
        k += np.asarray(weights["k_proj.bias"], np.float32)
    B, T, S, N, hd = x.shape[0], x.shape[1], m.shape[1], config.n_heads, config.head_dim
    q = q.reshape(B, T, N, hd).transpose(0, 2, 1, 3)  # (B, N, T, hd)
    k = k.reshape(B, S, config.n_kv_heads, hd).transpose(0, 2, 3, 1)  # (B, Nkv, hd, S)
    if feeds.get("past_key") is not None:  # a step model: the cached keys are scored too
        past = np.asarray(feeds["past_key"], np.float32).transpose(0, 1, 3, 2)  # (B, Nkv, hd, P)
        k = np.concatenate([past, k], axis=3)
        S = k.shape[3]
    score_max = 0.0
    for n in range(N):  # one head at a time bounds the memory at B*T*S
        kn = k[:, n // config.group_size]  # query head n reads key/value head n // group_size
        score_max = max(score_max, float(np.abs(q[:, n] @ kn).max()) * config.softmax_scale)
    return ProblemSize(reduction_length(config, S), score_max)
