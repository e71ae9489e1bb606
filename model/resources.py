"""How much memory a command will need, estimated from the config alone, before anything is
allocated; and the guard that refuses a command the machine cannot hold (exit 2, with the
estimate), instead of letting the kernel kill it, and the machine with it, minutes later.

The estimates are bounds of the right size, not measurements; they are calibrated on the peaks
measured (measurements/facts.md):
- weights: float32, 4 bytes a parameter, held once (the torch module shares the numpy arrays).
- export/build: the exporter's graph holds a second copy of the weights beside the arrays, and
  ONNX Runtime loads one of its own once they are dropped: 2x the weights (gpt3 measured somewhat
  less: measurements/facts.md), plus the activations of the largest shape checked.
- the float64 reference: each weight converted to float64 when used (the largest one, 8 bytes a
  parameter) and its activations in float64.
- activations: the projections' inputs and outputs, and where the attention core holds it the
  whole (batch, heads, queries, keys) score matrix twice (scores and probabilities): the
  decomposed and standard-Attention lowerings on ONNX Runtime CPU and torch's decomposed core do
  (the large preset's peaks at seq 8192: measurements/facts.md); the fused kernels and torch's SDPA stream it
  (SDPA falls back to its math path with a key padding mask).

The work of a case, attention_flops (what the bench harness reports against the GEMM roofline,
and what sizes a localisation's sessions): 2 FLOPs per multiply-add of the four projections and
of the two attention matmuls, for batch b, t queries, s keys (s = t and kv_dim = d_model in
self-attention), N heads of which Nkv key/value heads (grouped-query attention: Nkv < N):

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

import dataclasses
from collections.abc import Iterable

from attnx.errors import UsageError
from attnx.model.config import AttentionConfig
from attnx.model.cores import LOWERINGS

__all__ = [
    "Estimate",
    "ResourceError",
    "available_memory_bytes",
    "meminfo_bytes",
    "weights_bytes",
    "attention_flops",
    "activation_bytes",
    "materializes_scores",
    "estimate_case",
    "estimate_export",
    "estimate_parity",
    "check_memory",
    "cache_bytes",
    "estimate_decode_bench",
]

GB = 1024**3


class ResourceError(UsageError):
    """A command would need more memory than this machine has (or --max-mem-gb allows)."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a command will hold at its peak, by part (bytes)."""

    what: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {size / GB:.2f} GB" for name, size in self.parts.items() if size)
        return f"about {self.total / GB:.1f} GB for {self.what} ({parts})"


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo in bytes, or None where there is no /proc."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no /proc."""
    return meminfo_bytes("MemAvailable")


def weights_bytes(config: AttentionConfig) -> int:
    return 4 * config.n_params


def materializes_scores(config: AttentionConfig, core: str) -> bool:
    """Whether a lowering (its full form's cores: Core.holds_scores) or the torch module's core holds the whole score
    matrix."""
    if core in LOWERINGS:
        return LOWERINGS[core].holds_scores()
    return core == "sdpa" and config.key_padding_mask


def activation_bytes(
    config: AttentionConfig, batch: int, seq: int, mem_seq: int | None, core: str, itemsize: int = 4
) -> int:
    """The projections' inputs and outputs, and the score matrix twice where `core` holds it."""
    c = config
    s = (mem_seq or seq) if c.cross else seq
    acts = 2 * batch * (seq * (c.d_model + c.q_dim + c.d_model) + s * (c.kv_dim + c.q_dim + c.v_dim)) * itemsize
    scores = 2 * batch * c.n_heads * seq * s * itemsize if materializes_scores(c, core) else 0
    return acts + scores


def _reference_bytes(config: AttentionConfig, shapes: Iterable[tuple[int, int, int | None]]) -> int:
    """The float64 reference: its largest weight in float64 and its activations in float64
    (one head and one query at a time: no score matrix)."""
    c = config
    largest = 8 * max(c.q_dim * c.d_model, c.q_dim * c.kv_dim, c.v_dim * c.kv_dim, c.d_model * c.v_dim)
    return largest + max((activation_bytes(c, b, t, m, "fused", itemsize=8) for b, t, m in shapes), default=0)


def estimate_case(
    config: AttentionConfig, backend: str, core: str, batch: int, seq: int, mem_seq: int | None, dtype: str
) -> Estimate:
    """One benchmark case in a process of its own: the weights and one shape's activations."""
    item = 2 if dtype == "fp16" else 4
    return Estimate(
        f"{backend}/{core} batch {batch} seq {seq}",
        {"weights": weights_bytes(config), "activations": activation_bytes(config, batch, seq, mem_seq, core, item)},
    )


def estimate_export(
    config: AttentionConfig,
    shapes: Iterable[tuple[int, int, int | None]],
    core: str = "decomposed",
    what: str = "export",
    reference: bool = False,
) -> Estimate:
    """Export (and build): the weights, the exporter's or ONNX Runtime's copy of them, the
    activations of the largest shape the model is checked at (on ONNX Runtime, `core`), and
    with reference (a build) the float64 reference of its golden and parity cases."""
    shapes = list(shapes)
    parts = {
        "weights": weights_bytes(config),
        "a second copy (exporter, then onnxruntime)": weights_bytes(config),
        "activations": max((activation_bytes(config, b, t, m, core) for b, t, m in shapes), default=0),
    }
    if reference:
        parts["float64 reference"] = _reference_bytes(config, shapes)
    return Estimate(what, parts)


def estimate_parity(
    config: AttentionConfig, shapes: Iterable[tuple[int, int, int | None]], onnx_model: bool = True
) -> Estimate:
    """Parity: the weights, onnxruntime's copy of them (when an ONNX model runs), torch's
    decomposed activations (its default core) and the float64 reference."""
    shapes = list(shapes)
    return Estimate(
        "parity",
        {
            "weights": weights_bytes(config),
            "onnxruntime's copy": weights_bytes(config) if onnx_model else 0,
            "activations": max((activation_bytes(config, b, t, m, "decomposed") for b, t, m in shapes), default=0),
            "float64 reference": _reference_bytes(config, shapes),
        },
    )


def cache_bytes(config: AttentionConfig, batch: int, positions: int, itemsize: int = 4) -> int:
    """A step model's cache of `positions` positions, as its config lays it out (cache_values: keys and values of
    every key/value head, or a latent)."""
    return batch * config.cache_values() * positions * itemsize


def estimate_decode_bench(config: AttentionConfig, pasts: Iterable[int], sessions: int) -> Estimate:
    """attnx bench --decode: the weights, one copy per ONNX Runtime session (the step models are
    built from them), the largest past's cache about six times (the random cache, the buffer
    form's copy, the growing form's past and present, torch's cat), the bandwidth copies
    (2 x 512 MB) and the flush buffer (256 MB)."""
    largest = max(pasts, default=0) + 1
    return Estimate(
        "bench --decode",
        {
            "weights": weights_bytes(config),
            f"{sessions} onnxruntime sessions' weights": sessions * weights_bytes(config),
            "caches": 6 * cache_bytes(config, 1, largest),
            "bandwidth copies and flush": 1280 * 1024**2,
        },
    )


def check_memory(estimate: Estimate, max_mem_gb: float | None = None) -> None:
    """Refuse (ResourceError, exit 2) a command whose estimate exceeds --max-mem-gb, or else the
    memory available now; say nothing where the available memory cannot be read."""
    if max_mem_gb is not None and not max_mem_gb > 0:
        raise UsageError(f"--max-mem-gb must be positive, got {max_mem_gb}")
    limit = max_mem_gb * GB if max_mem_gb is not None else available_memory_bytes()
    if limit is not None and estimate.total > limit:
        source = "allowed by --max-mem-gb" if max_mem_gb is not None else "available on this machine"
        raise ResourceError(f"not started: it needs {estimate}; {limit / GB:.1f} GB {source}")


def attention_flops(config: AttentionConfig, batch: int, seq: int, mem_seq: int | None = None, past: int = 0) -> int:
    """FLOPs of one forward call at (batch, seq[, mem_seq]), by the model in the module docstring;
    past: the keys of a step model's cache, scored beside the call's own (none projected)."""
    c = config
    b, t = batch, seq
    s = (mem_seq if mem_seq is not None else seq) if c.cross else seq
    q = 2 * b * t * c.d_model * c.n_heads * c.head_dim
    kv = 2 * b * s * c.kv_dim * c.n_kv_heads * (c.head_dim + c.v_head_dim)  # grouped heads: Nkv projections
    core = 2 * b * c.n_heads * t * (s + past) * (c.head_dim + c.v_head_dim)
    out = 2 * b * t * c.n_heads * c.v_head_dim * c.d_model
    return q + kv + core + out
