"""One timed generation by ONNX Runtime GenAI 0.18, run in its own venv (it brings plain onnxruntime, never attnx's):
its Engine (requests of their own lengths, scheduled by the engine) or its Generator (one static batch of prompts of
one length). Called by run.py as `GENAI_PYTHON genai_worker.py SPEC.json`; prints one JSON line: the seconds of the
whole generation, each request's seconds to its first new token and its new tokens.

The spec: {"model": folder, "mode": "engine" | "generator", "prompts": [[ids]], "new": N, "threads": T}. Both modes
get `search.max_length` = the longest prompt + N (the cache GenAI allocates) and the end-of-sequence token masked
until N tokens (min length), so that every request makes N new tokens; first a warm-up of the same requests with 4
new tokens each (ONNX Runtime's arena grows to the run's shapes), untimed.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import onnxruntime_genai as og


def load(spec: dict) -> og.Model:
    longest = max(len(p) for p in spec["prompts"]) + spec["new"]
    config = og.Config(spec["model"])
    config.overlay(json.dumps({
        "model": {"decoder": {"session_options": {"intra_op_num_threads": spec["threads"],
                                                  "inter_op_num_threads": 1}}},
        "search": {"max_length": longest, "do_sample": False},
        "engine": {"static_batching": {"max_batch_size": len(spec["prompts"])}},
    }))  # fmt: skip
    return og.Model(config)


def engine_run(model: og.Model, prompts: list[list[int]], new: int) -> tuple[float, list[float], list[int]]:
    """Every prompt a Request of one turn, all given to the Engine at once; run until none is pending."""
    engine = og.Engine(model)
    start = time.perf_counter()
    requests = []
    for prompt in prompts:
        request = engine.create_request(options=og.RequestOptions())
        turn = og.TurnOptions(request)
        turn.set_max_generated_tokens(new)
        turn.set_min_generated_tokens(new)
        request.begin_turn(np.asarray(prompt, np.int32), turn)
        requests.append(request)
    index = {id(r): i for i, r in enumerate(requests)}
    first = [0.0] * len(prompts)
    tokens = [0] * len(prompts)
    events = engine.create_event_buffer(4 * len(prompts))
    while engine.has_pending_requests():
        for event in engine.run(events):
            if event.flags == og.EngineEventFlags.FAILED:
                raise SystemExit(f"GenAI's Engine failed a request: {event.error_code}")
            i = next((index[id(r)] for r in requests if r is event.request), None)
            if i is None:
                continue
            tokens[i] += 1
            if tokens[i] == 1:
                first[i] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    for request in requests:
        request.close()
    return seconds, first, tokens


def generator_run(model: og.Model, prompts: list[list[int]], new: int) -> tuple[float, list[float], list[int]]:
    """The prompts as one static batch (they must have one length): the prompt appended, then a token a call."""
    length = len(prompts[0])
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=len(prompts), max_length=length + new, min_length=length + new,
                              do_sample=False)  # fmt: skip
    start = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompts, np.int32))
    first = None
    while not generator.is_done():
        generator.generate_next_token()
        if first is None:
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    tokens = [len(generator.get_sequence(i)) - length for i in range(len(prompts))]
    return seconds, [first] * len(prompts), tokens


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    model = load(spec)
    run = engine_run if spec["mode"] == "engine" else generator_run
    run(model, spec["prompts"], 4)  # warm-up: the same shapes' prefills, a few steps
    seconds, first, tokens = run(model, spec["prompts"], spec["new"])
    print(json.dumps({"seconds": seconds, "first_token_s": first, "new_tokens": tokens,
                      "onnxruntime_genai": og.__version__ if hasattr(og, "__version__") else None}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
