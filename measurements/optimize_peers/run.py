"""attnx optimize beside the tools that rewrite the attention of a whole model (issue 40, item 3), on the committed
fixtures of whole models other tools exported (tests/fixtures/exported, tests/fixtures/unseen/exported):

    onnxscript     onnxscript's `optimize_for_ort` (onnxscript.rewriter.ort_fusions) of the model
    ort-optimizer  ONNX Runtime's transformers optimizer as Optimum's ORTOptimizer calls it with its default
                   OptimizationConfig: `optimize_model(path, model_type, num_heads, hidden_size, opt_level=1,
                   optimization_options=FusionOptions(model_type) without EmbedLayerNormalization)`, model_type
                   "gpt2" for the decoders (Optimum's type for llama and mistral), "bert" for BERT
    attnx          `attnx optimize MODEL --out OUT --checkpoint CKPT` (the fixture's checkpoint)

For each output: the attention nodes (com.microsoft MultiHeadAttention / GroupQueryAttention / Attention, ONNX's
Attention, leftover Softmax); whether ONNX Runtime loads it; whether it still computes what the input did, through
its own I/O (attnx's own whole-model proof, attnx.workflows.rewrite.prove.same_model: a padded batch, full sequence
and prefill + single steps through its cache: the same greedy tokens, the largest logits difference); and against
transformers' logits stored with the fixture (reference.safetensors: its full sequence, also as prefill + steps
through the cache, and Llama 4's left-padded batch; BERT's last hidden state of a right-padded batch). A tool that
raises, or writes a model ONNX Runtime refuses, is recorded with its one-line error. The input model is checked
against the reference the same way (the "input" row).

    python measurements/optimize_peers/run.py [--work DIR] [--json OUT] [--merge EARLIER.json] [FIXTURE ...]

FIXTURE: a fixture folder relative to tests/fixtures (e.g. exported/torch-dynamo/llama/sdpa-opset20); all by default.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SETS = ["exported/torch-dynamo/llama/*", "exported/torch-dynamo/qwen3/*", "exported/torch-dynamo/gemma2/*",
        "exported/torch-dynamo/llama4/*", "exported/torch-dynamo/gpt2/*", "exported/optimum/*",
        "exported/ort-optimizer/bert",
        "unseen/exported/torch-dynamo/*/*", "unseen/exported/optimum/*", "genai/*/*", "unseen/genai/*/*"]  # fmt: skip
TOOLS = ("onnxscript", "ort-optimizer", "attnx")
FUSED = {"com.microsoft.MultiHeadAttention", "com.microsoft.GroupQueryAttention", "com.microsoft.Attention",
         "ai.onnx.Attention"}  # fmt: skip
PREFILL = 8  # as attnx's whole-model proof: a prefill of 8, then single steps


def cpu() -> dict[str, object]:
    """`lscpu`'s model name and the AVX-512 / AMX flags."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    name = re.search(r"^Model name:\s*(.+)$", text, re.M)
    flags = re.search(r"^Flags:\s*(.+)$", text, re.M)
    wanted = sorted({f for f in (flags.group(1).split() if flags else []) if f.startswith(("avx512", "amx"))})
    return {"model": name.group(1).strip() if name else platform.processor(), "flags": wanted,
            "cores": os.cpu_count()}  # fmt: skip


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def attention_ops(path: Path) -> dict[str, int]:
    import onnx

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type in ("MultiHeadAttention", "GroupQueryAttention", "Attention", "Softmax"):
            key = f"{node.domain or 'ai.onnx'}.{node.op_type}"
            counts[key] = counts.get(key, 0) + 1
    return counts


GPT2_KEYS = {"n_head": "num_attention_heads", "n_embd": "hidden_size", "n_layer": "num_hidden_layers"}


def text_config(ckpt: Path) -> dict:
    """The checkpoint's text config, GPT-2's own key names given the common ones too (its config's attribute_map)."""
    config = json.loads((ckpt / "config.json").read_text())
    config = config.get("text_config", config)
    return {**{common: config[own] for own, common in GPT2_KEYS.items() if own in config}, **config}


def run_onnxscript(src: Path, out: Path, ckpt: Path, encoder: bool) -> dict:
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model, counts = optimize_for_ort(ir.load(str(src)))
    external = (src.parent / (src.name + ".data")).exists()  # the builder's: its tensors beside it, copied
    ir.save(model, str(out), external_data=out.name + ".data" if external else None)
    return {"fusions": {k: v for k, v in counts.items() if v}}


def run_ort_optimizer(src: Path, out: Path, ckpt: Path, encoder: bool) -> dict:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = "bert" if encoder else "gpt2"
    options = FusionOptions(model_type)
    options.enable_embed_layer_norm = False  # Optimum's OptimizationConfig: disable_embed_layer_norm_fusion=True
    config = text_config(ckpt)
    optimizer = optimize_model(str(src), model_type, config["num_attention_heads"], config["hidden_size"], opt_level=1,
                               optimization_options=options)  # fmt: skip
    optimizer.save_model_to_file(str(out))
    return {"model_type": model_type, "fused operators": {k: v for k, v in
            optimizer.get_fused_operator_statistics().items() if v}}  # fmt: skip


def run_attnx(src: Path, out: Path, ckpt: Path, encoder: bool) -> dict:
    from attnx.workflows import optimize_model

    report = optimize_model(str(src), str(out), checkpoint=str(ckpt))
    got = {"passed": report.passed, "blocks": [f"{b.core} -> {b.written or 'kept: ' + str(b.kept)}"
                                               for b in report.blocks],
           "rewritten": sum(b.written is not None for b in report.blocks),
           "repairs": [r for b in report.blocks for r in b.repairs],
           "proofs": [str(p) for p in report.proofs]}  # fmt: skip
    if not report.written:  # the verdict, and why each block was kept
        got["written"] = False
        kept = "; ".join(f"block {b.index} kept: {b.kept}" for b in report.blocks if b.kept)
        got["error"] = "nothing written" + (f": {kept}" if kept else "") + "; " + next(
            (str(p) for p in report.proofs if not p), "")  # fmt: skip
    return got


RUNNERS = {"onnxscript": run_onnxscript, "ort-optimizer": run_ort_optimizer, "attnx": run_attnx}


def load_error(path: Path) -> str | None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 (ORT raises its own types; the message is the finding)
        return first_line(e)
    return None


def caches_of(src: Path) -> dict[str, tuple[int, int, int]]:
    """Each cache input's (kv heads, capacity, head_dim) as attnx reads its block: the GenAI builder names the head
    size `kv_cache_dim` and keeps Gemma 2's window in a ring buffer (its past holds the window from the start)."""
    import onnx_ir as ir

    from attnx.export._blocks import iter_blocks

    found = {}
    for block in iter_blocks(ir.load(str(src)), [], lambda _i: False):
        for role in ("past_key", "past_value"):
            if block.config is not None and role in block.inputs:
                found[block.inputs[role]] = (block.config.n_kv_heads, block.cache_capacity,
                                             block.config.head_dim)  # fmt: skip
    return found


def same_as_input(src: Path, out: Path, encoder: bool) -> dict:
    """attnx's whole-model proof of OUT against the input (right padding for BERT's fused Attention and the
    builder's GroupQueryAttention, as attnx's own proof pads a model whose blocks read each row's length)."""
    from attnx.workflows.rewrite.prove import same_model
    from attnx.workflows.rewrite.report import ModelOptimizeReport

    report = ModelOptimizeReport(str(src), str(out), None, [], [])
    right = encoder or "com.microsoft.GroupQueryAttention" in attention_ops(src)
    dtype = "fp16" if "fp16" in src.parts else "fp32"
    try:
        passed = same_model(report, str(src), str(out), right=right, dtype=dtype, caches=caches_of(src))
    except Exception as e:  # noqa: BLE001 (a runtime's error in a run is the finding)
        return {"passed": False, "proofs": [f"FAIL: {first_line(e)}"], "largest logits difference": None}
    return {"passed": passed, "proofs": [str(p) for p in report.proofs],
            "largest logits difference": largest(report.proofs)}


def largest(proofs: list) -> float | None:
    """The largest logits difference of the whole-model proofs: their comparisons' max_abs."""
    found = [p.stats.max_abs for p in proofs if p.stats is not None and p.stats.max_abs is not None]
    return max(found) if found else None


def against_reference(path: Path, ckpt: Path, reference: Path) -> dict:
    """The model against transformers' outputs stored with the fixture: the largest difference of each run."""
    import onnxruntime as ort
    from safetensors.numpy import load_file

    from attnx.workflows.audit.cut import graph_feeds

    ref = load_file(str(reference))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in sess.get_inputs()}
    outs = [o.name for o in sess.get_outputs()]
    if "last_hidden_state" in ref:  # BERT: a batch of 2, row 1 right-padded; the real positions compared
        feeds = {k: ref[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in ins}
        got = sess.run(["last_hidden_state"], feeds)[0]
        real = ref["attention_mask"].astype(bool)
        return {"right-padded batch": float(np.abs(got - ref["last_hidden_state"])[real].max())}
    caches = [n for n in ins if n.startswith("past_key_values")]
    config = text_config(ckpt)
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    read = {n: (kv, 0, hd) for n in caches} | caches_of(path)
    half = {n for n in caches if ins[n].type == "tensor(float16)"}

    def empty(batch: int) -> dict[str, np.ndarray]:
        return {n: np.zeros((batch, read[n][0], read[n][1], read[n][2]), np.float16 if n in half else np.float32)
                for n in caches}  # fmt: skip

    def call(ids: np.ndarray, mask: np.ndarray, positions: np.ndarray | None, start: int, stop: int,
             past: dict[str, np.ndarray]) -> list[np.ndarray]:  # fmt: skip
        feeds = graph_feeds([n for n in ins if n not in caches], mask[:, :stop], start, None)
        feeds["input_ids"] = ids[:, start:stop]
        if positions is not None and "position_ids" in feeds:
            feeds["position_ids"] = positions[:, start:stop]
        return [np.asarray(a, np.float32) if a.dtype == np.float16 and i == 0 else a
                for i, a in enumerate(sess.run(None, {**feeds, **past}))]  # fmt: skip

    def runs(ids: np.ndarray, mask: np.ndarray, positions: np.ndarray | None, want: np.ndarray, what: str) -> dict:
        real = mask.astype(bool)
        found = {f"{what}full sequence": float(np.abs(call(ids, mask, positions, 0, ids.shape[1],
                                                           empty(len(ids)))[0] - want)[real].max())}  # fmt: skip
        if caches:
            out = call(ids, mask, positions, 0, PREFILL, empty(len(ids)))
            logits = [out[0]]
            for t in range(PREFILL, ids.shape[1]):
                past = {n: out[outs.index("present" + n[len("past_key_values"):])] for n in caches}
                out = call(ids, mask, positions, t, t + 1, past)
                logits.append(out[0])
            found[f"{what}prefill + steps"] = float(np.abs(np.concatenate(logits, axis=1) - want)[real].max())
        return found

    ids = ref["input_ids"]
    found = runs(ids, np.ones_like(ids), None, ref["logits"], "")
    batch = ins["input_ids"].shape[0]
    if "padded_logits" in ref and not isinstance(batch, int):
        found |= runs(ref["padded_input_ids"], ref["padded_attention_mask"], ref["padded_position_ids"],
                      ref["padded_logits"], "left-padded batch, ")  # fmt: skip
    return found


def fixture_dirs(chosen: list[str]) -> list[Path]:
    if chosen:
        return [FIXTURES / c for c in chosen]
    return [d for pattern in SETS for d in sorted(FIXTURES.glob(pattern)) if (d / "model.onnx").exists()]


def check(path: Path, src: Path, ckpt: Path, reference: Path | None, encoder: bool, same: bool) -> dict:
    ops = attention_ops(path)
    got: dict = {"ops": ops, "fused": sum(v for k, v in ops.items() if k in FUSED),
                 "softmax left": ops.get("ai.onnx.Softmax", 0), "load error": load_error(path)}  # fmt: skip
    if got["load error"] is None:
        if same:
            got["same as input"] = same_as_input(src, path, encoder)
        if reference is not None:
            try:
                got["against transformers"] = against_reference(path, ckpt, reference)
            except Exception as e:  # noqa: BLE001 (a runtime's error in a run is the finding)
                got["against transformers"] = {"error": first_line(e)}
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("fixtures", nargs="*", help="fixture folders relative to tests/fixtures (default: all)")
    p.add_argument("--work", default="/tmp/attnx-optimize-peers")
    p.add_argument("--json", default=None)
    p.add_argument("--merge", default=None, metavar="JSON",
                   help="an earlier run's JSON: its fixtures kept, those run now replaced or added (in SETS' order)")
    args = p.parse_args()
    import onnxruntime as ort

    logging.getLogger("onnxruntime").setLevel(logging.ERROR)  # the optimizer's per-fusion lines
    load = importlib.util.spec_from_file_location("fixturelib", FIXTURES / "fixturelib.py")
    fixturelib = importlib.util.module_from_spec(load)
    load.loader.exec_module(fixturelib)
    tolerance = fixturelib.TOLERANCE["fp32"]
    rows = []
    for folder in fixture_dirs(args.fixtures):
        name = str(folder.relative_to(FIXTURES))
        meta = json.loads((folder / "fixture.json").read_text()) if (folder / "fixture.json").exists() else {
            "checkpoint": "../checkpoint", "reference": "../reference.safetensors", "family": folder.parent.name,
            "tool": "onnxruntime-genai builder"}  # the builder's: tests/fixtures/genai/README.md  # fmt: skip
        ckpt = (folder / meta["checkpoint"]).resolve()
        reference = (folder / meta["reference"]).resolve() if meta.get("reference") else None
        encoder = meta.get("family") == "bert"
        src = folder / "model.onnx"
        row = {"fixture": name, "family": meta.get("family"), "tool": meta.get("tool"),
               "checkpoint": os.path.relpath(ckpt, ROOT), "input": check(src, src, ckpt, reference, encoder, False)}  # fmt: skip
        print(f"{name}: {row['input']['ops']}", flush=True)
        for tool in TOOLS:
            out = Path(args.work) / name / tool / "model.onnx"
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.exists():
                out.unlink()
            start = time.perf_counter()
            got: dict = {}
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # the optimizer prints its statistics
                    got["tool"] = RUNNERS[tool](src, out, ckpt, encoder)
                got["seconds"] = round(time.perf_counter() - start, 1)
                if "error" in got["tool"]:
                    got["error"] = got["tool"].pop("error")
            except Exception as e:  # noqa: BLE001 (a peer's crash, any type, is its finding)
                got["error"] = first_line(e)
            if out.exists() and "error" not in got:
                got |= check(out, src, ckpt, reference, encoder, True)
            row[tool] = got
            print(f"  {tool}: {summary(got, tolerance)}", flush=True)
        rows.append(row)
    result = {"cpu": cpu(), "date": datetime.date.today().isoformat(),
              "command": "python measurements/optimize_peers/run.py " + " ".join(sys.argv[1:]),
              "versions": {"onnxruntime": ort.__version__, **{k: importlib.metadata.version(k) for k in
                           ("onnxscript", "onnx", "onnx-ir", "torch", "transformers")}},
              "tolerance against transformers": tolerance, "fixtures": rows}  # fmt: skip
    if args.merge:  # an earlier run's fixtures kept, each with the run it came from
        earlier = json.loads(Path(args.merge).read_text())
        now = {r["fixture"]: r for r in rows}
        order = [str(d.relative_to(FIXTURES)) for d in fixture_dirs([])]
        kept = {r["fixture"]: {**r, "run": r.get("run") or {k: earlier[k] for k in ("cpu", "date", "command")}}
                for r in earlier["fixtures"]}  # fmt: skip
        merged = {**kept, **now}
        result["fixtures"] = sorted(merged.values(), key=lambda r: order.index(r["fixture"]) if r["fixture"] in order
                                    else len(order))  # fmt: skip
    print(tables(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


SHORT = {"com.microsoft.MultiHeadAttention": "MHA", "com.microsoft.GroupQueryAttention": "GQA",
         "com.microsoft.Attention": "Attention", "ai.onnx.Attention": "ONNX Attention", "ai.onnx.Softmax": "Softmax"}  # fmt: skip


def cores(got: dict) -> str:
    """A table cell: the attention nodes of a model, or why there is none."""
    if "error" in got:
        return "not written" if got.get("written") is False else "failed"
    text = ", ".join(f"{n} {SHORT[k]}" for k, n in sorted(got["ops"].items()))
    return text + (" (refused by ONNX Runtime)" if got["load error"] else "")


def said_same(got: dict) -> str:
    """Against the input: the same greedy tokens and the largest logits difference; repaired (attnx with the
    checkpoint: another formula than the input's, by design); or not run (the input refuses the padded batch: the
    builder's ring-buffer window)."""
    same = got["same as input"]
    largest_ = same.get("largest logits difference")
    if largest_ is None:  # the runtime's own message, or the proof's
        why = same["proofs"][0].removeprefix("FAIL: ").split("Status Message: ")[-1]
        return f"not compared ({why.replace('the written model', 'the output')[:84]})"
    if got.get("tool", {}).get("repairs"):
        return f"repaired ({'same' if same['passed'] else 'other'} tokens than the input, {largest_:.2g})"
    return f"{'same' if same['passed'] else 'OTHER'} tokens, {largest_:.2g}"


def agreement(got: dict, tolerance: float) -> str:
    """A table cell: the same greedy tokens as the input and the largest logits difference; the largest difference
    from transformers."""
    if "error" in got or got["load error"]:
        return "-"
    ref = [v for v in got.get("against transformers", {}).values() if isinstance(v, float)]
    text = said_same(got)
    return text + (f"; {max(ref):.2g}" + ("" if max(ref) <= tolerance else " (over)") if ref else "")


# The docs' summary: the fixtures by the source and form of their attention (first match)
SOURCES = [("torch.onnx, opset 20: llama, qwen3, llama4, mistral, phi3", r"torch-dynamo/(llama|qwen3|llama4|mistral|phi3)/.*opset20"),
           ("torch.onnx, Gemma 2", r"torch-dynamo/gemma2/"), ("torch.onnx, opset 23's Attention", r"opset23"),
           ("torch.onnx, GPT-2", r"torch-dynamo/gpt2/"),
           ("Optimum: llama, qwen2", r"optimum/(llama|qwen2)"), ("Optimum: Gemma 2", r"optimum/gemma2"),
           ("ONNX Runtime's optimizer: BERT", r"ort-optimizer/bert"),
           ("GenAI builder, fp32: llama, mistral, qwen2, qwen3, gemma2, phi3, gpt-oss", r"genai/[^/]+/fp32"),
           ("GenAI builder, int4: llama, qwen3", r"genai/[^/]+/int4"), ("GenAI builder, fp16: llama", r"genai/[^/]+/fp16")]  # fmt: skip


def by_source(result: dict) -> str:
    """A table: per source, each tool's cores (blocks in a fused core the tool wrote, of all blocks) and its
    agreement (every model the same greedy tokens as its input; the largest difference from transformers)."""
    tolerance = result["tolerance against transformers"]
    lines = ["| source (models, blocks) | onnxscript | ORT optimizer | attnx |", "|---|---|---|---|"]
    for label, pattern in SOURCES:
        rows = [f for f in result["fixtures"] if re.search(pattern, f["fixture"])]
        blocks = sum(sum(f["input"]["ops"].values()) for f in rows)
        cells = []
        for tool in TOOLS:
            done = [f[tool] for f in rows if "error" not in f[tool] and not f[tool]["load error"]]
            # a block rewritten: in a fused core of another kind than the input's (Softmax -> MHA, Attention -> GQA)
            written = [(k, v) for f in rows if "error" not in f[tool] for k, v in f[tool]["ops"].items()
                       if k in FUSED and k not in f["input"]["ops"]]  # fmt: skip
            kinds = sorted({SHORT[k] for k, _ in written})
            new = sum(v for _, v in written)
            if tool == "attnx":  # its own count: a block rewritten into its own kind (repaired) counts too
                new = sum(f[tool].get("tool", {}).get("rewritten", 0) for f in rows if "error" not in f[tool])
                kinds = sorted({SHORT[k] for f in rows if "error" not in f[tool] for k in f[tool]["ops"] if k in FUSED})
            if not done:
                cells.append(f"not written ({len(rows)} of {len(rows)})")
                continue
            # repaired models compute the checkpoint's formula, not the input's: held to transformers instead
            compared = [g for g in done if not g.get("tool", {}).get("repairs")
                        and g["same as input"].get("largest logits difference") is not None]  # fmt: skip
            same = all(g["same as input"]["passed"] for g in compared)
            ref = max((v for g in done for v in g.get("against transformers", {}).values() if isinstance(v, float)),
                      default=None)  # fmt: skip
            repaired = sum(bool(g.get("tool", {}).get("repairs")) for g in done)
            said = ([f"{'same tokens' if same else 'OTHER tokens'}"] if compared else []) + (
                [f"{repaired} repaired"] if repaired else [])  # fmt: skip
            if ref is not None:  # the largest difference from transformers, of every model written
                said.append(f"{ref:.2g}" + ("" if ref <= tolerance else " (over)"))
            rest = [f"{n} {what}" for n, what in ((len(done) - len(compared) - repaired, "not compared"),
                                                 (len(rows) - len(done), "not written")) if n]  # fmt: skip
            cell = "; ".join(part for part in [f"{new} of {blocks} rewritten" + (f" ({', '.join(kinds)})" if new else ""),
                                               ", ".join(said), *rest] if part)  # fmt: skip
            cells.append(cell)
        lines.append(f"| {label} ({len(rows)}, {blocks}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(result: dict) -> str:
    """The README's tables (markdown): the attention nodes per model, then the agreement."""
    tolerance = result["tolerance against transformers"]
    name = {f["fixture"]: f["fixture"].replace("unseen/exported/", "unseen ").replace("exported/", "")
            .replace("unseen/genai/", "unseen genai/") for f in result["fixtures"]}  # fmt: skip
    lines = ["| fixture | input | onnxscript | ORT optimizer | attnx |", "|---|---|---|---|---|"]
    for f in result["fixtures"]:
        lines.append(f"| {name[f['fixture']]} | {cores(f['input'])} | " + " | ".join(cores(f[t]) for t in TOOLS) + " |")
    lines += ["", "| fixture | input against transformers | onnxscript | ORT optimizer | attnx |", "|---|---|---|---|---|"]
    for f in result["fixtures"]:
        ref = [v for v in f["input"].get("against transformers", {}).values() if isinstance(v, float)]
        first = f"{max(ref):.2g}" + ("" if max(ref) <= tolerance else " (over)") if ref else "-"
        lines.append(f"| {name[f['fixture']]} | {first} | " + " | ".join(agreement(f[t], tolerance) for t in TOOLS) + " |")
    failed = [(name[f["fixture"]], t, f[t]["error"]) for f in result["fixtures"] for t in TOOLS if "error" in f[t]]
    lines += [""] + [f"- {n}, {t}: {e}" for n, t, e in failed]
    return "\n".join(lines) + "\n\n" + by_source(result)


def summary(got: dict, tolerance: float) -> str:
    """One line: fused / left, loads, same as the input, against transformers."""
    if "error" in got:
        return f"failed: {got['error']}"
    if got["load error"]:
        return f"{got['fused']} fused, {got['softmax left']} Softmax left; ONNX Runtime refuses it: {got['load error']}"
    ref = got.get("against transformers", {})
    worst = max((v for v in ref.values() if isinstance(v, float)), default=None)
    return (f"{got['fused']} fused, {got['softmax left']} Softmax left; {said_same(got)}; "
            + (f"transformers {worst:.3g} ({'within' if worst <= tolerance else 'OVER'} {tolerance:g})"
               if worst is not None else ref.get("error", "no reference")))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
