"""The sweep as a picture: latency and peak memory against sequence length, log-log.

matplotlib is an optional extra (`pip install attnx[plot]`): imported here only, and
checked for before a sweep starts, so a missing package is said at once and not after an
hour of measuring.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

from attnx._io import atomic_path
from attnx.bench._plan import BenchCase, BenchReport
from attnx.errors import UsageError

__all__ = ["plot_report", "check_plot_path", "PLOT_FORMATS"]

logger = logging.getLogger(__name__)

PLOT_FORMATS = (".png", ".svg", ".pdf")


def check_plot_path(path: str) -> None:
    """Raise UsageError before any work when the plot cannot be written."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in PLOT_FORMATS:
        raise UsageError(f"--plot {path!r}: the file name must end in {', '.join(PLOT_FORMATS)}")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, an optional extra: pip install 'attnx[plot]'")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--plot {path!r}: folder {parent!r} does not exist")


def _labeller(cases: list[BenchCase]) -> Callable[[BenchCase], str]:
    """One label per line: backend/lowering, with dtype, batch and memory length only where
    the sweep has more than one of them."""
    many_dtypes = len({c.dtype for c in cases}) > 1
    many_batches = len({c.batch for c in cases}) > 1
    many_mem = len({c.mem_seq for c in cases if c.mem_seq is not None}) > 1

    def label(c: BenchCase) -> str:
        text = c.label
        if many_dtypes:
            text += f" {c.dtype}"
        if many_batches:
            text += f" batch {c.batch}"
        if many_mem:
            text += f" mem {c.mem_seq}"
        return text

    return label


def plot_report(report: BenchReport, path: str | os.PathLike[str]) -> None:
    """Write the report's plot to `path` (atomically: a reader never sees half a file)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and none is touched
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    path = os.fspath(path)
    _Plain = _plain_formatter()
    label = _labeller(report.cases)
    lines: dict[str, list[BenchCase]] = {}
    for c in report.cases:
        lines.setdefault(label(c), []).append(c)

    # issue 12: with the cases' rel RMS errors, a third panel: the speed-accuracy frontier
    accuracy = any(c.status == "ok" and c.rel_rms for c in report.cases)
    fig = Figure(figsize=(19.5 if accuracy else 13, 5.5), layout="constrained")
    axes = fig.subplots(1, 3 if accuracy else 2)
    ax_time, ax_mem = axes[0], axes[1]
    seqs = sorted({c.seq for c in report.cases})
    skipped: dict[tuple, list[str]] = {}  # (backend, status, reason) -> lowerings
    markers = "osD^v<>ph*"
    for i, (name, cases) in enumerate(sorted(lines.items())):
        ok = sorted((c for c in cases if c.status == "ok"), key=lambda c: c.seq)
        if not ok:
            reason = next((c.reason for c in cases if c.reason), "no case ran")
            skipped.setdefault((cases[0].backend, cases[0].status, reason), []).append(cases[0].attention)
            continue
        style: dict[str, Any] = {"marker": markers[i % len(markers)], "linewidth": 1.6, "markersize": 5, "label": name}
        x = [c.seq for c in ok]
        ax_time.plot(x, [c.median_ms for c in ok], **style)
        mem = [(c.seq, c.peak_mem_mb) for c in ok if c.peak_mem_mb]
        if mem:
            ax_mem.plot([m[0] for m in mem], [m[1] for m in mem], **style)
        if accuracy:
            _frontier_points(axes[2], [c for c in ok if c.rel_rms], style)
    for ax, ylabel in ((ax_time, "latency, median (ms)"), (ax_mem, "peak memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if seqs:
            ax.xaxis.set_major_locator(FixedLocator(seqs))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        for axis in (ax.yaxis,):  # plain numbers (200, 0.05), not 2x10^2
            axis.set_major_formatter(_Plain(labelOnlyBase=False))
            axis.set_minor_formatter(_Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
        if ax.get_lines():
            ax.legend(fontsize=9)
        else:
            ax.text(0.5, 0.5, "no measured case", ha="center", va="center", transform=ax.transAxes)
    if accuracy:
        _frontier_axes(axes[2], _Plain)
    ax_time.set_title("latency per call")
    ax_mem.set_title(_memory_title(report))
    fig.suptitle(_title(report), fontsize=11)
    if skipped:
        notes = [
            f"{backend} ({', '.join(lowerings)}): {status}, {_short(reason)}"
            for (backend, status, reason), lowerings in skipped.items()
        ]
        height = 0.035 * len(notes) + 0.01
        fig.text(0.01, 0.005, "\n".join(notes), fontsize=8, va="bottom", color="0.3")
        fig.get_layout_engine().set(rect=(0, height, 1, 1 - height))  # room for the notes below the axes
    ext = os.path.splitext(path)[1]
    with atomic_path(path, suffix=ext) as tmp:
        fig.savefig(tmp, dpi=120, format=ext.lstrip(".").lower() or "png")


def _plain_formatter() -> type:
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        """LogFormatter's choice of which ticks get a label, written as 0.1 and 200."""

        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    return Plain


def _short(text: str, limit: int = 110) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _memory_title(report: BenchReport) -> str:
    kinds = {c.mem_kind for c in report.cases if c.status == "ok" and c.mem_kind}
    if kinds and all("RSS" in k for k in kinds):
        return "peak memory (RSS of the case process)"
    return "peak memory (RSS on CPU, allocator peak on GPU)"


def _title(report: BenchReport) -> str:
    model = report.meta.get("model", {})
    cfg = model.get("config") or {}
    name = model.get("preset") or os.path.basename(model.get("model_path") or "") or "config"
    settings = report.meta.get("settings", {})
    machine = report.meta.get("machine", {})
    parts = [
        f"attnx bench: {name} (d_model {cfg.get('d_model')}, {cfg.get('n_heads')} heads)",
        f"batch {','.join(str(b) for b in settings.get('batches', []))}",
        f"{settings.get('threads')} threads",
        str(machine.get("cpu") or ""),
    ]
    peak = report.peak_gflops
    if peak:
        parts.append(f"fp32 GEMM peak {peak:.0f} GFLOP/s")
    if report.interrupted:
        parts.append("INTERRUPTED: partial")
    return " | ".join(p for p in parts if p)


# The speed-accuracy frontier (issue 12) ---------------------------------------------------------------
def _frontier_points(ax: Any, cases: list[BenchCase], style: dict[str, Any]) -> None:
    """One form's cases as (rel RMS error, median ms), each point labelled with its seq."""
    if not cases:
        return
    ax.plot([c.rel_rms for c in cases], [c.median_ms for c in cases], linestyle=":", **style)
    for c in cases:
        ax.annotate(str(c.seq), (c.rel_rms, c.median_ms), fontsize=7, xytext=(3, 3), textcoords="offset points")


def _frontier_axes(ax: Any, plain: Any) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rel RMS error vs the float64 module")
    ax.set_ylabel("latency, median (ms)")
    ax.yaxis.set_major_formatter(plain(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    ax.set_title("speed-accuracy frontier (points: seq)")
    if ax.get_lines():
        ax.legend(fontsize=8)
