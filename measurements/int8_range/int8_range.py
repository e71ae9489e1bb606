"""The int8 form's error with 8-bit and 7-bit weights on this machine's CPU.

MLAS's u8s8 GEMM (DynamicQuantizeMatMul) on a CPU without AVX-512 VNNI or AVX-VNNI multiplies with
vpmaddubsw, which adds two u8 * s8 products into a saturating int16: weights in [-127, 127] overflow
it, weights in [-63, 63] cannot (attnx.model.int8). This writes the rel RMS error of the ort-fused
int8 model against the float64 reference for both widths (`int8_bits`, issue 39), with attnx's seeded
weights (uniform, as torch.nn.Linear) and with Gaussian ones (the same RMS; their tails set each
column's scale, so the step is coarser against the weights' RMS).

    python measurements/int8_range/int8_range.py measurements/int8_range/OUT.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

import numpy as np
import onnxruntime as ort

from attnx.export import build_model
from attnx.model import init_weights, preset, reference_attention
from attnx.model.inputs import make_inputs
from attnx.model.int8 import VNNI_FLAGS, has_vnni


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
    return {"cpu": name, "flags": sorted(set(flags)), "vnni": has_vnni(), "vnni_flags": list(VNNI_FLAGS)}


def gaussian(config, seed: int) -> dict[str, np.ndarray]:
    """init_weights with every projection weight redrawn from N(0, 1/(3 fan_in)): the uniform draw's RMS."""
    weights = init_weights(config, seed)
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            weights[name] = (rng.standard_normal(w.shape) / np.sqrt(3 * w.shape[1])).astype(np.float32)
    return weights


def main(out: str) -> None:
    rows = []
    for name in ("tiny", "base", "large"):
        config = preset(name)
        feeds = make_inputs(config, 1, 64, seed=2)
        for draw, weights in (("uniform", init_weights(config, 1)), ("gaussian", gaussian(config, 1))):
            ref = reference_attention(config, weights, **feeds)
            for bits in (8, 7):
                model = build_model(config, weights, "ort-fused", "full", "int8", int8_bits=bits)
                session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                (y,) = session.run(["y"], feeds)
                rel = float(np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2)))
                rows.append({"preset": name, "weights": draw, "weight_bits": bits, "rel_rms": rel})
                print(f"{name:6s} {draw:8s} {bits}-bit weights: rel RMS {rel:.4f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat(), "commit": commit,
              "machine": cpu(), "cpu_count": os.cpu_count(), "onnxruntime": ort.__version__,
              "batch": 1, "seq": 64, "rows": rows}  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
