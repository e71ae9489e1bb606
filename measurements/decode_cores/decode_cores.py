"""The attention core of one decode step alone, on a grouped-heads cache: which kernel reads the
cache how fast (docs/how-to/benchmark.md, "The decode step": why grouped heads are read more slowly per byte).

A preset's layer shape (default llama3-8b: 32 query heads on 8 key/value heads of 128), batch 1, one
new token over a cache of `past` positions (+1, the token's own), 2 threads, fp32; the projections
left out (they are GEMVs at the copy bound in every form). Each core is timed flushed (a 256 MB read
before each step, as `attnx bench --decode`) and warm (back to back), the median of 30:

- ort gqa: com.microsoft.GroupQueryAttention on the shared buffer (the buffer form's default core);
- ort mha grouped rows: com.microsoft.MultiHeadAttention with a group's query heads as rows, on the
  shared buffer, with the attention_bias the grouped core passes (--buffer-core grouped-mha);
- torch sdpa enable_gqa: scaled_dot_product_attention(enable_gqa=True), the static-cache peer's;
- torch sdpa grouped rows: the query heads of a group as rows of their kv head's query, what
  transformers does for a one-token step when it passes a mask (pack_gqa).

The bound: the cache's bytes (keys and values) over the copy bandwidth of `attnx bench --decode`.

    .venv/bin/python measurements/decode_cores/decode_cores.py [--preset llama3-8b] [--past 2048,8192]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from attnx.bench import measure_bandwidth

# Internal helpers, on purpose: attnx bench --decode's own cache flush and timing loop, so that these
# cores are timed exactly as the decode bench times its steps. No public name offers them.
from attnx.bench._decode import _Flusher, _median_ms
from attnx.model.config import preset
from attnx.model.contract import IR_VERSION, MS_DOMAIN

THREADS = 2


def _session(node: helper.NodeProto, inputs: list) -> ort.InferenceSession:
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.output]
    graph = helper.make_graph([node], "core", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)],
                              ir_version=IR_VERSION)  # fmt: skip
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _bound_step(sess: ort.InferenceSession, feeds: dict, key: np.ndarray, value: np.ndarray) -> Callable[[], None]:
    """One step on one buffer bound as the op's past and present (written in place)."""
    kv, vv = ort.OrtValue.ortvalue_from_numpy(key.copy()), ort.OrtValue.ortvalue_from_numpy(value.copy())
    b = sess.io_binding()
    for name, arr in feeds.items():
        b.bind_cpu_input(name, arr)
    b.bind_ortvalue_input("past_key", kv)
    b.bind_ortvalue_input("past_value", vv)
    b.bind_output("z")
    b.bind_ortvalue_output("present_key", kv)
    b.bind_ortvalue_output("present_value", vv)
    return lambda: sess.run_with_iobinding(b)


def cores(H: int, Hkv: int, hd: int, past: int, rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    G, total = H // Hkv, past + 1
    key = rng.standard_normal((1, Hkv, total, hd), dtype=np.float32)
    value = rng.standard_normal((1, Hkv, total, hd), dtype=np.float32)
    vi = helper.make_tensor_value_info
    cache = [vi("past_key", TensorProto.FLOAT, list(key.shape)), vi("past_value", TensorProto.FLOAT, list(value.shape))]
    new = {"k": rng.standard_normal((1, 1, Hkv * hd), dtype=np.float32),
           "v": rng.standard_normal((1, 1, Hkv * hd), dtype=np.float32)}  # fmt: skip
    kv_in = [vi(n, TensorProto.FLOAT, [1, 1, Hkv * hd]) for n in "kv"]
    out = ["z", "present_key", "present_value"]
    gqa = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"], out,
                           domain=MS_DOMAIN, num_heads=H, kv_num_heads=Hkv, scale=hd**-0.5)  # fmt: skip
    gqa_in = [vi("q", TensorProto.FLOAT, [1, 1, H * hd]), *kv_in, *cache, vi("seqlens_k", TensorProto.INT32, [1]),
              vi("total", TensorProto.INT32, [])]  # fmt: skip
    gqa_feeds = {"q": rng.standard_normal((1, 1, H * hd), dtype=np.float32), **new,
                 "seqlens_k": np.array([past], np.int32), "total": np.array(total, np.int32)}  # fmt: skip
    mha = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "bias", "past_key", "past_value", "past_len"],
                           out, domain=MS_DOMAIN, num_heads=Hkv, scale=hd**-0.5)  # fmt: skip
    mha_in = [vi("q", TensorProto.FLOAT, [1, G, Hkv * hd]), *kv_in, vi("bias", TensorProto.FLOAT, [1, 1, G, total]),
              *cache, vi("past_len", TensorProto.INT32, [1])]  # fmt: skip
    mha_feeds = {"q": rng.standard_normal((1, G, Hkv * hd), dtype=np.float32), **new,
                 "bias": np.zeros((1, 1, G, total), np.float32), "past_len": np.array([past], np.int32)}  # fmt: skip
    tq, tk, tv = torch.randn(1, H, 1, hd), torch.from_numpy(key.copy()), torch.from_numpy(value.copy())

    def sdpa_gqa() -> torch.Tensor:
        with torch.inference_mode():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    def sdpa_rows() -> torch.Tensor:
        with torch.inference_mode():
            return torch.nn.functional.scaled_dot_product_attention(tq.reshape(1, Hkv, G, hd), tk, tv)

    return {
        "ort gqa": _bound_step(_session(gqa, gqa_in), gqa_feeds, key, value),
        "ort mha grouped rows": _bound_step(_session(mha, mha_in), mha_feeds, key, value),
        "torch sdpa enable_gqa": sdpa_gqa,
        "torch sdpa grouped rows": sdpa_rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--past", default="2048,8192")
    args = ap.parse_args()
    c = preset(args.preset)
    torch.set_num_threads(THREADS)
    bandwidth = max(measure_bandwidth(THREADS).values())
    flush, rng = _Flusher(), np.random.default_rng(0)
    print(f"{args.preset}: {c.n_heads} query heads on {c.n_kv_heads} kv heads of {c.head_dim}, {THREADS} threads, "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    print(f"{'past':>5}  {'core':<24} {'flushed ms':>10} {'warm ms':>8} {'x bound':>8} {'GB/s flushed':>12}")
    for past in (int(p) for p in args.past.split(",")):
        nbytes = 2 * c.n_kv_heads * (past + 1) * c.head_dim * 4
        for name, fn in cores(c.n_heads, c.n_kv_heads, c.head_dim, past, rng).items():
            cold, warm = _median_ms(fn, flush, 30), _median_ms(fn, None, 30)
            print(f"{past:>5}  {name:<24} {cold:>10.3f} {warm:>8.3f} {cold / (nbytes / bandwidth * 1e3):>8.2f} "
                  f"{nbytes / cold / 1e6:>12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
