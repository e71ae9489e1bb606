"""MLA's decode step against its own memory bound, on this host's CPU (issue 52).

Two step models of one attention layer at DeepSeek-V3's attention sizes (128 heads, qk head 192 = nope 128 + rope 64
interleaved, v head 128, kv_lora_rank 512), attnx's decomposed core, growing form, fp32, batch 1, one new token:
**latent**, the absorbed step (export/_latent.py: past_latent [1, 1, T, 576]) and **expanded**, the same heads with
per-head keys and values (past_key [1, 128, T, 192], past_value [1, 128, T, 128]). d_model 1024 and q_lora_rank 256,
not 7168 and 1536: the projections' weights do not depend on T and, at full size, would add a fixed ~1 GB a step
that hides the cache's slope on a 2-core host; the attention over the cache is at full size.

Each length's step is timed `repeat` times (median) in each of `rounds` rounds, the two forms and the lengths in
rotated order; a length's time is the median of its rounds. The slope (ns a cached token) is the least-squares fit
over the lengths; the bound is the cache's bytes a token (its cache_values x 4 B) over the copy bandwidth measured
here (numpy copy of 512 MB, read + written, the best of 5); beside it the compute bound, the flops of a cached
token's products over numpy's measured fp32 matmul rate. /proc/loadavg is recorded at each timing.

    python run.py OUT.json [ROUNDS]
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

from attnx.export import build_step_model
from attnx.model import AttentionConfig, init_weights

LATENT = AttentionConfig(d_model=1024, n_heads=128, head_dim=192, v_head_dim=128, bias=False, causal=True,
                         key_padding_mask=False, kv_cache=True, rope={"theta": 10000.0, "dim": 64, "interleaved": True},
                         latent={"kv_lora_rank": 512, "q_lora_rank": 256, "eps": 1e-6})  # fmt: skip
EXPANDED = dataclasses.replace(LATENT, latent=None)
LENGTHS = {"latent": [1024, 2048, 4096, 8192, 16384], "expanded": [1024, 2048, 4096, 8192]}  # 8k: 1.3 GB of k, v


def bandwidth(nbytes: int = 512 * 1024**2, repeat: int = 5) -> float:
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    return 2 * nbytes / best


def gflops(n: int = 2048, repeat: int = 5) -> float:
    """The host's fp32 matrix product rate (numpy's BLAS, its threads): the compute a cached token's products need
    against it is the other bound (the absorbed step does 2 x heads x (576 + 512) flops a cached token)."""
    a, b = np.ones((n, n), np.float32), np.ones((n, n), np.float32)
    a @ b
    return 2 * n**3 / min(_timed(lambda: a @ b) for _ in range(repeat)) / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main() -> None:
    out, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    repeat = 5
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in (("latent", LATENT), ("expanded", EXPANDED)):
            path = os.path.join(tmp, f"{name}.onnx")
            onnx.save(build_step_model(config, init_weights(config, 0), "decomposed", "growing", "fp32"), path)
            sessions[name] = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 1024)).astype(np.float32)
    bw, rate = bandwidth(), gflops()
    samples = {(name, t): [] for name, lengths in LENGTHS.items() for t in lengths}
    loads = []
    for r in range(rounds):
        order = list(samples)
        order = order[r % len(order):] + order[: r % len(order)]
        for name, length in order:
            config = LATENT if name == "latent" else EXPANDED
            feeds = {"x": x, "position_ids": np.full((1, 1), length, np.int64)}
            for spec in config.cache_specs():
                feeds[spec.name] = np.zeros(spec.sized(1, length), np.float32)
            sess = sessions[name]
            sess.run(["y"], feeds)  # warm-up
            loads.append(load())
            step = lambda sess=sess, feeds=feeds: sess.run(["y"], feeds)  # noqa: E731
            samples[(name, length)].append(statistics.median(_timed(step) for _ in range(repeat)))
            print(f"round {r + 1}: {name} {length}: {samples[(name, length)][-1] * 1e3:.2f} ms (load {loads[-1]})",
                  file=sys.stderr, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": rounds, "repeat": repeat,
              "threads": 2, "onnxruntime": ort.__version__, "python": platform.python_version(),
              "cpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines(),
              "bandwidth_gbs": bw / 1e9, "gflops": rate, "load_1min": loads, "forms": {}}
    for name, config in (("latent", LATENT), ("expanded", EXPANDED)):
        lengths = LENGTHS[name]
        ms = [statistics.median(samples[(name, t)]) * 1e3 for t in lengths]
        slope, fixed = np.polyfit(lengths, ms, 1)
        token_bytes = config.cache_values() * 4
        # a cached token's products: q.k over the key width, p.v over the value width, every head
        keys, values = (576, 512) if config.latent else (config.head_dim, config.v_head_dim)
        token_flops = 2 * config.n_heads * (keys + values)
        result["forms"][name] = {"cache_values_a_token": config.cache_values(), "lengths": lengths, "ms": ms,
                                 "rounds_ms": [[s * 1e3 for s in samples[(name, t)]] for t in lengths],
                                 "slope_ns_a_token": slope * 1e6, "fixed_ms": fixed,
                                 "bound_ns_a_token": token_bytes / bw * 1e9,
                                 "passes": slope * 1e6 / (token_bytes / bw * 1e9),
                                 "compute_bound_ns_a_token": token_flops / rate}  # fmt: skip
    with open(out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(out + ".tmp", out)
    print(json.dumps({k: {m: v[m] for m in ("slope_ns_a_token", "bound_ns_a_token", "compute_bound_ns_a_token", "passes", "fixed_ms", "ms")}
                      for k, v in result["forms"].items()}, indent=1))


if __name__ == "__main__":
    main()
