"""attnx generate's serving speed against the peers (issue 41, item 5): a Llama-shaped model (hidden 1024, 16 heads of
64, 4 kv heads, 4 layers, vocab 4096, intermediate 2816, random weights) exported by torch.onnx (dynamo, with its
cache) and packaged by `attnx build --model EXPORT --checkpoint CKPT --out PKG`; 1, 8 and 32 requests whose prompt
lengths are drawn in 64-512 (seeded), 128 new tokens each; new tokens per second and time to first token, against

    attnx before       the same, by the checkout the change started from (--before-python: its venv; its own package)
    GenAI Engine       ONNX Runtime GenAI 0.18's Engine (requests of their own lengths, its scheduler), on its
                       builder's fp32 CPU model of the same checkpoint, in its own venv (--genai-python)
    GenAI Generator    the same model through its Generator: one static batch of prompts of one length (each the
                       mean of the drawn lengths, so the batch holds as many prompt tokens)
    transformers       transformers' `generate` with a static cache, the prompts left-padded into one batch, greedy

Each system runs in a process of its own (its model loaded, one untimed warm-up of the same requests with 4 new
tokens each, then the timed generation), all on 2 threads, interleaved: every round runs each request count through
the four in turn. The table gives each system's best round. attnx runs with --max-batch set to the request count (all
requests decoded together, continuous batching as they end) and ATTNX_THREADS=2.

The bounds of attnx's schedule (its prefills, one after the other, then 127 steps of every row): a prefill's flops
(every position's projections and MLP, the causal attention, the head at the last position: what generation needs)
at the GEMM rate measured in the run (the best of
ONNX Runtime MatMuls [M, 1024] x [1024, 2816], M 32 to 512, 2 threads), and each step the larger of its bytes (the weights but the
embedding table, and every row's cache so far, read once) at the copy bandwidth measured in the run
(attnx.bench.measure_bandwidth, the best) and its flops at the GEMM rate.

    python measurements/generate_throughput/run.py [--work DIR] [--rounds 2] [--requests 1,8,32] [--package PKG]
        [--fresh] [--before-python PY [--before-package PKG]] [--genai-python PY] [--json OUT]

The checkpoint, the export and the GenAI builder's model are made by measurements/optimize_speed/run.py's make()
(imported, as it is); attnx's package is built once (`attnx build` of the attnx this Python imports: run the
script with the venv of the checkout to measure), --fresh rebuilds it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NEW = 128
LENGTHS = (64, 512)  # prompt lengths drawn in [64, 512]
SYSTEMS = ("attnx", "attnx before", "GenAI Engine", "GenAI Generator", "transformers static")
THREADS = 2


def speed_script():
    """measurements/optimize_speed/run.py, imported as it is (its make(), cpu(), git_commit(), step_bytes())."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("optimize_speed_run", ROOT / "measurements/optimize_speed/run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["optimize_speed_run"] = module
    spec.loader.exec_module(module)
    return module


def attnx_commit() -> str:
    """The commit of the checkout whose attnx this Python imports (its product folders' changes: +dirty): the code
    measured, whichever checkout holds this script."""
    import attnx

    root = Path(attnx.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()

    product = ("attnx", "model", "export", "runtimes", "workflows", "bench", "matrix")
    return f"{root}@" + git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", *product)
                                                               else "")  # fmt: skip


def prompts_for(requests: int, vocab: int) -> list[list[int]]:
    """`requests` prompts, lengths drawn in LENGTHS, ids in 1..vocab-1: the same for every system and round."""
    rng = np.random.default_rng([41, requests])
    lengths = rng.integers(LENGTHS[0], LENGTHS[1] + 1, requests)
    return [[int(t) for t in rng.integers(1, vocab, n)] for n in lengths]


def equal_length(prompts: list[list[int]]) -> list[list[int]]:
    """The Generator's static batch: each prompt cut or extended (its own ids repeated) to the mean length."""
    n = round(statistics.mean(len(p) for p in prompts))
    return [(p * (n // len(p) + 1))[:n] for p in prompts]


# Workers: each runs in a process of its own and prints one JSON line -----------------------------------------------
def attnx_worker(spec: dict) -> dict:
    import attnx

    prompts = spec["prompts"]
    with attnx.load(spec["package"]) as model:
        model.generate(prompts, max_new_tokens=4, max_batch=len(prompts))  # warm-up
        first = [0.0] * len(prompts)

        def on_finish(request) -> None:
            first[request.index] = request.first_token_s

        start = time.perf_counter()
        tokens = model.generate(prompts, max_new_tokens=spec["new"], max_batch=len(prompts), on_finish=on_finish)
        seconds = time.perf_counter() - start
        stats = model.stats
        return {"seconds": seconds, "first_token_s": first, "new_tokens": [len(t) for t in tokens],
                "prefills": stats.prefills, "steps": stats.steps, "largest_batch": stats.largest_batch,
                "decode_form": model.manifest.get("decode", {}).get("form"),
                "engine": sys.modules["attnx.runtimes.generate"].__file__}  # fmt: skip


def transformers_worker(spec: dict) -> dict:
    import torch
    from transformers import LlamaForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(THREADS)
    model = LlamaForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32).eval()
    prompts = spec["prompts"]
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])  # left-padded, as transformers pads
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

    class FirstToken(BaseStreamer):
        """The time of the first new tokens (generate hands the prompt to put() first, then each step's tokens)."""

        def __init__(self) -> None:
            self.calls, self.at = 0, None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2:
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    def generate(new: int, streamer=None):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  cache_implementation="static", pad_token_id=0, streamer=streamer)  # fmt: skip

    generate(4)  # warm-up
    streamer = FirstToken()
    start = time.perf_counter()
    out = generate(spec["new"], streamer)
    seconds = time.perf_counter() - start
    new = int(out.shape[1] - longest)
    return {"seconds": seconds, "first_token_s": [streamer.at - start] * len(prompts), "new_tokens": [new] * len(prompts),
            "torch": torch.__version__}  # fmt: skip


WORKERS = {"attnx": attnx_worker, "attnx before": attnx_worker, "transformers static": transformers_worker}


def run_worker(system: str, spec: dict, genai_python: str, before_python: str | None = None) -> dict:
    """One system's timed generation in a process of its own (the module doc); its JSON line, with the load average
    before and after."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, ATTNX_THREADS=str(THREADS), OMP_NUM_THREADS=str(THREADS))
    if system.startswith("GenAI"):
        command = [genai_python, str(HERE / "genai_worker.py"), f.name]
    else:  # attnx before: the same worker, in the venv of the checkout measured as the before
        python = before_python if system == "attnx before" else sys.executable
        command = [python, str(Path(__file__).resolve()), "--worker", system, f.name]
    load = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"{system} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    total = sum(result["new_tokens"])
    result["tokens_per_s"] = total / result["seconds"]
    result["mean_first_token_s"] = statistics.mean(result["first_token_s"])
    return result


# Bounds ----------------------------------------------------------------------------------------------------------------
def gemm_rates(threads: int = THREADS) -> dict[str, float]:
    """FLOP/s of an ONNX Runtime MatMul [M, 1024] x [1024, 2816] (the MLP's up projection) on `threads` threads, at M
    of a decode step's rows (32) and of prompts (128, 288, 512), each the best of 10 runs: the bounds take the
    highest."""
    import onnxruntime as ort

    from attnx.bench._worker import write_gemm_model

    k, n = 1024, 2816
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in (32, 128, 288, 512):
            path = os.path.join(tmp, f"gemm{m}.onnx")
            write_gemm_model(path, m, k, n, "fp32")
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            a = np.random.default_rng(0).standard_normal((m, k), dtype=np.float32)
            session.run(None, {"a": a})
            times = []
            for _ in range(10):
                start = time.perf_counter()
                session.run(None, {"a": a})
                times.append(time.perf_counter() - start)
            out[f"{m}x{k}x{n}"] = 2 * m * k * n / min(times)
    return out


def model_costs(ckpt: Path, config: dict, step_bytes) -> dict:
    """The model's numbers the bounds read: weight bytes a step reads, cache bytes per position, flops per position of
    the projections and MLP (2 per weight of every matrix but the embedding table and the head), the head's flops
    (one position's: generation reads a prompt's last logits alone), the attention's per (query, key) pair."""
    weights, per_position = step_bytes(ckpt, config)
    head = 2 * config["vocab_size"] * config["hidden_size"]
    return {"weight_bytes": weights, "cache_bytes_per_position": per_position,
            "flops_per_token": 2 * weights // 4 - head, "head_flops": head,
            "attention_flops_per_pair": 4 * config["num_attention_heads"] * config["head_dim"]
            * config["num_hidden_layers"]}  # fmt: skip


def bounds(prompts: list[list[int]], new: int, costs: dict, bandwidth: float, rate: float) -> dict:
    """attnx's schedule's bounds (the module doc): seconds of the prefills and the steps, the new tokens/s and mean
    time to first token they allow."""
    lengths = [len(p) for p in prompts]
    prefill = [(costs["flops_per_token"] * n + costs["head_flops"] + costs["attention_flops_per_pair"] * n * (n + 1)
                / 2) / rate for n in lengths]  # fmt: skip
    steps = 0.0
    for s in range(1, new):  # every row's token s (its first came from its prefill)
        pasts = [n + s for n in lengths]
        memory = (costs["weight_bytes"] + costs["cache_bytes_per_position"] * sum(pasts)) / bandwidth
        compute = ((costs["flops_per_token"] + costs["head_flops"]) * len(pasts)
                   + costs["attention_flops_per_pair"] * sum(pasts)) / rate  # fmt: skip
        steps += max(memory, compute)
    total = sum(prefill) + steps
    return {"prefill_s": sum(prefill), "steps_s": steps, "tokens_per_s": new * len(prompts) / total,
            "mean_first_token_s": statistics.mean(np.cumsum(prefill))}


# The run -----------------------------------------------------------------------------------------------------------------
def build_package(work: Path, package: Path, paths: dict, fresh: bool) -> Path:
    if (package / "manifest.json").exists() and not fresh:
        return package
    export, ckpt = paths["torch.onnx dynamo export"], work / "checkpoint"
    print(f"attnx build --model {export} --checkpoint {ckpt} --out {package}", flush=True)
    start = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "attnx"), "build", "--model", str(export), "--checkpoint",
                    str(ckpt), "--out", str(package), "--force"], check=True)  # fmt: skip
    print(f"built in {time.perf_counter() - start:.0f} s", flush=True)
    return package


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/attnx-optimize-speed")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", default="1,8,32")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--new", type=int, default=NEW, help=f"new tokens a request (default {NEW})")
    p.add_argument("--package", default=None, help="attnx's package (default WORK/attnx-package)")
    p.add_argument("--fresh", action="store_true", help="rebuild attnx's package with the attnx this Python imports")
    p.add_argument("--before-python", default=None, help="the Python of the checkout measured as 'attnx before' (its "
                   "venv); without it, that system is not run")
    p.add_argument("--before-package", default=None, help="that checkout's package of the model (default "
                   "WORK/attnx-package-before, built by it when missing)")
    p.add_argument("--genai-python", default="/tmp/genai-venv/bin/python",
                   help="a Python with onnxruntime-genai 0.18 (its own venv)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=2, metavar=("SYSTEM", "SPEC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        system, spec_path = args.worker
        with open(spec_path) as f:
            print(json.dumps(WORKERS[system](json.load(f))))
        return 0

    import onnxruntime as ort

    from attnx.bench import measure_bandwidth

    speed = speed_script()
    work = Path(args.work)
    paths = speed.make(work, False, args.genai_python)
    package = build_package(work, Path(args.package or work / "attnx-package"), paths, args.fresh)
    config = json.loads((work / "checkpoint" / "config.json").read_text())
    costs = model_costs(work / "checkpoint", config, speed.step_bytes)
    counts = [int(n) for n in args.requests.split(",")]
    systems = [s for s in SYSTEMS if s in args.systems.split(",") and (s != "attnx before" or args.before_python)]
    before_package = None
    if "attnx before" in systems:
        before_package = Path(args.before_package or work / "attnx-package-before")
        if not (before_package / "manifest.json").exists():
            subprocess.run([str(Path(args.before_python).parent / "attnx"), "build", "--model",
                            str(paths["torch.onnx dynamo export"]), "--checkpoint", str(work / "checkpoint"), "--out",
                            str(before_package), "--force"], check=True)  # fmt: skip
    runs: dict[str, dict[str, list[dict]]] = {str(n): {s: [] for s in systems} for n in counts}
    bandwidth: dict[str, float] = {}
    rates: dict[str, float] = {}
    load = [round(os.getloadavg()[0], 2)]
    for r in range(args.rounds):
        for copy, value in measure_bandwidth(THREADS).items():
            bandwidth[copy] = max(bandwidth.get(copy, 0.0), value)
        for shape, value in gemm_rates().items():
            rates[shape] = max(rates.get(shape, 0.0), value)
        for n in counts:
            prompts = prompts_for(n, config["vocab_size"])
            for system in systems:
                spec = {"new": args.new, "threads": THREADS, "prompts": prompts}
                if system == "attnx":
                    spec["package"] = str(package)
                elif system == "attnx before":
                    spec["package"] = str(before_package)
                elif system == "transformers static":
                    spec["checkpoint"] = str(work / "checkpoint")
                else:
                    spec["model"] = str(paths["GenAI builder fp32"].parent)
                    spec["mode"] = "engine" if system == "GenAI Engine" else "generator"
                    if spec["mode"] == "generator":
                        spec["prompts"] = equal_length(prompts)
                result = run_worker(system, spec, args.genai_python, args.before_python)
                runs[str(n)][system].append(result)
                print(f"round {r + 1}, {n} requests, {system}: {result['tokens_per_s']:.1f} new tokens/s, first token "
                      f"{result['mean_first_token_s']:.2f} s on average (load {result['load_average']})", flush=True)
        load.append(round(os.getloadavg()[0], 2))
    best_bw, best_rate = max(bandwidth.values()), max(rates.values())
    table, bound = {}, {}
    for n in counts:
        table[str(n)] = {s: max(runs[str(n)][s], key=lambda x: x["tokens_per_s"]) for s in systems}
        bound[str(n)] = bounds(prompts_for(n, config["vocab_size"]), args.new, costs, best_bw, best_rate)
    result = {
        "cpu": speed.cpu(), "date": datetime.date.today().isoformat(), "threads": THREADS, "new_tokens": args.new,
        "prompt_lengths": {str(n): [len(p) for p in prompts_for(n, config["vocab_size"])] for n in counts},
        "command": "python measurements/generate_throughput/run.py " + " ".join(sys.argv[1:]),
        "attnx_commit": attnx_commit(), "package": str(package),
        "before": {"python": args.before_python, "package": str(before_package), "commit": subprocess.run(
            [args.before_python, "-c", "import attnx, subprocess, pathlib; r = pathlib.Path(attnx.__file__).resolve()"
             ".parents[1]; print(subprocess.run(['git', '-C', str(r), 'rev-parse', '--short', 'HEAD'], "
             "capture_output=True, text=True).stdout.strip())"], capture_output=True, text=True, cwd="/").stdout.strip(),
                   "decode_form": json.loads((before_package / "manifest.json").read_text()).get("decode")}
        if before_package else None,
        "decode_form": json.loads((package / "manifest.json").read_text()).get("decode"),
        "versions": {"onnxruntime (attnx)": ort.__version__, **{k: importlib.metadata.version(k) for k in
                     ("torch", "transformers", "numpy")}, "python": platform.python_version()},
        "method": f"{args.rounds} rounds; in each, every request count runs the systems in turn, each in a process of "
                  "its own: load, one warm-up of the same requests with 4 new tokens, then the timed generation; "
                  "the table gives each system's best round",
        "load_average_rounds": load, "bandwidth_gbs": {k: round(v / 1e9, 2) for k, v in bandwidth.items()},
        "gemm_gflops": {k: round(v / 1e9, 1) for k, v in rates.items()}, "costs": costs,
        "tokens_per_s": {n: {s: row[s]["tokens_per_s"] for s in systems} for n, row in table.items()},
        "mean_first_token_s": {n: {s: row[s]["mean_first_token_s"] for s in systems} for n, row in table.items()},
        "bound": bound, "runs": runs,
    }  # fmt: skip
    print(f"{result['cpu']['model']}, {THREADS} threads, {args.new} new tokens a request; copy bandwidth "
          f"{best_bw / 1e9:.1f} GB/s, GEMM {best_rate / 1e9:.0f} GFLOP/s")  # fmt: skip
    print(f"{'requests':>8} " + " ".join(f"{s:>20}" for s in systems) + f" {'bound':>8}   (new tokens/s)")
    for n in counts:
        row = result["tokens_per_s"][str(n)]
        print(f"{n:>8} " + " ".join(f"{row[s]:20.1f}" for s in systems) + f" {bound[str(n)]['tokens_per_s']:8.1f}")
    peers = [s for s in systems if not s.startswith("attnx")]
    if "attnx" in systems and peers:
        result["targets"] = {str(n): {
            "attnx >= the best peer": result["tokens_per_s"][str(n)]["attnx"]
            >= max(result["tokens_per_s"][str(n)][s] for s in peers),
            "attnx / transformers": result["tokens_per_s"][str(n)]["attnx"]
            / result["tokens_per_s"][str(n)]["transformers static"] if "transformers static" in systems else None,
        } for n in counts}  # fmt: skip
        for n, held in result["targets"].items():
            print(f"{n} requests: attnx >= the best peer: {held['attnx >= the best peer']}; attnx / transformers "
                  f"{held['attnx / transformers'] or float('nan'):.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
