"""MLA's decode step against its memory bound, on ONNX Runtime (issue 52: "the decode step measured against its own
memory bound: the latent cache read once, 576 values a token for DeepSeek-V3's sizes, against 40,960 for its 128
heads of k (192) and v (128)").

Two step models of one DeepSeek-V3 attention layer (d_model 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512,
rope 64 interleaved, qk head 192, v head 128), attnx's decomposed core, growing form, built by attnx.export:

    latent   the absorbed step (export/_latent.py): the cache past_latent [B, 1, T, 576]
    per-head the same heads without the latent (plain q/k/v projections): past_key [B, 128, T, 192] and
             past_value [B, 128, T, 128], 40,960 values a token: the cache MLA replaces

Each step: one new token a row, the cache of T tokens bound on the device (IOBinding), the present left there;
median of --repeat calls after --warmup. The slope of time over B * T (least squares over the lengths) is the time
a cached token costs; its bound is the cache's bytes a token over the device's copy bandwidth, measured here (a
device-to-device copy of 2 GiB: bytes read + written over time). The growing form reads the past once to join it
(Concat) and writes the present, then the core reads the present: three passes over the cache a step.

    latent-buffer (--buffer) the latent step in the decomposed core's buffer form: one buffer of T + 1 positions
             bound as past_latent and present_latent, TensorScatter writing the new token in place, seqlens_k and
             total_sequence_length as inputs (no key_padding_mask: each row its own length)

--profile DIR: each latent form once more at the longest length under ONNX Runtime's profiler (--repeat steps): the
microseconds a step spends in each op type and the ten longest nodes (profile.json).

    python run.py --out DIR [--provider cuda|cpu] [--small] [--lengths 1024,4096,16384] [--batch 8] [--buffer]
                  [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np


def configs(small: bool):
    from attnx.model import AttentionConfig

    d, heads, qk, v, rope, kv_rank, q_rank = (64, 4, 24, 16, 8, 32, 16) if small else (7168, 128, 192, 128, 64, 512, 1536)
    common = dict(d_model=d, n_heads=heads, head_dim=qk, v_head_dim=v, bias=False, causal=True, key_padding_mask=False,
                  kv_cache=True, rope={"theta": 10000.0, "dim": rope, "interleaved": True})  # fmt: skip
    latent = AttentionConfig(**common, latent={"kv_lora_rank": kv_rank, "q_lora_rank": q_rank, "eps": 1e-6})
    return {"latent": latent, "per-head": AttentionConfig(**common)}


def bandwidth(provider: str) -> float:
    """Bytes a second of a device-to-device copy (read + write), torch on CUDA, numpy on the CPU."""
    n = 1 << 29  # 2 GiB of fp32
    if provider == "cuda":
        import torch

        a, b = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
        return 2 * 4 * n * 10 / (time.perf_counter() - t)
    a, b = np.ones(n // 8, np.float32), np.empty(n // 8, np.float32)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(3):
        np.copyto(b, a)
    return 2 * 4 * (n // 8) * 3 / (time.perf_counter() - t)


def time_step(path: str, config, provider: str, batch: int, length: int, repeat: int, warmup: int,
              buffer: bool = False, profile: str | None = None) -> float:  # fmt: skip
    """The median step time (s); buffer: the buffer form (the cache one buffer of length + 1 positions, bound as past
    and present); profile: a folder for ONNX Runtime's profile of the run, whose per-op summary is returned instead
    (as a dict, beside the time)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(profile, os.path.basename(path) + ("-buffer" if buffer else ""))
    providers = ["CUDAExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(path, opts, providers=providers)
    assert session.get_providers()[0] == providers[0], session.get_providers()
    device = "cuda" if provider == "cuda" else "cpu"
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((batch, 1, config.d_model)).astype(np.float16)}
    if buffer:
        feeds.update(seqlens_k=np.full(batch, length, np.int32), total_sequence_length=np.array(length + 1, np.int32))
    else:
        feeds["position_ids"] = np.full((batch, 1), length, np.int64)
    names = {i.name for i in session.get_inputs()}
    binding = session.io_binding()
    for name, value in feeds.items():
        if name in names:
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, device, 0))
    for spec in config.cache_specs():  # made where it is read: a 10 GB cache is not made on the host
        shape = (batch, spec.shape[1], length + (1 if buffer else 0), spec.shape[3])
        cache = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float16, device, 0)
        if device == "cpu":
            cache.numpy()[...] = 0  # on the GPU left as allocated: the values do not change these kernels' time
        binding.bind_ortvalue_input(spec.name, cache)
        if buffer:  # the same memory: written in place
            binding.bind_ortvalue_output(spec.present, cache)
    for out in session.get_outputs():
        if not (buffer and out.name.startswith("present")):
            binding.bind_output(out.name, device)
    times = []
    for i in range(warmup + repeat):
        t = time.perf_counter()
        session.run_with_iobinding(binding)  # returns once the device's work is done
        if i >= warmup:
            times.append(time.perf_counter() - t)
    if profile is not None:
        summary = _profile_summary(session.end_profiling(), warmup + repeat)
        del session
        return summary
    del session
    return statistics.median(times)


def _profile_summary(path: str, steps: int) -> dict:
    """Per step: the microseconds of each op type's kernels and the ten longest nodes, from ONNX Runtime's profile."""
    with open(path) as f:
        events = json.load(f)
    by_op: dict[str, float] = {}
    by_node: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        op = e.get("args", {}).get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + e["dur"] / steps
        node = e["name"][: -len("_kernel_time")]
        by_node[f"{op} {node}"] = by_node.get(f"{op} {node}", 0.0) + e["dur"] / steps
    top = sorted(by_node.items(), key=lambda kv: -kv[1])[:10]
    return {"us_a_step_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])), "longest_nodes_us": dict(top),
            "us_a_step": sum(by_op.values())}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="a tiny layer (tries the script on a CPU)")
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--buffer", action="store_true", help="the latent step in the buffer form too")
    p.add_argument("--profile", action="store_true", help="profile each latent form at the longest length")
    args = p.parse_args()
    import onnx

    from attnx.export import build_step_model
    from attnx.model import init_weights

    os.makedirs(args.out, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    bw = bandwidth(args.provider)
    result = {"machine": {"python": sys.version.split()[0], "platform": platform.platform(), "provider": args.provider,
                          "copy_bandwidth_gb_s": bw / 1e9}, "batch": args.batch, "lengths": lengths, "forms": {}}  # fmt: skip
    if args.provider == "cuda":
        result["machine"]["gpu"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    forms = [(form, config, "growing") for form, config in configs(args.small).items()]
    if args.buffer:
        forms.insert(1, ("latent-buffer", configs(args.small)["latent"], "buffer"))
    for form, config, step_form in forms:
        path = os.path.join(args.out, f"{form}.onnx")
        onnx.save(build_step_model(config, init_weights(config, 0), "decomposed", step_form, "fp16"), path,
                  save_as_external_data=True, location=f"{form}.onnx.data")  # fmt: skip
        per_token = config.cache_values() * 2  # fp16 bytes a cached token (the config's cache layout)
        buffer = step_form == "buffer"
        ms = [time_step(path, config, args.provider, args.batch, t, args.repeat, args.warmup, buffer) * 1e3
              for t in lengths]  # fmt: skip
        if args.profile and form.startswith("latent"):
            result.setdefault("profiles", {})[form] = time_step(path, config, args.provider, args.batch, lengths[-1],
                                                                args.repeat, args.warmup, buffer, profile=args.out)  # fmt: skip
        tokens = np.asarray(lengths, float) * args.batch
        slope_ms, base_ms = np.polyfit(tokens, ms, 1)
        bound_ns = per_token / bw * 1e9
        result["forms"][form] = {"cache_values_a_token": config.cache_values(), "step_ms": dict(zip(map(str, lengths), ms)),
                                 "ns_a_cached_token": slope_ms * 1e6, "bound_ns_a_cached_token": bound_ns,
                                 "passes_over_the_cache": slope_ms * 1e6 / bound_ns, "intercept_ms": base_ms}  # fmt: skip
        print(form, json.dumps(result["forms"][form]), flush=True)
        for f in (path, path + ".data"):
            os.remove(f)
    with open(os.path.join(args.out, "mla_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    a, b = result["forms"]["latent"], result["forms"]["per-head"]
    print(f"a cached token: latent {a['ns_a_cached_token']:.3f} ns, per-head {b['ns_a_cached_token']:.3f} ns "
          f"({b['ns_a_cached_token'] / a['ns_a_cached_token']:.1f}x); bounds {a['bound_ns_a_cached_token']:.3f} and "
          f"{b['bound_ns_a_cached_token']:.3f} ns at {bw / 1e9:.0f} GB/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
