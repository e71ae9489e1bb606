"""attnx optimize's output against the torch.onnx dynamo export it came from and against the peers (issue 40, item 4):
a Llama-shaped model (hidden 1024, 16 heads of 64, 4 kv heads, 4 layers, vocab 4096, random weights), exported by
torch.onnx (dynamo, sdpa, with its cache) as tests/fixtures/exported/make.py exports; then `attnx optimize
--checkpoint` of that export, onnxscript's `optimize_for_ort` of it, and ONNX Runtime GenAI's model builder's fp32 CPU
model of the same checkpoint (built in its own venv: it brings plain onnxruntime). Each model through its own I/O on
the same ONNX Runtime (this venv's), CPU provider, 2 threads, batch 1: a prefill of 512 tokens and one decode step at
past 2048 and 8000. In every round each case runs the four models in turn (one warm-up run, then the timed runs);
each number is the median of a round's runs, and the table gives the lowest of the rounds' medians. Each step is
set against its memory bound: the weights a step reads (the checkpoint's, less the embedding table, of which it
reads one row) and the past cache read once, at the copy bandwidth measured in every round of the same run (the
best of attnx.bench's large copies).

    python measurements/optimize_speed/run.py [--work DIR] [--rounds 5] [--fresh] [--genai-python PY] [--json OUT]

--fresh rebuilds the three rewritten models (attnx's from the code of this checkout); the checkpoint and the export
are made once and kept.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
EXPORT, ONNXSCRIPT, GENAI, ATTNX = ("torch.onnx dynamo export", "onnxscript optimize_for_ort", "GenAI builder fp32",
                                    "attnx optimize")  # fmt: skip
ATTENTION_OPS = ("MultiHeadAttention", "GroupQueryAttention", "Attention", "Softmax")
PRODUCT = ("attnx", "model", "export", "runtimes", "workflows", "bench", "matrix")
CASES = {"prefill 512": (512, 0, 5), "step at past 2048": (1, 2048, 20), "step at past 8000": (1, 8000, 20)}


def cpu() -> dict[str, object]:
    """`lscpu`'s model name and the AVX-512 / AMX flags (from /proc/cpuinfo where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = open("/proc/cpuinfo").read().replace("model name", "Model name").replace("flags", "Flags")
    name = re.search(r"^Model name:\s*(.+)$", text, re.M)
    flags = re.search(r"^Flags:\s*(.+)$", text, re.M)
    wanted = sorted({f for f in (flags.group(1).split() if flags else []) if f.startswith(("avx512", "amx"))})
    return {"model": name.group(1).strip() if name else platform.processor(), "flags": wanted,
            "cores": os.cpu_count()}  # fmt: skip


def git_commit() -> str:
    """This checkout's commit, `+dirty` where the product's files (the folders pyproject maps into attnx) differ
    from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", *PRODUCT) else "")


def load_script(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def model_paths(work: Path) -> dict[str, Path]:
    """Where the four models lie under `work`, by name."""
    return {EXPORT: work / "export" / "model.onnx", ONNXSCRIPT: work / "onnxscript" / "model.onnx",
            GENAI: work / "genai" / "model.onnx", ATTNX: work / "attnx" / "model.onnx"}  # fmt: skip


def make(work: Path, fresh: bool, genai_python: str) -> dict[str, Path]:
    """The checkpoint and the export (made once), and the three models made from them (remade with `fresh`), each
    folder with a built.json saying what made it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt, paths = work / "checkpoint", model_paths(work)
    export = paths[EXPORT]
    if not ckpt.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                                     num_hidden_layers=4, intermediate_size=2816, vocab_size=4096,
                                     max_position_embeddings=16384)).eval().save_pretrained(ckpt)  # fmt: skip
    if not (ckpt / "tokenizer.json").exists():  # the builder stops without one; the export does not read it
        load_script("genai_make", ROOT / "tests/fixtures/genai/make.py").make_tokenizer(ckpt, 16384)
    if not export.exists():
        load_script("fixtures_make", ROOT / "tests/fixtures/exported/make.py").export_decoder(ckpt, "sdpa", None, export)
    for name in (ONNXSCRIPT, GENAI, ATTNX):
        folder = paths[name].parent
        if (folder / "built.json").exists() and not fresh:
            continue
        if folder.exists():  # remade, or left incomplete by a run that stopped
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        print(f"making {name} in {folder}", flush=True)
        start = time.perf_counter()
        built = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if name == ATTNX:
            from attnx.workflows import optimize_model

            report = optimize_model(str(export), str(paths[ATTNX]), checkpoint=str(ckpt))
            print("\n".join(report.lines()))
            if not report.passed:
                raise SystemExit("attnx optimize did not pass")
            built |= {"commit": git_commit(), "blocks": [f"{b.core} -> {b.written or 'kept: ' + str(b.kept)}"
                                                         for b in report.blocks],
                      "proofs": [str(p) for p in report.proofs]}  # fmt: skip
        elif name == ONNXSCRIPT:
            import onnx_ir as ir
            from onnxscript.rewriter.ort_fusions import optimize_for_ort

            model, counts = optimize_for_ort(ir.load(str(export)))
            ir.save(model, str(paths[ONNXSCRIPT]))
            built |= {"onnxscript": importlib.metadata.version("onnxscript"),
                      "fusions": {k: v for k, v in counts.items() if v}}  # fmt: skip
        else:
            command = [genai_python, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(folder),
                       "-p", "fp32", "-e", "cpu", "-c", str(work / "genai-cache")]  # fmt: skip
            log = work / "genai-build.log"
            with open(log, "w") as f:
                rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")).returncode  # fmt: skip
            if rc != 0:
                raise SystemExit(f"the GenAI builder failed (exit {rc}): see {log}")
            version = subprocess.run([genai_python, "-c", "import importlib.metadata as m; "
                                      "print(m.version('onnxruntime-genai'))"], capture_output=True, text=True)  # fmt: skip
            built |= {"onnxruntime-genai": version.stdout.strip(),
                      "command": "python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p fp32 -e cpu -c CACHE"}
        built["seconds"] = round(time.perf_counter() - start, 1)
        (folder / "built.json").write_text(json.dumps(built, indent=1))
    return paths


def attention_ops(path: Path) -> dict[str, int]:
    """The attention nodes of a model (com.microsoft MultiHeadAttention / GroupQueryAttention / Attention, ONNX's
    Attention, leftover Softmax), by domain and type, read without its weights."""
    import onnx

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type in ATTENTION_OPS:
            key = f"{node.domain or 'ai.onnx'}.{node.op_type}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def session(path: Path, spin: bool = True):
    """The model's CPU session, 2 intra-op threads; spin=False: its pool's threads wait without spinning (for runs
    that take turns with other sessions in one process: a pool left spinning takes the cores from the next)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert s.get_providers() == ["CPUExecutionProvider"], s.get_providers()
    return s


def case_feeds(config: dict, tokens: int, past: int) -> dict[str, np.ndarray]:
    """One case's inputs under every name the four models take (each model is fed those it has): the same tokens
    and the same random past for all, so that their logits can be compared."""
    rng = np.random.default_rng(0)
    kv, hd = config["num_key_value_heads"], config["head_dim"]
    out = {"input_ids": rng.integers(1, config["vocab_size"], (1, tokens)),
           "attention_mask": np.ones((1, past + tokens), np.int64), "position_ids": np.arange(past, past + tokens)[None]}  # fmt: skip
    for layer in range(config["num_hidden_layers"]):
        for part in ("key", "value"):
            out[f"past_key_values.{layer}.{part}"] = rng.standard_normal((1, kv, past, hd)).astype(np.float32)
    return out


def step_bytes(ckpt: Path, config: dict) -> tuple[int, int]:
    """(bytes of the weights a decode step reads, bytes of the cache per past position): every parameter of the
    checkpoint but the embedding table (a step gathers one row of it); keys and values of every layer."""
    from safetensors import safe_open

    weights = 0
    with safe_open(str(ckpt / "model.safetensors"), "np") as f:
        for name in f.keys():
            if name != "model.embed_tokens.weight":
                weights += int(np.prod(f.get_slice(name).get_shape())) * 4
    per_position = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    return weights, per_position


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/attnx-optimize-speed")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fresh", action="store_true", help="rebuild attnx's, onnxscript's and the builder's models")
    p.add_argument("--genai-python", default="/tmp/genai-venv/bin/python",
                   help="a Python with onnxruntime-genai 0.18's model builder (its own venv)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import onnxruntime as ort

    from attnx.bench import measure_bandwidth

    work = Path(args.work)
    paths = make(work, args.fresh, args.genai_python)
    config = json.loads((work / "checkpoint" / "config.json").read_text())
    weight_bytes, position_bytes = step_bytes(work / "checkpoint", config)
    models = {name: session(paths[name]) for name in (EXPORT, ONNXSCRIPT, GENAI, ATTNX)}
    names = {name: {i.name for i in s.get_inputs()} for name, s in models.items()}
    prepared = {case: case_feeds(config, t, past) for case, (t, past, _) in CASES.items()}
    times: dict[tuple[str, str], list[float]] = {}
    load = [os.getloadavg()[0]]  # the machine's 1-minute load average before the rounds and after each
    bandwidth: dict[str, float] = {}
    first: dict[tuple[str, str], np.ndarray] = {}
    presents: dict[str, dict[str, list[int]]] = {}  # the first present's shape: past + 1 where the cache is copied
    for r in range(args.rounds):
        for copy, value in measure_bandwidth(2).items():  # in every round: the best of the run sets the bound
            bandwidth[copy] = max(bandwidth.get(copy, 0.0), value)
        for case, (_, past, runs) in CASES.items():
            for name, s in models.items():
                f = {k: v for k, v in prepared[case].items() if k in names[name]}
                out = s.run(None, f)  # warm
                if r == 0:
                    first[(name, case)] = out[0]
                    if past:
                        presents.setdefault(name, {})[case] = list(out[1].shape)
                samples = []
                for _ in range(runs):
                    start = time.perf_counter()
                    s.run(None, f)
                    samples.append((time.perf_counter() - start) * 1e3)
                times.setdefault((name, case), []).append(statistics.median(samples))
        load.append(os.getloadavg()[0])
        print(f"round {r + 1} of {args.rounds} done (load average {load[-1]:.2f})", flush=True)
    best_bw = max(bandwidth.values())
    result = {
        "cpu": cpu(), "date": datetime.date.today().isoformat(), "threads": 2, "batch": 1,
        "command": "python measurements/optimize_speed/run.py " + " ".join(sys.argv[1:]),
        "versions": {"onnxruntime": ort.__version__, **{k: importlib.metadata.version(k) for k in
                     ("onnxscript", "torch", "transformers", "numpy")}, "python": platform.python_version()},
        "method": f"{args.rounds} rounds; in each, every case runs the models in turn: one warm-up run, then "
                  f"{', '.join(f'{c} {r}' for c, (_, _, r) in CASES.items())} timed runs; a round's number is their "
                  "median, the table's the lowest of the rounds'",
        "models": {name: {"path": str(paths[name]), "attention ops": attention_ops(paths[name]),
                          "inputs": sorted(names[name] - {n for n in names[name] if n.startswith("past")}),
                          "first present": presents.get(name),
                          "built": json.loads((paths[name].parent / "built.json").read_text())
                          if name != EXPORT else None} for name in models},
        "load_average": [round(x, 2) for x in load],
        "bandwidth_gbs": {k: round(v / 1e9, 2) for k, v in bandwidth.items()},
        "weight_bytes": weight_bytes, "cache_bytes_per_position": position_bytes,
        "ms": {}, "round_medians_ms": {}, "bound_ms": {}, "x_bound": {}, "logits_vs_export": {},
    }  # fmt: skip
    print(f"{result['cpu']['model']}, {len(result['cpu']['flags'])} avx512/amx flags, 2 threads, batch 1, the lowest "
          f"of {args.rounds} rounds' medians (ms); copy bandwidth {best_bw / 1e9:.1f} GB/s")  # fmt: skip
    print(f"{'case':20} " + " ".join(f"{m:>28}" for m in models) + f" {'bound':>8}")
    for case, (_, past, _) in CASES.items():
        row = {m: min(times[(m, case)]) for m in models}
        result["ms"][case] = row
        result["round_medians_ms"][case] = {m: times[(m, case)] for m in models}
        result["logits_vs_export"][case] = {m: float(np.abs(first[(m, case)] - first[(EXPORT, case)]).max())
                                            for m in models if m != EXPORT}  # fmt: skip
        bound = (weight_bytes + past * position_bytes) / best_bw * 1e3 if past else None
        result["bound_ms"][case] = bound
        if bound:
            result["x_bound"][case] = {m: row[m] / bound for m in models}
        print(f"{case:20} " + " ".join(f"{v:28.2f}" for v in row.values()) + (f" {bound:8.2f}" if bound else ""))
    ms = result["ms"]

    def at(case: str, model: str) -> float:  # peer / attnx: over 1 where attnx is faster
        return ms[case][model] / ms[case][ATTNX]

    result["targets"] = {
        "attnx at least as fast as the builder's model at every case": all(at(c, GENAI) >= 1 for c in CASES),
        "attnx at least as fast as onnxscript's at every case": all(at(c, ONNXSCRIPT) >= 1 for c in CASES),
        "builder / attnx at past 8000 >= 1.3": at("step at past 8000", GENAI) >= 1.3,
        "export / attnx at past 8000 >= 2": at("step at past 8000", EXPORT) >= 2,
        "ratios (peer / attnx)": {c: {m: at(c, m) for m in models if m != ATTNX} for c in CASES},
    }  # fmt: skip
    print("peer / attnx: " + "; ".join(f"{c}: " + ", ".join(f"{m} {v:.2f}" for m, v in r.items())
                                       for c, r in result["targets"]["ratios (peer / attnx)"].items()))  # fmt: skip
    for target, held in result["targets"].items():
        if isinstance(held, bool):
            print(f"{'met' if held else 'NOT met'}: {target}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
