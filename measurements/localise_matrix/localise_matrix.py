"""The parity matrix with every case localised (issue 23's target: no stage beyond its bound on a passing
case). Every registry config (the tests' registry, tests/conftest.py, as measured: copied below) in
decomposed, onnx and ort-fused (fp32), int8, int4 and fp16; the modern-LLM layers; step models in three
lowerings, int8/int4 and the buffer form; on ort-cpu, openvino and torch, localise="all".

    .venv/bin/python measurements/localise_matrix/localise_matrix.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
import time

from attnx import AttentionConfig, AttnxError, ModelSource, export_model, init_weights, run_decode_parity, run_parity

# The tests' registry of small models (tests/conftest.py) as this matrix measured it, copied so that
# the script stands alone: each feature of the contract once.
CONFIGS: dict[str, AttentionConfig] = {
    "self": AttentionConfig(d_model=32, n_heads=4),
    "cross": AttentionConfig(d_model=32, n_heads=4, cross=True, kv_dim=24, v_head_dim=6),
    "causal": AttentionConfig(d_model=32, n_heads=2, causal=True),
    "kpm": AttentionConfig(d_model=32, n_heads=4, key_padding_mask=True),
    "causal_kpm": AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True, scale=0.2),
    "cross_kpm": AttentionConfig(
        d_model=32, n_heads=2, head_dim=12, v_head_dim=20, cross=True, kv_dim=40, key_padding_mask=True, bias=False
    ),
}
# Modern LLM attention: every new term at once, and a Llama-3-shaped layer.
LLM_CONFIGS: dict[str, AttentionConfig] = {
    "llm": AttentionConfig(
        d_model=48, n_heads=4, n_kv_heads=2, head_dim=12, causal=True, key_padding_mask=True, sliding_window=4,
        softcap=2.0, qk_norm={"eps": 1e-5}, sinks=True,
        rope={"theta": 1000.0, "dim": 8, "interleaved": True,
              "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    ),
    "llama": AttentionConfig(
        d_model=64, n_heads=4, n_kv_heads=2, causal=True, bias=False,
        rope={"theta": 500000.0, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    ),
}  # fmt: skip
# The same terms in the shapes ONNX Runtime's GroupQueryAttention takes ("onnx" drops the sinks).
LLM_FUSED_CONFIGS: dict[str, AttentionConfig] = {
    "ort-fused": dataclasses.replace(LLM_CONFIGS["llm"], head_dim=16, v_head_dim=16),
    "onnx": dataclasses.replace(LLM_CONFIGS["llm"], head_dim=16, v_head_dim=16, sinks=False),
    "buffer": AttentionConfig(
        d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, causal=True, kv_cache=True, sliding_window=4, softcap=2.0,
        qk_norm={"eps": 1e-5}, sinks=True,
        rope={"theta": 1000.0, "dim": 16, "interleaved": True,
              "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    ),
}  # fmt: skip

RUN_BACKENDS = ["ort-cpu", "openvino", "torch"]
STEP = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True, key_padding_mask=True)
STEP_LLM = dataclasses.replace(LLM_FUSED_CONFIGS["ort-fused"], kv_cache=True)


def plans() -> list[tuple[str, AttentionConfig, str, str, str]]:
    """(name, config, lowering, decode form, dtype) of every model the matrix runs."""
    out = []
    for name, c in CONFIGS.items():
        out += [(name, c, att, "growing", "fp32") for att in ("decomposed", "onnx", "ort-fused")]
        if not c.cross:
            out += [(name, c, "decomposed", "growing", "int8"), (name, c, "ort-fused", "growing", "int4"),
                    (name, c, "decomposed", "growing", "fp16")]  # fmt: skip
    out += [(name, c, "decomposed", "growing", "fp32") for name, c in LLM_CONFIGS.items()]
    out += [(f"fused-{att}", c, att, "growing", "fp32") for att, c in LLM_FUSED_CONFIGS.items() if not c.kv_cache]
    out += [("step", STEP, att, "growing", "fp32") for att in ("decomposed", "onnx", "ort-fused")]
    out += [("step", STEP, "ort-fused", "growing", "int8"), ("step", STEP, "decomposed", "growing", "int4")]
    out += [("step-llm", STEP_LLM, att, "growing", "fp32") for att in ("decomposed", "ort-fused")]
    out += [("buffer", LLM_FUSED_CONFIGS["buffer"], "ort-fused", "buffer", "fp32")]
    return out


def main(out_path: str) -> None:
    rows, findings, start = [], [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name, c, att, form, dtype in plans():
            weights = init_weights(c, seed=1)
            path = os.path.join(tmp, f"{name}-{att}-{form}-{dtype}.onnx")
            try:
                export_model(c, path, weights, attention=att, dtype=dtype, validate=False, decode_form=form)
            except AttnxError as e:  # a form the contract refuses: recorded, not run
                rows.append({"config": name, "attention": att, "dtype": dtype, "error": f"export: {e}"})
                continue
            source = ModelSource(c, weights, path, dtype)
            if c.kv_cache:
                report = run_decode_parity(source, RUN_BACKENDS, prefills=(0, 5), steps=4, localise="all")
            else:
                report = run_parity(source, RUN_BACKENDS, batches=(1, 3), seqs=(1, 7, 33),
                                    mem_seqs=(5,) if c.cross else None, localise="all")  # fmt: skip
            for case in report.cases:
                loc = case.localisation or {}
                row = {"config": name, "attention": att, "form": form, "dtype": dtype, "backend": case.backend,
                       "batch": case.batch, "seq": case.seq, "status": case.status, "stage": loc.get("stage"),
                       "error": loc.get("error"), "line": loc.get("line")}  # fmt: skip
                rows.append(row)
                if case.status == "pass" and (loc.get("stage") or loc.get("error")):
                    findings.append(row)
            counts = {s: sum(x.status == s for x in report.cases) for s in ("pass", "fail", "skipped")}
            print(name, att, form, dtype, counts, "findings so far", len(findings), f"{time.time() - start:.0f}s",
                  flush=True)  # fmt: skip
    result = {"machine": platform.processor() or platform.machine(), "cases": len(rows),
              "passing": sum(r.get("status") == "pass" for r in rows),
              "failing": sum(r.get("status") == "fail" for r in rows), "findings": findings, "rows": rows,
              "seconds": time.time() - start}  # fmt: skip
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print("cases", result["cases"], "passing", result["passing"], "failing", result["failing"], "findings",
          len(findings))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
