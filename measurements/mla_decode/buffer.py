"""MLA's decode step in the decomposed core's buffer form beside its growing form, on this host's CPU (issue 52).

One attention layer at DeepSeek-V3's attention head sizes, 16 heads (qk head 192 = nope 128 + rope 64 interleaved,
v head 128, kv_lora_rank 512; d_model 1024 and q_lora_rank 256, as run.py beside it), attnx's decomposed core, fp32,
the absorbed step (export/_latent.py), one new token a row at `past` cached tokens, batch 1 and 4:

    growing   past_latent [B, 1, past, 576] in, present_latent [B, 1, past + 1, 576] out (a Concat: a new tensor)
    buffer    one buffer [B, 1, past + 1, 576] bound as past_latent and present_latent (IOBinding): TensorScatter-24
              writes the new token in place, a Slice reads the first total_sequence_length positions
    no-slice  the buffer form with its Slice taken out (the capacity is the total here, so the same numbers): what
              ONNX Runtime's Slice of the buffer costs a step (it copies: a Slice's output is a new tensor)
    no-slice-2x  the same model over a buffer of twice the positions (2 x (past + 1)): without the Slice the attention
              reads the whole capacity, filled or not

The buffer form is also run under ONNX Runtime's profiler (a session of its own, `repeat` steps): the microseconds a
step spends in each op type, the Slice's and TensorScatter's among them.

Each (batch, past) runs `rounds` x `repeat` rounds of one call of each form, the forms rotated, so that the forms'
calls are paired in time (others' processes share these cores and slow a stretch of calls, not one form): a form's
time is the median of its calls, beside the median of the buffer form's time over the growing form's in the same
round. /proc/loadavg is recorded each round.

    python buffer.py OUT.json [ROUNDS]
"""

from __future__ import annotations

import json
import os
import platform
import shutil
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
from attnx.runtimes.decode import bind_cache

CONFIG = AttentionConfig(d_model=1024, n_heads=16, head_dim=192, v_head_dim=128, bias=False, causal=True,
                         key_padding_mask=False, kv_cache=True, rope={"theta": 10000.0, "dim": 64, "interleaved": True},
                         latent={"kv_lora_rank": 512, "q_lora_rank": 256, "eps": 1e-6})  # fmt: skip
PASTS, BATCHES, FORMS = (1024, 4096), (1, 4), ("growing", "buffer", "no-slice", "no-slice-2x")


def without_slice(model: onnx.ModelProto) -> onnx.ModelProto:
    """The buffer form with each Slice of a present (the positions read) replaced by the present itself."""
    presents = {o.name for o in model.graph.output} - {"y"}
    kept, renamed = [], {}
    for node in model.graph.node:
        if node.op_type == "Slice" and node.input[0] in presents:
            renamed[node.output[0]] = node.input[0]
            continue
        kept.append(node)
    assert renamed, "no Slice of a present found"
    for node in kept:
        node.input[:] = [renamed.get(i, i) for i in node.input]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model


def load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def bandwidth(nbytes: int = 512 * 1024**2, repeat: int = 5) -> float:
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times)


def main() -> None:
    out, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    repeat = 7
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 2  # TensorScatter's "in-place optimization not activated" would show
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    weights = init_weights(CONFIG, 0)
    sessions = {}
    profiled = ort.SessionOptions()
    profiled.intra_op_num_threads = 2
    profiled.enable_profiling = True
    profiled.add_session_config_entry("session.intra_op.allow_spinning", "0")
    keep = tempfile.mkdtemp(prefix="mla-buffer-profile-")  # the profile outlives the models' folder
    with tempfile.TemporaryDirectory() as tmp:
        for form in FORMS:
            model = build_step_model(CONFIG, weights, "decomposed", "growing" if form == "growing" else "buffer")
            if form.startswith("no-slice"):
                model = without_slice(model)
            path = os.path.join(tmp, f"{form}.onnx")
            onnx.save(model, path)
            sessions[form] = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            if form == "buffer":
                profiled.profile_file_prefix = os.path.join(keep, "profile")
                sessions["profiled"] = ort.InferenceSession(path, profiled, providers=["CPUExecutionProvider"])
    (spec,) = CONFIG.cache_specs()
    rng = np.random.default_rng(0)
    copy_bps = bandwidth()
    results = []
    for batch in BATCHES:
        x = rng.standard_normal((batch, 1, CONFIG.d_model), dtype=np.float32)
        for past in PASTS:
            latents = rng.standard_normal(spec.sized(batch, past + 1), dtype=np.float32)
            steps = {}
            for form, sess in sessions.items():
                if form == "growing":
                    feeds = {"x": ort.OrtValue.ortvalue_from_numpy(x), "past_latent": ort.OrtValue.ortvalue_from_numpy(
                        np.ascontiguousarray(latents[:, :, :past])),
                        "position_ids": ort.OrtValue.ortvalue_from_numpy(np.full((batch, 1), past, np.int64))}  # fmt: skip
                    steps[form] = lambda sess=sess, feeds=feeds: sess.run_with_ort_values(["y", "present_latent"], feeds)
                    continue
                b = sess.io_binding()
                b.bind_cpu_input("x", x)
                b.bind_cpu_input("seqlens_k", np.full(batch, past, np.int32))
                # no-slice-2x: the keys' positions over the whole buffer (its mask hides those past each row's own)
                b.bind_cpu_input("total_sequence_length", np.asarray((past + 1) * (2 if form == "no-slice-2x" else 1),
                                                                     np.int32))  # fmt: skip
                b.bind_output("y")
                buffer = latents.copy() if form != "no-slice-2x" else np.concatenate([latents, latents], axis=2)
                bind_cache(b, [(spec, ort.OrtValue.ortvalue_from_numpy(buffer))])
                steps[form] = lambda sess=sess, b=b: sess.run_with_iobinding(b)
            profile = steps.pop("profiled")
            samples = {form: [] for form in steps}
            loads = []
            for form in steps:
                steps[form]()  # warm-up
            for r in range(rounds * repeat):  # one call of each form a round, in rotated order: paired in time
                order = list(steps)[r % len(steps):] + list(steps)[: r % len(steps)]
                for form in order:
                    t = time.perf_counter()
                    steps[form]()
                    samples[form].append((time.perf_counter() - t) * 1e3)
                loads.append(load())
            for _ in range(repeat):
                profile()
            ratio = [b / g for b, g in zip(samples["buffer"], samples["growing"])]
            row = {"batch": batch, "past": past, "ms": {f: statistics.median(v) for f, v in samples.items()},
                   "min_ms": {f: min(v) for f, v in samples.items()}, "buffer_over_growing": statistics.median(ratio),
                   "load": [min(loads), max(loads)],
                   "cache_mb": latents.nbytes / 1e6, "cache_copy_ms": latents.nbytes * 2 / copy_bps * 1e3}  # fmt: skip
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(sessions["profiled"].end_profiling()) as f:
        events = json.load(f)
    shutil.rmtree(keep)
    per_op: dict[str, list[float]] = {}
    for event in events:  # each node's run, in call order: split into the calls by their count
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op.setdefault(event["args"]["op_name"], []).append(event["dur"])
    calls = len(BATCHES) * len(PASTS)
    for i, row in enumerate(results):  # the profiled steps of row i: the i-th `repeat` block of each op's runs
        row["profile_us_a_step"] = {}
        for op, durations in per_op.items():
            each = len(durations) // (calls * repeat)
            block = durations[i * repeat * each : (i + 1) * repeat * each]
            row["profile_us_a_step"][op] = sum(block) / repeat
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    data = {"config": CONFIG.to_dict(), "threads": 2, "repeat": repeat, "rounds": rounds, "copy_gbs": copy_bps / 1e9,
            "cpu": model_name, "python": platform.python_version(), "onnxruntime": ort.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": results}  # fmt: skip
    with open(out, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
