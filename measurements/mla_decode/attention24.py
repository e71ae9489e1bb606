"""Whether ONNX Runtime's Attention-24 reads only the filled positions of a buffer (its nonpad_kv_seqlen input): one
step of 16 heads over one latent key/value head of 576 values (MLA's absorbed step, batch 4), fp32, 2 threads; its
error against numpy over the first n positions, and its median time of 15 calls, at each (capacity, n).

    python attention24.py
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

B, H, D = 4, 16, 576


def model() -> onnx.ModelProto:
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f32, [B, H, 1, D]),
              helper.make_tensor_value_info("k", f32, [B, 1, None, D]),
              helper.make_tensor_value_info("v", f32, [B, 1, None, D]),
              helper.make_tensor_value_info("n", TensorProto.INT64, [B])]  # fmt: skip
    node = helper.make_node("Attention", ["q", "k", "v", "", "", "", "n"], ["y"], scale=0.1)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", f32, [B, H, 1, D])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


def main() -> None:
    m = model()
    onnx.checker.check_model(m)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    session = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, 1, D), dtype=np.float32)
    for capacity, n in ((4096, 4096), (8192, 4096), (8192, 8192)):
        k = rng.standard_normal((B, 1, capacity, D), dtype=np.float32)
        feeds = {"q": q, "k": k, "v": k, "n": np.full(B, n, np.int64)}
        y = session.run(None, feeds)[0]
        scores = np.einsum("bhd,btd->bht", q[:, :, 0], k[:, 0, :n]) * 0.1
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("bht,btd->bhd", p / p.sum(-1, keepdims=True), k[:, 0, :n])
        times = []
        for _ in range(15):
            t = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - t)
        print(f"capacity {capacity}, n {n}: max error {np.abs(y[:, :, 0] - want).max():.2e}, "
              f"{np.median(times) * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
