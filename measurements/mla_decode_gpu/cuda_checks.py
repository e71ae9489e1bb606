"""Issue 52's new paths on ONNX Runtime's CUDA provider, once, on a GPU machine (device4.sh runs it):

    buffer   the decomposed core's buffer form (TensorScatter-24 writing each row's tokens into the bound buffer) of
             per-head and latent configs, against the float64 reference: prefills 0 and 5 then 4 steps, batch 2, and
             rows of 5, 2 and 7 tokens in one call (runtimes.decode.run_buffer_parity on ort-cuda)
    optimize attnx optimize --provider cuda of the tiny DeepSeek-V3 export (tests/fixtures/.../deepseek_v3, carried
             beside this run): each MLA block rewritten into the absorbed latent step, proven on CUDA; again with
             --weights int4 (stop 60: the blocks written at the graph's MatMulNBits)

    python cuda_checks.py OUT.json MODEL.onnx CHECKPOINT_DIR [cuda|cpu]    (cpu: tries the script here)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile

from attnx.model import AttentionConfig, init_weights
from attnx.runtimes import ModelSource
from attnx.runtimes.decode import run_buffer_parity

_STEP = dict(causal=True, kv_cache=True)
_ROPE = {"theta": 10000.0, "dim": 8, "interleaved": True}
MLA = AttentionConfig(d_model=64, n_heads=4, head_dim=24, v_head_dim=16, bias=False, rope=_ROPE,
                      latent={"kv_lora_rank": 32, "q_lora_rank": 16, "eps": 1e-6}, **_STEP)  # fmt: skip
CONFIGS = {
    "mha": AttentionConfig(d_model=32, n_heads=4, **_STEP),
    "grouped-window": AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, sliding_window=5, **_STEP),
    "mla": MLA,
    "mla-q-proj": dataclasses.replace(MLA, bias=True, latent={"kv_lora_rank": 32, "q_lora_rank": None, "eps": 1e-6}),
}


def main(out: str, model: str, checkpoint: str, provider: str = "cuda") -> int:
    import onnx

    from attnx.export import build_model
    from attnx.workflows.rewrite import optimize_model

    result = {"buffer": {}, "optimize": None, "optimize_int4": None}
    with tempfile.TemporaryDirectory() as folder:
        for name, config in CONFIGS.items():
            weights = init_weights(config, 0)
            path = f"{folder}/{name}.onnx"
            onnx.save(build_model(config, weights, "decomposed", "buffer"), path)
            for backend in ("ort-cuda", "ort-cpu") if provider == "cuda" else ("ort-cpu",):
                report = run_buffer_parity(ModelSource(config, weights, path), backend, prefills=(0, 5), steps=4,
                                           batch=2, rows=(5, 2, 7))  # fmt: skip
                cases = [(c.status, c.reason) for c in report.cases]
                result["buffer"][f"{name} {backend}"] = cases
                print(name, backend, cases, flush=True)
        for key, weights in (("optimize", None), ("optimize_int4", "int4")):  # int4: stop 60's MatMulNBits taken
            report = optimize_model(model, f"{folder}/{key}.onnx", checkpoint=checkpoint, provider=provider,
                                    weights=weights)  # fmt: skip
            result[key] = {"passed": report.passed, "written": [b.written for b in report.blocks],
                           "proofs": [str(p) for p in report.proofs],
                           "model_times": {k: dataclasses.asdict(t) for k, t in report.model_times.items()}}  # fmt: skip
            print("\n".join(report.lines()), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
