"""ORT offline optimization: save the graph ONNX Runtime builds for one provider, and time it.

ONNX Runtime optimizes every model when a session is created (constant folding, fusions
such as MatMul+Add and MatMul+Scale -> FusedMatMul, layout changes at level "all").
`optimize_for_provider` runs that once and saves the result
(SessionOptions.optimized_model_filepath), so a deployment can load the optimized graph
with optimizations off and skip that work at start-up.

The saved graph is only valid for the provider (and, at level "all", the hardware) it was
optimized for: ORT may put provider-specific fused ops (com.microsoft FusedMatMul, NCHWc
layouts, CUDA-only kernels) in it. So the provider, level and ORT version are recorded in
the model's metadata_props (key `attnx.ort_optimized`, JSON) and returned to the caller.

`compare_speed` times two models on the same feeds: both sessions are created first (the
creation time is reported, it is what offline optimization saves), warmed up, then run in
alternation so that the drift of a shared machine hits both alike; only session.run is
inside the timer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx._io import Staging, check_output_file, output_lock
from attnx.errors import InputError, ModelFileError, ProviderUnavailable, UsageError
from attnx.model.contract import (
    EXTERNAL_DATA_THRESHOLD,
    IR_VERSION,
    ORT_OPTIMIZED_KEY,
    PROVIDERS,
    check_choice,
    describe,
    get_provider,
    op_counts,
    require_model_file,
)
from attnx.runtimes.base import ModelSource, create_runner
from attnx.runtimes.ort_runner import OrtRunner, import_onnxruntime

__all__ = [
    "LEVELS",
    "OFFLINE_METADATA_KEY",
    "OfflineResult",
    "SpeedResult",
    "SpeedComparison",
    "optimize_for_provider",
    "compare_speed",
]

logger = logging.getLogger(__name__)

# Names of onnxruntime.GraphOptimizationLevel members, by the short names attnx uses.
LEVELS = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
OFFLINE_METADATA_KEY = ORT_OPTIMIZED_KEY
# With external data, tensors smaller than this stay inside the model file (shape
# constants, biases): only the weights go to the data file.
EXTERNAL_MIN_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class OfflineResult:
    """What optimize_for_provider wrote, and for what."""

    path: str
    files: list[str]  # the model first, then its data file when there is one
    provider: str  # "cpu" or "cuda"
    level: str
    ort_version: str
    external_data: bool
    optimize_s: float  # session creation with optimization and saving, as ORT did it
    ops_before: dict[str, int]
    ops_after: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def optimize_for_provider(
    model_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    provider: str = "cpu",
    level: str = "extended",
    *,
    external_data: bool | None = None,
) -> OfflineResult:
    """Save the model as ONNX Runtime optimizes it for `provider` at `level`, atomically.

    external_data None means: when the initializers pass EXTERNAL_DATA_THRESHOLD (protobuf's 2 GiB, less
    room for the graph), as attnx.export.save_model does; the data file is `<name>.data` beside the model. The
    written model is loaded again in this onnxruntime, with the same provider, before it
    replaces anything at out_path. Raises ProviderUnavailable when the provider does not
    really start (ORT falls back to CPU silently).
    """
    import onnx

    ort = import_onnxruntime(get_provider(provider).backend)
    if level not in LEVELS or level == "disabled":
        raise UsageError(f"unknown optimization level {level!r} (known: basic, extended, all)")
    model_path = os.path.abspath(os.fspath(model_path))
    out_path = os.path.abspath(os.fspath(out_path))
    require_model_file(model_path)
    if out_path == model_path:
        raise UsageError(f"the optimized model would overwrite its source {model_path!r}: choose another --out")
    check_output_file(out_path, "output")
    name = os.path.basename(out_path)

    source = describe(model_path)
    if external_data is None:
        external_data = source.initializer_bytes > EXTERNAL_DATA_THRESHOLD
    ops_before = source.operators
    data_name = f"{name}.data" if external_data else None

    with output_lock(out_path), Staging(out_path) as stage:
        tmp_model = stage.path()
        opts = _session_options(level)
        opts.optimized_model_filepath = tmp_model
        if data_name:
            opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", data_name)
            opts.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", str(EXTERNAL_MIN_BYTES)
            )
        start = time.perf_counter()
        _load(model_path, opts, provider).close()
        optimize_s = time.perf_counter() - start
        if not os.path.isfile(tmp_model):
            raise ModelFileError(f"onnxruntime {ort.__version__} did not write the optimized model for {model_path!r}")

        # Record what the graph is valid for, and hold it to the IR version attnx writes.
        proto = onnx.load(tmp_model, load_external_data=False)
        if proto.ir_version != IR_VERSION:
            logger.info("onnxruntime wrote IR version %d; setting %d", proto.ir_version, IR_VERSION)
            proto.ir_version = IR_VERSION
        meta = {p.key: p.value for p in proto.metadata_props}
        meta[OFFLINE_METADATA_KEY] = json.dumps(
            {"provider": provider, "level": level, "onnxruntime": ort.__version__}, sort_keys=True
        )
        del proto.metadata_props[:]
        for key, value in meta.items():
            proto.metadata_props.add(key=key, value=value)
        ops_after = op_counts(proto.graph.node)
        # Only the graph is rewritten: tensors keep their external data references.
        with open(tmp_model, "wb") as f:
            f.write(proto.SerializeToString())
        del proto

        # It must load again, in this ORT, on this provider, as a deployment would load it.
        _load(tmp_model, _session_options("disabled"), provider).close()

        written = stage.publish()
    result = OfflineResult(
        out_path, written, provider, level, ort.__version__, bool(data_name), optimize_s, ops_before, ops_after
    )
    logger.info("optimized %s for %s at level %s in %.2f s -> %s", model_path, provider, level, optimize_s, out_path)
    return result


# Timing -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpeedResult:
    path: str
    level: str  # the session's optimization level when it was loaded
    load_s: float  # session creation (optimization included), median of load_repeat
    runs_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def min_s(self) -> float:
        return min(self.runs_s)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "median_s": self.median_s, "min_s": self.min_s}


@dataclasses.dataclass(frozen=True)
class SpeedComparison:
    a: SpeedResult
    b: SpeedResult
    provider: str
    threads: int | None

    @property
    def speedup(self) -> float:
        """How many times faster b runs than a (median over median)."""
        return self.a.median_s / self.b.median_s

    @property
    def load_speedup(self) -> float:
        return self.a.load_s / self.b.load_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "provider": self.provider,
            "threads": self.threads,
            "speedup": self.speedup,
            "load_speedup": self.load_speedup,
        }

    def __str__(self) -> str:
        rows = [
            f"{'model':<12} {'level':<9} {'load ms':>9} {'median ms':>10} {'min ms':>9}",
            *(
                f"{label:<12} {r.level:<9} {r.load_s * 1e3:>9.1f} {r.median_s * 1e3:>10.2f} {r.min_s * 1e3:>9.2f}"
                for label, r in (("a", self.a), ("b", self.b))
            ),
            f"b runs {self.speedup:.2f}x as fast as a (median), loads {self.load_speedup:.2f}x as fast",
        ]
        return "\n".join(rows)


def compare_speed(
    a_path: str | os.PathLike[str],
    b_path: str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    repeat: int = 20,
    *,
    warmup: int = 3,
    provider: str = "cpu",
    threads: int | None = None,
    a_level: str = "all",
    b_level: str = "disabled",
    load_repeat: int = 3,
) -> SpeedComparison:
    """Time a and b on the same feeds: warm-up, then `repeat` runs of each, alternating,
    with only session.run inside the timer. The defaults compare an original model as ORT
    loads it by default (optimizing at level "all") with an offline-optimized one loaded
    as a deployment would, optimizations off. Session creation is timed `load_repeat`
    times each, alternating too (the first session of a process also pays for ORT's
    environment), and its median reported."""
    get_provider(provider)
    for label, level in (("a_level", a_level), ("b_level", b_level)):
        check_choice(label, level, LEVELS)
    if repeat < 1 or warmup < 0 or load_repeat < 1:
        raise UsageError(
            f"repeat and load_repeat must be at least 1 and warmup at least 0, "
            f"got repeat={repeat} load_repeat={load_repeat} warmup={warmup}"
        )
    feeds = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
    models = [(os.fspath(a_path), a_level), (os.fspath(b_path), b_level)]
    for path, _ in models:
        require_model_file(path)
    runners: list[OrtRunner | None] = [None, None]
    loads: tuple[list[float], list[float]] = ([], [])
    for _ in range(load_repeat):
        for i, (path, level) in enumerate(models):
            if runners[i] is not None:
                runners[i].close()  # the previous one goes first: a big model is held once
            start = time.perf_counter()
            runners[i] = _load(path, _session_options(level, threads), provider)
            loads[i].append(time.perf_counter() - start)
    sessions = [r.session for r in runners]
    for session, (path, _) in zip(sessions, models, strict=True):
        for _ in range(max(warmup, 1)):  # at least one: a bad feed fails here, not in the timer
            _run(session, feeds, path)
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for session, times in zip(sessions, runs, strict=True):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - start)
    for r in runners:
        r.close()
    a = SpeedResult(models[0][0], a_level, statistics.median(loads[0]), runs[0])
    b = SpeedResult(models[1][0], b_level, statistics.median(loads[1]), runs[1])
    return SpeedComparison(a, b, provider, threads)


# Sessions ---------------------------------------------------------------------------------
def _session_options(level: str, threads: int | None = None) -> Any:
    ort = import_onnxruntime(PROVIDERS["cpu"].backend)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # errors only
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[level])
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return opts


def _load(path: str, opts: Any, provider: str) -> OrtRunner:
    """A loaded runner on `provider` that really runs there (the runner checks the session's
    providers: ORT builds a CPU session when CUDA cannot start), or ProviderUnavailable."""
    runner = create_runner(get_provider(provider).backend, ModelSource(model_path=path), session_options=opts)
    try:
        return runner.load()
    except ProviderUnavailable as e:
        raise ProviderUnavailable(f"cannot use provider {provider!r}: {e}") from None


def _run(session: Any, feeds: Mapping[str, np.ndarray], path: str) -> None:
    try:
        session.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - ORT's InvalidArgument for a wrong name, dtype or shape
        text = str(e).strip()
        raise InputError(f"the feeds do not fit {path!r}: {text.splitlines()[0] if text else e!r}") from None
