"""The prefill of 512 of run.py's four models, interleaved run by run: the point where run.py's rounds (each model's
runs back to back, the lowest of the rounds' medians) could not tell the four apart on a noisy host.

Each iteration runs one prefill of each model, in an order shuffled per iteration (seeded), so that a slow stretch
of the host falls on every model alike; each peer's time is set against attnx's of the same iteration. Reported: each
model's median and quartiles, and each peer / attnx ratio's median over the iterations with a bootstrap 95%
interval (over 1: attnx is faster). The rule, fixed before the run: attnx is at least as fast as a peer where its
median is at most the peer's; the ratio's interval says whether the difference is more than the host's noise.

    python measurements/optimize_speed/prefill_interleaved.py [--work DIR] [--iterations 60] [--json OUT]

It reads the models run.py made under --work (run run.py first); it builds nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnx._io import write_json_atomic

HERE = Path(__file__).resolve().parent


def interleave(models: dict, fed: dict[str, dict[str, np.ndarray]], iterations: int,
               progress: Callable[[int], None] = lambda _done: None) -> dict[str, list[float]]:  # fmt: skip
    """Each session's run times (ms) over `iterations` iterations, one run of every session in each, in an order
    shuffled per iteration (random.Random(0)); progress(iterations done) after each."""
    order, shuffle = list(models), random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(iterations):
        shuffle.shuffle(order)
        for name in order:
            start = time.perf_counter()
            models[name].run(None, fed[name])
            times[name].append((time.perf_counter() - start) * 1e3)
        progress(i + 1)
    return times


def ratio_ci(ratio: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """(median, 2.5th, 97.5th percentile) of the per-iteration ratios: the median and its bootstrap 95% interval
    (2000 resamples of the iterations)."""
    boot = [float(np.median(rng.choice(ratio, ratio.size))) for _ in range(2000)]
    low, high = np.percentile(boot, [2.5, 97.5])
    return float(np.median(ratio)), float(low), float(high)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/attnx-optimize-speed")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--json", default=None)
    p.add_argument("--no-spin", action="store_true",
                   help="the sessions' pools wait without spinning (session.intra_op.allow_spinning 0): the four "
                        "sessions take turns in one process, and a pool left spinning takes the cores from the next")
    args = p.parse_args()
    import onnxruntime as ort

    sys.path.insert(0, str(HERE))
    import run  # run.py's models, sessions and feeds

    work = Path(args.work)
    paths = run.model_paths(work)
    missing = [str(path) for path in paths.values() if not path.exists()]
    if missing:
        raise SystemExit(f"no model at {', '.join(missing)}: run measurements/optimize_speed/run.py first")
    config = json.loads((work / "checkpoint" / "config.json").read_text())
    tokens, past, _ = run.CASES["prefill 512"]
    feeds = run.case_feeds(config, tokens, past)
    models = {name: run.session(path, spin=not args.no_spin) for name, path in paths.items()}
    fed = {name: {k: v for k, v in feeds.items() if k in {i.name for i in s.get_inputs()}} for name, s in models.items()}
    for _ in range(2):  # warm-up
        for name, s in models.items():
            s.run(None, fed[name])
    load = [os.getloadavg()[0]]

    def progress(done: int) -> None:
        if done % 10 == 0:
            load.append(os.getloadavg()[0])
            print(f"{done} of {args.iterations} iterations (load average {load[-1]:.2f})", flush=True)

    times = interleave(models, fed, args.iterations, progress)
    rng = np.random.default_rng(0)
    attnx = np.array(times[run.ATTNX])
    result = {
        "cpu": run.cpu(), "date": datetime.date.today().isoformat(), "threads": 2, "spinning": not args.no_spin, "batch": 1, "case": "prefill 512",
        "command": "python measurements/optimize_speed/prefill_interleaved.py " + " ".join(sys.argv[1:]),
        "versions": {"onnxruntime": ort.__version__, "numpy": importlib.metadata.version("numpy"),
                     "python": platform.python_version()},
        "method": f"{args.iterations} iterations after 2 warm-up runs of each model; in each, one prefill of every "
                  "model in an order shuffled per iteration (random.Random(0)); ratio = peer / attnx of the same "
                  "iteration, its median with a bootstrap 95% interval (2000 resamples of the iterations)",
        "models": {name: {"path": str(path), "attention ops": run.attention_ops(path),
                          "built": json.loads((path.parent / "built.json").read_text())
                          if (path.parent / "built.json").exists() else None} for name, path in paths.items()},
        "load_average": [round(x, 2) for x in load],
        "ms": times, "median_ms": {}, "quartiles_ms": {}, "ratio_vs_attnx": {}, "targets": {},
    }  # fmt: skip
    print(f"{result['cpu']['model']}, 2 threads, batch 1, prefill 512, {args.iterations} interleaved iterations")
    for name, values in times.items():
        q1, med, q3 = np.percentile(values, [25, 50, 75])
        result["median_ms"][name], result["quartiles_ms"][name] = float(med), [float(q1), float(q3)]
        line = f"{name:28} median {med:7.1f} ms (quartiles {q1:.1f}-{q3:.1f})"
        if name != run.ATTNX:
            ratio, low, high = ratio_ci(np.array(values) / attnx, rng)
            result["ratio_vs_attnx"][name] = {"median": ratio, "ci95": [low, high]}
            met = bool(np.median(attnx) <= med)
            result["targets"][f"attnx at least as fast as {name}"] = met
            line += f"; {name.split()[0]} / attnx {ratio:.3f} (95% {low:.3f}-{high:.3f}): " + (
                "met" if met else "NOT met")
        print(line)
    if args.json:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
