"""`attnx optimize` of a whole model another tool exported (issue 40, its first slice): each attention block the
audit reads (attnx.export._blocks, read and probed as `attnx audit` reads it) rewritten in place into the core the
ort-fused lowering writes for its formula (attnx.model.cores.core_for: MultiHeadAttention, else
GroupQueryAttention), the rest of the graph and its interface kept.

    read     the block's config and weights (with a checkpoint: its paired layer's, each difference a repair)
    write    the core's own model (attnx.export.build_model: the step model's growing form with the cache, else the
             full form; a key_padding_mask), spliced in: its inputs bound to the host's tensors (the block's hidden
             state, its cache inputs, Equal(attention_mask, 0), position_ids), its outputs replacing the block's
             output and presents, its initializers and nodes named under attnx/layerN/; what the old block leaves
             dead is removed (onnx-ir's RemoveUnusedNodesPass)
    prove    the written model audited (each new block against the float64 reference: full sequence, a padded
             batch, prefill + steps through its own cache, under the tolerance table; held to the checkpoint or to
             what the old block computed), and the whole model against the original through its own I/O: the same
             greedy tokens, its logits' largest difference said
    publish  only when every proof holds (attnx._io.Staging), never over the input

A block is kept as it is, and named with the reason, where it is not read, where its projections are quantized or
not float32 (kept in this version), or where no core of the lowering computes its formula. Not in this slice: the
choice among cores by measured speed, the buffer form, external data written tensor by tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx._io import Staging, check_output_file, output_lock
from attnx.errors import UsageError
from attnx.export import build_model
from attnx.export._blocks import iter_blocks
from attnx.model.contract import CONFIG_KEY, PROVIDERS
from attnx.model.cores import core_for
from attnx.runtimes._untrusted import check_untrusted_model
from attnx.runtimes.base import Runner
from attnx.workflows.audit import audit_model
from attnx.workflows.audit.compare import compare_terms
from attnx.workflows.audit.cut import AuditGraph, graph_feeds, read_computed_terms, runner_for
from attnx.workflows.audit.shapes import model_shapes
from attnx.workflows.audit.sources import CheckpointLayers

__all__ = ["BlockRewrite", "ModelOptimizeReport", "optimize_model", "written_by_another_tool"]

LOWERING = "ort-fused"


@dataclasses.dataclass
class BlockRewrite:
    """One block: its layer, its core before and after (None: kept, with the reason), the repairs made."""

    index: int
    node: str
    core: str
    layer: int | None = None
    written: str | None = None
    kept: str | None = None
    repairs: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ModelOptimizeReport:
    model: str
    out: str
    checkpoint: str | None
    blocks: list[BlockRewrite]
    proofs: list[str]  # each proof, one line: "pass: ..." or "FAIL: ..."
    passed: bool = False
    written: bool = False

    def lines(self) -> list[str]:
        out = []
        for b in self.blocks:
            layer = f" = layer {b.layer}" if b.layer is not None else ""
            what = f"{b.core} -> {b.written}" if b.written else f"{b.core} kept: {b.kept}"
            out.append(f"block {b.index}{layer}: {what}  [{b.node}]")
            out += [f"  repair: {r}" for r in b.repairs]
        out += self.proofs
        verdict = "wrote " + self.out if self.written else "nothing written"
        out.append(f"optimize {'PASSED' if self.passed else 'FAILED'}: {sum(b.written is not None for b in self.blocks)}"
                   f" of {len(self.blocks)} block(s) rewritten; {verdict}")  # fmt: skip
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "out": self.out, "checkpoint": self.checkpoint, "passed": self.passed,
                "written": self.written, "blocks": [dataclasses.asdict(b) for b in self.blocks],
                "proofs": self.proofs}  # fmt: skip


def written_by_another_tool(path: str) -> bool:
    """Whether the model at `path` carries no attnx.config (attnx did not write it), read without its data after the
    untrusted-file checks."""
    import onnx

    check_untrusted_model(os.fspath(path))
    return CONFIG_KEY not in {p.key for p in onnx.load(os.fspath(path), load_external_data=False).metadata_props}


def optimize_model(model_path: str, out_path: str, *, checkpoint: str | None = None, json_path: str | None = None,
                   progress: Callable[[str], None] | None = None) -> ModelOptimizeReport:  # fmt: skip
    """Rewrite every block of `model_path` that a core computes (the module doc), prove OUT, publish it."""
    say = progress or (lambda _m: None)
    model_path, out_path = os.fspath(model_path), os.fspath(out_path)
    check_output_file(out_path, "--out")
    if os.path.abspath(out_path) == os.path.abspath(model_path):
        raise UsageError("--out must differ from the input model: the input is what the output is proven against")
    check_untrusted_model(model_path, whole_model=True)
    import onnx
    from onnx.utils import Extractor

    model = ir.load(model_path)
    structure = onnx.load(model_path, load_external_data=False)
    graph = AuditGraph(model, Extractor(onnx.shape_inference.infer_shapes(structure)),
                       os.path.dirname(os.path.abspath(model_path)), model_shapes(model))  # fmt: skip
    source = CheckpointLayers(checkpoint) if checkpoint is not None else None
    report = ModelOptimizeReport(model_path, out_path, checkpoint, [], [])
    unread: list[str] = []
    plans = []
    for block in iter_blocks(model, unread):
        say(f"reading block {block.index}: {block.node}")
        rewrite = BlockRewrite(block.index, block.node, block.core)
        report.blocks.append(rewrite)
        if block.config is None:
            rewrite.kept = f"not read: {block.unread}"
            continue
        if source is not None:
            block.facts["reach_hint"], block.facts["rope_hint"] = source.reach, source.rope_original
        read_computed_terms(graph, block)
        plan = _plan(block, rewrite, source, graph)
        if plan is not None:
            plans.append(plan)
    if not report.blocks and not unread:
        raise UsageError(f"{model_path}: no attention block found (a model attnx did not write: no 'attnx.config' "
                         "metadata): nothing to optimize")  # fmt: skip
    report.proofs += [f"not read: {line}" for line in unread]
    if plans:
        _splice_all(model, plans)
    with output_lock(out_path), Staging(out_path) as stage:
        say(f"writing {len(plans)} rewritten block(s) to a staging file")
        ir.save(model, stage.path())
        report.passed = _prove(report, model_path, stage.path(), checkpoint, plans, say)
        if report.passed:
            stage.publish()
            report.written = True
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return report


def _plan(block: Any, rewrite: BlockRewrite, source: Any, graph: AuditGraph) -> tuple | None:
    """(block, config, weights) of a block to rewrite (rewrite.written: its core), or None with rewrite.kept saying
    why."""
    # a table no theta fits (a scaled rope) is held to the checkpoint's rope (the audit's rule)
    if block.unread and not (source is not None and block.unread == f"rope {block.facts.get('rope')}"):
        rewrite.kept = f"not read: {block.unread}"
        return None
    if block.dtype != "fp32" or block.quantization is not None:
        rewrite.kept = (f"its projections are {block.quantization['op']} {block.quantization['bits']}-bit"
                        if block.quantization else f"a {block.dtype} block") + ": kept in this version"  # fmt: skip
        return None
    config, weights = block.config, block.weights
    if source is not None:
        rewrite.layer = source.pair(block.weights)
        if rewrite.layer is None:
            rewrite.kept = "no checkpoint layer has a projection of its shapes"
            return None
        paired = source.layer(rewrite.layer)
        rewrite.repairs = [f"{f}: written as the checkpoint states" for f in
                           compare_terms(block, paired.config, paired.weights, rewrite.layer)]  # fmt: skip
        config, weights = paired.config, paired.weights
    inputs = {v.name for v in graph.model.graph.inputs}
    cached = "past_key" in block.inputs
    config = dataclasses.replace(config, kv_cache=cached, key_padding_mask="attention_mask" in inputs)
    if config.rope is not None and "position_ids" not in inputs:
        rewrite.kept = "a rotary block in a model without a position_ids input: kept in this version"
        return None
    try:
        core = core_for(LOWERING, config, form="growing" if cached else "full")
    except UsageError as e:
        rewrite.kept = str(e)
        return None
    rewrite.written = core.name
    return block, config, weights


def _splice_all(model: ir.Model, plans: list[tuple]) -> None:
    """Each planned block's core spliced into `model` in place of the block (the module doc), then what is dead
    removed."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    g = model.graph
    values = {v.name: v for node in g for v in node.outputs} | {v.name: v for v in g.inputs}
    binds: dict[str, ir.Value] = {}
    if "attention_mask" in values:  # attnx's key_padding_mask: True where transformers' mask is 0
        zero = ir.Value(name="attnx/zero_i64", const_value=ir.tensor(np.asarray(0, np.int64)))
        g.register_initializer(zero)
        kpm = ir.node("Equal", [values["attention_mask"], zero], outputs=[ir.Value(name="attnx/key_padding_mask")])
        g.append(kpm)
        binds["key_padding_mask"] = kpm.outputs[0]
    if "position_ids" in values:
        binds["position_ids"] = values["position_ids"]
    for block, config, weights in plans:
        sub = ir.from_proto(build_model(config, weights, LOWERING, "growing" if config.kv_cache else "full"))
        for domain, version in sub.opset_imports.items():
            model.opset_imports[domain] = max(model.opset_imports.get(domain, version), version)
        prefix = f"attnx/block{block.index}/"
        bound = {**binds, "x": values[block.inputs["x"]]}
        for role in ("past_key", "past_value"):
            if role in block.inputs:
                bound[role] = values[block.inputs[role]]
        ours = {v.name: v for v in sub.graph.inputs}
        initializers = list(sub.graph.initializers.values())
        for value in initializers:
            sub.graph.initializers.pop(value.name)
        for value in initializers:
            value.name = prefix + value.name
            g.register_initializer(value)
        nodes = list(sub.graph)
        outputs = {v.name: v for v in sub.graph.outputs}
        sub.graph.outputs.clear()
        for node in nodes:
            sub.graph.remove(node)
        for node in nodes:
            node.name = prefix + (node.name or node.op_type)
            for i, value in enumerate(node.inputs):
                if value is not None and ours.get(value.name) is value:
                    node.replace_input_with(i, bound[value.name])
            for value in node.outputs:
                value.name = prefix + value.name
            g.append(node)
        y = outputs["y"]
        if block.y_bias is not None and y.producer() is not None and y.producer().op_type == "Add":
            # the graph adds the output bias after the block (a SkipLayerNormalization): the block ends at the output
            # projection's MatMul, before its bias Add (linear), which is then dead
            y = y.producer().inputs[0]
        values[block.outputs["y"]].replace_all_uses_with(y)
        for role in ("present_key", "present_value"):
            if role not in block.outputs:
                continue
            old = values[block.outputs[role]]
            name, at = old.name, list(g.outputs).index(old)
            old.name = f"{prefix}replaced/{name}"
            outputs[role].name = name
            outputs[role].shape, outputs[role].type = old.shape, old.type  # the interface's own dims, as they were
            g.outputs[at] = outputs[role]
    RemoveUnusedNodesPass()(model)
    g.sort()  # the spliced nodes were appended: back into an order where each comes after what it reads


def _prove(report: ModelOptimizeReport, model_path: str, out_path: str, checkpoint: str | None, plans: list[tuple],
           say: Callable[[str], None]) -> bool:  # fmt: skip
    """The written model's proofs (the module doc), each a line of the report; whether all hold."""
    if not plans:
        report.proofs.append("FAIL: no block rewritten: nothing to write")
        return False
    say("auditing the written model's blocks")
    audit = audit_model(out_path, checkpoint=checkpoint)
    read = {b.index: b for b in audit.blocks}
    ok = True
    for block, _, _ in plans:
        b = read.get(block.index)
        if b is None:
            ok = False
            report.proofs.append(f"FAIL: block {block.index} of the written model is not read back: "
                                 + "; ".join(audit.unread))  # fmt: skip
            continue
        fine = b.passed and (checkpoint is None or not b.findings)
        ok &= fine
        report.proofs.append(f"{'pass' if fine else 'FAIL'}: block {b.index} ({b.core}) against the float64 reference"
                             f"{' and the checkpoint' if checkpoint else ''}"
                             + ("" if fine else ": " + "; ".join(b.findings + b.not_checked)))  # fmt: skip
    say("running the written model against the input through its own inputs and outputs")
    # padded as the model's blocks read a padded row: right for a mask_index or seqlens_k (BERT's fused Attention),
    # else left (transformers' attention_mask)
    right = any(block.padding == "right" for block, _, _ in plans)
    ok &= _same_model(report, model_path, out_path, right)
    return ok


def _same_model(report: ModelOptimizeReport, model_path: str, out_path: str, right: bool = False) -> bool:
    """The written model against the input, each loaded through the runner registry on ort-cpu (cut.runner_for, as
    the audit's whole-model decode): the same inputs and outputs (names, dtypes, dims), and on a left-padded batch,
    full sequence then prefill + single steps through each one's own cache (present.* fed back as
    past_key_values.*), the same greedy tokens (logits' argmax at every unpadded position); the largest logits
    difference is said."""
    with contextlib.ExitStack() as stack:
        runners = []
        for path in (model_path, out_path):
            runner = runner_for(PROVIDERS["cpu"].backend, path)
            if isinstance(runner, str):
                report.proofs.append(f"FAIL: the whole model not run: {runner}")
                return False
            runners.append(stack.enter_context(runner))
        if (runners[0].inputs, runners[0].outputs) != (runners[1].inputs, runners[1].outputs):
            report.proofs.append("FAIL: the written model's inputs or outputs differ from the input's")
            return False
        return _same_tokens(report, *runners, right)


def _same_tokens(report: ModelOptimizeReport, before: Runner, after: Runner, right: bool) -> bool:
    """_same_model's runs and comparison, on the two loaded models (one row where the model fixes its batch at 1)."""
    names = {spec.name for spec in before.inputs}
    if "input_ids" not in names or "attention_mask" not in names:
        report.proofs.append("not checked: the whole model, fed input_ids and attention_mask only in this version")
        return True
    fixed = next(spec.shape[0] for spec in before.inputs if spec.name == "input_ids")
    batch = fixed if isinstance(fixed, int) else 2  # the model's own batch where its dims fix it
    tokens, prefill = 12, 8
    mask = np.ones((batch, tokens), np.int64)
    side = "right" if right else "left"
    if batch > 1:  # the last row padded by 3, beside whole ones
        mask[-1, slice(-3, None) if right else slice(0, 3)] = 0
    rows = f"a {side}-padded batch" if batch > 1 else "one row (the model's batch is fixed at 1)"
    ids = np.random.default_rng(0).integers(1, 100, (batch, tokens))
    caches = {spec.name: spec.shape for spec in before.inputs if spec.name.startswith("past_key_values")}
    empty = {n: np.zeros((batch, shape[1], 0, shape[3]), np.float32) for n, shape in caches.items()}

    def call(runner: Runner, start: int, stop: int, past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {**graph_feeds([n for n in names if n not in caches], mask[:, :stop], start, None), **past}
        feeds["input_ids"] = ids[:, start:stop]
        return runner.run({k: v for k, v in feeds.items() if k in names})

    def run(runner: Runner) -> tuple[np.ndarray, np.ndarray]:
        logits = runner.outputs[0].name
        whole = call(runner, 0, tokens, empty)[logits]
        if not caches:
            return whole, whole
        out = call(runner, 0, prefill, empty)
        steps = [out[logits]]
        for t in range(prefill, tokens):
            out = call(runner, t, t + 1, {n: out["present" + n[len("past_key_values"):]] for n in caches})
            steps.append(out[logits])
        return whole, np.concatenate(steps, axis=1)

    (a_whole, a_steps), (b_whole, b_steps) = run(before), run(after)
    keep = mask.astype(bool)
    ok = True
    runs = [("full sequence", a_whole, b_whole)] + ([("prefill + steps", a_steps, b_steps)] if caches else [])
    for what, a, b in runs:
        same = bool(np.array_equal(a.argmax(-1)[keep], b.argmax(-1)[keep]))
        ok &= same
        report.proofs.append(f"{'pass' if same else 'FAIL'}: the whole model, {what} of {rows}: "
                             f"{'the same' if same else 'other'} greedy tokens, logits at most "
                             f"{float(np.abs(a - b)[keep].max()):.3g} apart")  # fmt: skip
    return ok
