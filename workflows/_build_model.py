"""`attnx build --model`: a whole model another tool exported, optimized and proven (attnx optimize), then golden
generations recorded from it, packaged with its manifest into a folder that `attnx verify` re-checks on the
deployment machine and `attnx generate` serves (attnx.runtimes.model_package holds the deployment side).

    optimize     attnx.workflows.rewrite.optimize_model into the stage: a model it cannot prove is not packaged
                 (CheckFailed, exit 1, its failing proofs said); each block in the core measured fastest (or --core)
    buffer form  on the CPU provider, the blocks' plans written again in the buffer form by their cores' emitters
                 (each block's first buffer core that reads each row's length), beside the optimized model, their
                 weights shared, and proven against it (attnx.workflows._buffer_form): a proof that fails is not
                 packaged (CheckFailed); a model whose form does not fit keeps its own I/O, the reason in the manifest
    golden       prompts of different lengths (short ones, one past the widest window, one whose steps cross the
                 rope's original length, where the model has them), run together through the generation engine
                 with continuous batching (fewer rows than prompts: some join between steps), greedy, on the form
                 generate serves (the buffer form where written): each prompt's logits (at its last position alone
                 where the form computes no other) and each step's logits and token
    text         the tokenizer's files (attnx.runtimes.text.TEXT_FILES) from --tokenizer DIR, else from --checkpoint
                 where it holds tokenizer.json, copied flat beside the model; a tokenizer with an id past the model's
                 vocabulary is refused; the manifest's "text" section records a golden round trip (a fixed prompt's
                 ids, the first golden generation's tokens and their text) that verify repeats
    manifest     every file's size and sha256, the optimization's report, each model's form, the decode form served
                 and its proof, the bound the golden generations are replayed under, context, vocabulary, padding,
                 the machine it was verified on
    verify       the stage verified as `attnx verify` would, then published whole (attnx._io.Staging)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from attnx._io import Staging, output_lock, write_json_atomic
from attnx.errors import CheckFailed, InputError
from attnx.model.checkpoint import read_checkpoint_config
from attnx.model.config import AttentionConfig
from attnx.model.contract import DEFAULT_ROPE_POSITIONS, PROVIDERS, describe, external_data_locations
from attnx.model.terms import TERMS
from attnx.runtimes.generate import ModelIO, Request
from attnx.runtimes.model_package import BUFFER_PROVIDER, GENERATIONS_FILE, engine_for, golden_arrays, open_model
from attnx.runtimes.package import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_SUM,
    MODEL_KIND,
    VerifyReport,
    file_sha256,
    verify_package,
)
from attnx.runtimes.text import PackageText, has_tokenizer, text_files, text_manifest
from attnx.workflows._buffer_form import BufferFormResult, prove_buffer_form, write_buffer_form
from attnx.workflows._build import _check_target
from attnx.workflows._package_files import versions, write_npz
from attnx.workflows.audit.sources import original_length
from attnx.workflows.audit.whole import open_whole_model
from attnx.workflows.rewrite import ModelOptimizeReport, optimize_model
from attnx.workflows.rewrite.choose import AUTO_CORE
from attnx.workflows.rewrite.prove import TWINS_SAID, float32_twins, int8_activations, longest_reduction

__all__ = ["GOLDEN_LENGTHS", "GOLDEN_STEPS", "ModelBuildReport", "build_model_package", "golden_lengths"]

MODEL_FILE = "model.onnx"
REPORT_FILE = "optimize.json"
GOLDEN_LENGTHS = (3, 11, 6, 17)  # short prompts, in an order that makes rows of other lengths share a batch
GOLDEN_STEPS = 8  # greedy tokens recorded per prompt
GOLDEN_BATCH = 3  # rows at once: fewer than the prompts, so that waiting prompts join between steps
GOLDEN_SEED = 0


@dataclasses.dataclass
class ModelBuildReport:
    directory: str
    optimize: ModelOptimizeReport
    manifest: dict[str, Any]
    verify: VerifyReport


def golden_lengths(window: int | None, original: int | None, context: int | None,
                   steps: int = GOLDEN_STEPS) -> list[int]:  # fmt: skip
    """The golden prompts' lengths: GOLDEN_LENGTHS, one past the widest window, one whose steps cross the rope's
    original length (where the model has them), each leaving room for its steps within the context."""
    lengths = list(GOLDEN_LENGTHS)
    if window:
        lengths.append(window + 2)
    if original:
        lengths.append(max(1, original - steps // 2))  # its steps cross the original length
    room = context - steps if context is not None else None
    return list(dict.fromkeys(n for n in lengths if room is None or n <= room)) or [1]


def _model_facts(report: ModelOptimizeReport, checkpoint: str | None) -> tuple[int | None, int | None, int | None]:
    """(the widest window, the length past which a rope switches tables, the context) of the model: its
    checkpoint's config where given (window, context), else what its blocks were written from. The switch is the
    written blocks' (Rope.switch_at: longrope's, or a graph's own two tables); a rope that scales its frequencies
    without switching (llama3, yarn) computes alike on both sides of its original length, which no golden prompt
    needs to cross (at Llama 3's 8192 such a prompt alone took 20 GB to replay at 150M parameters)."""
    configs = [b.config for b in report.blocks if b.config is not None]
    switches = [AttentionConfig.from_dict(c).rope.switch_at for c in configs if c.get("rope")]
    switch = max((n for n in switches if n), default=None)
    if checkpoint is not None:
        hf = read_checkpoint_config(checkpoint)
        context = hf.get("max_position_embeddings") or hf.get("n_positions")
        if switch is None and any(b.config is None for b in report.blocks) and "longrope" in json.dumps(
                [hf.get("rope_scaling"), hf.get("rope_parameters")]):  # blocks kept: the checkpoint's longrope
            switch = original_length(hf) or None
        return hf.get("sliding_window") or None, switch, int(context) if context else None
    window = max((c.get("sliding_window") or 0 for c in configs), default=0) or None
    return window, switch, None


def build_model_package(model_path: str, out: str | os.PathLike[str], *, checkpoint: str | None = None,
                        provider: str = "cpu", core: str = AUTO_CORE, force: bool = False, weights: str | None = None,
                        tokenizer: str | None = None,
                        progress: Callable[[str], None] = lambda _m: None) -> ModelBuildReport:  # fmt: skip
    """The module doc: optimize `model_path` (its weights quantized first with `weights` "int4" / "int8"), record
    golden generations, package with its text (from `tokenizer`, else `checkpoint`), verify, publish at `out`."""
    out = os.path.abspath(os.fspath(out))
    _check_target(out, force)
    text_from = _text_source(tokenizer, checkpoint, progress)
    model = open_whole_model(model_path)  # checked as untrusted input and parsed, once: optimize reads it from here
    with output_lock(out), Staging(out, folder=True) as stage:
        report = optimize_model(model, stage.path(MODEL_FILE), checkpoint=checkpoint, provider=provider,
                                core=core, weights=weights, progress=progress,
                                serve=provider == BUFFER_PROVIDER)  # fmt: skip
        report.out = os.path.join(out, MODEL_FILE)  # where it will be, not the stage's name
        if not report.passed:
            failed = [str(p) for p in report.proofs if not p]
            raise CheckFailed(f"{model_path}: not packaged, attnx optimize did not prove it: "
                              + ("; ".join(failed) or "no block rewritten"))  # fmt: skip
        write_json_atomic(stage.path(REPORT_FILE), report.to_dict())
        window, original, context = _model_facts(report, checkpoint)
        said = {"padding": report.padding, "generations": {"max_batch": GOLDEN_BATCH}, "context": context,
                "one_row": one_row(report),  # how the engine batches and feeds, as the manifest will say
                "cache_dims": {name: [heads, size] for name, (heads, _, size) in report.caches.items()}}
        lengths = golden_lengths(window, original, context)
        buffer = _buffer_form(stage.path(), provider, said, lengths, report, progress, model_path)
        report.served = None  # the model as it came: its memory freed before the golden generations
        progress("recording golden generations")
        golden = _record_golden(stage.path(), provider, said, lengths, buffer.file or MODEL_FILE)
        text = _copy_text(text_from, stage.path(), golden)
        manifest = _manifest(stage.path(), model_path, checkpoint, provider, report, golden, said, buffer, text)
        with open(stage.path(MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
        with open(stage.path(MANIFEST_SUM), "w", encoding="ascii") as f:
            f.write(f"{file_sha256(stage.path(MANIFEST))}  {MANIFEST}\n")
        progress("verifying the package as attnx verify would")
        verify = verify_package(stage.path(), provider, progress)
        if not verify.passed:
            raise CheckFailed(f"{out}: the package does not verify here: "
                              + "; ".join(f"{c.name}: {c.detail}" for c in verify.failures()))  # fmt: skip
        progress(f"moving the package into place: {out}")
        stage.publish(replace_folder=lambda target: _check_target(target, force))
    verify.directory = out
    return ModelBuildReport(out, report, manifest, verify)


def _text_source(tokenizer: str | None, checkpoint: str | None,
                 progress: Callable[[str], None]) -> str | None:  # fmt: skip
    """The folder the package's text comes from (--tokenizer, else a --checkpoint holding tokenizer.json), its files
    read and checked against the model's vocabulary before anything is built; None: the package carries no text."""
    folder = tokenizer if tokenizer is not None else checkpoint if checkpoint and has_tokenizer(checkpoint) else None
    if folder is None:
        progress("no tokenizer: the package carries no text (give --tokenizer DIR, or a --checkpoint holding "
                 "tokenizer.json); generate takes token ids")  # fmt: skip
        return None
    if tokenizer is None and importlib.util.find_spec("tokenizers") is None:  # asked for by no flag: said, not fatal
        progress(f"no text: {checkpoint} holds tokenizer.json, but the tokenizers library is not installed (pip "
                 "install 'attnx[serve]'); the package carries no text, generate takes token ids")  # fmt: skip
        return None
    text = PackageText.from_folder(folder)
    if checkpoint is not None:  # early, where the checkpoint says; the model's own logits are checked once run
        vocab = read_checkpoint_config(checkpoint).get("vocab_size")
        _check_vocab(folder, text, vocab if isinstance(vocab, int) else None, f"{checkpoint}'s config.json")
    progress(f"text: {', '.join(text_files(folder))} from {folder} ({text.vocab_size} tokens, eos "
             f"{sorted(text.eos_ids)}, chat template: {'yes' if text.has_chat_template else 'no'})")  # fmt: skip
    return folder


def _check_vocab(folder: str, text: PackageText, vocab: int | None, said: str) -> None:
    if vocab is not None and text.vocab_size > vocab:
        raise InputError(f"{folder}: the tokenizer's ids go up to {text.vocab_size - 1}, past the model's vocabulary "
                         f"of {vocab} ({said}): not this model's tokenizer")  # fmt: skip


def _copy_text(folder: str | None, stage: str, golden: dict[str, Any]) -> dict[str, Any] | None:
    """The text files copied into the stage (flat, beside the model) and read back from there; the manifest's
    "text" section, its golden tokens the first golden generation's."""
    if folder is None:
        return None
    names = text_files(folder)
    for name in names:
        shutil.copyfile(os.path.join(os.path.realpath(folder), name), os.path.join(stage, name))
    text = PackageText.from_folder(stage, files=names)
    _check_vocab(folder, text, golden["vocab"], "its logits")
    return text_manifest(text, names, golden["tokens"])


def _buffer_form(folder: str, provider: str, said: dict[str, Any], lengths: list[int], report: ModelOptimizeReport,
                 progress: Callable[[str], None], model_path: str) -> BufferFormResult:  # fmt: skip
    """The buffer form written from the report's plans beside the optimized model and proven against it
    (attnx.workflows._buffer_form), on the provider it is served on; CheckFailed where its proof fails."""
    blocks = len(report.blocks)
    if provider != BUFFER_PROVIDER:
        return BufferFormResult(None, f"the buffer form is served on ONNX Runtime's {BUFFER_PROVIDER} provider only "
                                      "in this version")  # fmt: skip
    progress("writing the buffer form (the cache written in place, each row its own length)")
    result = write_buffer_form(folder, MODEL_FILE, report.served, said["context"] or DEFAULT_ROPE_POSITIONS)
    if result.file is None:
        progress(f"no buffer form: {result.reason}; generate serves the model's own inputs and outputs")
        return result
    progress("proving the buffer form against the model's own inputs and outputs")
    logits = [s.shape for s in describe(os.path.join(folder, MODEL_FILE)).outputs if s.name == "logits"]
    vocab = logits[0][-1] if logits and logits[0] and isinstance(logits[0][-1], int) else 1000
    if not int8_activations(os.path.join(folder, MODEL_FILE)):
        prove_buffer_form(folder, MODEL_FILE, result, said, lengths, GOLDEN_STEPS, vocab, blocks)
    else:
        # the kernels round activations to int8 (accuracy_level 4): what the pass wrote is proven on the forms'
        # float32-compute twins (prove.float32_twins); the golden generations are recorded from the form served
        with float32_twins([os.path.join(folder, n) for n in (MODEL_FILE, result.file)], folder) as twins:
            twin = dataclasses.replace(result, file=os.path.relpath(twins[1], folder))
            prove_buffer_form(folder, os.path.relpath(twins[0], folder), twin, said, lengths, GOLDEN_STEPS, vocab,
                              blocks, computing=TWINS_SAID)  # fmt: skip
        result.passed, result.proofs = twin.passed, twin.proofs
    if not result.passed:
        raise CheckFailed(f"{model_path}: not packaged, its buffer form does not compute what its own inputs and "
                          "outputs do: " + "; ".join(str(p) for p in result.proofs if not p))  # fmt: skip
    return result


def _stage_manifest(folder: str, model_file: str, provider: str) -> dict[str, Any]:
    """What open_model needs of a manifest to open one model of the stage (its files listed, not hashed)."""
    files = [model_file, *external_data_locations(os.path.join(folder, model_file))]
    return {"models": [{"file": model_file, "providers": [provider]}], "files": {f: {} for f in files}}


def _record_golden(folder: str, provider: str, said: dict[str, Any], lengths: list[int],
                   model_file: str) -> dict[str, Any]:  # fmt: skip
    """The golden generations (the module doc) recorded from `model_file` and written to GENERATIONS_FILE; what the
    manifest says of them."""
    with open_model(folder, _stage_manifest(folder, model_file, provider), provider) as runner:
        io = ModelIO.of(runner, said.get("cache_dims"))
        vocab = io.vocab
        rng = np.random.default_rng(GOLDEN_SEED)
        high = min(vocab or 1000, 1000)
        requests = [Request(i, [int(t) for t in rng.integers(1, high, n)], GOLDEN_STEPS)
                    for i, n in enumerate(lengths)]  # fmt: skip
        engine = engine_for(runner, said, record=True)
        engine.run(requests)
        inputs, outputs = [s.to_dict() for s in runner.inputs], [s.to_dict() for s in runner.outputs]
        logits = next(s for s in runner.outputs if s.name == io.logits)
    write_npz(os.path.join(folder, GENERATIONS_FILE), golden_arrays(requests))
    return {"file": GENERATIONS_FILE, "requests": len(requests), "max_batch": GOLDEN_BATCH, "steps": GOLDEN_STEPS,
            "tokens": list(requests[0].tokens),  # the first generation's new tokens: the text's golden round trip
            "lengths": lengths, "seed": GOLDEN_SEED, "vocab": vocab, "largest_batch": engine.max_batch,
            "model": model_file, "inputs": inputs, "outputs": outputs,
            # the served form's LastLogits: a prompt's logits at its last position alone
            "prompt_logits": "last" if len(logits.shape) == 3 and logits.shape[1] == 1 else "all"}  # fmt: skip


def one_row(report: ModelOptimizeReport) -> str | None:
    """Why the model's rows must run one at a time, or None: a longrope switches its factors for a whole call once
    the call's largest position passes its original length (transformers' rule, the exported graph's too), so a row
    past it would turn its batch-mates' keys with the long factors; a term computed from a token's slot (the
    registry's by_slot: Llama 4's temperature) gives a left-padded row other values than it has alone."""
    ropes = [(b.config or {}).get("rope") or {} for b in report.blocks]
    if any((rope.get("scaling") or {}).get("rope_type") == "longrope" for rope in ropes):
        return ("longrope: the call's largest position switches the factors of every row, so rows of a batch would "
                "change each other's tokens")
    configs = [AttentionConfig.from_dict(b.config) for b in report.blocks if b.config is not None]
    slotted = sorted({t.name for c in configs for t in TERMS.values() if t.by_slot and t.uses(c)})
    if slotted:
        return (f"{', '.join(slotted)}: computed from a token's slot in its batch, padding included, so a left-padded "
                "row would get other values than alone and rows of a batch would change each other's tokens")
    return None


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx512_vnni", "avx_vnni", "amx")) or f in ("avx2", "avx512f")]
    return f"{name} ({', '.join(wanted)})" if wanted else name


def _model_entry(folder: str, name: str, provider: str, form: str) -> dict[str, Any]:
    """A model's entry in the manifest: its file, providers, form, IR version, opsets, external data, inputs and
    outputs (read from the file without its data)."""
    info = describe(os.path.join(folder, name))
    return {"file": name, "providers": [provider], "form": form, "ir_version": int(info.ir_version),
            "opsets": dict(info.opsets), "external_data": list(info.external_data),
            "inputs": [s.to_dict() for s in info.inputs], "outputs": [s.to_dict() for s in info.outputs]}  # fmt: skip


def _manifest(folder: str, model_path: str, checkpoint: str | None, provider: str, report: ModelOptimizeReport,
              golden: dict[str, Any], said: dict[str, Any], buffer: BufferFormResult,
              text: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The package's manifest; `said`: how the engine batches and feeds (padding, context, one_row, cache_dims),
    as the golden generations were recorded under it."""
    models = [_model_entry(folder, MODEL_FILE, provider, "growing")]
    if buffer.file is not None:
        models.append(_model_entry(folder, buffer.file, provider, "buffer"))
    names = list(dict.fromkeys([m["file"] for m in models] + [n for m in models for n in m["external_data"]]
                               + [GENERATIONS_FILE, REPORT_FILE] + (text["files"] if text else [])))  # fmt: skip
    files = {n: {"size": os.path.getsize(os.path.join(folder, n)), "sha256": file_sha256(os.path.join(folder, n))}
             for n in names}  # fmt: skip
    logits = next(o for o in golden["outputs"] if o["name"] == "logits") if any(
        o["name"] == "logits" for o in golden["outputs"]) else golden["outputs"][0]  # fmt: skip
    cores = buffer.cores if buffer.file is not None else [b.written or f"kept {b.core}" for b in report.blocks]
    if buffer.file is not None:
        decode = {"form": "buffer: the cache written in place (past and present one buffer), each row its own length",
                  "file": buffer.file, "served_on": [BUFFER_PROVIDER],
                  "proofs": [str(p) for p in buffer.proofs], "notes": buffer.notes}
    else:
        decode = {"form": "growing: the model's own inputs and outputs (past_key_values in, present out)",
                  "file": MODEL_FILE, "buffer_form": f"not written: {buffer.reason}"}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": MODEL_KIND,
        "source": {"model": os.path.basename(model_path), "checkpoint": os.path.basename(os.path.abspath(checkpoint))
                   if checkpoint else None},
        "files": files,
        "models": models,
        "inputs": models[0]["inputs"], "outputs": models[0]["outputs"],
        "generations": {k: golden[k] for k in ("file", "requests", "max_batch", "steps", "lengths", "seed", "model",
                                               "prompt_logits")},
        # replayed under the whole-model row of the tolerance table: every block may run other kernels elsewhere
        "tolerance": {"dtype": "fp16" if logits["dtype"] == "fp16" else "fp32", "blocks": max(1, len(report.blocks)),
                      "k": longest_reduction(os.path.join(folder, MODEL_FILE))},
        "vocab": golden["vocab"], **{k: said[k] for k in ("context", "padding", "one_row", "cache_dims")},
        "decode": {**decode, "cores": cores, "max_batch": golden["largest_batch"]},
        "optimize": {"report": REPORT_FILE, "passed": report.passed, "provider": report.provider,
                     "proofs": [str(p) for p in report.proofs], "weights": report.weights},
        "verified_on": [provider],
        "machine": {"cpu": _cpu(), "provider": PROVIDERS[provider].ort_name},
        "versions": versions(),
        **({"text": text} if text else {}),
    }
