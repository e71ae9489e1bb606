"""attnx bench --decode: the per-token step of the step model against the memory-bandwidth bound.

For each past length P, batch 1 (one process, one run, so every ratio compares numbers measured
together):

- bandwidth: large copies (512 MB read + 512 MB written), best of 5: numpy's and torch's on the
  step's thread count; the higher is the bound's (one thread alone does not saturate memory).
- bytes per step (the least any implementation must move): the weights once, the cache read
  once (P + 1 positions, keys and values) and the new token's keys/values written.
  bound = bytes / bandwidth.
- the ort-fused buffer form (GroupQueryAttention on one cache bound as past and present,
  IOBinding: only the new token is written); the ort-fused and decomposed growing forms (a new
  cache each step: the old one read and the new one written on top); torch eager's step as
  the peer (torch.cat onto the cache + scaled_dot_product_attention, grouped heads by enable_gqa).
- with int8/int4 (`attnx bench --decode --dtype fp32,int8,int4`): the buffer form (its default core
  and auto) and the ort-fused growing form of the step model with quantized projections ("ort-fused
  buffer int8", "ort-fused buffer auto int8"), each against the bound of its own bytes per step
  (weight_bytes: the weights as that model stores them).
- with a modern-LLM config (rope, qk_norm): the growing forms take the step's position_ids, the
  buffer form rotates inside GroupQueryAttention (do_rotary) at its token index; the torch peers
  rotate as transformers does (cos/sin of position_ids * inv_freq, rotate_half); "torch static" is
  the static-cache peer (a preallocated cache written in place with index_copy_, as transformers'
  StaticCache, then SDPA over it); "openvino onnx growing" and "openvino decomposed growing" run
  attnx's onnx and decomposed step models on OpenVINO (f32, the step's threads). With softcap or sinks the peers attend as transformers' eager attention
  does (Gemma 2, gpt-oss); with a sliding window they read the last W keys, and so does the bound.

Timing: each timed step is preceded, outside the timer, by a read of 256 MB (more than every
cache level), so the weights and the cache come from memory as in a layer among many ("flushed");
"warm" repeats the step back to back. ORT's worker threads spin after a run by default, which
would steal a core from the flush and from torch: the sessions here set
session.intra_op.allow_spinning = 0. Each implementation is timed in `rounds` rounds, the order
rotated between rounds; each round takes the median of `repeat` steps, and the lowest of the
rounds' medians is reported. The step writes
position P each time (the state is reset), so every timed step is the step from P to P + 1.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attnx.errors import UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import BUFFER_CORES
from attnx.model.rope import rope_frequencies
from attnx.model.weights import init_weights, weight_shapes
from attnx.runtimes import ModelSource, create_runner

__all__ = ["DECODE_DTYPES", "DecodeBenchRow", "measure_bandwidth", "run_decode_bench", "step_bytes", "weight_bytes"]

DECODE_DTYPES = ("fp32", "int8", "int4")  # the step model's weights: float, or QuantizeProjections' forms
DEFAULT_BLOCK_SIZE = 32  # attnx.export.passes.DEFAULT_BLOCK_SIZE (int4), the block size the bench builds

_FLUSH_BYTES = 256 * 1024**2


@dataclasses.dataclass
class DecodeBenchRow:
    past: int
    step_bytes: int
    bandwidth_gbs: float  # the higher of the copies
    bound_ms: float
    times_ms: dict[str, float]  # "<impl> flushed" / "<impl> warm" -> median ms
    copies_gbs: dict[str, float] = dataclasses.field(default_factory=dict)  # each large copy measured
    # a quantized step model's own bytes per step and bound ("int8"/"int4"; fp32's are the above)
    dtype_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    def bound_for(self, impl: str) -> tuple[int, float]:
        """(bytes per step, bound ms) of `impl`: of its dtype when it names one ("ort-fused buffer int8")."""
        dtype = impl.split()[-1]
        nbytes = self.dtype_bytes.get(dtype, self.step_bytes)
        return nbytes, nbytes / self.step_bytes * self.bound_ms

    def ratio(self, impl: str) -> float:
        return self.times_ms[f"{impl} flushed"] / self.bound_for(impl)[1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def step_bytes(config: AttentionConfig, past: int, batch: int = 1, itemsize: int = 4, dtype: str = "fp32",
               block_size: int = DEFAULT_BLOCK_SIZE) -> int:  # fmt: skip
    """Bytes one step must move at least: weights (as stored in `dtype`: weight_bytes), the cache
    read (past + 1 positions; with a sliding window W, the last W), the new keys/values written, x and y."""
    c = config
    cache_row = c.n_kv_heads * (c.head_dim + c.v_head_dim) * itemsize * batch
    weights = c.n_params * itemsize if dtype == "fp32" else weight_bytes(c, dtype, block_size)
    seen = past + 1 if c.sliding_window is None else min(past + 1, c.sliding_window)  # a window reads its W keys
    return weights + cache_row * seen + cache_row + 2 * batch * c.d_model * itemsize


def weight_bytes(config: AttentionConfig, dtype: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The bytes of the projections' weights as a step model of `dtype` stores them
    (QuantizeProjections): fp32 4 per weight; int8 1 per weight plus a float32 scale and an int8
    zero point per output channel; int4 half a byte per weight (K padded to whole blocks) plus a
    float32 scale and a 4-bit zero point per block. Biases stay float32. The buffer form packs
    q/k/v into one weight: per output channel, so the same bytes."""
    total = 0
    for shape in weight_shapes(config).values():
        if len(shape) == 1 or dtype == "fp32":  # a bias, or a float weight
            total += 4 * int(np.prod(shape))
            continue
        n, k = shape  # torch's [out, in]
        if dtype == "int8":
            total += k * n + 4 * n + n
        elif dtype == "int4":
            blocks = -(-k // block_size)
            total += n * blocks * block_size // 2 + 4 * n * blocks + n * -(-blocks // 2)
        else:
            raise UsageError(f"no step model weights in {dtype!r} (fp32, int8, int4)")
    return total


def measure_bandwidth(threads: int, nbytes: int = 512 * 1024**2, repeat: int = 5) -> dict[str, float]:
    """Bytes per second of a large copy (read + write counted), best of `repeat`: numpy's (one
    thread) and torch's copy_ on `threads` threads, the step's own thread count. The higher is
    the bound's bandwidth: one thread alone does not saturate memory here (measured: AMD EPYC,
    24.6 GB/s with one, 31.9 GB/s with two)."""
    import torch

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    torch.set_num_threads(threads)

    def best(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 2 * nbytes / min(times)

    return {"numpy copy": best(lambda: np.copyto(dst, src)), f"torch copy_ ({threads} threads)": best(
        lambda: tdst.copy_(tsrc))}  # fmt: skip


class _Flusher:
    """Evicts every cache level by reading 256 MB (written once, here). A read, not a write: the
    lines it leaves are clean, so the timed step does not pay for writing the flush back, as a
    layer among many reads other layers' weights and caches, mostly clean."""

    def __init__(self) -> None:
        self.buf = np.ones(_FLUSH_BYTES // 4, np.float32)
        self.sink = 0.0

    def __call__(self) -> None:
        self.sink += float(self.buf.sum(dtype=np.float32))


def _median_ms(fn: Callable[[], Any], flush: Callable[[], None] | None, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        if flush is not None:
            flush()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def _session(model: Any, threads: int) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    with tempfile.TemporaryDirectory(prefix="attnx-decode-bench-") as tmp:
        import onnx

        path = os.path.join(tmp, "step.onnx")
        onnx.save(model, path, save_as_external_data=model.ByteSize() > 1024**3, location="step.onnx.data")
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def run_decode_bench(
    config: AttentionConfig,
    pasts: Sequence[int],
    *,
    threads: int = 2,
    repeat: int = 20,
    seed: int = 0,
    rounds: int = 3,
    impls: Sequence[str] = (
        "ort-fused buffer",
        "ort-fused growing",
        "onnx growing",
        "decomposed growing",
        "torch eager",
        "torch static",
    ),
    progress: Callable[[str], None] = lambda msg: None,
) -> list[DecodeBenchRow]:
    import onnx
    import onnxruntime as ort
    import torch

    from attnx.export import build_step_model

    c = config
    torch.set_num_threads(threads)
    weights = init_weights(c, seed)
    flush = _Flusher()
    progress("measuring the memory bandwidth (large copies)")
    copies = measure_bandwidth(threads)
    bandwidth = max(copies.values())
    sessions, openvino = {}, {}
    tmp = tempfile.TemporaryDirectory(prefix="attnx-decode-bench-")
    for impl in impls:
        if impl.startswith("torch"):
            continue
        if impl.startswith("openvino"):  # "openvino onnx growing": attnx's step model on OpenVINO
            _, lowering, form = impl.split()
            progress(f"building the step model: {impl}")
            path = os.path.join(tmp.name, f"{lowering}-{form}.onnx")
            onnx.save(build_step_model(c, weights, lowering, form), path)
            openvino[impl] = create_runner("openvino", ModelSource(c, weights, path), threads=threads).load()
            continue
        lowering, form, *rest = impl.split()  # "ort-fused buffer", "ort-fused buffer int8", "... grouped-mha"
        dtype = next((w for w in rest if w in DECODE_DTYPES), "fp32")
        core = next((w for w in rest if w in BUFFER_CORES), "gqa")
        progress(f"building the step model: {impl}")
        model = build_step_model(c, weights, lowering, form, dtype, DEFAULT_BLOCK_SIZE, buffer_core=core)
        sessions[impl] = _session(model, threads)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 1, c.d_model), dtype=np.float32)
    tw = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
    rows = []
    for past in pasts:
        cap = past + 1
        key = rng.standard_normal((1, c.n_kv_heads, cap, c.head_dim), dtype=np.float32)
        value = rng.standard_normal((1, c.n_kv_heads, cap, c.v_head_dim), dtype=np.float32)
        steps: dict[str, Callable[[], Any]] = {}
        for impl, sess in sessions.items():
            if impl.split()[1] == "buffer":
                kv = ort.OrtValue.ortvalue_from_numpy(key)
                vv = ort.OrtValue.ortvalue_from_numpy(value)
                b = sess.io_binding()
                b.bind_cpu_input("x", x)
                b.bind_cpu_input("seqlens_k", np.full(1, past, np.int32))
                b.bind_cpu_input("total_sequence_length", np.asarray(past + 1, np.int32))
                b.bind_ortvalue_input("past_key", kv)
                b.bind_ortvalue_input("past_value", vv)
                b.bind_output("y")
                b.bind_ortvalue_output("present_key", kv)  # one buffer: the step writes position `past`
                b.bind_ortvalue_output("present_value", vv)

                def fn(sess=sess, b=b):
                    sess.run_with_iobinding(b)
            else:
                feeds = {
                    "x": ort.OrtValue.ortvalue_from_numpy(x),
                    "past_key": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(key[:, :, :past])),
                    "past_value": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value[:, :, :past])),
                }
                if c.rope is not None:  # the new token at position `past`
                    feeds["position_ids"] = ort.OrtValue.ortvalue_from_numpy(np.full((1, 1), past, np.int64))
                names = [o.name for o in sess.get_outputs()]

                def fn(sess=sess, feeds=feeds, names=names):
                    sess.run_with_ort_values(names, feeds)

            steps[impl] = fn
        for impl, runner in openvino.items():
            ov_feeds = {"x": x, "past_key": np.ascontiguousarray(key[:, :, :past]),
                        "past_value": np.ascontiguousarray(value[:, :, :past])}  # fmt: skip
            if c.rope is not None:
                ov_feeds["position_ids"] = np.full((1, 1), past, np.int64)
            steps[impl] = lambda runner=runner, ov_feeds=ov_feeds: runner.run_impl(ov_feeds)
        peer = _TorchPeer(c, tw, past)
        if "torch eager" in impls:
            kc = torch.from_numpy(np.ascontiguousarray(key[:, :, :past]))
            vc = torch.from_numpy(np.ascontiguousarray(value[:, :, :past]))
            xt = torch.from_numpy(x)

            def torch_step(xt=xt, kc=kc, vc=vc, peer=peer):
                with torch.inference_mode():
                    q, k, v = peer.qkv(xt)
                    k_all = torch.cat([kc, k], dim=2)  # the growing cache: a new tensor per step
                    v_all = torch.cat([vc, v], dim=2)
                    return peer.attend(q, k_all, v_all)

            steps["torch eager"] = torch_step
        if "torch static" in impls:
            # transformers' StaticCache: the cache preallocated (here past + 1 positions, all filled by
            # this step), the new token written in place at its position with index_copy_.
            ks = torch.from_numpy(key.copy())
            vs = torch.from_numpy(value.copy())
            xt = torch.from_numpy(x)
            at = torch.tensor([past])

            def static_step(xt=xt, ks=ks, vs=vs, at=at, peer=peer):
                with torch.inference_mode():
                    q, k, v = peer.qkv(xt)
                    ks.index_copy_(2, at, k)
                    vs.index_copy_(2, at, v)
                    return peer.attend(q, ks, vs)

            steps["torch static"] = static_step
        # Rounds, each timing every implementation in a rotated order; the lowest median of the
        # rounds is kept: another process on these shared cores, or one runtime's threads still
        # waking up after another's, slows one round, not all of them.
        samples: dict[str, list[float]] = {f"{impl} {mode}": [] for impl in steps for mode in ("flushed", "warm")}
        order = list(steps)
        for r in range(rounds):
            for impl in order[r % len(order) :] + order[: r % len(order)]:
                progress(f"past {past}: {impl} (round {r + 1}/{rounds})")
                samples[f"{impl} flushed"].append(_median_ms(steps[impl], flush, repeat))
                samples[f"{impl} warm"].append(_median_ms(steps[impl], None, repeat))
        times = {k: min(v) for k, v in samples.items()}
        nbytes = step_bytes(c, past)
        quantized = sorted({i.split()[-1] for i in impls if i.split()[-1] in DECODE_DTYPES[1:]})
        rows.append(DecodeBenchRow(past, nbytes, bandwidth / 1e9, nbytes / bandwidth * 1e3, times,
                                   {k: v / 1e9 for k, v in copies.items()},
                                   {d: step_bytes(c, past, dtype=d) for d in quantized}))  # fmt: skip
    for runner in openvino.values():
        runner.close()
    tmp.cleanup()
    return rows


class _TorchPeer:
    """The torch peers' step, as Hugging Face's eager Llama/Qwen3 attention computes it: the
    projections, q/k RMSNorm (qk_norm), rotary embeddings (cos/sin of position_ids * inv_freq times
    attention_factor, rotate_half or interleaved pairs, on the first rope dim dims), then SDPA
    (grouped heads by enable_gqa) and the out projection. The new token sits at position `past`."""

    def __init__(self, config: AttentionConfig, weights: dict, past: int) -> None:
        import torch

        self.c, self.w = config, weights
        self.position = torch.tensor([[past]], dtype=torch.int64)
        if config.rope is not None:
            inv_freq, self.factor = rope_frequencies(config.rope)
            self.inv_freq = torch.from_numpy(inv_freq.astype(np.float32))

    def _rotate(self, u, cos, sin):
        import torch

        dim = self.c.rope.dim
        rot, rest = u[..., :dim], u[..., dim:]
        if self.c.rope.interleaved:  # pairs (2i, 2i + 1)
            a, b = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        else:  # transformers' rotate_half over cat(freqs, freqs)
            cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
            rot = rot * cos2 + torch.cat((-rot[..., dim // 2 :], rot[..., : dim // 2]), -1) * sin2
        return rot if rest.shape[-1] == 0 else torch.cat((rot, rest), -1)

    def qkv(self, xt):
        import torch.nn.functional as F

        c, w = self.c, self.w
        q = F.linear(xt, w["q_proj.weight"], w.get("q_proj.bias")).view(1, 1, c.n_heads, c.head_dim).transpose(1, 2)
        k = F.linear(xt, w["k_proj.weight"], w.get("k_proj.bias")).view(1, 1, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = F.linear(xt, w["v_proj.weight"], w.get("v_proj.bias")).view(1, 1, c.n_kv_heads, c.v_head_dim).transpose(1, 2)
        if c.qk_norm is not None:
            q = F.rms_norm(q, (c.head_dim,), w["q_norm.weight"], c.qk_norm.eps)
            k = F.rms_norm(k, (c.head_dim,), w["k_norm.weight"], c.qk_norm.eps)
        if c.rope is not None:
            freqs = self.position.float()[..., None] * self.inv_freq  # [1, 1, dim/2]
            cos, sin = (freqs.cos() * self.factor)[:, None], (freqs.sin() * self.factor)[:, None]  # [1, 1, 1, dim/2]
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        return q, k, v

    def attend(self, q, k_all, v_all):
        """The new token's y over the cache: SDPA; with softcap or sinks transformers' eager attention
        (Gemma 2, gpt-oss: the key/value heads repeated, scores, c * tanh(s / c), the sink's logit joined
        to the softmax and dropped after it); with a window the last W keys only (a query at p sees
        p - W < j <= p: a sliding-window cache holds those)."""
        import torch
        import torch.nn.functional as F

        c = self.c
        if c.sliding_window is not None:
            k_all, v_all = k_all[:, :, -c.sliding_window :], v_all[:, :, -c.sliding_window :]
        if c.softcap is None and not c.sinks:
            z = F.scaled_dot_product_attention(q, k_all, v_all, scale=c.softmax_scale,
                                               enable_gqa=c.n_kv_heads != c.n_heads)  # fmt: skip
        else:
            k_all = k_all.repeat_interleave(c.group_size, dim=1)  # transformers' repeat_kv
            v_all = v_all.repeat_interleave(c.group_size, dim=1)
            scores = torch.matmul(q, k_all.transpose(2, 3)) * c.softmax_scale
            if c.softcap is not None:
                scores = torch.tanh(scores / c.softcap) * c.softcap
            if c.sinks:
                sink = self.w["sinks"].reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
                p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                p = torch.softmax(scores, dim=-1)
            z = torch.matmul(p, v_all)
        return F.linear(z.transpose(1, 2).reshape(1, 1, c.v_dim), self.w["out_proj.weight"], self.w.get("out_proj.bias"))
