"""`attnx optimize` of a whole model another tool exported (issue 40): each attention block the audit reads
(attnx.export._blocks, read and probed as `attnx audit` reads it) rewritten in place into the fastest core of the
ort-fused lowering that computes its formula under its inputs, measured on the provider (choose), the rest of the
graph and its interface kept.

    read     the block's config and weights (with a checkpoint: its paired layer's, each difference a repair;
             without one, the graph's own formula, said), and how it is bound into the graph (plan.Plan)
    write    the core's own model (attnx.export.build_model) spliced in (splice): the whole block from its hidden
             state where its projections are float32; the core alone, bound at the graph's own projections and
             handing its z to the graph's output projection, where they are MatMulNBits or fp16 (kept as they are);
             its inputs bound to the block's cache, GroupQueryAttention's lengths, Equal(attention_mask, 0), the
             positions the graph rotates by (position_ids or its own Range), the op's own cos/sin caches; its
             initializers and nodes named under attnx/blockN/; what the old block leaves dead is removed (onnx-ir's
             RemoveUnusedNodesPass)
    prove    the written model audited (each new block against the float64 reference: full sequence, a padded
             batch, prefill + steps through its own cache, under the tolerance table; held to the checkpoint or to
             what the old block computed; the whole model's decoding), and the whole model against the original
             through its own I/O: the same greedy tokens, its logits within the table's whole-model bound
    publish  only when every proof holds (attnx._io.Staging), never over the input

The steps live in this package's modules: plan (read, and what each block becomes), choose (measured), splice
(write), prove, and report.

A block is kept as it is, and named with the reason, where it is not read, where the rewrite would be the block
itself (the builder's GroupQueryAttention with nothing to repair), where a weight its kept projections hold differs
from the checkpoint's, or where no core of the lowering computes its formula under its inputs.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from attnx._io import Staging, check_output_file, output_lock, write_json_atomic
from attnx.errors import ProviderUnavailable, UsageError
from attnx.export import save_model
from attnx.export.passes import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE
from attnx.model.contract import LOWERINGS, PROVIDERS
from attnx.model.cores import MEASURE
from attnx.model.dtypes import check_choice
from attnx.model.int8 import INT8_BITS_FLAG
from attnx.runtimes.base import backend_unavailable_reason
from attnx.workflows._lower import AUTO_CANDIDATES
from attnx.workflows._optimize import LayerOptions, optimize_layer
from attnx.workflows._proof import Proof, ProofStatus
from attnx.workflows.audit.sources import CheckpointLayers
from attnx.workflows.audit.whole import WholeModel, open_whole_model, read_blocks
from attnx.workflows.rewrite.choose import (
    AUTO_CORE,
    CoreChoice,
    candidates,
    choose_core,
    own_is_fastest,
    pick,
    time_shape,
    time_whole,
)
from attnx.workflows.rewrite.plan import LOWERINGS_TRIED, Plan, plan_block
from attnx.workflows.rewrite.prove import prove
from attnx.workflows.rewrite.report import BlockRewrite, ModelOptimizeReport, formula_said
from attnx.workflows.rewrite.splice import splice_blocks
from attnx.workflows.rewrite.weights import distance_said, quantize_weights_file, weights_distance

__all__ = ["BlockRewrite", "ModelOptimizeReport", "optimize_model"]

# what a model attnx wrote takes in place of --weights
WEIGHTS_SAID = (" (its projections are quantized by --dtype int4|int8, attnx's own quantizer: --block-size, "
                "--accuracy-level, --int8-bits)")  # fmt: skip


def _given(value: object, default: object) -> object:
    """A quantization option's value where it was given other than its default, else None."""
    return None if value is None or value == default else value


def _default(value: object, default: object) -> object:
    return default if value is None else value


def optimize_model(model: str | WholeModel, out_path: str, *, checkpoint: str | None = None,
                   json_path: str | None = None, provider: str = "cpu", core: str | None = None,
                   weights: str | None = None, lowering: str | None = None, dtype: str | None = None,
                   keep_io_fp32: bool = False, auto_seq: int | None = None, block_size: int | None = None,
                   accuracy_level: int | None = None, int8_bits: int | str | None = None,
                   progress: Callable[[str], None] | None = None, source: CheckpointLayers | None = None,
                   serve: bool = False) -> ModelOptimizeReport:  # fmt: skip
    """Rewrite every block of `model` (a path, or the model opened once: attnx.workflows.audit.whole) that a core
    computes into the fastest such core on `provider` (core "measure", the default, measured:
    attnx.workflows.rewrite.choose; or the core named, wherever it computes the block), prove OUT on the provider,
    publish it (the module doc). weights "int4" / "int8": the model's MatMul weights quantized first
    (attnx.workflows.rewrite.weights), the quantized model optimized and proven, its distance from the input said.
    source: `checkpoint`'s layers where the caller has read them already. serve: the model as it came and the plans
    kept in report.served, for the form served to be written from them (attnx.workflows.rewrite.serve).

    lowering: the lowering each block is written in (None: the first of plan.LOWERINGS_TRIED whose cores compute
    it), core its cores measured or the one named.

    A model attnx wrote is a whole model with one block, the graph itself (attnx.workflows._optimize): `lowering`
    (default ort-fused; "measure": measured), `dtype` (default the model's), keep_io_fp32, auto_seq (the sequence
    length measure times at), block_size / accuracy_level (int4) and int8_bits (int8) say how it is written, core
    None the lowering's own core. Those options, and lowering "measure", are refused (UsageError) for a model
    another tool exported, and `checkpoint` and `weights` for a model attnx wrote: a flag means one thing or is
    refused, never guessed at. serve is for a model with a cache: a model attnx wrote has none to serve
    (report.served stays None)."""
    whole = model if isinstance(model, WholeModel) else open_whole_model(model)
    layer = {"--dtype": dtype,
             "--keep-io-fp32": keep_io_fp32 or None, "--auto-seq": auto_seq, "--block-size": _given(block_size, DEFAULT_BLOCK_SIZE),
             "--accuracy-level": _given(accuracy_level, DEFAULT_ACCURACY_LEVEL), INT8_BITS_FLAG: _given(int8_bits, "auto")}
    if not whole.written_by_another_tool:
        given = [flag for flag, value in (("--checkpoint", checkpoint), ("--weights", weights)) if value is not None]
        if given:
            raise UsageError(f"{given[0]} is for a whole model another tool exported; {whole.path} was written by "
                             f"attnx export" + (WEIGHTS_SAID if given[0] == "--weights" else ""))  # fmt: skip
        options = LayerOptions(lowering or "ort-fused", core, dtype, keep_io_fp32, auto_seq,
                               _default(block_size, DEFAULT_BLOCK_SIZE), _default(accuracy_level, DEFAULT_ACCURACY_LEVEL),
                               _default(int8_bits, "auto"))  # fmt: skip
        return optimize_layer(whole, out_path, options, provider=provider, json_path=json_path, progress=progress)
    given = [flag for flag, value in layer.items() if value is not None]
    if given:
        raise UsageError(f"{given[0]} is for a model attnx wrote (attnx export: its attnx.config); a whole model "
                         "another tool exported takes --attention (a lowering, or measure), --core (the core each "
                         f"block is written as, {MEASURE}: the fastest of the lowering's) and --weights int4|int8 (its "
                         "MatMul weights quantized)")  # fmt: skip
    if lowering == MEASURE and core not in (None, MEASURE):
        raise UsageError(f"--core {core} is one core of one lowering: name the lowering (--attention), not {MEASURE}")
    if lowering not in (None, MEASURE):
        check_choice("--attention", lowering, LOWERINGS)
    # measure: each block's cores of every lowering attnx measures (a model attnx wrote: the same lowerings) timed
    lowerings = LOWERINGS_TRIED if lowering is None else AUTO_CANDIDATES if lowering == MEASURE else (lowering,)
    core = AUTO_CORE if core is None else core
    if weights is None:
        return _optimize_model(whole, out_path, checkpoint=checkpoint, json_path=json_path, provider=provider,
                               core=core, progress=progress, source=source, serve=serve, lowerings=lowerings,
                               measure_lowerings=lowering == MEASURE)  # fmt: skip
    say = progress or (lambda _m: None)
    out_path = os.fspath(out_path)
    check_output_file(out_path, "--out")
    model_path = whole.path
    folder = os.path.dirname(os.path.abspath(out_path))  # beside OUT: the same disk, never the input's folder
    with tempfile.TemporaryDirectory(prefix=".attnx-weights-", dir=folder) as work:
        quantized, record = quantize_weights_file(whole.model, model_path, weights, work, save_model, say)
        report = _optimize_model(quantized, out_path, checkpoint=checkpoint, provider=provider, core=core,
                                 progress=progress, source=source, serve=serve, lowerings=lowerings,
                                 measure_lowerings=lowering == MEASURE, quantized=True)  # fmt: skip
        report.model = model_path
        report.weights = record.to_dict()
        report.proofs.insert(0, Proof(ProofStatus.SAID, record.said()))
        if report.served is not None:  # the quantized model's file goes with `work`: its tensors read into memory
            _read_from(report.served[0], work)
        if report.written:
            say(f"measuring the {weights} model's distance from the fp32 input")
            report.weights["distance"] = weights_distance(model_path, out_path, report.caches_read(), provider)
            report.proofs.append(distance_said(report.weights["distance"], weights))
    if json_path is not None:
        write_json_atomic(json_path, report.to_dict())
    return report


def _read_from(model: ir.Model, folder: str) -> None:
    """Each initializer of `model` that a data file in `folder` holds read into memory (the folder is about to go)."""
    folder = os.path.abspath(folder)
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and os.path.abspath(tensor.path).startswith(folder + os.sep):
            value.const_value = ir.tensor(tensor.numpy(), name=name)


def _optimize_model(model: str | WholeModel, out_path: str, *, checkpoint: str | None = None,
                    json_path: str | None = None, provider: str = "cpu", core: str = AUTO_CORE,
                    progress: Callable[[str], None] | None = None, source: CheckpointLayers | None = None,
                    serve: bool = False, lowerings: tuple[str, ...] = LOWERINGS_TRIED,
                    measure_lowerings: bool = False, quantized: bool = False) -> ModelOptimizeReport:  # fmt: skip
    say = progress or (lambda _m: None)
    check_choice("--provider", provider, PROVIDERS)
    unavailable = backend_unavailable_reason(PROVIDERS[provider].backend)  # asked for it: never another in its place
    if unavailable is not None:
        raise ProviderUnavailable(f"--provider {provider}: {unavailable}")
    model_path = model.path if isinstance(model, WholeModel) else os.fspath(model)
    out_path = os.fspath(out_path)
    check_output_file(out_path, "--out")
    if os.path.abspath(out_path) == os.path.abspath(model_path):
        raise UsageError("--out must differ from the input model: the input is what the output is proven against")
    whole = model if isinstance(model, WholeModel) else open_whole_model(model_path)
    graph = whole.graph
    if checkpoint is not None and source is None:
        source = CheckpointLayers(checkpoint)
    report = ModelOptimizeReport(model_path, out_path, checkpoint, [], [], provider=provider)
    unread: list[str] = []
    planned: list[tuple[BlockRewrite, Plan]] = []  # each block read and planned, then its core chosen
    plans = []
    measured: dict = {}  # blocks of one shape are timed once
    limit = source.max_positions if source is not None else None
    for block in read_blocks(whole, unread, source):
        say(f"reading block {block.index}: {block.node}")
        rewrite = BlockRewrite(block.index, block.node, block.core)
        report.blocks.append(rewrite)
        if block.padding == "right" or "seqlens_k" in block.inputs:  # how the model reads a padded batch
            report.padding = "right"
        if block.config is None:
            rewrite.kept = f"not read: {block.unread}"
            continue
        plan = plan_block(block, rewrite, source, graph, lowerings)
        if plan is None:
            continue
        rewrite.config = plan.config.to_dict()
        if source is None:
            rewrite.formula = formula_said(plan.config) + " (no --checkpoint: nothing to hold it to)"
        rewrite.splice = "the core alone, at the graph's projections" if plan.bound != "x" else "the whole block"
        planned.append((rewrite, plan))
    caches = whole.caches  # each cache input as read: a window kept in a ring buffer, its past holds the window
    for rewrite, plan in planned:  # the blocks planned compute alike what they compute from the model's inputs
        options = {"limit": limit, "repaired": bool(rewrite.repairs), "shared_by": len(planned), "memo": measured,
                   "say": say}  # fmt: skip
        if measure_lowerings:
            rewrite.choice, plan.lowering = _measure_lowerings(plan, graph, provider, lowerings, **options)
        else:
            rewrite.choice = choose_core(plan, graph, provider, plan.lowering, core=core, **options)
        plan.core = rewrite.written = rewrite.choice.core
        if rewrite.written is None:
            rewrite.kept = rewrite.choice.reason
            continue
        plans.append(plan)
    report.caches = {name: list(read) for name, read in caches.items()}
    if not report.blocks and not unread:
        raise UsageError(f"{model_path}: no attention block found (a model attnx did not write: no 'attnx.config' "
                         "metadata): nothing to optimize")  # fmt: skip
    report.proofs += [Proof(ProofStatus.NOT_READ, line) for line in unread]
    if serve:  # the model as it came (its tensors shared, not copied), and every block planned (a block kept as the
        # fastest in the growing form too: the form served writes each block again), for the form served
        report.served = (whole.model.clone(), [plan for _, plan in planned])
    if plans:
        splice_blocks(whole.model, plans)
    with output_lock(out_path), Staging(out_path) as stage:
        say(f"writing {len(plans)} rewritten block(s) to a staging file")
        save_model(whole.model, stage.path())
        report.passed = prove(report, whole, stage.path(), checkpoint, plans, say, provider, caches, source,
                              quantized)  # fmt: skip
        if report.passed and plans:  # with no block rewritten, before and after are one graph
            say(f"timing the whole model before and after on {provider}")
            # the whole model's within every block's positions (a block's own rotary table may be shorter)
            shapes = [b.choice.shape for b in report.blocks if b.choice is not None] or [time_shape(limit)]
            report.time_shape = {k: min(s[k] for s in shapes) for k in shapes[0]}
            report.model_times = {"before": time_whole(model_path, provider, report.time_shape, caches=caches),
                                  "after": time_whole(stage.path(), provider, report.time_shape, caches=caches)}  # fmt: skip
        if report.passed:
            stage.publish()
            report.written = True
    if json_path is not None:
        write_json_atomic(json_path, report.to_dict())
    return report


def _measure_lowerings(plan: Plan, graph: Any, provider: str, lowerings: tuple[str, ...], *, repaired: bool,
                       **options: Any) -> tuple[CoreChoice, str]:  # fmt: skip
    """--attention measure of a whole model: the block's cores of each of `lowerings` that computes it timed
    (choose_core's measure within each), and choose's rule (pick) over them all, the graph's own block among them;
    the choice and the lowering of the core chosen (the plan's own where the block is kept)."""
    choices, lowering_of = {}, {}
    for lowering in lowerings:
        if candidates(plan.config, plan.form, lowering, plan.dtype, plan.cores):
            planned = dataclasses.replace(plan, lowering=lowering)
            choices[lowering] = choose_core(planned, graph, provider, lowering, core=AUTO_CORE, repaired=repaired,
                                            **options)  # fmt: skip
            lowering_of |= dict.fromkeys(choices[lowering].times, lowering)
    first = next(iter(choices.values()))  # the plan's own lowering computes it: plan_block said so
    times = {name: t for choice in choices.values() for name, t in choice.times.items()}
    steps = first.shape["steps"]
    core, reason = pick(first.before, times, steps, own=not repaired)
    fastest = core is None and not repaired and (own_is_fastest(first.before, times, steps) or not times)
    choice = CoreChoice(core, f"{reason} (measured across {', '.join(choices)})", first.shape, first.before, times,
                        fastest)  # fmt: skip
    return choice, lowering_of.get(core, plan.lowering)
