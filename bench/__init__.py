"""attnx.bench: backends x lowerings x shapes, timed, with the roofline and peak memory.

By job: _plan (what to measure, the report format and its ratios), _costs (the FLOP
model; memory: attnx.model.resources), _worker (one case in a process of its own, and the parent's side of it),
_sweep (the order of work), _plot; gpu_check is a script over them. The measurements made with
them (commands, results, machines, dates) live outside the package, in measurements/.

Each case runs in a process of its own so that its peak memory is its own. Nothing here
imports torch, onnx, onnx-ir or matplotlib at module level: the worker imports this package,
and its baseline memory should be the runtime's, not ours.
"""

from __future__ import annotations

from attnx.bench._costs import GEMM_ROWS, attention_flops, gemm_flops, gemm_shape
from attnx.bench._decode import (
    DECODE_DTYPES,
    DEFAULT_IMPLS,
    DecodeBenchRow,
    DecodeImpl,
    decode_impls,
    measure_bandwidth,
    run_decode_bench,
    step_bytes,
    weight_bytes,
)
from attnx.bench._plan import (
    BENCH_BACKENDS,
    DEFAULT_SEQS,
    ORT_LOWERINGS,
    SCHEMA,
    TORCH_LOWERINGS,
    BenchCase,
    BenchPlan,
    BenchReport,
    GemmResult,
    compare_lowerings,
)
from attnx.bench._plot import PLOT_FORMATS, check_plot_path, plot_report
from attnx.bench._sweep import machine_info, run_bench

__all__ = [
    "attention_flops",
    "gemm_flops",
    "gemm_shape",
    "GEMM_ROWS",
    "BenchPlan",
    "BenchCase",
    "GemmResult",
    "BenchReport",
    "run_bench",
    "compare_lowerings",
    "machine_info",
    "plot_report",
    "check_plot_path",
    "PLOT_FORMATS",
    "BENCH_BACKENDS",
    "DEFAULT_SEQS",
    "TORCH_LOWERINGS",
    "ORT_LOWERINGS",
    "SCHEMA",
    "DecodeBenchRow",
    "DECODE_DTYPES",
    "DEFAULT_IMPLS",
    "DecodeImpl",
    "decode_impls",
    "weight_bytes",
    "measure_bandwidth",
    "run_decode_bench",
    "step_bytes",
]
