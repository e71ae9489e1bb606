"""The buffer form's prefill with each core (docs/concepts/step-forms.md, "The buffer form": why GroupQueryAttention stays the
default and what auto keeps of each): the prompt of `seq` tokens written into an empty shared cache
in one call, batch 1, fp32, 2 threads, ONNX Runtime's CPU provider, the median of `repeat` calls.

    .venv/bin/python measurements/buffer_prefill/buffer_prefill.py [--preset llama3-8b] [--seq 2048,4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

from attnx.export import build_step_model
from attnx.model.config import preset
from attnx.model.contract import BUFFER_CORES
from attnx.model.weights import init_weights

THREADS = 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--seq", default="2048,4096")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    c = dataclasses.replace(preset(args.preset), causal=True, key_padding_mask=False, cross=False, kv_cache=True)
    weights = init_weights(c, 0)
    seqs = [int(s) for s in args.seq.split(",")]
    rng = np.random.default_rng(0)
    print(f"{args.preset}: buffer form prefill, batch 1, fp32, {THREADS} threads, median of {args.repeat} (ms)")
    print(f"{'core':<12} " + " ".join(f"{f'seq {s}':>10}" for s in seqs))
    with tempfile.TemporaryDirectory(prefix="attnx-prefill-") as tmp:
        for core in BUFFER_CORES:
            path = os.path.join(tmp, f"{core}.onnx")
            onnx.save(build_step_model(c, weights, "ort-fused", "buffer", buffer_core=core), path)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = THREADS
            opts.log_severity_level = 3
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            row = []
            for seq in seqs:
                x = rng.standard_normal((1, seq, c.d_model), dtype=np.float32)
                key = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, c.n_kv_heads, seq, c.head_dim), np.float32))
                value = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, c.n_kv_heads, seq, c.v_head_dim), np.float32))
                b = sess.io_binding()
                b.bind_cpu_input("x", x)
                b.bind_cpu_input("seqlens_k", np.full(1, seq - 1, np.int32))
                b.bind_cpu_input("total_sequence_length", np.asarray(seq, np.int32))
                b.bind_ortvalue_input("past_key", key)
                b.bind_ortvalue_input("past_value", value)
                b.bind_output("y")
                b.bind_ortvalue_output("present_key", key)
                b.bind_ortvalue_output("present_value", value)
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    sess.run_with_iobinding(b)
                    times.append(time.perf_counter() - t)
                row.append(statistics.median(times) * 1e3)
            del sess
            print(f"{core:<12} " + " ".join(f"{t:>10.0f}" for t in row))


if __name__ == "__main__":
    main()
