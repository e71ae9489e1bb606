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
  buffer form rotates inside GroupQueryAttention (do_rotary) at its token index; the torch peers are
  the torch module's own projections and q/k terms (each Term.torch: attnx.model.terms); "torch static" is
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
from attnx.model.contract import BUFFER_CORES, QUANTIZED_DTYPES
from attnx.model.cores import LOWERING_OF_CORE, LOWERINGS, buffer_core_of, core_for
from attnx.model.reference import hidden_keys
from attnx.model.terms import TERMS
from attnx.model.weights import init_weights, weight_shapes
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.decode import bind_cache

__all__ = ["DECODE_DTYPES", "DEFAULT_IMPLS", "DecodeBenchRow", "DecodeImpl", "decode_impls", "measure_bandwidth",
           "run_decode_bench", "step_bytes", "weight_bytes"]

# the step model's weights: float, or quantized projections (fp16 is a GPU's form: gpu_check measures it)
DECODE_DTYPES = ("fp32", *QUANTIZED_DTYPES)


@dataclasses.dataclass(frozen=True)
class DecodeImpl:
    """One implementation of the step the decode bench times: attnx's step model in a lowering, form,
    buffer core and dtype, on ONNX Runtime or OpenVINO, or a torch peer ("eager": torch.cat onto the cache;
    "static": a preallocated cache written in place, as transformers' StaticCache)."""

    runtime: str  # "ort", "openvino" or "torch"
    lowering: str  # a lowering (attnx.model.cores.LOWERINGS), or the torch peer's kind
    form: str = "growing"
    core: str | None = None  # the buffer form's core (None: the default, unnamed in the label)
    dtype: str = "fp32"

    @property
    def label(self) -> str:
        """The name reports and the JSON use: "ort-fused buffer auto int8", "openvino onnx growing", "torch static"."""
        if self.runtime == "torch":
            return f"torch {self.lowering}"
        words = ["openvino"] if self.runtime == "openvino" else []
        words += [self.lowering, self.form, *([self.core] if self.core else []), *([self.dtype] if self.dtype != "fp32" else [])]
        return " ".join(words)

    def unavailable(self, config: AttentionConfig) -> str | None:
        """Why this implementation cannot run `config` (its core's reasons, the registry's), or None."""
        if self.runtime == "torch":  # the peers attend over per-head k and v (_TorchPeer)
            return "the torch peers cache per-head keys and values, not a latent" if config.latent else None
        try:
            core_for(self.lowering, config, self.dtype, self.form, self.core)
        except UsageError as e:
            return str(e)
        return None

    def __str__(self) -> str:
        return self.label


# the lowerings bench times in the growing form, the registry's last (the fused) first
_GROWING = [name for name, lw in reversed(LOWERINGS.items()) if lw.bench and "growing" in lw.cores]


def decode_impls(dtypes: Sequence[str] = ("fp32",), openvino: bool = True) -> list[DecodeImpl]:
    """What `attnx bench --decode` times: attnx's buffer form with each core, its growing forms, OpenVINO on
    the step models it reads, torch's two peers; each quantized dtype's buffer form (the default core and
    auto) and ort-fused growing form after the float ones."""
    # each buffer core under the lowering that writes it, named where it is not that lowering's default
    ort = [DecodeImpl("ort", LOWERING_OF_CORE[core], "buffer", None if core == buffer_core_of(LOWERING_OF_CORE[core])
                      else core) for core in BUFFER_CORES]  # fmt: skip
    ort += [DecodeImpl("ort", lowering) for lowering in _GROWING]
    for dtype in dtypes:
        if dtype != "fp32":
            ort += [DecodeImpl("ort", "ort-fused", "buffer", dtype=dtype),
                    DecodeImpl("ort", "ort-fused", "buffer", "switch", dtype),
                    DecodeImpl("ort", "ort-fused", dtype=dtype)]  # fmt: skip
    # OpenVINO runs the step models of standard ops (runtimes/openvino_runner.py)
    ov = [DecodeImpl("openvino", lw) for lw in _GROWING if not LOWERINGS[lw].contrib] if openvino else []
    return [*ort, *ov, DecodeImpl("torch", "eager"), DecodeImpl("torch", "static")]


DEFAULT_IMPLS = (DecodeImpl("ort", "ort-fused", "buffer"), DecodeImpl("ort", "ort-fused"), DecodeImpl("ort", "onnx"),
                 DecodeImpl("ort", "decomposed", "buffer"), DecodeImpl("ort", "decomposed"), DecodeImpl("torch", "eager"),
                 DecodeImpl("torch", "static"))  # fmt: skip
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
    batch: int = 1  # rows a step, each at the same past

    def bound_for(self, impl: DecodeImpl) -> tuple[int, float]:
        """(bytes per step, bound ms) of `impl`: of its own dtype's weights."""
        nbytes = self.dtype_bytes.get(impl.dtype, self.step_bytes)
        return nbytes, nbytes / self.step_bytes * self.bound_ms

    def ratio(self, impl: DecodeImpl) -> float:
        return self.times_ms[f"{impl.label} flushed"] / self.bound_for(impl)[1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def step_bytes(config: AttentionConfig, past: int, batch: int = 1, itemsize: int = 4, dtype: str = "fp32",
               block_size: int = DEFAULT_BLOCK_SIZE) -> int:  # fmt: skip
    """Bytes one step must move at least: weights (as stored in `dtype`: weight_bytes), the cache
    read (the keys the new token sees of past + 1: with a sliding window W, the last W; in a chunk, its chunk's), the
    new keys/values written, x and y."""
    c = config
    cache_row = c.cache_values() * itemsize * batch  # the cache's layout (cache_specs): keys and values, or a latent
    weights = c.n_params * itemsize if dtype == "fp32" else weight_bytes(c, dtype, block_size)
    seen = int((~hidden_keys(c, past, past + 1)).sum())  # the keys its mask terms let it see (a window's W)
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
    the bound's bandwidth: one thread alone does not saturate memory here (measurements/facts.md)."""
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
    impls: Sequence[DecodeImpl] = DEFAULT_IMPLS,
    progress: Callable[[str], None] = lambda msg: None,
    batch: int = 1,
) -> list[DecodeBenchRow]:
    """The step (one new token a row, `batch` rows each at past P) of every implementation at each past P, timed
    flushed and warm; its bound is step_bytes over the best large copy of the run."""
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
        if impl.runtime == "torch":
            continue
        progress(f"building the step model: {impl}")
        model = build_step_model(c, weights, impl.lowering, impl.form, impl.dtype, DEFAULT_BLOCK_SIZE,
                                 buffer_core=impl.core)  # fmt: skip
        if impl.runtime == "openvino":  # attnx's step model on OpenVINO
            path = os.path.join(tmp.name, f"{impl.lowering}-{impl.form}.onnx")
            onnx.save(model, path)
            openvino[impl.label] = create_runner("openvino", ModelSource(c, weights, path), threads=threads).load()
        else:
            sessions[impl] = _session(model, threads)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 1, c.d_model), dtype=np.float32)
    rows = []
    for past in pasts:
        cap = past + 1
        # the cache as the config's core lays it out (cache_specs): keys and values, or one latent
        cache = [(spec, rng.standard_normal(spec.sized(batch, cap), dtype=np.float32)) for spec in c.cache_specs()]
        pasts_of = {spec.name: np.ascontiguousarray(a.take(range(past), axis=spec.grows)) for spec, a in cache}
        steps: dict[str, Callable[[], Any]] = {}
        for impl, sess in sessions.items():
            if impl.form == "buffer":
                b = sess.io_binding()
                b.bind_cpu_input("x", x)
                b.bind_cpu_input("seqlens_k", np.full(batch, past, np.int32))
                b.bind_cpu_input("total_sequence_length", np.asarray(past + 1, np.int32))
                b.bind_output("y")
                # one buffer each, past and present: the step writes position `past`
                bind_cache(b, [(spec, ort.OrtValue.ortvalue_from_numpy(a)) for spec, a in cache])

                def fn(sess=sess, b=b):
                    sess.run_with_iobinding(b)
            else:
                feeds = {"x": ort.OrtValue.ortvalue_from_numpy(x)}
                feeds.update({name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in pasts_of.items()})
                if c.rope is not None:  # the new token at position `past`
                    feeds["position_ids"] = ort.OrtValue.ortvalue_from_numpy(np.full((batch, 1), past, np.int64))
                names = [o.name for o in sess.get_outputs()]

                def fn(sess=sess, feeds=feeds, names=names):
                    sess.run_with_ort_values(names, feeds)

            steps[impl.label] = fn
        for impl, runner in openvino.items():
            ov_feeds = {"x": x, **pasts_of}
            if c.rope is not None:
                ov_feeds["position_ids"] = np.full((batch, 1), past, np.int64)
            steps[impl] = lambda runner=runner, ov_feeds=ov_feeds: runner.run_impl(ov_feeds)
        labels = {impl.label for impl in impls}
        if labels & {"torch eager", "torch static"}:  # per-head keys and values (DecodeImpl.unavailable)
            peer, (key, value) = _TorchPeer(c, weights, past), (a for _, a in cache)
        if "torch eager" in labels:
            kc, vc = (torch.from_numpy(pasts_of[spec.name]) for spec, _ in cache)
            xt = torch.from_numpy(x)

            def torch_step(xt=xt, kc=kc, vc=vc, peer=peer):
                with torch.inference_mode():
                    q, k, v = peer.qkv(xt)
                    k_all = torch.cat([kc, k], dim=2)  # the growing cache: a new tensor per step
                    v_all = torch.cat([vc, v], dim=2)
                    return peer.attend(q, k_all, v_all)

            steps["torch eager"] = torch_step
        if "torch static" in labels:
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
        nbytes = step_bytes(c, past, batch)
        quantized = sorted({impl.dtype for impl in impls if impl.dtype in QUANTIZED_DTYPES})
        rows.append(DecodeBenchRow(past, nbytes, bandwidth / 1e9, nbytes / bandwidth * 1e3, times,
                                   {k: v / 1e9 for k, v in copies.items()},
                                   {d: step_bytes(c, past, batch, dtype=d) for d in quantized}, batch))  # fmt: skip
    for runner in openvino.values():
        runner.close()
    tmp.cleanup()
    return rows


class _TorchPeer:
    """The torch peers' step, from the torch module's own functions (attnx.model.module, the model
    defined once): its projections and q/k terms (Term.torch: the norms, the rotation at position
    `past`), then the core over the cache as transformers attends: SDPA (grouped heads by enable_gqa),
    or with softcap or sinks its eager attention (Gemma 2, gpt-oss), which is the module's decomposed
    core over the repeated key/value heads; the out projection."""

    def __init__(self, config: AttentionConfig, weights: dict, past: int) -> None:
        import torch

        from attnx.model.module import build_module

        self.c, self.m = config, build_module(config, weights)
        self.position = torch.tensor([[past]], dtype=torch.int64)

    def qkv(self, xt):
        c, m, rows = self.c, self.m, xt.shape[0]
        q = m.q_proj(xt).view(rows, 1, c.n_heads, c.head_dim)
        k = m.k_proj(xt).view(rows, 1, c.n_kv_heads, c.head_dim)
        for term in m._terms["qk"]:  # qk_norm, rope
            q, k = TERMS[term].torch(m, q, k, self.position.expand(rows, 1), self.position[0])
        v = m.v_proj(xt).view(rows, 1, c.n_kv_heads, c.v_head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q, k_all, v_all):
        """The new token's y over the cache, the keys its mask terms let it see only (a window's last W, as a
        sliding-window cache holds them; a chunk's own)."""
        import torch.nn.functional as F

        c, m = self.c, self.m
        seen = ~hidden_keys(c, k_all.shape[2] - 1, k_all.shape[2])  # a window's last W keys, a chunk's own
        if not seen.all():
            k_all, v_all = k_all[:, :, seen], v_all[:, :, seen]
        if not {"softcap", "sinks"} & set(c.terms):  # eager attention for these (the peers' rule)
            z = F.scaled_dot_product_attention(q, k_all, v_all, scale=c.softmax_scale,
                                               enable_gqa=c.n_kv_heads != c.n_heads)  # fmt: skip
        else:  # transformers' repeat_kv, then eager attention: the module's decomposed core
            z = m._decomposed(q, k_all.repeat_interleave(c.group_size, dim=1),
                              v_all.repeat_interleave(c.group_size, dim=1), None)  # fmt: skip
        return m.out_proj(z.transpose(1, 2).reshape(q.shape[0], 1, c.v_dim))
