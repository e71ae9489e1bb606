"""The int8 form's error with 8-bit and 7-bit weights on this machine's CPU.

MLAS's u8s8 GEMM (DynamicQuantizeMatMul) on a CPU without AVX-512 VNNI or AVX-VNNI multiplies with
vpmaddubsw, which adds two u8 * s8 products into a saturating int16: weights in [-127, 127] overflow
it, weights in [-63, 63] cannot (attnx.export.passes.quantize.INT8_WEIGHT_MAX). This writes the rel
RMS error of the ort-fused int8 model against the float64 reference for both ranges.

    python measurements/int8_range/int8_range.py measurements/int8_range/int8_range.json
"""

from __future__ import annotations

import json
import platform
import sys

import numpy as np
import onnxruntime as ort

import attnx.export.passes.quantize as quantize
from attnx.export import build_model
from attnx.model import init_weights, preset, reference_attention
from attnx.model.inputs import make_inputs


def cpu() -> dict:
    name, flags = platform.processor(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = [x for x in line.split(":", 1)[1].split() if "avx" in x or "vnni" in x or "amx" in x]
                    break
    except OSError:
        pass
    return {"cpu": name, "flags": sorted(set(flags))}


def main(out: str) -> None:
    rows = []
    for name in ("tiny", "base", "large"):
        config = preset(name)
        weights = init_weights(config, 1)
        feeds = make_inputs(config, 1, 64, seed=2)
        ref = reference_attention(config, weights, **feeds)
        for bits, qmax in ((8, 127), (7, 63)):
            quantize.INT8_WEIGHT_MAX = qmax
            model = build_model(config, weights, "ort-fused", "full", "int8")
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            (y,) = session.run(["y"], feeds)
            rel = float(np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2)))
            rows.append({"preset": name, "weight_bits": bits, "rel_rms": rel})
            print(f"{name:6s} {bits}-bit weights: rel RMS {rel:.4f}")
    result = {"command": " ".join(sys.argv), "machine": cpu(), "onnxruntime": ort.__version__, "batch": 1, "seq": 64,
              "rows": rows}  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
