"""The GPU check: parity and benchmark of the GPU backends, on any CUDA machine, into one folder.

    python -m attnx.bench.gpu_check --out DIR [--backends ort-cuda,torch-cuda] [--presets large,gpt3]
                                    [--seqs 512,...] [--quick]

Nothing here is new machinery: it is `attnx parity` and `attnx bench` over a fixed matrix.

1. environment: the machine (CPU, GPU, versions) and why each backend can or cannot run here
   (each backend's own probe: a real session and a real allocation, never
   get_available_providers()).
2. parity: the `--parity-preset` model (large: d_model 1024, 16 heads), plain and causal, in
   each dtype, through each ONNX Runtime backend with every lowering `attnx bench` times by
   default (decomposed, onnx, ort-fused) and through each torch backend, against the float64
   reference (attnx.runtimes.parity: the one comparator and the tolerance table).
3. decode: the step model of `--decode-preset` (large-gqa: 16 query heads on 4 key/value heads)
   with rope, in each dtype (float16: what GroupQueryAttention takes on a GPU), ort-fused:
   step-by-step parity of its growing form on every backend (the torch ones run the module) and
   of its buffer form (one cache bound in place, IOBinding) with each core that takes the dtype
   (attnx.model.cores.BUFFER_CORES; one that refuses it is a skipped run with the reason) on each ONNX
   Runtime backend; prefill 0, 1 and 37 then 64 steps (attnx.runtimes.decode).
4. bench: for each preset, the sweep of `attnx bench` (each case in a process of its own,
   inputs and outputs on the device, each call timed to its end): ort-fused on the ONNX
   Runtime backends against SDPA on the torch backends, in float16, batch 1, with a GEMM of
   the model's projection size as the roofline.

DIR gets gpu_check.json (rewritten after every step and parity run: a run cut short keeps what
it measured) and bench-<preset>.json per preset. Exit status 0 when every parity run passed and
every benchmark case ran, 1 otherwise (a run where nothing could run is not a pass), 2 on bad
usage. The GPU tests are `pytest -m cuda` from a checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import onnx

from attnx._io import write_json_atomic
from attnx.bench._plan import BenchPlan
from attnx.bench._sweep import machine_info, run_bench
from attnx.errors import AttnxError
from attnx.export import build_step_model
from attnx.model import PRESETS, init_weights, preset
from attnx.model.contract import (
    BENCH_ORT_LOWERINGS,
    BUFFER_CORES,
    DEFAULT_BUFFER_CORE,
    MODEL_DTYPES,
    PROVIDERS,
    QUANTIZED_DTYPES,
    backend_device,
    core_for,
    provider_of_backend,
)
from attnx.model.cores import LOWERING_OF_CORE, why_not_on_cuda
from attnx.runtimes import ModelSource
from attnx.runtimes.base import backend_unavailable_reason
from attnx.runtimes.decode import DEFAULT_PREFILLS, DEFAULT_STEPS, run_buffer_parity, run_decode_parity
from attnx.runtimes.parity import run_parity
from attnx.workflows import export_model

__all__ = ["SCHEMA", "GPU_CHECK_BACKENDS", "DEFAULT_PRESETS", "DEFAULT_SEQS", "parse_args", "main"]

logger = logging.getLogger("attnx.bench.gpu_check")  # its own name when run with -m as well

SCHEMA = "attnx.gpu_check/2"
# The backends gpu_check measures unless told (--backends).
GPU_CHECK_BACKENDS = (PROVIDERS["cuda"].backend, PROVIDERS["cuda"].torch_backend)
# Any backend that runs on a device can be checked (ort-cpu and torch run the same matrix on CPU).
DEVICE_BACKENDS = tuple(b for p in PROVIDERS.values() for b in (p.backend, p.torch_backend))
DEFAULT_PRESETS = ("large", "gpt3")
DEFAULT_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQS = (512, 2048)
PARITY_SEQS = (1, 7, 128, 515)
PARITY_BATCHES = (2,)
# What the benchmark times: ONNX Runtime's fused kernel against torch's, in half precision.
BENCH_LOWERINGS = ("ort-fused", "sdpa")
BENCH_DTYPE = "fp16"


STEPS = ("parity", "decode", "bench")
# The decode step's model: rope on the preset's step model (what every decoder deployed now has).
DECODE_ROPE = {"theta": 10000.0}
# The float dtypes the GPU check covers (the quantized forms are CPU forms: issue 12).
GPU_DTYPES = tuple(d for d in MODEL_DTYPES if d not in QUANTIZED_DTYPES)

def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnx.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the results (created if missing)")
    p.add_argument("--backends", type=_names, default=GPU_CHECK_BACKENDS, help=f"default {','.join(GPU_CHECK_BACKENDS)}")
    p.add_argument("--presets", type=_names, default=DEFAULT_PRESETS, help="benchmark presets (default large,gpt3)")
    p.add_argument("--seqs", type=_positive_ints, default=None, help="benchmark sequence lengths (default 512..16384)")
    p.add_argument("--quick", action="store_true", help=f"benchmark seq {','.join(map(str, QUICK_SEQS))} only")
    p.add_argument("--parity-preset", default="large", help="the model of the parity matrix (default large)")
    p.add_argument("--parity-seqs", type=_positive_ints, default=PARITY_SEQS, help="default 1,7,128,515")
    p.add_argument("--dtypes", type=_names, default=GPU_DTYPES, help="parity dtypes (default fp32,fp16)")
    p.add_argument("--decode-preset", default="large-gqa", help="the step model of the decode step (default large-gqa)")
    p.add_argument("--steps", type=_names, default=STEPS, help=f"any of {', '.join(STEPS)} (default all)")
    p.add_argument("--repeat", type=int, default=10, help="timed calls per benchmark case (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds per benchmark case")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    known = {"backends": set(DEVICE_BACKENDS), "presets": set(PRESETS), "dtypes": set(GPU_DTYPES),
             "steps": set(STEPS)}  # fmt: skip
    for key, values in (("backends", args.backends), ("presets", args.presets), ("dtypes", args.dtypes),
                        ("steps", args.steps)):  # fmt: skip
        bad = [v for v in values if v not in known[key]]
        if bad or not values:
            parser.error(f"--{key}: unknown {bad[0]!r} (known: {', '.join(sorted(known[key]))})" if bad else f"--{key} is empty")
    for flag, name in (("--parity-preset", args.parity_preset), ("--decode-preset", args.decode_preset)):
        if name not in PRESETS:
            parser.error(f"{flag}: unknown {name!r} (known: {', '.join(PRESETS)})")
    if args.repeat < 1 or args.warmup < 0 or not args.timeout > 0:
        parser.error("--repeat must be at least 1, --warmup at least 0 and --timeout positive")
    if args.seqs is None:
        args.seqs = QUICK_SEQS if args.quick else DEFAULT_SEQS
    return args


class Results:
    """gpu_check.json in the output folder, rewritten (atomically) after every step and run."""

    def __init__(self, out: str) -> None:
        self.path = os.path.join(out, "gpu_check.json")
        self.data: dict[str, Any] = {"schema": SCHEMA, "steps": {}}

    def save(self) -> None:
        write_json_atomic(self.path, self.data)


def run_parity_matrix(args: argparse.Namespace, usable: list[str], results: Results) -> dict[str, Any]:
    """Each (plain, causal) model x dtype: every usable torch backend on the module, every usable
    ONNX Runtime backend on each lowering, against the float64 reference."""
    step: dict[str, Any] = {"status": "running", "preset": args.parity_preset, "seqs": list(args.parity_seqs),
                            "batches": list(PARITY_BATCHES), "runs": []}  # fmt: skip
    results.data["steps"]["parity"] = step
    ort = [b for b in usable if provider_of_backend(b) is not None]
    torches = [b for b in usable if b not in ort]
    base = preset(args.parity_preset)
    with tempfile.TemporaryDirectory(prefix="attnx-gpu-parity-") as tmp:
        for name, config in ((args.parity_preset, base), (f"{args.parity_preset}-causal", dataclasses.replace(base, causal=True))):
            weights = init_weights(config, seed=0)
            for dtype in args.dtypes:
                if torches:
                    _parity_run(step, results, name, "module", dtype, ModelSource(config, weights, None, dtype), torches)
                for lowering in BENCH_ORT_LOWERINGS if ort else ():
                    path = os.path.join(tmp, f"{name}-{lowering}-{dtype}.onnx")
                    try:
                        export_model(config, path, weights, attention=lowering, dtype=dtype, validate=False)
                    except AttnxError as e:  # an export failure is a result of this matrix
                        step["runs"].append({"model": name, "lowering": lowering, "dtype": dtype, "backends": ort,
                                             "status": "failed", "reason": f"export: {e}"})  # fmt: skip
                        results.save()
                        continue
                    _parity_run(step, results, name, lowering, dtype, ModelSource(config, weights, path, dtype), ort)
                    os.remove(path)
    runs = step["runs"]
    step["passed"] = bool(runs) and all(r["status"] == "done" and r["passed"] for r in runs)
    step["status"] = "done"
    return step


def _parity_run(step: dict, results: Results, name: str, lowering: str, dtype: str, source: ModelSource,
                backends: list[str]) -> None:  # fmt: skip
    logger.info("parity %s %s %s on %s", name, lowering, dtype, ",".join(backends))
    entry: dict[str, Any] = {"model": name, "lowering": lowering, "dtype": dtype, "backends": backends}
    start = time.monotonic()
    report = run_parity(source, backends, batches=PARITY_BATCHES, seqs=step["seqs"])
    entry.update(status="done", passed=report.passed, seconds=time.monotonic() - start, report=report.to_dict())
    step["runs"].append(entry)
    results.save()


def run_decode_matrix(args: argparse.Namespace, usable: list[str], results: Results) -> dict[str, Any]:
    """The step model of --decode-preset with rope, ort-fused, in each dtype: its growing form step by step
    on every usable backend (left-padded batch 3), its buffer form on each ONNX Runtime backend (batch 2,
    no padding: the form has none), against the float64 reference's full forward."""
    step: dict[str, Any] = {"status": "running", "preset": args.decode_preset, "prefills": list(DEFAULT_PREFILLS),
                            "steps": DEFAULT_STEPS, "runs": []}  # fmt: skip
    results.data["steps"]["decode"] = step
    ort = [b for b in usable if provider_of_backend(b) is not None]
    base = dataclasses.replace(preset(args.decode_preset), kv_cache=True, causal=True, cross=False, rope=DECODE_ROPE)
    with tempfile.TemporaryDirectory(prefix="attnx-gpu-decode-") as tmp:
        for form, backends, padded in (("growing", usable, True), ("buffer", ort, False)):
            config = type(base).from_dict({**base.to_dict(), "key_padding_mask": padded})
            weights = init_weights(config, seed=0)
            cores = BUFFER_CORES if form == "buffer" else (DEFAULT_BUFFER_CORE,)
            for dtype, core in [(d, c) for d in args.dtypes for c in cores] if backends else ():
                writer = LOWERING_OF_CORE[core] if form == "buffer" else "ort-fused"  # the lowering of the core
                lowering = f"{writer} {form}" + ("" if core in (DEFAULT_BUFFER_CORE, writer) else f" {core}")  # default unnamed
                entry: dict[str, Any] = {"model": f"{args.decode_preset}-rope", "lowering": lowering,
                                         "dtype": dtype, "backends": backends}  # fmt: skip
                try:
                    chosen = core_for(writer, config, dtype, form, core if form == "buffer" else None)
                except AttnxError as e:  # this core does not take this dtype (the grouped ones: no fp16)
                    entry.update(status="skipped", reason=str(e))
                    step["runs"].append(entry)
                    continue
                # a core whose CUDA kernel refuses the run (why_not_on_cuda: measured) runs on the other backends
                why_cuda = "; ".join(why_not_on_cuda(chosen, config, dtype, form))
                refused = {b: why_cuda for b in backends
                           if why_cuda and provider_of_backend(b) is not None and backend_device(b) == "cuda"}  # fmt: skip
                run_on = [b for b in backends if b not in refused]
                if refused:
                    entry.update(backends=run_on, refused=refused)
                if not run_on:
                    entry.update(status="skipped", reason="; ".join(f"{b}: {r}" for b, r in refused.items()))
                    step["runs"].append(entry)
                    continue
                logger.info("decode parity %s %s on %s", lowering, dtype, ",".join(backends))
                start = time.monotonic()
                try:
                    path = os.path.join(tmp, f"{form}-{core}-{dtype}.onnx")
                    buffer_core = core if form == "buffer" else None
                    onnx.save(build_step_model(config, weights, writer, form, dtype, buffer_core=buffer_core), path)
                    source = ModelSource(config, weights, path, dtype)
                    if form == "growing":
                        reports = [run_decode_parity(source, run_on, batch=3, localise="off")]
                    else:
                        reports = [run_buffer_parity(source, b) for b in run_on]
                except AttnxError as e:  # a model that cannot be built or run here is a result of this matrix
                    entry.update(status="failed", reason=str(e))
                else:
                    cases = [c.to_dict() for r in reports for c in r.cases]
                    entry.update(status="done", passed=all(r.passed for r in reports), report={"cases": cases})
                entry["seconds"] = time.monotonic() - start
                step["runs"].append(entry)
                results.save()
    runs = step["runs"]
    step["passed"] = any(r["status"] == "done" for r in runs) and all(
        r["status"] == "skipped" or (r["status"] == "done" and r["passed"]) for r in runs)  # fmt: skip
    step["status"] = "done"
    return step


def run_benchmarks(args: argparse.Namespace, usable: list[str], results: Results) -> dict[str, Any]:
    """`attnx bench`'s sweep per preset: ort-fused on ONNX Runtime, SDPA on torch, float16."""
    step: dict[str, Any] = {"status": "running", "dtype": BENCH_DTYPE, "lowerings": list(BENCH_LOWERINGS),
                            "presets": {}}  # fmt: skip
    results.data["steps"]["bench"] = step
    for name in args.presets:
        plan = BenchPlan(
            config=preset(name), backends=usable, attentions=BENCH_LOWERINGS, seqs=args.seqs, dtypes=(BENCH_DTYPE,),
            repeat=args.repeat, warmup=args.warmup, timeout_s=args.timeout, preset=name,
        )  # fmt: skip
        path = os.path.join(args.out, f"bench-{name}.json")
        logger.info("bench %s: %s", name, ", ".join(f"{b}/{a}" for b, a in plan.series()))
        report = run_bench(plan, json_path=path, meta={"command": "attnx.bench.gpu_check"})
        counts = {s: sum(c.status == s for c in report.cases) for s in ("ok", "failed", "timeout", "skipped")}
        step["presets"][name] = {"file": os.path.basename(path), "cases": counts, "ratios": report.ratios(),
                                 "interrupted": report.interrupted}  # fmt: skip
        results.save()
        if report.interrupted:
            raise KeyboardInterrupt
    presets = step["presets"].values()
    step["passed"] = all(p["cases"]["ok"] > 0 and not p["cases"]["failed"] + p["cases"]["timeout"] for p in presets)
    step["status"] = "done"
    return step


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logger.setLevel(logging.INFO)  # this script's progress; the layers below keep to warnings
    os.makedirs(args.out, exist_ok=True)
    results = Results(args.out)
    results.data.update(started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        argv=list(sys.argv[1:] if argv is None else argv), machine=machine_info())  # fmt: skip
    unavailable = {b: backend_unavailable_reason(b) for b in args.backends}
    results.data["unavailable"] = unavailable
    for backend, reason in unavailable.items():
        logger.info("%s: %s", backend, "available" if reason is None else reason)
    usable = [b for b, reason in unavailable.items() if reason is None]
    results.save()
    ok = bool(usable)
    for name, run in (("parity", run_parity_matrix), ("decode", run_decode_matrix), ("bench", run_benchmarks)):
        if name not in args.steps:
            continue
        if not usable:
            results.data["steps"][name] = {"status": "skipped", "reason": "; ".join(f"{b}: {r}" for b, r in unavailable.items())}
            continue
        try:
            step = run(args, usable, results)
        except KeyboardInterrupt:
            results.data["steps"].setdefault(name, {})["status"] = "interrupted"
            results.save()
            print(f"interrupted: kept what was measured in {args.out}", file=sys.stderr)
            return 130
        ok &= bool(step.get("passed"))
        results.save()
    results.data.update(finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), passed=ok)
    results.save()
    _print_summary(results.data)
    print(f"results: {results.path}")
    return 0 if ok else 1


def _print_summary(data: dict[str, Any]) -> None:
    for backend, reason in data.get("unavailable", {}).items():
        print(f"{backend}: {'available' if reason is None else reason}")
    steps = data.get("steps", {})
    for name in ("parity", "decode"):
        par = steps.get(name)
        if not par:
            continue
        print(f"{name}: {par.get('status')} passed={par.get('passed')} {par.get('reason') or ''}".rstrip())
        for run in par.get("runs", []):
            verdict = "" if run.get("passed") is None else ("PASS" if run["passed"] else "FAIL")
            print(f"  {run['model']:14s} {run['lowering']:10s} {run['dtype']} {','.join(run['backends'])}: "
                  f"{run['status']} {verdict} {run.get('reason') or ''}".rstrip())  # fmt: skip
    bench = steps.get("bench")
    if bench:
        print(f"bench: {bench.get('status')} passed={bench.get('passed')} {bench.get('reason') or ''}".rstrip())
        for name, p in bench.get("presets", {}).items():
            print(f"  {name}: {p['cases']} ({p['file']})")
            for r in p["ratios"]:
                print(f"    seq {r['seq']}: {r['baseline']} / {r['target']}: {r['speedup']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
