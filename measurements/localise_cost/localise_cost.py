"""What localising a failing case costs against the case's own parity time (issue 23's target: at most
3x on the tiny and base presets).

The case's parity time: run_parity of that one case on that backend (its session, the reference, the
run, the comparison), localise="off". The localisation: the same call with localise="failing" less
that time. The fault: the decomposed graph's scale constant x1.25; the ort-fused graph's
MultiHeadAttention scale attribute x1.25 (a fault inside the fused operator: the look inside runs).
Median of 5 each.

    .venv/bin/python measurements/localise_cost/localise_cost.py OUT.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import onnx
from onnx import numpy_helper

from attnx.model.config import preset
from attnx.model.weights import init_weights
from attnx.runtimes import ModelSource
from attnx.runtimes.parity import run_parity
from attnx.workflows import export_model


def plant(path: str, out: str) -> None:
    model = onnx.load(path)
    node = next((n for n in model.graph.node if "scores" in n.output), None)
    if node is not None:
        scale = next(t for t in model.graph.initializer if t.name in node.input)
        scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 1.25, scale.name))
    else:
        mha = next(n for n in model.graph.node if n.op_type == "MultiHeadAttention")
        next(a for a in mha.attribute if a.name == "scale").f *= 1.25
    onnx.save(model, out)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def main(out_path: str) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tiny", "base"):
            config = preset(name)
            weights = init_weights(config, 0)
            for attention in ("decomposed", "ort-fused"):
                good = os.path.join(tmp, f"{name}-{attention}.onnx")
                bad = os.path.join(tmp, f"{name}-{attention}-fault.onnx")
                export_model(config, good, weights, attention=attention, validate=False)
                plant(good, bad)
                source = ModelSource(config, weights, bad)
                for backend in ("ort-cpu", "openvino"):
                    for seq in (7, 128):
                        parity, localise = [], []
                        for _ in range(5):
                            start = time.perf_counter()
                            plain = run_parity(source, [backend], batches=(3,), seqs=(seq,), localise="off")
                            parity.append(time.perf_counter() - start)
                            start = time.perf_counter()
                            found = run_parity(source, [backend], batches=(3,), seqs=(seq,), localise="failing")
                            localise.append(time.perf_counter() - start - parity[-1])
                        loc = found.cases[0].localisation or {}
                        assert plain.cases[0].status == "fail" and loc.get("stage"), loc
                        row = {"preset": name, "attention": attention, "backend": backend, "batch": 3, "seq": seq,
                               "parity_ms": 1e3 * statistics.median(parity),
                               "localise_ms": 1e3 * statistics.median(localise),
                               "stage": loc["stage"], "cause": loc.get("cause")}  # fmt: skip
                        row["ratio"] = row["localise_ms"] / row["parity_ms"]
                        print(f"{name:5s} {attention:10s} {backend:8s} seq {seq:4d}  parity {row['parity_ms']:7.1f} ms  "
                              f"localise {row['localise_ms']:7.1f} ms  x{row['ratio']:.2f}  stage {row['stage']}",
                              flush=True)  # fmt: skip
                        rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"cpu": cpu_name(), "threads": os.environ.get("ATTNX_THREADS"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
