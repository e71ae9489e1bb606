"""Writing a graph two ways: traced from the torch module (torch.onnx's dynamo exporter, what the
decomposed full-sequence form still is) and emitted from the registry (attnx.export.build_model, what
every other lowering is). Why attnx writes lowerings from the registry rather than rewriting the torch
export: the seconds below, and that the rewrite rules could not express the caches, the buffer form or
the modern-LLM terms (those were built node by node anyway).

    python measurements/build_paths/build_paths.py measurements/build_paths/build_paths.json

Each row: the median of 3 fresh builds in this process (the exporter's trace cache cleared before each).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch

from attnx.export import build_model, export_onnx
from attnx.export._export import TRACES
from attnx.model import init_weights, preset


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _median(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        TRACES.clear()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(out: str) -> None:
    rows = []
    for name in ("tiny", "base", "large", "llama3-8b"):
        config = preset(name)
        weights = init_weights(config, 0)
        row = {"preset": name}
        if not config.llm_keys:  # the torch export of a modern-LLM config is the decomposed form alone too
            row["torch_export_decomposed_s"] = _median(lambda c=config, w=weights: export_onnx(c, w))
        row["emit_decomposed_s"] = _median(lambda c=config, w=weights: build_model(c, w, "decomposed"))
        row["emit_ort_fused_s"] = _median(lambda c=config, w=weights: build_model(c, w, "ort-fused"))
        rows.append(row)
        print(row)
    result = {"command": " ".join(sys.argv), "machine": {"cpu": _cpu(), "threads": torch.get_num_threads()},
              "torch": torch.__version__, "rows": rows}  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
