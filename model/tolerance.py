"""The tolerance table: how far two computations of the same formula may differ.

One rule, set from each dtype's precision and the problem size, never tuned per test:

    atol = ulps[dtype] * eps[dtype] * (sqrt(K) + S) * scale       rtol = ulps[dtype] * eps[dtype]

K is the longest reduction in the formula (the widest projection input or the number of
keys): rounding errors of a K-term sum grow like sqrt(K) ulps. S is the largest |score|
(scale * q.k, plus ALiBi's largest |slope * (j - i)| when the config has it) of the case: softmax turns an absolute error in a score into the same
relative error in its probability, and a score's rounding error grows with its size, so
peaked attention (large scores, as trained models and large weights give) is that much
worse conditioned. scale is the reference output's RMS, so the rule holds for weights of
any magnitude (those made outside attnx included). A pair passes when
|out - ref| <= atol + rtol * |ref| everywhere (attnx.runtimes.compare applies it).
ulps counts the roundings that stack along the chain (four matmuls, a softmax, and for
half precision the rounding of inputs, weights and every stored intermediate).

Rotary positions (config rope) add one term, from this error model. Every form computes the
angle of pair i at position p, theta_i = p * w_i (w = inv_freq), in float32 (as transformers does):
w_i rounded (relative error <= eps/2), times p (exact below 2^24), rounded again (<= eps/2), so

    |d theta_i| <= eps * |p| * w_i                    (eps the float32 epsilon, not the dtype's)

an absolute error that grows with the position (p = 8192 and w_0 = 1: 1e-3 rad); the cos and sin
of the rounded angle add only a few eps absolute each, inside the rule above. A pair (a, b) turned
by theta + d theta is the exact result turned again by d theta: it moves by |d theta| |(a, b)|,
at right angles. A score scale * q.k, summed over pairs, then moves by at most

    |ds| <= scale * sum_i eps (|p_q| + |p_k|) w_i |q_i| |k_i|
         <= 2 eps P * scale * Qw * Kw,      Qw = sqrt(sum_i w_i |q_i|^2), Kw alike

(|q_i| the norm of pair i after rope, P the largest |position| of the case; the second line is
Cauchy-Schwarz with weights w_i, so the slow pairs, whose angles barely round, weigh little).
B = the largest scale * Qw * Kw of a query and a key that a head pairs. The softmax turns an
absolute score error into at most twice that relative error of the output (dz = sum_j p_j
(ds_j - mean_p ds) v_j: the centred error), so, relative to rms(ref):

    atol += ROPE_FACTOR * eps32 * P * B * scale          ROPE_FACTOR = 4 (q and k, the centring)

A bound, reached only if every rounding went the worst way at once; the error grows with P as it
says (the llama3-8b and gemma2-9b presets against it: measurements/facts.md). It cannot hide a planted fault in the rotation: a wrong position, pair layout or
frequency turns the fast pairs by whole radians, where this term is eps * P relative. At the
positions of everyday parity (P < 200) the term is below the rule's own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import OPENVINO
from attnx.model.reference import reference_attention, scored_qk
from attnx.model.rope import rope_frequencies, rope_pairs
from attnx.model.stages import get_stage
from attnx.model.terms import TERMS

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "tolerance_for",
    "reduction_length",
    "ProblemSize",
    "problem_size",
    # Reduced precision (issue 12)
    "QuantTolerance",
    "ProjectionError",
    "QUANT_TAIL",
    "QUANT_RMS_SLACK",
    # Rotary positions (issue 22)
    "ROPE_FACTOR",
    "ROPE_EPS",
    "rotated_cache_size",
    "stored_bound",
    "rope_table_bound",
    # Localisation (issue 23)
    "StageBound",
    "stage_tolerance",
    # A whole model against its rewrite (issue 40)
    "whole_model_tolerance",
    # An intermediate requantized to int8 (MatMulNBits accuracy_level 4)
    "RequantizedTolerance",
    "Requantization",
    "requantization_slack",
]

# The rope term (module doc): the angle is rounded in float32 whatever the dtype of the rest.
ROPE_FACTOR = 4.0
ROPE_EPS = float(np.finfo(np.float32).eps)


# Values read back from a graph another tool wrote (its weights, its rotary tables) against the source's:
# stored in the graph's dtype, each is within half an eps of the value (relative to the tensor's largest);
# STORED_ULPS of them is the bound, the slack covering a source held in another dtype before the cast.
STORED_ULPS = 2.0


def stored_bound(dtype: Any) -> float:
    """The largest difference, relative to a tensor's largest |value|, of a tensor stored in `dtype`."""
    return STORED_ULPS * float(np.finfo(np.dtype(dtype)).eps)


def rope_table_bound(dtype: Any, angles: np.ndarray) -> np.ndarray:
    """Each entry's largest difference of a cos/sin table stored in `dtype` from the exact one, at its angle
    p * inv_freq: its storage, and the angle rounded in float32 (the rope term of the module doc)."""
    return stored_bound(dtype) + ROPE_FACTOR * ROPE_EPS * np.abs(angles)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    dtype: str
    eps: float  # machine epsilon of the compute dtype
    ulps: float  # how many eps of error the chain may stack up

    def atol(self, size: ProblemSize, scale: float) -> float:
        rope = ROPE_FACTOR * min(ROPE_EPS, self.eps) * size.rope_position * size.rope_qk  # 0 without rope
        return (self.ulps * self.eps * (math.sqrt(size.k) + size.score_max) + rope) * scale

    @property
    def rtol(self) -> float:
        return self.ulps * self.eps


# The table. Keyed by the compute dtype; a (dtype, backend) key overrides where a backend
# must differ (TF32 is switched off for parity runs on CUDA, so fp32 needs none; OpenVINO's
# quantized rows, at the end, describe its own quantization of the inputs).
TOLERANCES: dict[str | tuple[str, str], Tolerance] = {
    "fp64": Tolerance("fp64", float(np.finfo(np.float64).eps), ulps=8.0),
    "fp32": Tolerance("fp32", float(np.finfo(np.float32).eps), ulps=8.0),
    # Half precision (fp16 eps 2^-10, bf16 eps 2^-7): every backend here multiplies in the
    # half dtype but sums in float32 (ORT CPU runs fp16 MatMul/Softmax through float32
    # kernels, torch CPU and cuBLAS accumulate in float32), so the error is that of storing
    # x, the weights and each intermediate in the half dtype: about 0.5 eps RMS and at most
    # a few eps times rms(ref) per element (S ~ 1), whatever K (measured for K = 2 .. 1024:
    # measurements/facts.md). That floor does not shrink with K, and at K = 2 (sqrt(K) + S ~ 2.2)
    # ulps = 4 puts atol just over the worst error measured, the least margin of all cases. Fewer
    # ulps would leave none at small K; the sqrt(K) growth that makes the rule looser for
    # large K is what an accumulation in the half dtype itself would need. bf16 errors
    # measure the same number of its eps. (Issue 3 report: worst max_abs/atol 0.36 at K = 2,
    # <= 0.13 from K = 32 up, fp16 and bf16.)
    "fp16": Tolerance("fp16", float(np.finfo(np.float16).eps), ulps=4.0),
    "bf16": Tolerance("bf16", 2.0**-7, ulps=4.0),
}


def tolerance_for(dtype: str, backend: str | None = None, quantization: Mapping | None = None) -> Tolerance:
    """The row of `dtype` (and `backend` where one overrides it); a quantized dtype's row needs the
    model's quantization (its metadata, attnx.model.contract.quantization_of) for its error model."""
    if backend is not None and (dtype, backend) in TOLERANCES:
        row = TOLERANCES[(dtype, backend)]
    else:
        row = TOLERANCES[dtype]
    if isinstance(row, QuantTolerance):
        if quantization is None:
            raise UsageError(
                f"the {dtype} tolerance is sized from the model's quantization metadata, and none was given"
            )
        return row.for_model(quantization)
    return row


def whole_model_tolerance(dtype: str, rewritten: int) -> Tolerance:
    """How far a whole model's outputs (its logits) may move when `rewritten` of its attention blocks are rewritten
    into other cores (attnx optimize): the row of `dtype`, its ulps counted twice for each block rewritten, with the
    rule's K the model's longest reduction and S 0 (ProblemSize(k)).

    Each new block and the block it replaces are each held within the row's bound of the float64 formula (the
    audit's check of every block), so the two differ by at most two such bounds at the block's output; the layers
    after it add that difference to the residual stream, and the norms rescale it with the stream, so the differences
    of the blocks rewritten add up at the logits rather than multiply. A wrong term (a window, a softcap, a scale, a
    rope) moves the logits by a sizeable part of their RMS, thousands of times this bound."""
    row = tolerance_for(dtype)
    return Tolerance(row.dtype, row.eps, row.ulps * 2 * max(1, rewritten))


def reduction_length(config: AttentionConfig, kv_len: int) -> int:
    """K: the longest sum in the formula for this config and number of keys."""
    return max(config.d_model, config.kv_dim, config.q_dim, config.v_dim, kv_len)


@dataclasses.dataclass(frozen=True)
class ProblemSize:
    """What the tolerance of one case depends on besides the dtype (see the module doc)."""

    k: int  # the longest reduction
    score_max: float = 0.0  # the largest |scale * q.k| of the case
    # What a quantized form's error model needs (problem_size(..., activations=True)): the RMS of
    # the scores, and per quantized input its RMS, range and the RMS over its rows of each row's
    # max |value| ("x", "memory", "z": the attention output, the output projection's input).
    score_rms: float = 0.0
    activations: tuple[tuple[str, float, float, float, float], ...] = ()  # (name, rms, min, max, row peak rms)
    # Rotary positions (the module doc's rope term): P, the largest |position| of the case, and B,
    # the largest scale * Qw * Kw (inv_freq-weighted norms) of a query and a key a head pairs.
    rope_position: float = 0.0
    rope_qk: float = 0.0

    def to_dict(self) -> dict[str, float]:
        out: dict = {"k": self.k, "score_max": self.score_max}
        if self.rope_position:
            out["rope_position"], out["rope_qk"] = self.rope_position, self.rope_qk
        if self.activations:
            out["score_rms"] = self.score_rms
            out["activations"] = {n: [r, lo, hi, peak] for n, r, lo, hi, peak in self.activations}
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> ProblemSize:
        # a record written before the row peaks (three numbers): the tensor's largest |value| bounds every row's
        acts = tuple((n, float(v[0]), float(v[1]), float(v[2]), float(v[3]) if len(v) > 3 else max(-float(v[1]), float(v[2])))
                     for n, v in dict(data.get("activations") or {}).items())  # fmt: skip
        return cls(int(data["k"]), float(data["score_max"]), float(data.get("score_rms", 0.0)), acts,
                   float(data.get("rope_position", 0.0)), float(data.get("rope_qk", 0.0)))  # fmt: skip

    def activation(self, name: str) -> tuple[float, float, float, float] | None:
        """(rms, min, max, RMS of the rows' max |value|) of one quantized input, or None."""
        return next(((r, lo, hi, peak) for n, r, lo, hi, peak in self.activations if n == name), None)


def problem_size(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    feeds: Mapping[str, np.ndarray],
    activations: bool = False,
) -> ProblemSize:
    """K and the largest attention score for these weights and inputs (float32 is plenty
    for a bound; masked scores are included, which can only make the bound larger). With
    activations, also what a quantized form's error model reads (ProblemSize.activations)."""
    # q and k as the formula scores them, in float32: the reference's own (its projections and q/k terms)
    positions = feeds.get("position_ids")
    past = np.shape(feeds["past_key"])[2] if feeds.get("past_key") is not None else 0
    q, k = scored_qk(config, weights, feeds["x"], feeds.get("memory"), positions, dtype=np.float32, past=past)
    N = config.n_heads  # q (B, T, N, hd), k (B, S, Nkv, hd)
    rope_position, weights_w = 0.0, None
    if config.rope is not None:
        if np.size(positions):
            rope_position = float(np.max(np.abs(positions)))
            weights_w = rope_frequencies(config.rope, int(np.max(positions)) + 1)[0]  # the call's inv_freq
    rope_qk = 0.0
    if weights_w is not None:
        a, b = rope_pairs(config.rope)

        def weighted_norm(u: np.ndarray) -> np.ndarray:  # sqrt(sum_i w_i |u_i|^2) over the pairs i
            pairs = np.square(u[..., a], dtype=np.float64) + np.square(u[..., b], dtype=np.float64)
            return np.sqrt(np.sum(pairs * weights_w, axis=-1))

        qw, kw = weighted_norm(q), weighted_norm(k)  # (B, T, N), (B, S, Nkv)
        for n in range(N):
            pair_max = float(qw[:, :, n].max() * kw[:, :, n // config.group_size].max())
            rope_qk = max(rope_qk, pair_max * config.softmax_scale)
    q = q.transpose(0, 2, 1, 3)  # (B, N, T, hd)
    k = k.transpose(0, 2, 3, 1)  # (B, Nkv, hd, S)
    S = k.shape[3]
    if feeds.get("past_key") is not None:  # a step model: the cached keys are scored too
        past = np.asarray(feeds["past_key"], np.float32).transpose(0, 1, 3, 2)  # (B, Nkv, hd, P)
        k = np.concatenate([past, k], axis=3)
        S = k.shape[3]
    score_max = 0.0
    for n in range(N):  # one head at a time bounds the memory at B*T*S
        kn = k[:, n // config.group_size]  # query head n reads key/value head n // group_size
        score_max = max(score_max, float(np.abs(q[:, n] @ kn).max()) * config.softmax_scale)
    for term in TERMS.values():  # what a score term adds to them (ALiBi's slope_n * (j - i))
        if term.score_bound is not None and term.uses(config):
            score_max += term.score_bound(config, S)
    size = ProblemSize(reduction_length(config, S), score_max, rope_position=rope_position, rope_qk=rope_qk)
    if not activations:
        return size
    return _with_activations(config, weights, feeds, size)


def rotated_cache_size(config: AttentionConfig, size: ProblemSize, cache: np.ndarray) -> ProblemSize:
    """`size` for comparing a step model's present_key, the keys as rotated by rope: each stored pair
    i moves by at most eps * P * w_i |k_i| itself (the module doc's first step, no score after it),
    so the rope term (ROPE_FACTOR * eps * P * rope_qk * rms(ref)) gets rope_qk = max_i w_i |k_i| /
    (ROPE_FACTOR * rms(cache)). Unchanged without rope. cache: the reference's present_key."""
    if config.rope is None or not size.rope_position:
        return size
    cache = np.asarray(cache, np.float64)  # (B, Nkv, T, hd)
    a, b = rope_pairs(config.rope)
    pair_norm = np.sqrt(cache[..., a] ** 2 + cache[..., b] ** 2)  # (B, Nkv, T, dim/2)
    w = np.maximum(*(rope_frequencies(config.rope, n)[0] for n in (None, int(size.rope_position) + 1)))
    rms = float(np.sqrt(np.mean(cache**2))) or 1.0
    return dataclasses.replace(size, rope_qk=float(np.max(pair_norm * w)) / (ROPE_FACTOR * rms))


def _with_activations(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    feeds: Mapping[str, np.ndarray],
    size: ProblemSize,
) -> ProblemSize:
    """`size` with the scores' RMS (visible keys only) and the RMS and range of every input a
    quantized form quantizes: x, memory and z, the attention output, from the reference run in float32
    (the formula's own masks and terms)."""
    # The modern-LLM terms keep the model (docs/concepts/tolerances.md, "Quantized forms"): a window only hides keys (the
    # masks); softcap's c tanh(s / c) has slope <= 1, so a score error does not grow through it
    # (score_rms is taken before the cap, the larger); a sink is one more logit with no value and no
    # error: dz = sum_j p_j (ds_j - mean_p ds) v_j over the keys, rows of p summing to <= 1, so both
    # bounds (rms(ds) for q and k, eta_v for v) hold as they are. z is computed with all three.
    stages: dict[str, np.ndarray] = {}
    stats: dict[str, float] = {}
    args = {k: v for k, v in feeds.items() if k in ("memory", "key_padding_mask", "past_key", "past_value",
                                                    "position_ids")}  # fmt: skip
    reference_attention(config, weights, feeds["x"], **args, stages=stages, core_stages=False, dtype=np.float32,
                        stats=stats)  # fmt: skip
    x = np.asarray(feeds["x"], np.float32)
    stats_of = [("x", x)] + ([("memory", np.asarray(feeds["memory"], np.float32))] if config.cross else [])
    stats_of.append(("z", stages["z"]))  # (B, T, N*dv): the output projection's input
    acts = tuple(
        (name, float(np.sqrt(np.mean(np.square(a, dtype=np.float64)))), float(a.min()), float(a.max()),
         float(np.sqrt(np.mean(np.square(np.abs(a).max(axis=-1), dtype=np.float64)))))
        for name, a in stats_of
    )  # fmt: skip
    score_rms = math.sqrt(stats.get("score_sq", 0.0) / max(stats.get("scores", 0), 1))
    return dataclasses.replace(size, score_rms=score_rms, activations=acts)


# Quantized forms (issue 12) ----------------------------------------------------------------------
# The error model of a quantized projection, and how it reaches y.
#
# One projection u = a W (a: K inputs, W [K, N]) with W rounded to the nearest multiple of its step
# s (per output channel for int8, per block of K for int4): each weight's error e_kn is uniform in
# [-s/2, s/2], RMS s/sqrt(12), and independent of the others (rounding errors of unrelated values).
# The error of one output, sum_k a_k e_kn, is then a sum of K independent zero-mean terms: its RMS
# is sqrt(sum_k a_k^2) * s_rms/sqrt(12) = sqrt(K) rms(a) s_rms/sqrt(12), a random walk. The worst
# case, K * max|a| * s/2, needs every rounding to go the same way with the largest input: for
# K = 1024 it is sqrt(3K) ~ 55x the RMS, a bound no fault could exceed, so the table uses the walk.
# Relative to u itself (rms sqrt(K) rms(a) rms(W) for inputs not aligned with W), the weight's
# relative error eta_w = s_rms / (sqrt(12) rms(W)): the pass records it per projection.
# A dynamically quantized input adds eta_a = step_rms/(sqrt(12) rms(a)), independent of eta_w, on
# the same argument. int8 divides each row (token) by its max |a| before the op's per-tensor uint8
# quantization, so row i gets step_i <= 2 max|a_i|/255 and step_rms = 2 rms_i(max|a_i|)/255 (a model
# from before the row scales: uint8 per tensor, step (max(a,0) - min(a,0))/255); int4 at
# accuracy_level 4: int8 per block of K, step at most max|a_i|/127 in row i (a block lies within a
# row, so its row's peak bounds its own), step_rms <= rms_i(max|a_i|)/127. OpenVINO quantizes the
# inputs of both forms its own way (runtimes/openvino_runner.py): int8 in groups of consecutive
# values along K, so within a row, whatever the graph says; its rows ("openvino" below) take that
# per-block step.
#
# Through attention, relative to y (rms(ref)):
# - v: linear, y = P (m Wv) Wo: eta_v passes unchanged (rows of P sum to 1; both the error and the
#   values are averaged by the same weights);
# - out: eta_w of Wo and eta_a of its input z (the attention output, computed for the case);
# - q and k: a relative error eta in q (or k) moves each score by eta * rms(score); the softmax
#   turns a score error ds into dz_i = sum_j p_ij (ds_ij - mean_p ds) v_j, whose RMS relative to z
#   is at most rms(ds) (Cauchy-Schwarz under p): the contribution is eta_qk * rms(score).
# The contributions are independent: their squares add, sigma^2 = sum of them, the predicted RMS
# error of y. Every element of y is a sum of many independent roundings, so its error is close to
# normal: QUANT_TAIL sigma bounds the largest of millions (P(|N(0,1)| > 7) = 3e-12; 6 let an element
# through in the test configs: measurements/facts.md; the rows of a causal model that see one or two
# keys have the heavier tails), and the
# measured RMS error itself (an average over the whole output) must be at most QUANT_RMS_SLACK
# sigma (times the sampling spread of an RMS over few values, rel_rms_bound): that test catches a
# systematic fault (a zero point off by one, a scale off by 2x) that the elementwise bound alone,
# sized for the tail, would let through. The slack covers the model's approximations (inputs not
# aligned with the weights, the softmax bound): the measured rel RMS / sigma over the test configs
# is in measurements/facts.md.
QUANT_TAIL = 7.0
QUANT_RMS_SLACK = 1.5


@dataclasses.dataclass(frozen=True)
class ProjectionError:
    """One quantized projection, as the model's metadata records it."""

    role: str  # q, k, v, qkv (packed), out
    k: int  # its input width
    rel_error: float  # eta_w = s_rms / (sqrt(12) rms(W))
    weight_rms: float


@dataclasses.dataclass(frozen=True)
class QuantTolerance(Tolerance):
    """The float rule of fp32 (the core and the float parts run in fp32) plus the quantization's
    own term from the error model above: atol += QUANT_TAIL * sigma, and rel RMS <= QUANT_RMS_SLACK
    * sigma / rms(ref). A table row has no projections; for_model() reads them from metadata."""

    activations: str = "none"  # "none", "uint8 per row", "uint8 per tensor", "int8 per block"
    projections: tuple[ProjectionError, ...] = ()
    # A runtime that quantizes the inputs its own way whatever the graph says (OpenVINO): its scheme,
    # which replaces the metadata's. None: the graph's scheme is what runs (ONNX Runtime).
    runtime_activations: str | None = None

    def for_model(self, quantization: Mapping) -> QuantTolerance:
        acts = str(quantization.get("activations", "none"))
        kind = ("none" if acts == "none" else "int8 per block" if "per block" in acts
                else "uint8 per row" if "per row" in acts else "uint8 per tensor")  # fmt: skip
        kind = self.runtime_activations or kind
        projections = tuple(
            ProjectionError(role, int(p["k"]), float(p["rel_error"]), float(p["weight_rms"]))
            for role, p in sorted(dict(quantization.get("projections") or {}).items())
        )
        return dataclasses.replace(self, activations=kind, projections=projections)

    def _act_step(self, stats: tuple[float, float, float, float] | None) -> float:
        """The RMS quantization step of an input of these statistics (rms, min, max, rows' peak
        rms; 0: not quantized)."""
        if stats is None or self.activations == "none":
            return 0.0
        _, lo, hi, row_peak = stats
        if self.activations == "int8 per block":
            return row_peak / 127.0
        if self.activations == "uint8 per row":
            return 2.0 * row_peak / 255.0
        return (max(hi, 0.0) - min(lo, 0.0)) / 255.0

    def _act_rel(self, stats: tuple[float, float, float, float] | None) -> float:
        if stats is None or stats[0] <= 0:
            return 0.0
        return self._act_step(stats) / math.sqrt(12.0) / stats[0]

    def rel_sigma(self, size: ProblemSize) -> float:
        """The predicted RMS error of y relative to its magnitude. It scales with each row's own
        magnitude: a query attending to one key gets that key's value and its whole error; one
        averaging many keys averages the errors with the values."""
        x = size.activation("x")
        m = size.activation("memory") or x
        var = 0.0
        for p in self.projections:
            a = x if p.role == "q" else (size.activation("z") if p.role == "out" else m)
            eta2 = p.rel_error**2 + self._act_rel(a) ** 2
            if p.role == "out":
                var += eta2
            if p.role in ("q", "k", "qkv"):
                var += eta2 * size.score_rms**2 * (2 if p.role == "qkv" else 1)
            if p.role in ("v", "qkv"):
                var += eta2
        return math.sqrt(var)

    def sigma(self, size: ProblemSize, scale: float) -> float:
        """The predicted RMS error of y from the quantization (scale: rms of the reference)."""
        return self.rel_sigma(size) * scale

    def atol(self, size: ProblemSize, scale: float) -> float:
        """The bound at a row of RMS `scale` (what reports show; compare_arrays applies
        quant_bound row by row)."""
        return super().atol(size, scale) + QUANT_TAIL * self.sigma(size, scale)

    def quant_bound(self, size: ProblemSize, row_rms: np.ndarray) -> np.ndarray:
        """The quantization's share of the elementwise bound, per row of RMS `row_rms`."""
        return QUANT_TAIL * self.rel_sigma(size) * row_rms

    def rel_rms_bound(self, size: ProblemSize, scale: float, n: int | None = None) -> float:
        """The largest rel RMS error (||out - ref|| / ||ref||) this model may have over `n` output
        values. Their mean square is sigma^2 chi^2_n / n, whose upper point QUANT_TAIL standard
        deviations out is 1 + QUANT_TAIL sqrt(2/n): a few values (seq 1) can have twice the
        error's RMS by chance, a million cannot."""
        sampling = math.sqrt(1.0 + QUANT_TAIL * math.sqrt(2.0 / n)) if n else 1.0
        return QUANT_RMS_SLACK * sampling * self.sigma(size, scale) / scale + Tolerance.atol(self, size, 1.0)

    def for_cache(self, which: str) -> QuantTolerance:
        """The tolerance of a step model's present_key (which "k") or present_value ("v"): the
        cache holds that projection's output itself, so its error is the projection's own (its
        weights' and its input's, as v's passes to y unchanged): the error model of that one
        projection taken as v. The packed q/k/v (buffer form) counts with its recorded error."""
        own = tuple(dataclasses.replace(p, role="v") for p in self.projections if p.role in (which, "qkv"))
        return dataclasses.replace(self, projections=own)


# The quantized rows: the float part is fp32's (inputs, core and outputs are float32).
TOLERANCES["int8"] = QuantTolerance("int8", float(np.finfo(np.float32).eps), ulps=8.0)
TOLERANCES["int4"] = QuantTolerance("int4", float(np.finfo(np.float32).eps), ulps=8.0)
# OpenVINO reads the weights of both forms from the graph but quantizes their inputs itself, int8 in
# groups within a row (its DYNAMIC_QUANTIZATION_GROUP_SIZE, set and read back by the runner).
for _dtype in ("int8", "int4"):
    TOLERANCES[(_dtype, OPENVINO)] = dataclasses.replace(TOLERANCES[_dtype], runtime_activations="int8 per block")


EPS32 = float(np.finfo(np.float32).eps)


# An intermediate requantized to int8 (MatMulNBits accuracy_level 4) ----------------------------------
# At accuracy_level 4 MatMulNBits rounds its input to int8 per block of the weights' block size along K
# (scale = max |a| / 127, nearest even), and the audit's reference does the same (its int8 blocks, exact
# on the input it feeds: measured 5e-6 on q/k/v of rms 2.3, the float sum's own rounding). The output
# projection's input is z, the heads' output, which the kernel computes itself: its z differs from the
# reference's by the float rule's bound at z (y's rule relative to rms(z), as localisation holds z),
#
#     |dz_j| <= delta_j = atol(size, rms(z)) + rtol |z_j|,      the block's max |z| by delta_A = max_j delta_j.
#
# The rounding is a step function: in levels, v_j = z_j / s (s = A / 127, A the block's max |z|) moves by
#
#     |dv_j| <= (delta_j + |z_j| delta_A / A) / s + eps32 |v_j|      (eps32: the product's own rounding)
#
# and an element whose v_j lies within |dv_j| of a midpoint k + 1/2 may be rounded to either neighbour by
# the kernel and by the reference: its level differs by at most one, and y_n = sum_j level_j s_j W[n, j] + b
# by s_j |W[n, j]|. Every other element rounds alike on both sides, and between midpoints y does not move
# with z (the step s moves with A, continuously, by less than the float rule at y already allows). So
#
#     |dy_n| <= float rule + sum over ambiguous j of s_j |W[n, j]|          (the slack, element by element)
#
# A bound, not a statistic: the elements it counts are those of this case whose reference value lies that
# close to a midpoint (a fraction 2 |dv| of them, about 1.5% of z on a Qwen2.5-0.5B-shaped layer: 314 to 385 of 21504,
# slack up to 4.5e-3 to 8.9e-3 at an element of y), where the kernel's z (5e-6 from the reference's) flipped
# one level in 11 of 24 layers and moved y by 4.4e-4 to 2.1e-3 against fp32's 3e-5. Every other element of
# z rounds alike, and a fault that moves y by more than those few steps of z times a row of W (a wrong
# attention scale: 8e-2 there) is still found.


@dataclasses.dataclass(frozen=True, eq=False)
class Requantization:
    """What the int8 rounding of an intermediate may change in y, for one case (requantization_slack)."""

    slack: np.ndarray  # y's shape: sum over the ambiguous elements of z of step * |W[n, j]|
    ambiguous: int  # elements of z within the float bound of a rounding midpoint
    elements: int  # elements of z
    block: int  # the int8 block along K


def requantization_slack(tol: Tolerance, size: ProblemSize, z: np.ndarray, weight: np.ndarray,
                         block: int) -> Requantization:  # fmt: skip
    """The slack of y = int8(z) W^T + b (the section above): z the reference's [..., K] (quantized as float32),
    weight [N, K], `block` the int8 blocks' length along K; tol and size the case's float rule."""
    a = np.asarray(z, np.float32)
    k = a.shape[-1]
    rows = np.pad(a.reshape(-1, k), ((0, 0), (0, (-k) % block))).reshape(-1, -(-k // block), block).astype(np.float64)
    rms = float(np.sqrt(np.mean(np.square(a, dtype=np.float64)))) if a.size else 0.0
    delta = tol.atol(size, max(rms, float(np.finfo(np.float32).tiny))) + tol.rtol * np.abs(rows)  # (R, blocks, n)
    peak = np.abs(rows).max(axis=2, keepdims=True)  # A, each block's max |z|
    step = peak / 127.0
    live = peak > 0
    levels = np.divide(rows, step, out=np.zeros_like(rows), where=live)
    moved = np.divide(delta + np.abs(rows) * delta.max(axis=2, keepdims=True) / np.where(live, peak, 1.0), step,
                      out=np.zeros_like(rows), where=live) + EPS32 * np.abs(levels)  # fmt: skip
    margin = 0.5 - np.abs(levels - np.rint(levels))  # levels from the nearest midpoint
    ambiguous = (live & (margin <= moved)).reshape(rows.shape[0], -1)[:, :k]  # (R, K), the padding left out
    flip = ambiguous * np.repeat(step, block, axis=2).reshape(rows.shape[0], -1)[:, :k]  # a level where it may flip
    slack = flip @ np.abs(np.asarray(weight, np.float64)).T  # (R, N)
    return Requantization(slack.reshape(*a.shape[:-1], -1), int(ambiguous.sum()), int(a.size), block)


@dataclasses.dataclass(frozen=True, eq=False)
class RequantizedTolerance(Tolerance):
    """A float row plus, element by element, the slack of an intermediate requantized to int8 (the section
    above). compare_arrays applies it as a quantized form's share of the bound (quant_bound), here per element;
    atol (what reports show) is the float rule's plus the largest slack."""

    slack: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(()))

    @classmethod
    def of(cls, row: Tolerance, slack: np.ndarray) -> RequantizedTolerance:
        return cls(row.dtype, row.eps, row.ulps, slack=np.asarray(slack, np.float64))

    def atol(self, size: ProblemSize, scale: float) -> float:
        return super().atol(size, scale) + (float(self.slack.max()) if self.slack.size else 0.0)

    def quant_bound(self, size: ProblemSize, row_rms: np.ndarray) -> np.ndarray:
        return self.slack


# Stages (issue 23) -------------------------------------------------------------------------------
# Localisation compares every stage of the formula (attnx.model.stages) with the reference's, each
# under its own bound, from the same rule and error models as y's (module doc, quantized forms):
# - a projection (q, k, v, their norms, a step's cache): the rule with the case's K and no score
#   term (nothing after it is a softmax), relative to its own RMS; quantized, that projection's own
#   error (QuantTolerance.for_cache, as a cache is compared).
# - a rotated q or k: as the cache of rotated keys (rotated_cache_size): eps * P * w_i |u_i| per pair.
# - scores: scale * q.k of two such vectors: the rule without its score term relative to the largest
#   |score| (the rounding of a dot product is relative to |q||k|, not to the scores' RMS), plus the rope
#   term, whose bound 2 eps P B is absolute; quantized, the q and k projections' errors, each relative,
#   of that largest |score| too: ds_ij = dq_i.k_j + q_i.dk_j is relative to |q_i||k_j|, not to row i's
#   scores (a row of small scores measured over QUANT_TAIL sigma of its own RMS: measurements/facts.md).
# - probs: a score error ds moves p_j by p_j (ds_j - mean_p ds), at most 2 |ds| p_j: relative to 1 (the
#   largest a probability is), the whole rule (its score term is that); quantized, each probability's
#   error relative to itself, 2 * QUANT_TAIL * eta_qk * rms(score) (the score error of y's model).
# - z: y's rule (a softmax and the values: everything but the last projection), relative to rms(z);
#   quantized, y's error model without the output projection.
# - y: parity's own bound, unchanged: the case fails at y exactly when parity says it fails.


@dataclasses.dataclass(frozen=True)
class StageBound:
    """What compare_arrays takes for one stage: the tolerance, the problem size, the scale its atol
    is relative to (None: rms of the reference) and, for probs, an extra relative term."""

    tol: Tolerance
    size: ProblemSize
    scale: float | None = None


@dataclasses.dataclass(frozen=True)
class _RelativeTolerance(Tolerance):
    """A float rule with a larger rtol: a quantized form's probabilities, each relative to itself."""

    extra_rtol: float = 0.0

    @property
    def rtol(self) -> float:
        return self.ulps * self.eps + self.extra_rtol


def stage_tolerance(stage: str, config: AttentionConfig, tol: Tolerance, size: ProblemSize,
                    ref: np.ndarray) -> StageBound:  # fmt: skip
    """The bound of `stage` (a name of attnx.model.stages) for a case whose y is held to `tol` and
    `size` (tolerance_for and problem_size, as parity computes them); ref: the reference's value of
    the stage in its canonical layout (the section above says why each bound is what it is)."""
    kind = get_stage(stage).kind
    quant = tol if isinstance(tol, QuantTolerance) else None
    float_tol = Tolerance(tol.dtype, tol.eps, tol.ulps) if quant is not None else tol
    plain = dataclasses.replace(size, score_max=0.0, rope_position=0.0, rope_qk=0.0)
    if kind in ("projection", "rotated"):
        keys = ("k", "k_norm", "k_rope", "present_key", "present_latent")
        role = "k" if stage in keys else "v" if stage in ("v", "present_value") else "q"
        own_tol = quant.for_cache(role) if quant is not None else float_tol
        if stage == "present_value":  # a cache is held to what decode parity holds it to
            return StageBound(own_tol, size)
        if stage in ("present_key", "present_latent"):  # the latents' first rope.dim dims: the rotated key
            return StageBound(own_tol, rotated_cache_size(config, size, ref))
        if kind == "rotated":
            heads = config.n_heads if stage == "q_rope" else config.n_kv_heads
            b, t, _ = ref.shape
            rotated = dataclasses.replace(plain, rope_position=size.rope_position)
            return StageBound(own_tol, rotated_cache_size(config, rotated, ref.reshape(b, t, heads, config.head_dim)))
        return StageBound(own_tol, plain)
    if kind == "scores":
        peak = float(np.max(np.abs(ref))) if ref.size else 0.0
        peak = max(peak, float(np.finfo(np.float32).tiny))
        own = dataclasses.replace(plain, rope_position=size.rope_position, rope_qk=size.rope_qk / peak)
        if quant is not None:
            qk = tuple(dataclasses.replace(p, role="v") for p in quant.projections if p.role in ("q", "k", "qkv"))
            return StageBound(dataclasses.replace(quant, projections=qk), own, scale=peak)
        return StageBound(float_tol, own, scale=peak)
    if kind == "probs":
        if quant is not None:
            qk = tuple(p for p in quant.projections if p.role in ("q", "k", "qkv"))
            rel = 2.0 * QUANT_TAIL * dataclasses.replace(quant, projections=qk).rel_sigma(size)
            return StageBound(_RelativeTolerance(tol.dtype, tol.eps, tol.ulps, extra_rtol=rel), size, scale=1.0)
        return StageBound(float_tol, size, scale=1.0)
    if kind == "attention" and quant is not None:
        return StageBound(dataclasses.replace(quant, projections=tuple(p for p in quant.projections
                                                                     if p.role != "out")), size)  # fmt: skip
    return StageBound(tol, size)
