"""attnx's package of ONNX Runtime GenAI's int4 CPU model against GenAI's own Generator on that model: new tokens per
second at 1 and 8 requests (prompt lengths drawn in 64-256, seeded; 64 new tokens each, greedy), a Qwen2.5-0.5B-shaped
checkpoint (make_checkpoint.py) built by GenAI 0.18's builder (`python -m onnxruntime_genai.models.builder -i CKPT
-o MODEL -p int4 -e cpu`) and packaged by `attnx build --model MODEL/model.onnx --checkpoint CKPT --out PKG`
(build.py records that step).

    attnx            attnx.load(PKG).generate(prompts, max_new_tokens=64, max_batch=N), this venv's attnx and its
                     onnxruntime; the engine batches as the package allows (GenerateStats.largest_batch is recorded)
    GenAI Generator  og.Generator on the builder's model, in its own venv (--genai-python: its plain onnxruntime),
                     one static batch: at 8 requests each prompt cut or extended to the mean of the drawn lengths,
                     so the batch holds as many prompt tokens (measurements/generate_throughput's rule)
    llama.cpp        llama-cpp-python's Llama on a GGUF of the same checkpoint (--gguf, make_gguf.py: f32, Q4_0),
                     in its own venv (--llamacpp-python), n_threads 2; one sequence at a time (its API's), so at 8
                     requests the prompts are served in turn (llamacpp_worker.py)

Each system runs in a process of its own: load, one untimed warm-up of the same prompts with 4 new tokens, then the
timed generation. Both get 2 intra-op threads and the thread pools' spinning off (session.intra_op.allow_spinning
and inter_op "0": attnx's runner's session options patched in the worker, GenAI's through genai_config's
session_options; --spin leaves both at ONNX Runtime's default). Rounds interleave the systems: every round runs
each request count through each system in turn. The table gives each system's best and median round.

    python measurements/int4_package/run.py --package PKG [--package LABEL=PKG ...] --genai-model MODEL
        [--genai-python PY] [--gguf LABEL=FILE ...] [--llamacpp-python PY] [--rounds 3] [--requests 1,8] [--new 64]
        [--spin] [--json OUT]

--package may be given more than once: each package is a system of its own, "attnx" unlabelled, "attnx LABEL" when
given as LABEL=PKG (e.g. own-int4=PKG for attnx's own --weights int4 build of the checkpoint's fp32 export); every
one of them runs in each round and gets its ratio to GenAI's Generator.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NEW = 64
LENGTHS = (64, 256)
THREADS = 2
GENAI = "GenAI Generator"
LLAMA_CPP = "llama.cpp"
PRODUCT = ("attnx", "model", "export", "runtimes", "workflows", "bench", "matrix")


def cpu() -> dict[str, object]:
    """lscpu's model name, the AVX-512 / AMX flags, the cores."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = re.search(r"^Model name:\s*(.+)$", text, re.M)
    flags = re.search(r"^Flags:\s*(.+)$", text, re.M)
    wanted = sorted({f for f in (flags.group(1).split() if flags else []) if f.startswith(("avx512", "amx"))})
    return {"model": name.group(1).strip() if name else platform.processor(), "flags": wanted,
            "cores": os.cpu_count()}  # fmt: skip


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", *PRODUCT) else "")


def prompts_for(requests: int, vocab: int) -> list[list[int]]:
    """`requests` prompts, lengths drawn in LENGTHS, ids in 1..vocab-1: the same for every system and round."""
    rng = np.random.default_rng([64, requests])
    lengths = rng.integers(LENGTHS[0], LENGTHS[1] + 1, requests)
    return [[int(t) for t in rng.integers(1, vocab, n)] for n in lengths]


def equal_length(prompts: list[list[int]]) -> list[list[int]]:
    """The Generator's static batch: each prompt cut or extended (its own ids repeated) to the mean length."""
    n = round(statistics.mean(len(p) for p in prompts))
    return [(p * (n // len(p) + 1))[:n] for p in prompts]


def attnx_worker(spec: dict) -> dict:
    """attnx.load(package).generate in this process (its spinning off unless spec["spin"])."""
    import onnxruntime

    import attnx
    from attnx.runtimes import ort_runner

    if not spec["spin"]:
        made = ort_runner.OrtRunner.make_session_options

        def no_spin(self):
            opts = made(self)
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
            return opts

        ort_runner.OrtRunner.make_session_options = no_spin
    prompts = spec["prompts"]
    first = [0.0] * len(prompts)

    def on_finish(request) -> None:
        first[request.index] = request.first_token_s

    with attnx.load(spec["package"]) as model:
        model.generate(prompts, max_new_tokens=4, max_batch=len(prompts))  # warm-up
        start = time.perf_counter()
        tokens = model.generate(prompts, max_new_tokens=spec["new"], max_batch=len(prompts), on_finish=on_finish)
        seconds = time.perf_counter() - start
        stats = model.stats
        form = model.manifest.get("decode", {}).get("form")
    return {"seconds": seconds, "first_token_s": first, "new_tokens": [len(t) for t in tokens],
            "prefills": stats.prefills, "steps": stats.steps, "largest_batch": stats.largest_batch,
            "decode_form": form, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "onnxruntime": onnxruntime.__version__}  # fmt: skip


def run_worker(system: str, spec: dict, genai_python: str, llama_python: str | None = None) -> dict:
    """One system's timed generation in a process of its own; its JSON line, the load average before and after."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, ATTNX_THREADS=str(THREADS), OMP_NUM_THREADS=str(THREADS))
    if system == GENAI:
        command = [genai_python, str(HERE / "genai_worker.py"), f.name]
    elif system.startswith(LLAMA_CPP):
        command = [llama_python, str(HERE / "llamacpp_worker.py"), f.name]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", f.name]
    load = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    result["tokens_per_s"] = sum(result["new_tokens"]) / result["seconds"]
    result["mean_first_token_s"] = statistics.mean(result["first_token_s"])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", action="append", default=[],
                   help="attnx's package of the builder's model (build.py); repeatable, LABEL=PKG names the system "
                        "'attnx LABEL'")  # fmt: skip
    p.add_argument("--genai-model", help="the builder's int4 model folder (genai_config.json, model.onnx)")
    p.add_argument("--genai-python", default="/tmp/int4work/genai-venv/bin/python",
                   help="a Python with onnxruntime-genai 0.18 (its own venv)")  # fmt: skip
    p.add_argument("--gguf", action="append", default=[],
                   help="a GGUF of the same checkpoint (make_gguf.py) served by llama.cpp; repeatable, LABEL=FILE "
                        "names the system 'llama.cpp LABEL'")  # fmt: skip
    p.add_argument("--llamacpp-python", default="/tmp/llama-venv/bin/python",
                   help="a Python with llama-cpp-python (built from its source distribution) for --gguf")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", default="1,8")
    p.add_argument("--systems", default=None, help="a comma-separated subset of the systems (default all)")
    p.add_argument("--new", type=int, default=NEW, help=f"new tokens a request (default {NEW})")
    p.add_argument("--spin", action="store_true", help="leave ONNX Runtime's thread pools spinning (its default)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        with open(args.worker) as f:
            print(json.dumps(attnx_worker(json.load(f))))
        return 0
    if not args.package or not args.genai_model:
        p.error("--package and --genai-model are required")

    import onnxruntime

    packages: dict[str, str] = {}
    for given in args.package:
        label, _, path = given.rpartition("=")
        packages[f"attnx {label}" if label else "attnx"] = path
    manifests = {s: json.loads((Path(path) / "manifest.json").read_text()) for s, path in packages.items()}
    vocabs = {m["vocab"] for m in manifests.values()}
    if len(vocabs) != 1:
        p.error(f"the packages' vocabularies differ: {sorted(vocabs)}")
    vocab = vocabs.pop()
    ggufs: dict[str, str] = {}
    for given in args.gguf:
        label, _, path = given.rpartition("=")
        ggufs[f"{LLAMA_CPP} {label}" if label else LLAMA_CPP] = path
    counts = [int(n) for n in args.requests.split(",")]
    systems = [s for s in [*packages, GENAI, *ggufs] if args.systems is None or s in args.systems.split(",")]
    runs: dict[str, dict[str, list[dict]]] = {str(n): {s: [] for s in systems} for n in counts}
    load = [round(os.getloadavg()[0], 2)]
    for r in range(args.rounds):
        for n in counts:
            prompts = prompts_for(n, vocab)
            for system in systems:
                spec = {"new": args.new, "threads": THREADS, "spin": args.spin, "no_spin": not args.spin}
                if system in packages:
                    spec.update(package=packages[system], prompts=prompts)
                elif system in ggufs:
                    spec.update(gguf=ggufs[system], prompts=prompts)
                else:
                    spec.update(model=str(args.genai_model), prompts=equal_length(prompts))
                result = run_worker(system, spec, args.genai_python, args.llamacpp_python)
                runs[str(n)][system].append(result)
                print(f"round {r + 1}, {n} requests, {system}: {result['tokens_per_s']:.1f} new tokens/s, first token "
                      f"{result['mean_first_token_s']:.2f} s on average, peak RSS {result['peak_rss_mb']:.0f} MB "
                      f"(load {result['load_average']})", flush=True)  # fmt: skip
        load.append(round(os.getloadavg()[0], 2))
    best = {n: {s: max(x["tokens_per_s"] for x in row[s]) for s in systems} for n, row in runs.items()}
    median = {n: {s: statistics.median(x["tokens_per_s"] for x in row[s]) for s in systems} for n, row in runs.items()}
    genai_versions = next((x for row in runs.values() for x in row.get(GENAI, [])), {})
    result = {
        "cpu": cpu(), "date": datetime.date.today().isoformat(), "threads": THREADS, "new_tokens": args.new,
        "spinning": "default" if args.spin else "off (session.intra_op/inter_op.allow_spinning 0)",
        "prompt_lengths": {str(n): [len(x) for x in prompts_for(n, vocab)] for n in counts},
        "generator_prompt_length": {str(n): len(equal_length(prompts_for(n, vocab))[0]) for n in counts},
        "command": "python measurements/int4_package/run.py " + " ".join(sys.argv[1:]),
        "attnx_commit": git_commit(), "package": packages, "genai_model": str(args.genai_model), "gguf": ggufs,
        "package_decode": {s: m.get("decode") for s, m in manifests.items()},
        "package_weights": {s: m.get("optimize", {}).get("weights") for s, m in manifests.items()},
        "versions": {"onnxruntime (attnx)": onnxruntime.__version__,
                     "onnxruntime (GenAI)": genai_versions.get("onnxruntime"),
                     "onnxruntime-genai": genai_versions.get("onnxruntime_genai"),
                     "llama-cpp-python": next((x.get("llama_cpp_python") for row in runs.values() for s, xs in
                                               row.items() if s in ggufs for x in xs), None),
                     "numpy": importlib.metadata.version("numpy"), "python": platform.python_version()},
        "method": f"{args.rounds} rounds; in each, every request count runs the systems in turn, each in a process of "
                  "its own: load, one warm-up of the same prompts with 4 new tokens, then the timed generation",
        "load_average_rounds": load,
        "tokens_per_s_best": best, "tokens_per_s_median": median,
        "ratio_to_genai": {s: {n: {"best": best[n][s] / best[n][GENAI], "median": median[n][s] / median[n][GENAI]}
                               for n in best}
                           for s in systems if s != GENAI and GENAI in systems},
        "runs": runs,
    }  # fmt: skip
    print(f"{result['cpu']['model']}, {THREADS} threads, {args.new} new tokens a request, spinning {result['spinning']}")  # fmt: skip
    print(f"{'requests':>8} " + " ".join(f"{s + ' best':>22} {s + ' median':>24}" for s in systems))
    for n in counts:
        print(f"{n:>8} " + " ".join(f"{best[str(n)][s]:22.1f} {median[str(n)][s]:24.1f}" for s in systems))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
