"""attnx optimize's output against the torch.onnx dynamo export it came from (issue 40, item 4, a first measure):
a Llama-shaped model (hidden 1024, 16 heads of 64, 4 kv heads, 4 layers, vocab 4096, random weights), exported by
torch.onnx (dynamo, sdpa, with its cache) as tests/fixtures/exported/make.py exports, then `attnx optimize
--checkpoint`. Each model through its own I/O on ONNX Runtime's CPU, 2 threads, batch 1: a prefill of 512 tokens and
one decode step at past 2048 and 8000, each the median of its runs, the models interleaved in every round.

    python measurements/optimize_speed/run.py [--work DIR] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def make(work: Path) -> tuple[Path, Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt, export, out = work / "checkpoint", work / "export" / "model.onnx", work / "attnx" / "model.onnx"
    if not ckpt.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                                     num_hidden_layers=4, intermediate_size=2816, vocab_size=4096,
                                     max_position_embeddings=16384)).eval().save_pretrained(ckpt)  # fmt: skip
    if not export.exists():
        spec = importlib.util.spec_from_file_location("fixtures_make", ROOT / "tests/fixtures/exported/make.py")
        maker = importlib.util.module_from_spec(spec)
        sys.modules["fixtures_make"] = maker  # its dataclasses look their module up
        spec.loader.exec_module(maker)
        maker.export_decoder(ckpt, "sdpa", None, export)
    if not out.exists():
        from attnx.workflows import optimize_model

        out.parent.mkdir(parents=True, exist_ok=True)
        report = optimize_model(str(export), str(out), checkpoint=str(ckpt))
        print("\n".join(report.lines()))
        if not report.passed:
            raise SystemExit("attnx optimize did not pass")
    return ckpt, export, out


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds(s, tokens: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {"input_ids": rng.integers(1, 4096, (1, tokens)), "attention_mask": np.ones((1, past + tokens), np.int64),
           "position_ids": np.arange(past, past + tokens)[None]}  # fmt: skip
    for i in s.get_inputs():
        if i.name.startswith("past"):
            out[i.name] = rng.standard_normal((1, i.shape[1], past, i.shape[3])).astype(np.float32)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--work", default="/tmp/attnx-optimize-speed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = Path(args.work)
    _, export, out = make(work)
    models = {"torch.onnx dynamo export": session(export), "attnx optimize": session(out)}
    cases = {"prefill 512": (512, 0, 3), "step at past 2048": (1, 2048, 20), "step at past 8000": (1, 8000, 20)}
    times: dict[tuple[str, str], list[float]] = {}
    prepared = {(m, c): feeds(s, t, past) for m, s in models.items() for c, (t, past, _) in cases.items()}
    for _ in range(args.rounds):
        for case, (_, _, runs) in cases.items():
            for name, s in models.items():
                f = prepared[(name, case)]
                s.run(None, f)  # warm
                samples = []
                for _ in range(runs):
                    start = time.perf_counter()
                    s.run(None, f)
                    samples.append((time.perf_counter() - start) * 1e3)
                times.setdefault((name, case), []).append(statistics.median(samples))
    result = {"cpu": cpu_name(), "date": datetime.date.today().isoformat(), "threads": 2,
              "command": "python measurements/optimize_speed/run.py", "ms": {}}  # fmt: skip
    print(f"{result['cpu']}, 2 threads, batch 1, the lowest of {args.rounds} rounds' medians (ms)")
    print(f"{'case':20} " + " ".join(f"{m:>26}" for m in models) + "   export / attnx")
    for case in cases:
        row = [min(times[(m, case)]) for m in models]
        result["ms"][case] = dict(zip(models, row))
        print(f"{case:20} " + " ".join(f"{v:26.2f}" for v in row) + f"   {row[0] / row[1]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
