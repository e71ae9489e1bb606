"""One timed generation by llama.cpp through llama-cpp-python (built from its source distribution), run in its own
venv: `LLAMA_PY llamacpp_worker.py SPEC.json`; prints one JSON line, as genai_worker.py does.

The spec: {"gguf": file, "prompts": [[ids]], "new": N, "threads": T}. llama-cpp-python's Llama object holds one
sequence: the prompts are served one after another (its high-level API has no batch of sequences), each a prefill
of the prompt (n_batch 512) then `new` greedy tokens (top_k 1, temperature 0), the end-of-sequence token never
ending a row (generate() yields whatever is sampled; it does not stop). A warm-up of the first prompt with 4 new
tokens comes first, untimed. first_token_s: each request's first new token, from the start of the timed run.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import llama_cpp


def serve(llm: llama_cpp.Llama, prompts: list[list[int]], new: int, start: float) -> tuple[list[float], list[int]]:
    first, counts = [], []
    for prompt in prompts:
        llm.reset()
        n = 0
        for _token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if n == 1:
                first.append(time.perf_counter() - start)
            if n >= new:
                break
        counts.append(n)
    return first, counts


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    longest = max(len(p) for p in spec["prompts"]) + spec["new"]
    llm = llama_cpp.Llama(spec["gguf"], n_ctx=longest + 8, n_batch=512, n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], logits_all=False, verbose=False)  # fmt: skip
    serve(llm, spec["prompts"][:1], 4, time.perf_counter())  # warm-up
    start = time.perf_counter()
    first, counts = serve(llm, spec["prompts"], spec["new"], start)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "first_token_s": first, "new_tokens": counts,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "llama_cpp_python": llama_cpp.__version__}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
