"""The control for --weights' distance on a random-weight model: every MatMul weight of the fp32 export perturbed by
Gaussian noise of int8's rounding RMS (each column's max |w| / 127 / sqrt(12)), then the same distance
(attnx.workflows.rewrite.weights.weights_distance). A model whose logits move as far under that noise as under int8
is chaotic in its weights: the distance is the model's, not the quantizer's.

    python measurements/weights_int4/noise_control.py EXPORT/model.onnx SCRATCH_DIR
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnx_ir as ir

from attnx.workflows.rewrite.weights import weights_distance


def main(model: str, scratch: str) -> None:
    m = ir.load(model)
    rng = np.random.default_rng(0)
    for node in m.graph:
        weight = node.inputs[1] if node.op_type == "MatMul" else None
        if weight is not None and weight.const_value is not None:
            w = weight.const_value.numpy()
            rms = np.abs(w).max(axis=0, keepdims=True) / 127 / np.sqrt(12)
            weight.const_value = ir.tensor((w + rng.standard_normal(w.shape) * rms).astype(np.float32), name=weight.name)
    path = os.path.join(scratch, "noisy.onnx")
    ir.save(m, path, external_data="noisy.onnx.data")
    d = weights_distance(model, path)
    print(json.dumps({k: d[k] for k in ("rel_rms", "top1", "worst_rel_rms", "worst_top1")}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
