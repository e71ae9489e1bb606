"""attnx.bench: backends x lowerings x shapes, timed, with the roofline and peak memory.

Each case runs in a process of its own (attnx.bench._worker) so that its peak memory is its
own. Nothing here imports torch, onnx or matplotlib at module level: the worker imports
this package, and its baseline memory should be the runtime's, not ours.
"""

from __future__ import annotations

from attnx.bench._flops import GEMM_ROWS, attention_flops, gemm_flops, gemm_shape
from attnx.bench._plot import PLOT_FORMATS, check_plot_path, plot_report
from attnx.bench._sweep import (
    DEFAULT_BACKENDS,
    DEFAULT_SEQS,
    ORT_LOWERINGS,
    SCHEMA,
    TORCH_LOWERINGS,
    BenchCase,
    BenchPlan,
    BenchReport,
    GemmResult,
    compare_lowerings,
    describe_onnx_model,
    estimate_peak_bytes,
    run_bench,
)

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
    "describe_onnx_model",
    "estimate_peak_bytes",
    "plot_report",
    "check_plot_path",
    "PLOT_FORMATS",
    "DEFAULT_BACKENDS",
    "DEFAULT_SEQS",
    "TORCH_LOWERINGS",
    "ORT_LOWERINGS",
    "SCHEMA",
]
