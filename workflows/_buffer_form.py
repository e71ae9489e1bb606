"""The buffer form in a whole model's package (attnx build --model): written from the plans attnx optimize proved, by
each core's own emitter, into the model as it came (attnx.workflows.rewrite.serve), its weights shared with the
optimized model, and proven against it before anything is recorded from it.

    write    the optimized model's tensors moved into one data file (DATA_FILE), unless they are there already; the
             buffer form spliced (the cache in place, each row its own length, GroupQueryAttention rotating q and k
             itself), then the rest of its graph for a step (serve_passes: RMS norms fused, sibling MatMuls packed,
             the packed q/k/v fed to the core, the logits of the last position alone), written beside it
             (DECODE_FILE): each of its tensors that the optimized model holds, the same bytes, is that model's entry
             of the same file, so the package holds it once
    prove    the same prompts (the golden ones: other lengths, joining between steps) through the generation engine
             on the model's own I/O, recorded, then fed through the buffer form: the same greedy tokens at every step,
             every logit within the tolerance table's whole-model bound of the model's own (a prompt's at its last
             position, where the buffer form computes no other)

A model whose form does not fit (a cache read by a block attnx did not rewrite, a block no buffer core computes:
NotBufferable's reason) keeps its own I/O, the reason in the manifest.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.export import save_model
from attnx.export.passes.serve import FuseRmsNorm, FuseSkipRmsNorm, LastLogits, PackedQkv, PackMatMuls
from attnx.model.contract import DEFAULT_ROPE_POSITIONS, PROVIDERS, external_data_locations
from attnx.model.tolerance import ProblemSize, whole_model_tolerance
from attnx.runtimes.base import ModelSource, create_runner
from attnx.runtimes.generate import Request
from attnx.runtimes.model_package import BUFFER_PROVIDER, engine_for, recorded_cases, replay_cases
from attnx.workflows._proof import Proof, ProofStats
from attnx.workflows.rewrite.prove import longest_reduction
from attnx.workflows.rewrite.serve import NotBufferable, splice_served

__all__ = ["DATA_FILE", "DECODE_FILE", "BufferFormResult", "prove_buffer_form", "serve_passes", "write_buffer_form"]

DECODE_FILE = "decode.onnx"
DATA_FILE = "model.onnx.data"


@dataclasses.dataclass
class BufferFormResult:
    """What write_buffer_form did: the file written (None, with the reason, where the form does not fit), the pass's
    notes, and its proofs (prove_buffer_form: one a prompt)."""

    file: str | None
    reason: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    proofs: list[Proof] = dataclasses.field(default_factory=list)
    passed: bool = False
    cores: list[str] = dataclasses.field(default_factory=list)  # each block's core in the form written

    def to_dict(self) -> dict[str, Any]:
        """Its fields, each proof as its line (as the manifest says it), their statuses and statistics beside."""
        return {"file": self.file, "reason": self.reason, "notes": self.notes, "passed": self.passed,
                "proofs": [str(p) for p in self.proofs], "proof_results": [p.to_dict() for p in self.proofs]}


def serve_passes() -> list[Any]:
    """The passes over the rest of the buffer form's graph for a step, in order (the pipeline as data;
    attnx.export.passes.serve)."""
    return [FuseRmsNorm(), FuseSkipRmsNorm(), PackMatMuls(), PackedQkv(), LastLogits()]


def write_buffer_form(folder: str, model_file: str, served: tuple[ir.Model, list[Any]] | None,
                      positions: int = DEFAULT_ROPE_POSITIONS) -> BufferFormResult:  # fmt: skip
    """The buffer form of `folder`/`model_file` (optimized from `served`: the model as it came and its plans,
    ModelOptimizeReport.served) written as `folder`/DECODE_FILE (the module doc), or why not; `positions`: the most a
    row can reach (the model's context where known), the rows of its rope table."""
    if served is None or not served[1]:
        return BufferFormResult(None, "no block was planned: the model's caches are not attnx's to write in place")
    model, plans = served
    try:
        served_plans = splice_served(model, plans, positions)
    except NotBufferable as e:
        return BufferFormResult(None, str(e))
    cores = [plan.core for plan in served_plans]
    notes = [f"{cores.count(core)} block(s) written in the buffer form by their core's emitter ({core}): the cache "
             "in place, each row its own length" for core in dict.fromkeys(cores)]  # fmt: skip
    path = os.path.join(folder, model_file)
    if not external_data_locations(path):  # DATA_FILE: save_model's `<name>.data` of the package's model.onnx
        save_model(ir.load(path), path, external_data=True)
    _share_tensors(model, ir.load(path))
    for step in serve_passes():
        step(model)
        notes += step.notes
    save_model(model, os.path.join(folder, DECODE_FILE), external_data=False)
    return BufferFormResult(DECODE_FILE, notes=notes, cores=cores)


def _share_tensors(model: ir.Model, optimized: ir.Model) -> None:
    """Each initializer of `model` that `optimized` (read from its file) holds under its name, the same dtype, shape
    and bytes, made that model's (an entry of its data file); one that is the columns (or rows) of several of the
    model's, in order (a core's packed q/k/v where the growing form's core keeps them apart), their Concat,
    which ONNX Runtime folds when it loads the model; any other read into memory, so that `model` refers to no file
    but its package's and the package holds each weight once."""
    theirs = optimized.graph.initializers
    for name, value in list(model.graph.initializers.items()):
        mine, other = value.const_value, theirs[name].const_value if name in theirs else None
        if other is not None and (mine.dtype, tuple(mine.shape)) == (other.dtype, tuple(other.shape)) \
                and np.array_equal(mine.numpy(), other.numpy()):  # fmt: skip
            value.const_value = other
            continue
        parts = _as_parts(mine, theirs)
        if parts is not None:
            axis, values = parts
            model.graph.initializers.pop(name)
            shared = []
            for part in values:
                if part.name not in model.graph.initializers:
                    model.graph.register_initializer(ir.Value(name=part.name, shape=part.shape, type=part.type,
                                                              const_value=part.const_value))  # fmt: skip
                shared.append(model.graph.initializers[part.name])
            concat = ir.node("Concat", shared, {"axis": axis}, outputs=[ir.Value(name=f"{name}/joined")],
                             name=f"{name}/Concat")  # fmt: skip
            model.graph.insert_before(next(iter(model.graph)), concat)
            value.replace_all_uses_with(concat.outputs[0])
        elif isinstance(mine, ir.ExternalTensor):
            value.const_value = ir.tensor(mine.numpy(), name=name)


def _as_parts(mine: Any, theirs: Mapping[str, ir.Value]) -> tuple[int, list[ir.Value]] | None:
    """(axis, initializers of `theirs` whose Concat along axis is `mine`, byte for byte), or None."""
    array = mine.numpy()
    if array.ndim < 2:
        return None
    pool = [v for v in theirs.values() if v.const_value is not None and v.const_value.dtype == mine.dtype
            and len(v.const_value.shape) == array.ndim]  # fmt: skip
    for axis in (array.ndim - 1, 0):
        at, found = 0, []
        while at < array.shape[axis]:
            piece = next((v for v in pool if v not in found and _is_slice(array, axis, at, v.const_value)), None)
            if piece is None:
                break
            found.append(piece)
            at += piece.const_value.shape[axis]
        if at == array.shape[axis] and len(found) > 1:
            return axis, found
    return None


def _is_slice(array: np.ndarray, axis: int, at: int, tensor: Any) -> bool:
    """Whether `tensor` is `array`'s slice [at, at + its length) along `axis`: its shape, then its first row (cheap:
    most candidates of one shape differ there), then every byte."""
    shape = tuple(tensor.shape)
    if shape[axis] > array.shape[axis] - at or any(shape[d] != array.shape[d] for d in range(array.ndim) if d != axis):
        return False
    part = np.take(array, range(at, at + shape[axis]), axis=axis)
    theirs = tensor.numpy()
    return np.array_equal(part.reshape(-1)[:64], theirs.reshape(-1)[:64]) and np.array_equal(part, theirs)


def prove_buffer_form(folder: str, model_file: str, result: BufferFormResult, said: Mapping[str, Any],
                      lengths: Sequence[int], steps: int, vocab: int, blocks: int,
                      computing: str | None = None) -> None:  # fmt: skip
    """The buffer form against the model's own I/O (the module doc), on ONNX Runtime's CPU provider: result.proofs
    and result.passed. `said`: how the engine batches (max_batch, one_row, padding, context, as the manifest says);
    `computing`: how the two forms' kernels compute, where the proofs say it (float32 twins)."""
    paths = [os.path.join(folder, f) for f in (model_file, result.file)]
    tol = whole_model_tolerance("fp32", blocks)
    size = ProblemSize(longest_reduction(paths[0]))
    rng = np.random.default_rng(1)
    high = min(vocab, 1000)
    requests = [Request(i, [int(t) for t in rng.integers(1, high, n)], steps) for i, n in enumerate(lengths)]
    backend = PROVIDERS[BUFFER_PROVIDER].backend
    with create_runner(backend, ModelSource(model_path=paths[0])).load() as own:
        engine_for(own, said, record=True).run(requests)
    with create_runner(backend, ModelSource(model_path=paths[1])).load() as buffer:
        checks = replay_cases(buffer, said, recorded_cases(requests), tol, size, label="prompt")
    rows = "one row at a time" if said.get("one_row") else f"{said['generations']['max_batch']} rows at once"
    subject = "the buffer form against the model's own inputs and outputs" + (f", {computing}" if computing else "")
    # each detail quotes its comparison (replay_cases: Comparison.detail(), a failing one's needed atol)
    result.proofs = [Proof.verdict(bool(c), f"{subject}, {c.name} ({rows})", c.detail,
                                   ProofStats.from_stats(c.stats) if c.stats is not None else None, quoted=True)
                     for c in checks]  # fmt: skip
    result.passed = all(result.proofs)
