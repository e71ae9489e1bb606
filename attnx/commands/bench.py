"""attnx bench: latency, throughput, roofline ratio and peak memory, backend by backend."""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import time
from typing import IO, Any

from attnx._io import check_output_file, not_a_file, write_json_atomic
from attnx._text import format_table
from attnx.bench import (
    BENCH_BACKENDS,
    DECODE_DTYPES,
    DEFAULT_SEQS,
    BenchPlan,
    check_plot_path,
    decode_impls,
    machine_info,
    plot_report,
    run_bench,
    run_decode_bench,
)
from attnx.commands import COMMANDS
from attnx.commands._common import (
    SEED_MAX,
    float_arg,
    int_arg,
    int_list,
    load_config_arg,
    model_flag,
    step_config,
    str_list,
)
from attnx.errors import UsageError
from attnx.model import PRESETS
from attnx.model.contract import (
    BENCH_ORT_LOWERINGS,
    EXPORT_ATTENTIONS,
    MODEL_DTYPES,
    RUNTIME_DTYPES,
    TORCH_CORES,
    model_form,
)
from attnx.model.resources import check_memory, estimate_decode_bench
from attnx.runtimes.base import backend_unavailable_reason

__all__ = ["add_parser", "run", "ProgressBar", "report_table", "format_report"]

HELP = COMMANDS["bench"].help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help=HELP,
        description=HELP + ". Each case runs in a process of its own, after warm-up; the roofline ratio "
        "is a case's GFLOP/s over a GEMM of the model's projection size measured through the same runtime.",
    )
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--preset", help=f"a preset: {', '.join(PRESETS)}")
    group.add_argument("--config", metavar="C.json", help="an AttentionConfig JSON file")
    group.add_argument("--model", metavar="M.onnx", help="bench this attnx ONNX file on the ort-* backends")
    p.add_argument("--weights", metavar="W.safetensors", help="weights (default: seeded, see --seed)")
    p.add_argument("--seed", type=int_arg(0, SEED_MAX), default=0, help="seed of the generated weights (default 0)")
    p.add_argument(
        "--backends", type=str_list, default=list(BENCH_BACKENDS), help=f"default {','.join(BENCH_BACKENDS)}"
    )
    p.add_argument(
        "--attention",
        type=str_list,
        default=None,
        help=f"lowerings to time, each where its backend has it: torch {','.join(TORCH_CORES)}; ort-* "
        f"{','.join(EXPORT_ATTENTIONS)} (default: {','.join(TORCH_CORES)} and {','.join(BENCH_ORT_LOWERINGS)})",
    )
    p.add_argument("--batch", type=int_list, default=[1], help="default 1; with --decode one number: the rows a step")
    p.add_argument(
        "--seq", type=int_list, default=list(DEFAULT_SEQS), help=f"default {','.join(map(str, DEFAULT_SEQS))}"
    )
    p.add_argument("--mem-seq", type=int_list, default=None, help="memory lengths for cross-attention (default: = seq)")
    p.add_argument(
        "--dtype",
        type=str_list,
        default=None,
        help=f"{', '.join((*MODEL_DTYPES, *RUNTIME_DTYPES))} (default fp32, or the --model's; bf16: torch in bfloat16 "
        "and openvino's bf16 hint on the fp32 graph)",
    )
    p.add_argument("--repeat", type=int_arg(1, 100_000), default=10, help="timed calls per case (default 10)")
    p.add_argument("--warmup", type=int_arg(0, 10_000), default=2, help="untimed calls before them (default 2)")
    p.add_argument("--rounds", type=int_arg(1, 100), default=None,
                   help="time each shape's cases this many times, the order rotated between rounds, and keep each "
                        "case's lowest median: a shared machine's slow spells then fall on no one form "
                        "(default 1; --decode: 3)")  # fmt: skip
    p.add_argument(
        # None: the cores of the machine that runs the bench (_threads), not of the one that made the parser
        "--threads", type=int_arg(1, 4096), default=None, help="ORT intra-op and torch threads (default: all cores)"
    )
    p.add_argument(
        "--timeout", type=float_arg(0.0, 7 * 24 * 3600.0), default=600.0, metavar="S", help="time budget per case in seconds (default 600)"
    )
    p.add_argument(
        "--max-mem-gb", type=float_arg(0.0), default=None, help="skip cases estimated to need more (default: memory available)"
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON, rewritten after every case")
    p.add_argument("--plot", metavar="FILE.png", help="plot latency and peak memory against seq (needs matplotlib)")
    p.add_argument("--decode", action="store_true",
                   help="time the per-token step of the step model (batch 1, fp32; --dtype fp32,int8,int4 adds the "
                   "quantized step models) at each --past against the "
                   "memory-bandwidth bound, with torch's growing-cache and static-cache steps as the peers and OpenVINO on the onnx step model (docs/how-to/benchmark.md)")  # fmt: skip
    p.add_argument("--past", type=int_list, default=[128, 2048, 8192], help="with --decode (default 128,2048,8192)")
    p.add_argument("--kv-heads", type=int_arg(1, 1 << 20), default=None,
                   help="with --decode: n_kv_heads of the step model (default: the config's)")  # fmt: skip
    p.set_defaults(run=run)


def _threads(args: argparse.Namespace) -> int:
    """--threads, or every core of this machine."""
    return args.threads if args.threads is not None else os.cpu_count() or 1


def run_decode(args: argparse.Namespace) -> int:
    """attnx bench --decode: one process, every number of a row measured in the same run."""
    if args.model:
        raise UsageError("--decode builds its step models from --preset or --config")
    config = step_config(load_config_arg(args), model_flag(args), as_decoder=True, kv_heads=args.kv_heads)
    dtypes = args.dtype or ["fp32"]
    for dtype in dtypes:
        if dtype not in DECODE_DTYPES:
            raise UsageError(
                f"--decode --dtype {dtype}: the step model's weights are one of {', '.join(DECODE_DTYPES)}"
            )
    if "fp32" not in dtypes:
        raise UsageError("--decode --dtype must include fp32: the quantized steps are compared with it and torch's")
    if len(args.batch) != 1 or args.batch[0] < 1:
        raise UsageError(f"--decode --batch takes one number of rows, 1 or more (got {','.join(map(str, args.batch))})")
    batch = args.batch[0]
    impls = decode_impls(dtypes, openvino=backend_unavailable_reason("openvino") is None)
    for impl in list(impls):  # an implementation whose core cannot express the config is left out, saying why
        if (why := impl.unavailable(config)) is not None:
            impls.remove(impl)
            print(f"  skipped {impl}: {why}", file=sys.stderr)
    check_memory(estimate_decode_bench(config, args.past, sessions=len(impls) - 1), args.max_mem_gb)
    rows = run_decode_bench(config, args.past, threads=_threads(args), repeat=args.repeat, seed=args.seed,
                            rounds=args.rounds or 3, impls=impls, batch=batch,
                            progress=lambda m: print(f"  {m}", file=sys.stderr))  # fmt: skip
    table = []
    for r in rows:
        for impl in impls:
            flushed, warm = r.times_ms[f"{impl.label} flushed"], r.times_ms[f"{impl.label} warm"]
            nbytes, bound = r.bound_for(impl)
            table.append((r.past, impl.label, f"{flushed:.3f}", f"{warm:.3f}", f"{nbytes / 1e6:.1f}", f"{bound:.3f}",
                          f"{flushed / bound:.2f}", *(_peer_ratio(r, peer, flushed) for peer in ("eager", "static"))))
    machine = machine_info()
    print(f"decode step: d_model {config.d_model}, {config.n_heads} heads, {config.n_kv_heads} kv heads, batch {batch}, "
          f"{','.join(dtypes)}, {_threads(args)} threads, {machine['cpu']}; bandwidth {rows[0].bandwidth_gbs:.1f} GB/s (the best "
          f"large copy of this run: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[0].copies_gbs.items())
          + f"); flushed: a 256 MB read before each timed step; lowest median of {args.rounds or 3} rounds")  # fmt: skip
    headers = ["past", "step", "ms flushed", "ms warm", "MB/step", "bound ms", "x bound", "torch/this", "static/this"]
    print(format_table(headers, table))
    if args.json:
        write_json_atomic(args.json, {"config": config.to_dict(), "threads": _threads(args), "machine": machine,
                                      "rows": [r.to_dict() for r in rows]})  # fmt: skip
    return 0


def _peer_ratio(row: Any, peer: str, flushed: float) -> str:
    """A torch peer's time over this step's, or "-" where the peer did not run (a latent cache: DecodeImpl.unavailable)."""
    peer_ms = row.times_ms.get(f"torch {peer} flushed")
    return "-" if peer_ms is None else f"{peer_ms / flushed:.2f}"


def _plan(args: argparse.Namespace) -> Any:
    dtypes = args.dtype or ["fp32"]
    if args.model:
        if args.weights:
            raise UsageError("--weights does not go with --model: the model file holds its weights")
        if (why := not_a_file(args.model)) is not None:
            raise UsageError(f"--model {args.model!r} {why}")
        # The model describes itself: its config, dtype and lowering; a flag that contradicts them is an error.
        form = model_form(args.model)
        for dtype in args.dtype or []:
            form.agree(dtype=dtype)
        for lowering in args.attention or []:  # ort-* run the file's own lowering (sdpa is torch's alone)
            if lowering in EXPORT_ATTENTIONS:
                form.agree(lowering=lowering)
        config = form.config
        dtypes = args.dtype or [form.dtype]
    else:
        config = load_config_arg(args)
        if args.weights and (why := not_a_file(args.weights)) is not None:
            raise UsageError(f"--weights {args.weights!r} {why}")
    if config.kv_cache:
        raise UsageError("this is a step model ('kv_cache': true): its bench is the per-token step, attnx bench --decode")
    return BenchPlan(
        config=config,
        backends=args.backends,
        attentions=args.attention,
        batches=args.batch,
        seqs=args.seq,
        mem_seqs=args.mem_seq,
        dtypes=dtypes,
        repeat=args.repeat,
        warmup=args.warmup,
        rounds=args.rounds or 1,
        threads=_threads(args),
        timeout_s=args.timeout,
        max_mem_gb=args.max_mem_gb,
        weights_path=args.weights,
        seed=args.seed,
        model_path=args.model,
        preset=args.preset,
    )


class ProgressBar:
    """A bar redrawn in place on a terminal; one line per step when stderr is a file or a pipe."""

    def __init__(self, stream: IO[str] | None = None, width: int = 24) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.width = width
        self.start = time.perf_counter()
        self.drawn = False

    def __call__(self, done: int, total: int, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        if not self.tty:
            print(f"[{elapsed:7.1f}s] {done}/{total} {message}", file=self.stream, flush=True)
            return
        filled = self.width * done // total if total else self.width
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {elapsed:6.0f}s  {message}"
        columns = shutil.get_terminal_size((100, 20)).columns
        self.stream.write("\r\033[K" + line[: columns - 1])
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _num(value: float | None) -> float | int | None:
    """Big numbers as whole ones (12345, not 1.23e+04); small ones keep 3 significant digits."""
    if value is None:
        return None
    return int(round(value)) if abs(value) >= 1000 else value


def report_table(report: Any) -> str:
    """The cases as an aligned table. A series skipped at every shape for one reason (an
    unavailable backend, a lowering that does not export) is one row."""
    cross = any(c.mem_seq is not None for c in report.cases)
    headers = ["backend", "attention", "dtype", "batch", "seq"] + (["mem_seq"] if cross else [])
    headers += ["median_ms", "p10_ms", "p90_ms", "first_ms", "tokens/s", "GFLOP/s", "roofline", "peak_MB", "rel_rms"]
    headers += ["status"]
    series: dict[tuple, list[Any]] = {}
    for c in report.cases:
        series.setdefault((c.backend, c.attention, c.dtype), []).append(c)
    rows, skipped_rows = [], []
    for c in report.cases:
        same = series[(c.backend, c.attention, c.dtype)]
        if len(same) > 1 and all(s.status == "skipped" and s.reason == c.reason for s in same):
            if c is same[0]:  # one row for the series, after the measured ones
                skipped_rows.append([c.backend, c.attention, c.dtype] + [None] * (len(headers) - 4) + [c.status])
            continue
        rows.append(
            [c.backend, c.attention, c.dtype, c.batch, c.seq] + ([c.mem_seq] if cross else [])
            + [_num(v) for v in (c.median_ms, c.p10_ms, c.p90_ms, c.first_ms, c.tokens_per_s, c.gflops)]
            + [c.roofline, _num(c.peak_mem_mb), c.rel_rms, c.status]
        )  # fmt: skip
    rows += skipped_rows
    return format_table(headers, rows)


def _notes(report: Any) -> list[str]:
    lines = []
    for g in report.gemm:
        if g.status == "ok":
            lines.append(
                f"GEMM {g.m}x{g.k}x{g.n} {g.dtype} on {g.backend}: {g.gflops:.1f} GFLOP/s ({g.median_ms:.3g} ms)"
            )
        elif g.status != "skipped":
            lines.append(f"GEMM on {g.backend} ({g.dtype}) {g.status}: {g.reason} (no roofline for its cases)")
    # One line per reason: an unavailable backend is said once, not once per lowering.
    reasons: dict[tuple, list[Any]] = {}
    for c in report.cases:
        if c.status != "ok":
            reasons.setdefault((c.backend, c.status, c.reason), []).append(c)
    for (backend, status, reason), cases in reasons.items():
        lowerings = list(dict.fromkeys(c.attention for c in cases))
        where = f" at batch {cases[0].batch} seq {cases[0].seq}" if len(cases) == 1 else ""
        lines.append(f"{status} {backend}/{','.join(lowerings)}{where}: {reason}")
    for r in report.ratios():  # baseline over target: above 1, the target is faster or smaller
        base = r["baseline"] if r["baseline"] == r["baseline_case"] else f"{r['baseline']} ({r['baseline_case']})"
        first = f" (first call {r['first_call_speedup']:.2f}x)" if r.get("first_call_speedup") else ""
        memory = f", peak memory {r['memory_ratio']:.2f}x" if r["memory_ratio"] else ""
        lines.append(
            f"seq {r['seq']} batch {r['batch']} {r['dtype']}: {base} / {r['target']}: "
            f"time {r['speedup']:.2f}x{first}{memory}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    if args.json:
        check_output_file(args.json, "--json")
    if args.decode:
        return run_decode(args)
    if args.plot:
        check_plot_path(args.plot)  # before the sweep: a missing matplotlib is said now, not in an hour
    plan = _plan(args)
    bar = ProgressBar()
    try:
        report = run_bench(plan, json_path=args.json, progress=bar, meta={"command": "attnx " + " ".join(sys.argv[1:])})
    finally:
        bar.close()
    print(format_report(report))
    if args.plot:
        plot_report(report, args.plot)
    for path in filter(None, (args.json, args.plot)):
        print(f"wrote {path}")
    if report.interrupted:
        print(f"attnx bench: interrupted: kept {len(report.cases)} measured cases", file=sys.stderr)
        return 130
    failed = [c for c in report.cases if c.status == "failed"]
    if failed or not any(c.status == "ok" for c in report.cases):
        # One line that says why the exit is 1, whatever the statuses were (a check that ran and
        # failed says so on stdout: docs/reference/behaviour.md, "Exit codes and errors").
        counts = collections.Counter(c.status for c in report.cases)
        what = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        print(f"bench FAILED: {'a case failed' if failed else 'no case was measured'} ({what or 'no cases'})")
        return 1
    return 0


def format_report(report: Any) -> str:
    return "\n".join([report_table(report), "", *_notes(report), *frontier_lines(report)]).rstrip()


def frontier_lines(report: Any) -> list[str]:
    """issue 12: per shape, every measured form as (median ms, rel RMS error against the float64
    module), fastest first; * marks the speed-accuracy frontier (no other form is both faster and
    more accurate)."""
    groups: dict[tuple, list[Any]] = {}
    for c in report.cases:
        if c.status == "ok" and c.median_ms is not None and c.rel_rms is not None:
            groups.setdefault((c.batch, c.seq, c.mem_seq), []).append(c)
    lines: list[str] = []
    for (batch, seq, mem_seq), cases in groups.items():
        if len({c.dtype for c in cases}) < 2 and len(cases) < 2:
            continue
        lines += ["", f"frontier, batch {batch} seq {seq}" + (f" mem_seq {mem_seq}" if mem_seq else "") + ":"]
        rows = []
        for c in sorted(cases, key=lambda c: c.median_ms):
            dominated = any(o.median_ms < c.median_ms and o.rel_rms < c.rel_rms for o in cases)
            rows.append(["" if dominated else "*", f"{c.backend}/{c.attention}", c.dtype, c.median_ms, c.rel_rms])
        lines += format_table(["", "form", "dtype", "median_ms", "rel_rms"], rows).splitlines()
    return lines
