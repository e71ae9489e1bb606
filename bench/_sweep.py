"""The sweep: backends x lowerings x shapes, each case timed in a process of its own.

Order of work: one GEMM per backend and dtype (the roofline, and the probe that tells a
backend that cannot run here), one export per ORT lowering and dtype (reused by every
shape), then the cases from the shortest sequence up, every backend at one length before
the next length, so that a sweep stopped early still compares the backends. The JSON file
is rewritten (atomically) after every case: Ctrl-C keeps what was measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from attnx.bench._flops import attention_flops, gemm_flops, gemm_shape
from attnx.errors import UsageError
from attnx.model.config import AttentionConfig

__all__ = [
    "BenchPlan",
    "BenchCase",
    "GemmResult",
    "BenchReport",
    "run_bench",
    "describe_onnx_model",
    "estimate_peak_bytes",
    "compare_lowerings",
    "DEFAULT_BACKENDS",
    "DEFAULT_SEQS",
    "TORCH_LOWERINGS",
    "ORT_LOWERINGS",
    "SCHEMA",
]

logger = logging.getLogger(__name__)

SCHEMA = "attnx.bench/1"
DEFAULT_BACKENDS = ("torch", "ort-cpu", "ort-cuda", "torch-cuda")
DEFAULT_SEQS = (128, 512, 2048)
# The attention axis per backend. torch runs the module's core (attnx.model.module
# ATTENTION_IMPLS, not imported here: that would import torch); ORT runs an exported
# lowering. "auto" is left out of the default: it is one of the others, picked by measure.
TORCH_LOWERINGS = ("decomposed", "sdpa")
ORT_LOWERINGS = ("decomposed", "onnx", "ort-fused")
# The torch backend on the same device as each ORT backend: what "torch eager" means in the
# compiler's target for that device.
_TORCH_PEER = {"ort-cpu": "torch", "ort-cuda": "torch-cuda"}

Progress = Callable[[int, int, str], None]  # (cases done, cases in all, what is happening)


@dataclasses.dataclass
class BenchPlan:
    """What to measure. attentions None: every lowering each backend has (TORCH_LOWERINGS,
    ORT_LOWERINGS). mem_seqs None: memory as long as x (cross-attention only). model_path:
    bench this ONNX file on the ort-* backends instead of exporting (its lowering and dtype
    are read from the file)."""

    config: AttentionConfig
    backends: Sequence[str] = DEFAULT_BACKENDS
    attentions: Sequence[str] | None = None
    batches: Sequence[int] = (1,)
    seqs: Sequence[int] = DEFAULT_SEQS
    mem_seqs: Sequence[int] | None = None
    dtypes: Sequence[str] = ("fp32",)
    repeat: int = 10
    warmup: int = 2
    threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    timeout_s: float = 600.0
    max_mem_gb: float | None = None  # None: the memory the machine has available per case
    weights_path: str | None = None
    seed: int = 0
    model_path: str | None = None
    preset: str | None = None

    def validate(self) -> None:
        from attnx.export import EXPORT_DTYPES, LOWERINGS
        from attnx.runtimes import backend_names

        known = backend_names()
        for name in self.backends:
            if name not in known or name == "reference":
                raise UsageError(f"unknown --backends value {name!r} (known: {', '.join(DEFAULT_BACKENDS)})")
        if not self.backends:
            raise UsageError("--backends is empty")
        valid = set(TORCH_LOWERINGS) | set(LOWERINGS)
        for name in self.attentions or ():
            if name not in valid:
                raise UsageError(f"unknown --attention value {name!r} (known: {', '.join(sorted(valid))})")
        for name in self.dtypes:
            if name not in EXPORT_DTYPES:
                raise UsageError(f"unknown --dtype value {name!r} (known: {', '.join(EXPORT_DTYPES)})")
        for flag, values in (("batch", self.batches), ("seq", self.seqs), ("dtype", self.dtypes)):
            if not values:
                raise UsageError(f"--{flag} is empty")
        for key, values in (("batch", self.batches), ("seq", self.seqs), ("mem-seq", self.mem_seqs or [1])):
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise UsageError(f"--{key} values must be positive integers, got {list(values)}")
        if self.mem_seqs and not self.config.cross:
            raise UsageError("--mem-seq is for cross-attention models; this config has cross false")
        if self.repeat < 1 or self.warmup < 0 or self.threads < 1:
            raise UsageError("--repeat and --threads must be at least 1, --warmup at least 0")
        if not self.timeout_s > 0:
            raise UsageError(f"--timeout must be positive, got {self.timeout_s}")
        if self.max_mem_gb is not None and not self.max_mem_gb > 0:
            raise UsageError(f"--max-mem-gb must be positive, got {self.max_mem_gb}")
        if not self.series():
            raise UsageError(
                f"nothing to run: --attention {','.join(self.attentions or [])} applies to none of --backends "
                f"{','.join(self.backends)} (torch: {', '.join(TORCH_LOWERINGS)}; ort-*: {', '.join(_ort_lowerings())})"
            )

    def series(self) -> list[tuple[str, str]]:
        """(backend, attention) pairs in table order."""
        out = []
        for backend in self.backends:
            if backend.startswith("torch"):
                default, valid = TORCH_LOWERINGS, TORCH_LOWERINGS
            elif self.model_path:  # the file's own lowering
                out.append((backend, describe_onnx_model(self.model_path)[1]))
                continue
            else:
                default, valid = ORT_LOWERINGS, _ort_lowerings()
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


def _ort_lowerings() -> tuple[str, ...]:
    from attnx.export import LOWERINGS

    return LOWERINGS


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
        from attnx.runtimes.parity import write_json_atomic

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
        for ort_backend, torch_backend in _TORCH_PEER.items():
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


# Estimating what a case needs, to skip one the machine cannot hold --------------------------
def _materializes_scores(config: AttentionConfig, attention: str) -> bool:
    """Whether the lowering holds the whole (b, N, t, s) score matrix: the decomposed form and
    ORT's Attention-23 on CPU do (DESIGN.md section 7: 8.96 and 8.7 GB at seq 8192 for the
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
    return _meminfo_bytes("MemAvailable")


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


# Files the workers read: exports, the GEMM model ---------------------------------------------
def describe_onnx_model(path: str) -> tuple[AttentionConfig, str, str]:
    """(config, lowering, dtype) of an attnx ONNX file: the config from its metadata, the
    lowering from its operators, the dtype from input x."""
    import onnx
    from google.protobuf.message import DecodeError

    from attnx.export import CONFIG_METADATA_KEY

    try:
        proto = onnx.load(path, load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise UsageError(f"--model {path!r} is not a readable ONNX model: {str(e).strip()[:200]}") from None
    meta = {p.key: p.value for p in proto.metadata_props}
    if CONFIG_METADATA_KEY not in meta:
        raise UsageError(
            f"--model {path!r} has no {CONFIG_METADATA_KEY!r} metadata: it was not written by attnx export"
        )
    config = AttentionConfig.from_json(meta[CONFIG_METADATA_KEY])
    ops = {(n.domain or "ai.onnx", n.op_type) for n in proto.graph.node}
    if {("com.microsoft", "MultiHeadAttention"), ("com.microsoft", "Attention")} & ops:
        lowering = "ort-fused"
    elif ("ai.onnx", "Attention") in ops:
        lowering = "onnx"
    else:
        lowering = "decomposed"
    x = next((i for i in proto.graph.input if i.name == "x"), None)
    if x is None:
        raise UsageError(f"--model {path!r} has no input 'x'")
    elem = x.type.tensor_type.elem_type
    dtype = {onnx.TensorProto.FLOAT: "fp32", onnx.TensorProto.FLOAT16: "fp16"}.get(elem)
    if dtype is None:
        raise UsageError(f"--model {path!r}: input 'x' has element type {elem}, expected float or float16")
    return config, lowering, dtype


def write_gemm_model(path: str, m: int, k: int, n: int, dtype: str) -> None:
    """A one-MatMul ONNX model: a [m, k] input times a constant [k, n] weight, as a
    projection is. Written at attnx's IR version so the pinned onnxruntime reads it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from attnx.export import IR_VERSION
    from attnx.model.config import DTYPES

    elem = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}[dtype]
    rng = np.random.Generator(np.random.PCG64(1))
    weight = rng.standard_normal((k, n), dtype=np.float32).astype(DTYPES[dtype])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        "attnx_gemm",
        [helper.make_tensor_value_info("a", elem, [m, k])],
        [helper.make_tensor_value_info("y", elem, [m, n])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="attnx bench")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    onnx.save(model, path)


# Running one worker ------------------------------------------------------------------------
def run_worker(spec: dict[str, Any], workdir: str, name: str, timeout_s: float) -> dict[str, Any]:
    """Run one spec in `python -m attnx.bench._worker` and return its result. A worker that
    passes timeout_s is killed (status "timeout"); one that dies without a result (killed by
    the kernel for memory, a crash in native code) is "failed" with what it last printed."""
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    result_path = os.path.join(workdir, f"{name}.result.json")
    log_path = os.path.join(workdir, f"{name}.log")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "attnx.bench._worker", spec_path, result_path]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"status": "timeout", "reason": f"ran past the {timeout_s:g} s budget per case (--timeout)"}
        except BaseException:  # Ctrl-C: the case is dropped, the worker must not outlive us
            proc.kill()
            proc.wait()
            raise
    if os.path.exists(result_path):
        with open(result_path, encoding="utf-8") as f:
            return json.load(f)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        tail = [line.strip() for line in f.read().splitlines() if line.strip()][-1:]
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
        why = f"killed by {sig}" + (" (out of memory?)" if returncode == -signal.SIGKILL else "")
    else:
        why = f"exited with status {returncode}"
    return {"status": "failed", "reason": why + (f": {tail[0]}" if tail else ""), "killed": returncode < 0}


def _times(result: dict[str, Any]) -> dict[str, Any]:
    times = np.asarray(result["times_ms"], dtype=np.float64)
    warm_up = [float(t) for t in result.get("warmup_ms") or []]
    return {
        "first_ms": (warm_up or [float(times[0])])[0],
        "warmup_ms": warm_up,
        "median_ms": float(np.median(times)),
        "p10_ms": float(np.percentile(times, 10)),
        "p90_ms": float(np.percentile(times, 90)),
        "runs": len(times),
        "times_ms": [float(t) for t in times],
    }


# The sweep ------------------------------------------------------------------------------------
def run_bench(
    plan: BenchPlan,
    json_path: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    meta: dict[str, Any] | None = None,
) -> BenchReport:
    """Measure every case of the plan. The report (and json_path, rewritten after each case)
    holds what was measured; Ctrl-C stops the sweep and returns it with interrupted True."""
    plan.validate()
    say = progress or (lambda done, total, message: None)
    series = plan.series()
    shapes = plan.shapes()
    total = len(series) * len(shapes) * len(plan.dtypes)
    report = BenchReport(meta={**_meta(plan), **(meta or {})})

    def save() -> None:
        if json_path is not None:
            report.write_json(json_path)

    with tempfile.TemporaryDirectory(prefix="attnx-bench-") as workdir:
        try:
            unavailable = _measure_gemms(plan, report, workdir, say, total)
            save()
            models, export_failed = _export_lowerings(plan, series, unavailable, workdir, say, total)
            _measure_cases(plan, report, series, shapes, unavailable, models, export_failed, workdir, say, total, save)
            report.complete = True
        except KeyboardInterrupt:
            logger.info("interrupted: keeping %d measured cases", len(report.cases))
            report.interrupted = True
        save()
    say(len(report.cases), total, "done" if report.complete else "interrupted")
    return report


def _meta(plan: BenchPlan) -> dict[str, Any]:
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "preset": plan.preset,
            "config": plan.config.to_dict(),
            "weights": plan.weights_path or f"seeded (seed {plan.seed})",
            "model_path": plan.model_path,
        },
        "settings": {
            "backends": list(plan.backends),
            "attentions": list(plan.attentions) if plan.attentions is not None else None,
            "batches": list(plan.batches),
            "seqs": list(plan.seqs),
            "mem_seqs": list(plan.mem_seqs) if plan.mem_seqs else None,
            "dtypes": list(plan.dtypes),
            "repeat": plan.repeat,
            "warmup": plan.warmup,
            "threads": plan.threads,
            "timeout_s": plan.timeout_s,
            "max_mem_gb": plan.max_mem_gb,
            "gemm_shape": list(gemm_shape(plan.config)),
        },
        "flop_model": (
            "2*b*t*d_model*N*head_dim (q) + 2*b*s*kv_dim*N*(head_dim+v_head_dim) (k, v) "
            "+ 2*b*N*t*s*(head_dim+v_head_dim) (scores, weighted sum) + 2*b*t*N*v_head_dim*d_model (output)"
        ),
        "machine": machine_info(),
    }


def machine_info() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    total_mem = _meminfo_bytes("MemTotal")
    versions = {}
    for pkg in ("torch", "onnxruntime-gpu", "onnxruntime", "numpy"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(total_mem / 1024**3, 1) if total_mem else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _measure_gemms(plan: BenchPlan, report: BenchReport, workdir: str, say: Progress, total: int) -> dict[tuple, str]:
    """One GEMM per backend and dtype. Returns {(backend, dtype): reason} for the backends that
    cannot run here, found by the GEMM's own runner."""
    m, k, n = gemm_shape(plan.config)
    unavailable: dict[tuple, str] = {}
    for backend, dtype in itertools.product(plan.backends, plan.dtypes):
        say(0, total, f"GEMM {m}x{k}x{n} {dtype} on {backend}")
        spec: dict[str, Any] = {
            "kind": "gemm", "backend": backend, "dtype": dtype, "m": m, "k": k, "n": n,
            "threads": plan.threads, "repeat": max(plan.repeat, 10), "warmup": max(plan.warmup, 2),
        }  # fmt: skip
        if backend.startswith("ort-"):
            spec["model_path"] = os.path.join(workdir, f"gemm-{dtype}.onnx")
            if not os.path.exists(spec["model_path"]):
                write_gemm_model(spec["model_path"], m, k, n, dtype)
        result = run_worker(spec, workdir, f"gemm-{backend}-{dtype}", plan.timeout_s)
        g = GemmResult(
            backend,
            dtype,
            m,
            k,
            n,
            result["status"],
            result.get("reason"),
            threads=plan.threads,
            timed=result.get("timed"),
        )
        if result["status"] == "ok":
            stats = _times(result)
            g.median_ms, g.runs = stats["median_ms"], stats["runs"]
            g.gflops = gemm_flops(m, k, n) / (g.median_ms * 1e-3) / 1e9
            g.peak_rss_mb = result.get("peak_rss_mb")
        elif result["status"] == "skipped":
            unavailable[(backend, dtype)] = result["reason"]
        else:
            logger.info("GEMM on %s (%s) %s: %s", backend, dtype, result["status"], result.get("reason"))
        report.gemm.append(g)
    return unavailable


def _load_weights(plan: BenchPlan) -> Any:
    from attnx.model import init_weights, load_weights

    return load_weights(plan.weights_path, plan.config) if plan.weights_path else init_weights(plan.config, plan.seed)


def _export_lowerings(
    plan: BenchPlan,
    series: list[tuple[str, str]],
    unavailable: dict[tuple, str],
    workdir: str,
    say: Progress,
    total: int,
) -> tuple[dict[tuple, str], dict[tuple, str]]:
    """Export each ORT lowering once per dtype, for the ORT backends that can run here.
    Returns ({(lowering, dtype): path}, {(lowering, dtype): why the export failed})."""
    models: dict[tuple, str] = {}
    failed: dict[tuple, str] = {}
    wanted = sorted(
        {
            (attention, dtype)
            for (backend, attention), dtype in itertools.product(series, plan.dtypes)
            if backend.startswith("ort-") and (backend, dtype) not in unavailable
        }
    )
    if plan.model_path:
        return {key: plan.model_path for key in wanted}, failed
    weights = None
    for attention, dtype in wanted:
        from attnx.export import export_model

        if weights is None:
            weights = _load_weights(plan)
        path = os.path.join(workdir, f"model-{attention}-{dtype}.onnx")
        say(0, total, f"exporting the {attention} lowering ({dtype})")
        try:
            export_model(plan.config, path, weights, attention=attention, dtype=dtype, validate=False)
            models[(attention, dtype)] = path
        except Exception as e:  # a lowering that cannot be built yet is a skipped series, not a crash
            text = str(e).strip()
            failed[(attention, dtype)] = f"export failed: {type(e).__name__}: {text.splitlines()[0] if text else ''}"
            logger.info("%s lowering (%s): %s", attention, dtype, failed[(attention, dtype)])
    return models, failed


def _measure_cases(
    plan: BenchPlan,
    report: BenchReport,
    series: list[tuple[str, str]],
    shapes: list[tuple[int, int, int | None]],
    unavailable: dict[tuple, str],
    models: dict[tuple, str],
    export_failed: dict[tuple, str],
    workdir: str,
    say: Progress,
    total: int,
    save: Callable[[], None],
) -> None:
    peaks = {(g.backend, g.dtype): g.gflops for g in report.gemm if g.status == "ok"}
    # (backend, attention, dtype, batch, mem_seq) -> the seq at which that series timed out or
    # was killed: longer sequences of it are not started (they would only do so again).
    stopped: dict[tuple, str] = {}
    for dtype, (batch, seq, mem_seq) in itertools.product(plan.dtypes, shapes):
        for backend, attention in series:
            case = BenchCase(backend, attention, dtype, batch, seq, mem_seq, "skipped", threads=plan.threads)
            case.flops = attention_flops(plan.config, batch, seq, mem_seq)
            key = (backend, attention, dtype, batch, mem_seq)
            say(len(report.cases), total, f"{case.label} {dtype} batch {batch} seq {seq}")
            case.reason = _skip_reason(plan, case, unavailable, models, export_failed, stopped.get(key))
            if case.reason is None and _run_case(
                plan, case, models, workdir, len(report.cases), peaks.get((backend, dtype))
            ):
                what = "timed out" if case.status == "timeout" else "was killed"
                stopped[key] = f"not run: seq {seq} of this series {what}"
            report.cases.append(case)
            save()


def _skip_reason(
    plan: BenchPlan,
    case: BenchCase,
    unavailable: dict[tuple, str],
    models: dict[tuple, str],
    export_failed: dict[tuple, str],
    stopped: str | None,
) -> str | None:
    backend, attention, dtype = case.backend, case.attention, case.dtype
    if (backend, dtype) in unavailable:
        return unavailable[(backend, dtype)]
    if backend.startswith("torch") and plan.model_path:
        return (
            "torch runs the attnx module from a config and weights; "
            "--model gives only an ONNX file (use --preset or --config)"
        )
    if backend.startswith("ort-") and (attention, dtype) not in models:
        return export_failed.get((attention, dtype), "no model for this lowering")
    if stopped:
        return stopped
    if not backend.endswith("-cuda"):  # the guard is for host memory; a GPU case fails on its own
        need = estimate_peak_bytes(plan.config, backend, attention, case.batch, case.seq, case.mem_seq, dtype)
        limit = plan.max_mem_gb * 1024**3 if plan.max_mem_gb else available_memory_bytes()
        if limit is not None and need > limit:
            return (
                f"not run: needs about {need / 1024**3:.1f} GB, {limit / 1024**3:.1f} GB "
                f"{'allowed (--max-mem-gb)' if plan.max_mem_gb else 'available'}"
            )
    return None


def _run_case(
    plan: BenchPlan, case: BenchCase, models: dict[tuple, str], workdir: str, index: int, peak: float | None
) -> bool:
    """Measure one case into `case`. True when it timed out or was killed: the longer
    sequences of its series would only do the same."""
    spec: dict[str, Any] = {
        "kind": "case", "backend": case.backend, "attention": case.attention, "dtype": case.dtype,
        "config": plan.config.to_dict(), "batch": case.batch, "seq": case.seq, "mem_seq": case.mem_seq,
        "threads": plan.threads, "repeat": plan.repeat, "warmup": plan.warmup,
        "weights_path": plan.weights_path, "seed": plan.seed,
        "model_path": models.get((case.attention, case.dtype)),
    }  # fmt: skip
    result = run_worker(spec, workdir, f"case{index}", plan.timeout_s)
    case.status, case.reason = result["status"], result.get("reason")
    for key in ("peak_rss_mb", "import_rss_mb", "load_rss_mb", "load_s", "timed"):
        setattr(case, key, result.get(key))
    if case.status != "ok":
        return case.status == "timeout" or bool(result.get("killed"))
    for key, value in _times(result).items():
        setattr(case, key, value)
    seconds = case.median_ms * 1e-3
    case.tokens_per_s = case.batch * case.seq / seconds
    case.gflops = case.flops / seconds / 1e9
    case.peak_gflops = peak
    case.roofline = case.gflops / peak if peak else None
    if case.backend.endswith("-cuda"):
        case.peak_mem_mb, case.mem_kind = result.get("gpu_peak_mb"), result.get("gpu_mem_kind")
    else:
        case.peak_mem_mb, case.mem_kind = case.peak_rss_mb, "peak RSS of the case process (VmHWM)"
    return False
