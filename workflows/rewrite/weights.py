"""`--weights int4|int8` of attnx optimize and build --model: an fp32 export's MatMul weights quantized with ONNX
Runtime's MatMulNBits quantizer (attnx.export.passes.quantize_weights), then optimized as any quantized model is
(each block's core rewritten alone at the quantized projections and proven against float64 with the file's own
dequantized weights), and the whole written model's distance from the fp32 input measured: the logits' relative RMS
and the top-1 agreement over DISTANCE_PROMPTS, full sequence, batch 1.

The distance is a report, never a verdict: int4's rounding is the scheme's (DESIGN: ~8% per projection on Gaussian
weights), and what it does to a model's tokens is the user's call; the proofs are of the quantized model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.errors import ProviderUnavailable, UsageError
from attnx.export.passes.quantize_weights import WEIGHT_BITS, QuantizeWeights, WeightsRecord
from attnx.model.contract import PROVIDERS
from attnx.workflows._proof import Proof, ProofStatus
from attnx.workflows.audit.cut import graph_feeds, runner_for
from attnx.workflows.rewrite.prove import empty_cache, vocab_of

__all__ = ["DISTANCE_PROMPTS", "quantize_weights_file", "weights_distance"]

# the prompts the distance is measured on: (tokens, seed) each, random ids below the vocab
DISTANCE_PROMPTS = ((16, 0), (48, 1), (96, 2), (128, 3))


def quantize_weights_file(model: ir.Model | str, model_path: str, weights: str, folder: str,
                          save: Callable[[ir.Model, str], object],
                          say: Callable[[str], None] = lambda _m: None) -> tuple[str, WeightsRecord]:  # fmt: skip
    """`model` (an fp32 whole model read from `model_path`, checked as untrusted by the caller: its onnx-ir model,
    quantized in place, or its path) with its MatMul weights quantized to `weights`, written into `folder` by `save`
    (its external data beside it); the path and what was done."""
    if weights not in WEIGHT_BITS:
        raise UsageError(f"--weights {weights}: must be one of {', '.join(WEIGHT_BITS)}")
    say(f"quantizing the model's MatMul weights to {weights} (ONNX Runtime's MatMulNBits quantizer)")
    if isinstance(model, str):
        model = ir.load(model)
    floats = [v for v in model.graph.initializers.values() if v.const_value is not None]
    if any(v.const_value.dtype == ir.DataType.FLOAT16 for v in floats) and not any(
            v.const_value.dtype == ir.DataType.FLOAT for v in floats):  # fmt: skip
        raise UsageError(f"--weights {weights}: {model_path} holds fp16 weights; --weights quantizes an fp32 export")
    quantize = QuantizeWeights(weights)
    quantize(model)
    if not quantize.record.quantized:  # an already quantized model: its embeddings alone are not what was asked
        raise UsageError(f"--weights {weights}: {model_path} has no MatMul of a constant 2-D float32 weight to "
                         "quantize (already quantized, or its weights are not constants)")  # fmt: skip
    path = os.path.join(folder, "quantized.onnx")
    save(model, path)
    return path, quantize.record


def weights_distance(fp32_path: str, quantized_path: str, caches: Mapping[str, tuple[int, int, int]] | None = None,
                     provider: str = "cpu") -> dict[str, Any]:  # fmt: skip
    """The quantized model's logits against the fp32 model's over DISTANCE_PROMPTS (each alone, full sequence, no
    past): relative RMS of the difference (all positions pooled), top-1 agreement (the share of positions whose
    argmax is the same), and the worst prompt's of each."""
    with contextlib.ExitStack() as stack:
        runners = []
        for path in (fp32_path, quantized_path):
            runner = runner_for(PROVIDERS[provider].backend, path)
            if isinstance(runner, str):
                raise ProviderUnavailable(f"--provider {provider}: {runner}")
            runners.append(stack.enter_context(runner))
        vocab = vocab_of(runners[0], 256)
        squares = references = agree = positions = 0.0
        rows = []
        for tokens, seed in DISTANCE_PROMPTS:
            ids = np.random.default_rng([seed, tokens]).integers(1, vocab, (1, tokens))
            fp32, quantized = (_logits(r, ids, caches) for r in runners)
            diff, same = np.square(quantized - fp32).sum(), (quantized.argmax(-1) == fp32.argmax(-1)).sum()
            squares, references = squares + diff, references + np.square(fp32).sum()
            agree, positions = agree + same, positions + tokens
            rows.append({"tokens": tokens, "rel_rms": float(np.sqrt(diff / np.square(fp32).sum())),
                         "top1": float(same / tokens)})  # fmt: skip
    return {"prompts": [t for t, _ in DISTANCE_PROMPTS], "rel_rms": float(np.sqrt(squares / references)),
            "top1": float(agree / positions), "worst_rel_rms": max(r["rel_rms"] for r in rows),
            "worst_top1": min(r["top1"] for r in rows), "per_prompt": rows}  # fmt: skip


def distance_said(distance: Mapping[str, Any], weights: str) -> Proof:
    """The quantized model's distance from the fp32 input (weights_distance), said among the proofs: the user's call,
    never a failure."""
    return Proof(ProofStatus.SAID, f"the {weights} model against the fp32 input, {len(distance['prompts'])} prompts of "
                                   f"{', '.join(map(str, distance['prompts']))} tokens (full sequence): logits "
                                   f"relative RMS {distance['rel_rms']:.3g} (worst prompt "
                                   f"{distance['worst_rel_rms']:.3g}), top-1 agreement {distance['top1']:.1%} (worst "
                                   f"prompt {distance['worst_top1']:.1%})")  # fmt: skip


def _logits(runner: Any, ids: np.ndarray, caches: Mapping[str, tuple[int, int, int]] | None) -> np.ndarray:
    """A whole model's logits [tokens, vocab] float64 for one row of `ids`, no past."""
    specs = {s.name: s for s in runner.inputs}
    names = [n for n in specs if not n.startswith("past") and n != "input_ids"]
    feeds = graph_feeds(names, np.ones(ids.shape, np.int64), 0, None)
    feeds["input_ids"] = ids.astype(np.int64)
    for name, spec in specs.items():
        if name.startswith("past"):
            feeds[name] = empty_cache(spec, 1, (caches or {}).get(name))
    out = runner.run(feeds)
    logits = out["logits"] if "logits" in out else next(iter(out.values()))
    return np.asarray(logits, np.float64).reshape(ids.shape[1], -1)
