"""What a sweep measures and what it reports: the plan, the cases, the report format
(attnx.bench/1 JSON) and the ratios the compiler's targets are judged by."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from attnx._io import write_json_atomic
from attnx.errors import UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    BACKEND_NAMES,
    BENCH_ORT_LOWERINGS,
    EXPORT_ATTENTIONS,
    MODEL_DTYPES,
    PROVIDERS,
    REFERENCE,
    RUNTIME_DTYPES,
    TORCH_CORES,
    check_choice,
    describe,
    runs_onnx_model,
)

__all__ = [
    "BenchPlan",
    "BenchCase",
    "GemmResult",
    "BenchReport",
    "compare_lowerings",
    "BENCH_BACKENDS",
    "DEFAULT_SEQS",
    "TORCH_LOWERINGS",
    "ORT_LOWERINGS",
    "SCHEMA",
]

SCHEMA = "attnx.bench/1"
# The backends a bench measures unless told (--backends): every backend but the reference.
BENCH_BACKENDS = tuple(b for b in BACKEND_NAMES if b != REFERENCE)
DEFAULT_SEQS = (128, 512, 2048)
# The attention axis per backend. torch runs the module's core; ORT runs an exported lowering.
# "auto" is left out of the default: it is one of the others, picked by measure.
TORCH_LOWERINGS = TORCH_CORES
ORT_LOWERINGS = BENCH_ORT_LOWERINGS


@dataclasses.dataclass
class BenchPlan:
    """What to measure. attentions None: every lowering each backend has (TORCH_LOWERINGS,
    ORT_LOWERINGS). mem_seqs None: memory as long as x (cross-attention only). model_path:
    bench this ONNX file on the ort-* backends instead of exporting (its lowering and dtype
    are read from the file)."""

    config: AttentionConfig
    backends: Sequence[str] = BENCH_BACKENDS
    attentions: Sequence[str] | None = None
    batches: Sequence[int] = (1,)
    seqs: Sequence[int] = DEFAULT_SEQS
    mem_seqs: Sequence[int] | None = None
    dtypes: Sequence[str] = ("fp32",)
    repeat: int = 10
    warmup: int = 2
    # each shape's cases are timed this many times, the order rotated between rounds; a case
    # keeps its lowest median (round_medians_ms has them all)
    rounds: int = 1
    threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    timeout_s: float = 600.0
    max_mem_gb: float | None = None  # None: the memory the machine has available per case
    weights_path: str | None = None
    seed: int = 0
    model_path: str | None = None
    preset: str | None = None

    def validate(self) -> None:
        for name in self.backends:
            check_choice("--backends value", name, BENCH_BACKENDS)
        if not self.backends:
            raise UsageError("--backends is empty")
        valid = sorted(set(TORCH_LOWERINGS) | set(EXPORT_ATTENTIONS))
        for name in self.attentions or ():
            check_choice("--attention value", name, valid)
        for name in self.dtypes:
            check_choice("--dtype value", name, (*MODEL_DTYPES, *RUNTIME_DTYPES))
        for flag, values in (("batch", self.batches), ("seq", self.seqs), ("dtype", self.dtypes)):
            if not values:
                raise UsageError(f"--{flag} is empty")
        for key, values in (("batch", self.batches), ("seq", self.seqs), ("mem-seq", self.mem_seqs or [1])):
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise UsageError(f"--{key} values must be positive integers, got {list(values)}")
        if self.mem_seqs and not self.config.cross:
            raise UsageError("--mem-seq is for cross-attention models; this config has cross false")
        if self.repeat < 1 or self.warmup < 0 or self.threads < 1 or self.rounds < 1:
            raise UsageError("--repeat, --rounds and --threads must be at least 1, --warmup at least 0")
        if not self.timeout_s > 0:
            raise UsageError(f"--timeout must be positive, got {self.timeout_s}")
        if self.max_mem_gb is not None and not self.max_mem_gb > 0:
            raise UsageError(f"--max-mem-gb must be positive, got {self.max_mem_gb}")
        if not self.series():
            raise UsageError(
                f"nothing to run: --attention {','.join(self.attentions or [])} applies to none of --backends "
                f"{','.join(self.backends)} (torch: {', '.join(TORCH_LOWERINGS)}; ort-*: {', '.join(EXPORT_ATTENTIONS)})"
            )

    def series(self) -> list[tuple[str, str]]:
        """(backend, attention) pairs in table order."""
        out = []
        for backend in self.backends:
            if not runs_onnx_model(backend):  # a torch backend: the module's cores
                default, valid = TORCH_LOWERINGS, TORCH_LOWERINGS
            elif self.model_path:  # the file's own lowering, read from its graph
                out.append((backend, describe(self.model_path).lowering))
                continue
            else:
                default, valid = ORT_LOWERINGS, EXPORT_ATTENTIONS
            chosen = default if self.attentions is None else [a for a in self.attentions if a in valid]
            out += [(backend, a) for a in chosen]
        return out

    def shapes(self) -> list[tuple[int, int, int | None]]:
        """(batch, seq, mem_seq), shortest sequence first."""
        out = []
        for seq, batch in itertools.product(sorted(set(self.seqs)), self.batches):
            if not self.config.cross:
                out.append((batch, seq, None))
            else:
                out += [(batch, seq, m) for m in (self.mem_seqs or [seq])]
        return out


@dataclasses.dataclass
class BenchCase:
    """One backend x lowering x shape. Times are of the run call alone, after warm-up;
    first_ms is the first call after loading (the first warm-up call, or the first timed one
    with --warmup 0), where a runtime grows its memory arena: a deployment's first request.
    peak_mem_mb is the case process's peak resident memory on CPU (interpreter, runtime
    library, weights, session, inputs, activations: nothing subtracted; import_rss_mb and
    load_rss_mb show how it builds up) and the device allocator's peak on GPU."""

    backend: str
    attention: str
    dtype: str
    batch: int
    seq: int
    mem_seq: int | None
    status: str  # "ok" | "skipped" | "failed" | "timeout"
    reason: str | None = None
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    first_ms: float | None = None
    tokens_per_s: float | None = None
    gflops: float | None = None
    roofline: float | None = None  # gflops / peak_gflops
    peak_mem_mb: float | None = None
    peak_gflops: float | None = None  # this backend's GEMM throughput, the roofline's limit
    flops: int | None = None
    mem_kind: str | None = None
    peak_rss_mb: float | None = None
    import_rss_mb: float | None = None
    load_rss_mb: float | None = None
    load_s: float | None = None
    threads: int | None = None
    runs: int | None = None
    times_ms: list[float] | None = None
    warmup_ms: list[float] | None = None
    timed: str | None = None  # the call that was timed, and where its inputs and outputs were
    # issue 12: the output's rel RMS error against the float64 torch module on the same inputs
    # (||y - ref|| / ||ref||, attnx.runtimes.compare): the frontier's accuracy axis
    rel_rms: float | None = None
    # with --rounds: every round's median, in the order measured (median_ms is the lowest)
    round_medians_ms: list[float] | None = None

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.attention}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GemmResult:
    """The float32 (or the case dtype's) matmul throughput of one backend's runtime."""

    backend: str
    dtype: str
    m: int
    k: int
    n: int
    status: str
    reason: str | None = None
    median_ms: float | None = None
    gflops: float | None = None
    peak_rss_mb: float | None = None
    threads: int | None = None
    runs: int | None = None
    timed: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class BenchReport:
    meta: dict[str, Any]
    gemm: list[GemmResult] = dataclasses.field(default_factory=list)
    cases: list[BenchCase] = dataclasses.field(default_factory=list)
    complete: bool = False
    interrupted: bool = False

    @property
    def peak_gflops(self) -> float | None:
        """The machine's float32 matmul limit: the best GEMM any runtime reached in this run."""
        values = [g.gflops for g in self.gemm if g.status == "ok" and g.dtype == "fp32" and g.gflops]
        return max(values) if values else None

    def ratios(self) -> list[dict[str, Any]]:
        return compare_lowerings(self.cases)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            **self.meta,
            "complete": self.complete,
            "interrupted": self.interrupted,
            "peak_gflops": self.peak_gflops,
            "gemm": [g.to_dict() for g in self.gemm],
            "ratios": self.ratios(),
            "cases": [c.to_dict() for c in self.cases],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchReport:
        derived = {"schema", "complete", "interrupted", "peak_gflops", "gemm", "ratios", "cases"}
        return cls(
            meta={k: v for k, v in data.items() if k not in derived},
            gemm=[GemmResult(**g) for g in data.get("gemm", [])],
            cases=[BenchCase(**c) for c in data.get("cases", [])],
            complete=bool(data.get("complete")),
            interrupted=bool(data.get("interrupted")),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BenchReport:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read bench results {os.fspath(path)!r}: {e}") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise UsageError(f"{os.fspath(path)!r} is not an attnx bench result ({SCHEMA})")
        return cls.from_dict(data)

    def write_json(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())


def compare_lowerings(cases: Iterable[BenchCase]) -> list[dict[str, Any]]:
    """The compiler's targets as ratios from one run, per shape: each ORT backend's ort-fused
    against torch eager on the same device (the better of its decomposed and sdpa cores) and
    against its own decomposed lowering. speedup = baseline median / ort-fused median,
    first_call_speedup the same for the first call after loading, and memory_ratio =
    baseline peak / ort-fused peak: above 1, ort-fused is faster or smaller."""
    ok = [c for c in cases if c.status == "ok"]
    by_shape: dict[tuple, list[BenchCase]] = {}
    for c in ok:
        by_shape.setdefault((c.dtype, c.batch, c.seq, c.mem_seq), []).append(c)
    out = []
    for (dtype, batch, seq, mem_seq), group in by_shape.items():
        for ort_backend, torch_backend in ((p.backend, p.torch_backend) for p in PROVIDERS.values()):
            fused = _find(group, ort_backend, "ort-fused")
            if fused is None:
                continue
            eager = [c for c in group if c.backend == torch_backend]
            baselines = []
            if eager:
                best = min(eager, key=lambda c: c.median_ms)
                baselines.append((f"{torch_backend} eager", best))
            decomposed = _find(group, ort_backend, "decomposed")
            if decomposed is not None:
                baselines.append((decomposed.label, decomposed))
            for what, base in baselines:
                out.append(
                    {
                        "dtype": dtype,
                        "batch": batch,
                        "seq": seq,
                        "mem_seq": mem_seq,
                        "target": fused.label,
                        "baseline": what,
                        "baseline_case": base.label,
                        "speedup": base.median_ms / fused.median_ms,
                        "first_call_speedup": (
                            base.first_ms / fused.first_ms if base.first_ms and fused.first_ms else None
                        ),
                        "memory_ratio": (
                            base.peak_mem_mb / fused.peak_mem_mb if base.peak_mem_mb and fused.peak_mem_mb else None
                        ),
                    }
                )
    return out


def _find(cases: Iterable[BenchCase], backend: str, attention: str) -> BenchCase | None:
    return next((c for c in cases if c.backend == backend and c.attention == attention), None)
