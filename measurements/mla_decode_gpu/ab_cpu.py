"""The absorbed step before and after the change that reads v as the latents whole (the rope columns dropped from
p.v instead of a Slice that copies the cache a step), in one run on the CPU: a DeepSeek-shaped layer of 16 heads
(d_model 1024, qk head 192, v head 128, rope 64, kv_lora_rank 512, q_lora_rank 256), fp32, batch 4, 8192 cached
tokens; the old form rebuilt by wrapping attnx.export._latent._absorbed. It wraps that commit's internals: run it
at 5c049d2 (the step model has since become an If of the expanded and absorbed forms).

    python ab_cpu.py [ROUNDS]
"""

import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort

import attnx.export._latent as latent_module
from attnx.export import build_step_model
from attnx.model import AttentionConfig, init_weights

new_form = latent_module._absorbed


def old_form(e, q, latent, cut):
    heads = new_form(e, q, latent, cut)
    c, g = e.c, e.g
    r, rank = c.rope.dim, c.latent.kv_lora_rank
    return latent_module.LatentHeads(heads.q, latent, cut(latent, r, r + rank), 1, r + rank, rank,
                                     lambda z: g.op("MatMul", z, "kv_b_proj.v_half.T"))  # fmt: skip


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    c = AttentionConfig(d_model=1024, n_heads=16, head_dim=192, v_head_dim=128, bias=False, causal=True,
                        key_padding_mask=False, kv_cache=True, rope={"theta": 10000.0, "dim": 64, "interleaved": True},
                        latent={"kv_lora_rank": 512, "q_lora_rank": 256, "eps": 1e-6})  # fmt: skip
    w = init_weights(c, 0)
    paths = {}
    for name, form in (("new", new_form), ("old", old_form)):
        latent_module._absorbed = form
        paths[name] = f"/tmp/ab_{name}.onnx"
        onnx.save(build_step_model(c, w, "decomposed", "growing", "fp32"), paths[name])
    latent_module._absorbed = new_form
    batch, length = 4, 8192
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((batch, 1, 1024)).astype(np.float32),
             "position_ids": np.full((batch, 1), length, np.int64),
             "past_latent": rng.standard_normal((batch, 1, length, 576)).astype(np.float32)}  # fmt: skip
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = {k: ort.InferenceSession(p, options, providers=["CPUExecutionProvider"]) for k, p in paths.items()}
    ys = {k: s.run(["y"], feeds)[0] for k, s in sessions.items()}
    print("max |new - old|", float(np.abs(ys["new"] - ys["old"]).max()))
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(rounds):  # alternated, one call of each a round
        for k, s in sessions.items():
            t = time.perf_counter()
            s.run(["y"], feeds)
            times[k].append(time.perf_counter() - t)
    for k, v in times.items():
        print(k, "median ms", round(statistics.median(v) * 1e3, 2), "min", round(min(v) * 1e3, 2))


if __name__ == "__main__":
    main()
