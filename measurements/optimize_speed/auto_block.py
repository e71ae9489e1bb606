"""One attention block of run.py's Llama-shaped model in the growing form, written by three cores: grouped-mha (what
attnx optimize writes today), gqa, and auto (an If: GroupQueryAttention with no bias for a prompt with no padding,
the grouped core otherwise), timed interleaved at a prompt of 512 and at a step after 2048.

    python measurements/optimize_speed/auto_block.py [--iterations 40] [--json OUT]

The block: hidden 1024, 16 heads of 64 on 4 key/value heads, rope, causal, the padding mask as an input (none of it
padded), no biases, random weights (seed 1); batch 1, 2 intra-op threads that do not spin, the CPU provider. Each iteration runs each
core once in a shuffled order (seeded); the step runs 8x the prompt's iterations. Reported: each core's median and
its ratio to grouped-mha's of the same iteration (median, bootstrap 95% interval).
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from pathlib import Path

import numpy as np

from attnx._io import write_json_atomic

HERE = Path(__file__).resolve().parent
CORES = ("grouped-mha", "switch", "gqa")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import onnxruntime as ort

    from attnx.export import build_model
    from attnx.model import AttentionConfig, init_weights
    from attnx.model.rope import Rope

    sys.path.insert(0, str(HERE))
    import run  # run.py's cpu()

    c = AttentionConfig(d_model=1024, n_heads=16, n_kv_heads=4, head_dim=64, causal=True, kv_cache=True, bias=False,
                        key_padding_mask=True, rope=Rope(theta=10000.0, dim=64))  # fmt: skip
    w = init_weights(c, seed=1)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    # three sessions in one process, run in turn: a pool left spinning after its run takes the cores from the next
    # session's (a step of about 1 ms moved by 0.7-1.5x between runs with spinning on)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = {core: ort.InferenceSession(build_model(c, w, "ort-fused", "growing", core=core).SerializeToString(),
                                           options, providers=["CPUExecutionProvider"]) for core in CORES}  # fmt: skip
    rng = np.random.default_rng(0)
    result = {"cpu": run.cpu(), "date": datetime.date.today().isoformat(), "threads": 2, "batch": 1,
              "command": "python measurements/optimize_speed/auto_block.py " + " ".join(sys.argv[1:]),
              "versions": {"onnxruntime": ort.__version__}, "cases": {}}  # fmt: skip
    for case, (tokens, past, iterations) in {"prefill 512": (512, 0, args.iterations),
                                             "step at past 2048": (1, 2048, 8 * args.iterations)}.items():
        feeds = {"x": rng.standard_normal((1, tokens, 1024)).astype(np.float32),
                 "past_key": rng.standard_normal((1, 4, past, 64)).astype(np.float32),
                 "past_value": rng.standard_normal((1, 4, past, 64)).astype(np.float32),
                 "key_padding_mask": np.zeros((1, past + tokens), bool),
                 "position_ids": np.arange(past, past + tokens)[None].astype(np.int64)}  # fmt: skip
        for session in sessions.values():
            for _ in range(2):
                session.run(None, feeds)
        times: dict[str, list[float]] = {core: [] for core in CORES}
        order, shuffle = list(CORES), random.Random(0)
        for _ in range(iterations):
            shuffle.shuffle(order)
            for core in order:
                start = time.perf_counter()
                sessions[core].run(None, feeds)
                times[core].append((time.perf_counter() - start) * 1e3)
        base = np.array(times["grouped-mha"])
        out = result["cases"][case] = {"iterations": iterations, "median_ms": {}, "vs_grouped_mha": {}}
        for core, values in times.items():
            ratio = np.array(values) / base
            boot = [float(np.median(rng.choice(ratio, ratio.size))) for _ in range(2000)]
            out["median_ms"][core] = float(np.median(values))
            out["vs_grouped_mha"][core] = {"median": float(np.median(ratio)),
                                           "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]}
        print(case + ": " + ", ".join(f"{core} {out['median_ms'][core]:.3f} ms ({out['vs_grouped_mha'][core]['median']:.3f}"
                                      f" of grouped-mha)" for core in CORES))  # fmt: skip
    if args.json:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
