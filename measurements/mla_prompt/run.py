"""The latent step model's prompt and step, with the If between the expanded and the absorbed heads (attnx's step
model since this measurement) and absorbed alone (the step model before it: prompt_expands stubbed to None, which
writes exactly that graph), one layer at DeepSeek-V3's head sizes with 16 heads, ONNX Runtime CPU, one thread pool,
spinning off, the best of 5 runs after a warm-up.

    .venv/bin/python measurements/mla_prompt/run.py measurements/mla_prompt/result.json
"""

from __future__ import annotations

import json
import platform
import sys
import time

import numpy as np
import onnxruntime as ort

import attnx.export.cores.decomposed as decomposed
from attnx.export._emit import build_model
from attnx.model.config import AttentionConfig
from attnx.model.weights import init_weights

CONFIG = AttentionConfig.from_dict({
    "d_model": 2048, "n_heads": 16, "head_dim": 192, "v_head_dim": 128, "causal": True, "kv_cache": True,
    "rope": {"dim": 64, "theta": 10000.0, "interleaved": True},
    "latent": {"kv_lora_rank": 512, "q_lora_rank": 1536, "eps": 1e-6}})  # fmt: skip
CALLS = [("prompt", 128, 0), ("prompt", 512, 0), ("prompt", 1024, 0), ("step", 1, 1024), ("step", 1, 4096),
         ("chunk", 64, 2048)]  # fmt: skip


def session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def best_ms(s: ort.InferenceSession, feeds: dict) -> float:
    s.run(None, feeds)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        s.run(None, feeds)
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main(out: str) -> None:
    weights = init_weights(CONFIG, 0)
    switched = session(build_model(CONFIG, weights, "decomposed"))
    stub, decomposed.prompt_expands = decomposed.prompt_expands, lambda e, latents: None  # the emitter's name for it
    try:
        absorbed = session(build_model(CONFIG, weights, "decomposed"))
    finally:
        decomposed.prompt_expands = stub
    rng = np.random.default_rng(0)
    rows = []
    for kind, seq, past in CALLS:
        feeds = {"x": rng.standard_normal((1, seq, CONFIG.d_model), dtype=np.float32),
                 "past_latent": rng.standard_normal((1, 1, past, 576), dtype=np.float32),
                 "position_ids": np.arange(past, past + seq, dtype=np.int64)[None]}  # fmt: skip
        row = {"call": kind, "tokens": seq, "past": past, "absorbed_ms": best_ms(absorbed, feeds),
               "switched_ms": best_ms(switched, feeds)}  # fmt: skip
        rows.append(row)
        print(f"{kind:6} {seq:5} tokens after {past:5}: absorbed {row['absorbed_ms']:8.2f} ms, "
              f"with the If {row['switched_ms']:8.2f} ms", flush=True)  # fmt: skip
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "cpu": cpu,
              "cores": len(__import__("os").sched_getaffinity(0)), "python": platform.python_version(),
              "onnxruntime": ort.__version__, "config": CONFIG.to_dict(), "rows": rows}  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
