"""One timed generation by ONNX Runtime GenAI 0.18's Generator (one static batch of prompts of one length), run in
its own venv: `GENAI_PYTHON genai_worker.py SPEC.json`; prints one JSON line. The generation itself is
measurements/generate_throughput/genai_worker.py's generator_run (imported by path, as it is: a warm-up of the same
prompts with 4 new tokens, then the timed run, the end-of-sequence token masked until `new` tokens). What differs
is the session: `intra_op_num_threads` = spec["threads"], and with spec["no_spin"] the pools' spinning off
(session.intra_op/inter_op.allow_spinning "0", as genai_config's session_options passes any other key as a
session config entry).

The spec: {"model": folder, "prompts": [[ids]], "new": N, "threads": T, "no_spin": bool}.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import sys
from pathlib import Path

import onnxruntime
import onnxruntime_genai as og

HERE = Path(__file__).resolve().parent


def throughput_worker():
    spec = importlib.util.spec_from_file_location("genai_throughput_worker",
                                                  HERE.parent / "generate_throughput" / "genai_worker.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(spec: dict) -> og.Model:
    longest = max(len(p) for p in spec["prompts"]) + spec["new"]
    options = {"intra_op_num_threads": spec["threads"], "inter_op_num_threads": 1}
    if spec.get("no_spin"):
        options.update({"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"})
    config = og.Config(spec["model"])
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}},
                               "search": {"max_length": longest, "do_sample": False}}))  # fmt: skip
    return og.Model(config)


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    run = throughput_worker().generator_run
    model = load(spec)
    run(model, spec["prompts"], 4)  # warm-up: the same prefill, a few steps
    seconds, first, tokens = run(model, spec["prompts"], spec["new"])
    print(json.dumps({"seconds": seconds, "first_token_s": first, "new_tokens": tokens,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "onnxruntime": onnxruntime.__version__,
                      "onnxruntime_genai": getattr(og, "__version__", None)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
