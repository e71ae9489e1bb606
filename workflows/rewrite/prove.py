"""The written model's proofs: each new block audited against the float64 reference (and the checkpoint), and the
whole model against the input through its own inputs and outputs."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from attnx.model.contract import PROVIDERS, external_data_locations
from attnx.model.tolerance import ProblemSize, Tolerance, whole_model_tolerance
from attnx.runtimes.base import Runner
from attnx.runtimes.compare import compare_arrays
from attnx.workflows._proof import Proof, ProofStats, ProofStatus
from attnx.workflows.audit import audit_model
from attnx.workflows.audit.audit import float32_compute
from attnx.workflows.audit.cut import NP_DTYPES, graph_feeds, runner_for
from attnx.workflows.audit.run import first_line
from attnx.workflows.audit.sources import CheckpointLayers
from attnx.workflows.audit.whole import WholeModel, open_whole_model
from attnx.workflows.rewrite.report import ModelOptimizeReport

__all__ = ["empty_cache", "float32_twins", "int8_activations", "prove", "same_model", "same_tokens", "vocab_of"]

# said of a comparison run on float32-compute twins (float32_twins)
TWINS_SAID = "each with its MatMulNBits computing in float32 (accuracy_level 1; served at 4)"


def prove(report: ModelOptimizeReport, model: str | WholeModel, out_path: str, checkpoint: str | None,
          plans: list[Any], say: Callable[[str], None], provider: str = "cpu",
          caches: dict[str, tuple[int, int, int]] | None = None,
          source: CheckpointLayers | None = None, quantized: bool = False) -> bool:  # fmt: skip
    """The written model's proofs (the module doc), each a Proof of the report; whether all hold. model: the input
    (a path, or the model opened once). caches: each cache input's (kv heads, capacity, head_dim) as its block reads
    it (capacity: the positions it holds before the first token, a window kept in a ring buffer), where the model's
    dims do not say. source: `checkpoint`'s layers, as read for the input. quantized: `model` is the input with its
    MatMul weights quantized (optimize --weights), a change of its own, proven by its caller."""
    if not plans:
        if quantized:  # the weights are what changed: the blocks kept, each said above
            report.proofs.append(Proof(ProofStatus.PASS, "no block rewritten", "the model written with its MatMul "
                                       "weights quantized, each block as it is (kept above)"))  # fmt: skip
            return True
        fastest = [b.index for b in report.blocks if b.choice is not None and b.choice.fastest]
        if not fastest:
            report.proofs.append(Proof(ProofStatus.FAIL, "no block rewritten", "nothing to write"))
            return False
        # already fast is not a failure: the model is written as it came, so a pipeline's next step finds it
        report.proofs.append(Proof(ProofStatus.PASS, "no block rewritten",
                                   f"block(s) {', '.join(map(str, fastest))} already in the fastest core for their "
                                   "inputs and outputs (timed above); the model written as it is"))  # fmt: skip
        return True
    say("auditing the written model's blocks")
    written = open_whole_model(out_path, whole_model=False)  # what attnx wrote, opened once for its audit and proofs
    audit = audit_model(written, checkpoint=checkpoint, backends=(PROVIDERS[provider].backend,), source=source)
    written.release()  # its protobuf alone is read from here on, beside the runtimes' own copies
    read = {b.index: b for b in audit.blocks}
    ok = True
    for finding in audit.findings:  # of the whole model: its decoding as written fails, a layer paired twice
        ok = False
        report.proofs.append(Proof(ProofStatus.FAIL, "the written model", finding))
    for plan in plans:
        block = plan.block
        b = read.get(block.index)
        if b is None:
            ok = False
            report.proofs.append(Proof(ProofStatus.FAIL, f"block {block.index} of the written model is not read back",
                                       "; ".join(audit.unread)))  # fmt: skip
            continue
        fine = b.passed and (checkpoint is None or not b.findings)
        ok &= fine
        worst = b.worst()  # a failing one's line ends with the atol it would pass at
        report.proofs.append(Proof.verdict(fine, f"block {b.index} ({b.core}) against the float64 reference"
                                                 f"{' and the checkpoint' if checkpoint else ''}",
                                           "" if fine else "; ".join(b.findings + b.not_checked),
                                           ProofStats.of(worst) if worst is not None else None))  # fmt: skip
    say("running the written model against the input through its own inputs and outputs")
    # padded as the model's blocks read a padded row: right for a mask_index or seqlens_k (BERT's fused Attention, the
    # GenAI builder's GroupQueryAttention), else left (transformers' attention_mask)
    right = report.padding == "right"
    repaired = [b.layer for b in report.blocks if b.written is not None and b.repairs]
    if repaired:  # they compute what the checkpoint states, which the input does not: held to its reference above
        report.proofs.append(Proof(ProofStatus.NOT_COMPARED,
                                   f"the whole model against the input, whose layer(s) {', '.join(map(str, repaired))} "
                                   "compute other terms than the checkpoint states; each repaired block is held to "
                                   "the checkpoint's reference above"))  # fmt: skip
        return ok
    dtype = next((plan.dtype for plan in plans if plan.dtype != "fp32"), "fp32")
    ok &= same_model(report, model, written, right, provider, len(plans), dtype, caches)
    return ok


def same_model(report: ModelOptimizeReport, model: str | WholeModel, out: str | WholeModel, right: bool = False,
               provider: str = "cpu", rewritten: int = 1, dtype: str = "fp32",
               caches: dict[str, tuple[int, int, int]] | None = None) -> bool:  # fmt: skip
    """The written model against the input (each a path, or the model opened once), each loaded through the runner
    registry on ort-cpu (cut.runner_for, as the audit's whole-model decode: an ONNX Runtime session of its path,
    attnx.workflows.audit.whole says why): the same inputs and outputs (names, dtypes, dims), and on a left-padded
    batch, full sequence then prefill + single steps through each one's own cache (present.* fed back as
    past_key_values.*), the same greedy tokens (logits' argmax at every unpadded position); the largest logits
    difference is said."""
    protos = [m.proto if isinstance(m, WholeModel) else _structure(m) for m in (model, out)]
    model_path, out_path = (m.path if isinstance(m, WholeModel) else os.fspath(m) for m in (model, out))
    with contextlib.ExitStack() as stack:
        runners = []
        paths = (model_path, out_path)
        twins = any(int8_activations(p) for p in protos)
        if twins:  # int8 activations: one value rounded to the next level parts two graphs past the bound
            paths = stack.enter_context(float32_twins(paths, os.path.dirname(os.path.abspath(out_path)), protos))
        for path in paths:
            runner = runner_for(PROVIDERS[provider].backend, path)
            if isinstance(runner, str):
                report.proofs.append(Proof(ProofStatus.FAIL, "the whole model not run", runner))
                return False
            runners.append(stack.enter_context(runner))
        before, after = declared_io(protos[0]), declared_io(protos[1])
        if before != after:  # as the files declare them (a runtime may type an output further from its producer)
            which = next(a[0] for a, b in zip(before + [("-",)], after + [("-",)]) if a != b)
            report.proofs.append(Proof(ProofStatus.FAIL, "the written model's inputs or outputs differ from the "
                                                         f"input's (first: {which})"))  # fmt: skip
            return False
        return same_tokens(report, *runners, right, whole_model_tolerance(dtype, rewritten),
                           ProblemSize(longest_reduction(protos[0])), caches,
                           named=f"the whole model ({TWINS_SAID})" if twins else "the whole model")  # fmt: skip


def _structure(model: Any) -> Any:
    """A ModelProto as given, or the one at a path read without its data."""
    import onnx

    return onnx.load(os.fspath(model), load_external_data=False) if isinstance(model, (str, os.PathLike)) else model


def int8_activations(model: Any) -> bool:
    """Whether any MatMulNBits of `model` (a path, or its ModelProto) quantizes its input to int8 (accuracy_level
    4), read without its data."""
    graph = _structure(model).graph
    return any(a.name == "accuracy_level" and a.i == 4 for n in graph.node if n.op_type == "MatMulNBits"
               for a in n.attribute)  # fmt: skip


@contextlib.contextmanager
def float32_twins(paths: Sequence[str], near: str, protos: Sequence[Any] | None = None) -> Iterator[list[str]]:
    """Each model of `paths` with every MatMulNBits at accuracy_level 1 (float32 compute), every other byte the same:
    written into a scratch folder in `near` (the output's), beside links to its own external data files (hard links,
    else symbolic ones), removed after. Two graphs of the same int8-computing weights part by one value rounded to
    the next int8 level where their float32 noise differs; their twins show what the graphs compute, the int8
    rounding being the kernels', alike in both. protos: each path's ModelProto where the caller holds it already
    (copied, never edited)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix=".attnx-twins-", dir=near) as scratch:
        twins = []
        for i, path in enumerate(paths):
            folder = os.path.join(scratch, str(i))
            os.makedirs(folder)
            for location in external_data_locations(path):
                source, link = os.path.join(os.path.dirname(os.path.abspath(path)), location), os.path.join(folder, location)
                os.makedirs(os.path.dirname(link), exist_ok=True)
                try:
                    os.link(source, link)
                except OSError:  # another file system
                    os.symlink(os.path.abspath(source), link)
            if protos is None:
                model = onnx.load(path, load_external_data=False)
            else:
                model = onnx.ModelProto()
                model.CopyFrom(protos[i])
            float32_compute(model)
            twins.append(os.path.join(folder, os.path.basename(path)))
            onnx.save(model, twins[-1])
        yield twins


def declared_io(model: Any) -> list[tuple[str, int, list[Any]]]:
    """The inputs and outputs a model (a path, or its ModelProto) declares: name, element type, dims (a dim's name
    or size)."""
    graph = _structure(model).graph
    return [(v.name, v.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in [*graph.input, *graph.output]]  # fmt: skip


def empty_cache(spec: Any, batch: int, read: tuple[int, int, int] | None) -> np.ndarray:
    """A cache input's past before the first token, in its dtype: no position, or the window's capacity of a ring
    buffer; its heads and head size from its dims, or as its block reads them (`read`: the GenAI builder names the
    head size kv_cache_dim)."""
    kv, capacity, hd = read or (spec.shape[1], 0, spec.shape[3])
    heads = spec.shape[1] if isinstance(spec.shape[1], int) else kv
    size = spec.shape[3] if isinstance(spec.shape[3], int) else hd
    return np.zeros((batch, heads, capacity, size), NP_DTYPES.get(spec.dtype, np.float32))


def longest_reduction(model: Any) -> int:
    """K of the tolerance rule for a whole model (a path, or its ModelProto): its longest sum, the widest input of a
    MatMul's constant weights (a MatMulNBits' K), read from the graph without its data."""
    graph = _structure(model).graph
    dims = {t.name: list(t.dims) for t in graph.initializer}
    widths = [dims[n.input[1]][0] for n in graph.node if n.op_type == "MatMul" and len(dims.get(n.input[1], [])) == 2]
    widths += [a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "K"]
    return max(widths, default=1)


def vocab_of(runner: Runner, most: int) -> int:
    """The tokens a whole model takes: its logits' last dim where it is static, at most `most` (ids below it)."""
    spec = next((s for s in runner.outputs if s.name == "logits"), runner.outputs[0])
    last = spec.shape[-1] if spec.shape else None
    return min(int(last), most) if isinstance(last, int) else most


def same_tokens(report: ModelOptimizeReport, before: Runner, after: Runner, right: bool, tol: Tolerance,
                size: ProblemSize, read: dict[str, tuple[int, int, int]] | None = None, *,
                named: str = "the whole model") -> bool:  # fmt: skip
    """_same_model's runs and comparison, on the two loaded models (one row where the model fixes its batch at 1):
    the same greedy tokens at every unpadded position, and the logits there within `tol` (the tolerance table's
    whole-model row) of the input's; a failure names its first (row, position), a NaN or inf there included. A
    padding position's output has no meaning and enters no comparison: where the input's logits at a padded row's
    own positions are not finite though the row alone's are (its padding's NaN reaching them through keys its mask
    hides: 0 * NaN), that row is held to the input's run of the row alone, as said. An input that fails to decode
    through its own cache (ONNX Runtime's error: the GenAI builder's fp16 model) is said, and the written model's
    steps are held to the input's full sequence instead: a causal model's logits at a position are the same whether
    its tokens come at once or one by one. `named`: how the proofs name the model (and how its kernels compute)."""
    names = {spec.name for spec in before.inputs}
    if "input_ids" not in names or "attention_mask" not in names:
        report.proofs.append(Proof(ProofStatus.NOT_CHECKED,
                                   f"{named}, fed input_ids and attention_mask only in this version"))  # fmt: skip
        return True
    fixed = next(spec.shape[0] for spec in before.inputs if spec.name == "input_ids")
    batch = fixed if isinstance(fixed, int) else 2  # the model's own batch where its dims fix it
    tokens, prefill = 12, 8
    mask = np.ones((batch, tokens), np.int64)
    side = "right" if right else "left"
    if batch > 1:  # the last row padded by 3, beside whole ones
        mask[-1, slice(-3, None) if right else slice(0, 3)] = 0
    rows = f"a {side}-padded batch" if batch > 1 else "one row (the model's batch is fixed at 1)"
    ids = np.random.default_rng(0).integers(1, vocab_of(before, 100), (batch, tokens))
    specs = {spec.name: spec for spec in before.inputs if spec.name.startswith("past_key_values")}
    caches = {name: spec.shape for name, spec in specs.items()}
    empty = {n: empty_cache(specs[n], batch, (read or {}).get(n)) for n in caches}

    def call(runner: Runner, ids: np.ndarray, mask: np.ndarray, start: int, stop: int,
             past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # fmt: skip
        feeds = {**graph_feeds([n for n in names if n not in caches], mask[:, :stop], start, None), **past}
        feeds["input_ids"] = ids[:, start:stop]
        return runner.run({k: v for k, v in feeds.items() if k in names})

    def run(runner: Runner, ids: np.ndarray = ids, mask: np.ndarray = mask,
            prefill: int = prefill) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        logits, tokens = runner.outputs[0].name, ids.shape[1]
        whole = call(runner, ids, mask, 0, tokens, empty)[logits]
        if not caches:
            return whole, whole
        out = call(runner, ids, mask, 0, prefill, empty)
        steps = [out[logits]]
        for t in range(prefill, tokens):
            out = call(runner, ids, mask, t, t + 1, {n: out["present" + n[len("past_key_values"):]] for n in caches})
            steps.append(out[logits])
        return whole, np.concatenate(steps, axis=1)

    b_whole, b_steps = run(after)
    steps_said = "prefill + steps"
    decodes = True
    try:
        a_whole, a_steps = run(before)
    except Exception as e:  # noqa: BLE001 - the input's own failure, in ONNX Runtime's error types
        a_whole = call(before, ids, mask, 0, tokens, empty)[before.outputs[0].name]  # its full sequence runs, or this raises
        a_steps = a_whole
        decodes = False
        steps_said = "prefill + steps (held to the input's full sequence)"
        report.proofs.append(Proof(ProofStatus.SAID, f"the input fails to decode through its own cache "
                                                     f"({first_line(e)}); the written model's steps are held to the "
                                                     "input's full sequence"))  # fmt: skip
    keep = mask.astype(bool)
    a_whole, a_steps = alone_where_padding_spreads(report, before, run, ids, keep, prefill, decodes, a_whole, a_steps)
    ok = True
    runs = [("full sequence", a_whole, b_whole)] + ([(steps_said, a_steps, b_steps)] if caches else [])
    for what, a, b in runs:
        cmp = compare_arrays("logits", b, a, tol, size, where=keep)
        with np.errstate(invalid="ignore"):  # a NaN's row: named below as not finite
            other = np.argwhere((a.argmax(-1) != b.argmax(-1)) & keep)
            far = np.argwhere((~(np.abs(b - a) <= cmp.atol + cmp.rtol * np.abs(a))).any(-1) & keep)
        fine = not len(other) and bool(cmp)
        ok &= fine
        said = f"{'the same' if not len(other) else 'other'} greedy tokens, logits {cmp.detail()}"
        first = [f"first other token at row {other[0][0]}, position {other[0][1]}"] if len(other) else []
        first += [f"first logits past the bound at row {far[0][0]}, position {far[0][1]}"] if len(far) else []
        if cmp.nonfinite is not None:
            whose = "the written model's" if cmp.nonfinite_in == "output" else "the input's"
            first += [f"{whose} logits not finite at row {cmp.nonfinite[0]}, position {cmp.nonfinite[1]}"]
        report.proofs.append(Proof.verdict(fine, f"{named}, {what} of {rows}",
                                           said + (f" ({'; '.join(first)})" if first else ""), ProofStats.of(cmp),
                                           quoted=True))  # fmt: skip
    return ok


def alone_where_padding_spreads(report: ModelOptimizeReport, before: Runner,
                                run: Callable[..., tuple[np.ndarray, np.ndarray]], ids: np.ndarray, keep: np.ndarray,
                                prefill: int, decodes: bool, whole: np.ndarray,
                                steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The input's logits (`whole`, `steps`: [batch, tokens, vocab]) with each padded row whose own positions hold a
    NaN or inf replaced there by the input's run of that row alone (its tokens in every row of the batch, no
    padding), where that run is finite: its padding's outputs reached its own positions (a row that sees no key, its
    NaN carried into the next layer's keys, which the mask hides but 0 * NaN keeps). Said in the report; a row whose
    run alone is not finite either keeps its NaN, which the comparison names."""
    whole, steps = whole.copy(), steps.copy()
    for row in np.flatnonzero(~keep.all(axis=1)):
        own = keep[row]
        if np.isfinite(whole[row, own]).all() and np.isfinite(steps[row, own]).all():
            continue
        alone = np.broadcast_to(ids[row, own], (ids.shape[0], int(own.sum())))
        ones = np.ones(alone.shape, np.int64)
        alone_whole, alone_steps = run(before, alone, ones, max(prefill - int((~own[:prefill]).sum()), 1)) \
            if decodes else (run(before, alone, ones)[0],) * 2  # fmt: skip
        if not (np.isfinite(alone_whole[0]).all() and np.isfinite(alone_steps[0]).all()):
            continue
        whole[row, own], steps[row, own] = alone_whole[0], alone_steps[0]
        report.proofs.append(Proof(ProofStatus.SAID, f"the input's logits at row {row}'s own positions are not "
                                                     "finite in the padded batch and finite with the row alone: "
                                                     "its padding's outputs reach them (0 * NaN through keys its "
                                                     "mask hides); that row is held to the input's run of it "
                                                     "alone"))  # fmt: skip
    return whole, steps
