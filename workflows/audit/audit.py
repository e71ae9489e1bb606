"""`attnx audit`: each attention block of a whole model read back (attnx.export._blocks), cut out and run
(workflows.audit.cut, .run), held to its source (.sources, .compare); see the package's docstring."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attnx.errors import UsageError
from attnx.export.cores import UnreadKind
from attnx.model.contract import AUDIT_BACKENDS
from attnx.model.terms import TERMS
from attnx.model.tolerance import Requantization, problem_size, tolerance_for
from attnx.workflows.audit import run as _run
from attnx.workflows.audit.compare import compare_terms, is_projection_weight, reference_of
from attnx.workflows.audit.cut import (
    NP_DTYPES,
    AuditGraph,
    compute_in_cut,
    cut_block,
    cut_file,
    graph_inputs_needed,
)
from attnx.workflows.audit.report import AuditReport, BlockAudit
from attnx.workflows.audit.run import first_line
from attnx.workflows.audit.sources import CheckpointLayers, StatedConfig, pairing_findings, stated_config
from attnx.workflows.audit.whole import WholeModel, open_whole_model, read_blocks

__all__ = ["audit_model"]


def audit_model(
    model: str | WholeModel,
    *,
    checkpoint: str | None = None,
    layers: Sequence[int] | None = None,
    backends: Sequence[str] = ("ort-cpu",),
    strict: bool = False,
    progress: Callable[[str], None] | None = None,
    source: CheckpointLayers | None = None,
) -> AuditReport:
    """Audit every attention block of `model` (a path, or the model opened once: attnx.workflows.audit.whole; see
    the module's docstring). strict: a check the model cannot run (a gap, AuditReport.gaps) fails the audit; without
    it, the gap is named and the verdict is what was run. source: `checkpoint`'s layers where the caller has read
    them already."""
    say = progress or (lambda _m: None)
    for name in backends:
        if name not in AUDIT_BACKENDS:
            raise UsageError(f"backend {name!r}: the audit runs on {', '.join(AUDIT_BACKENDS)}")
    # untrusted input: refused before anything parses it for real, then parsed once
    whole = model if isinstance(model, WholeModel) else open_whole_model(model, whole_model=False)
    graph = whole.graph
    # a model attnx wrote states its config (attnx.config): the source each block is held to, as a checkpoint's
    # layer would be, with the graph's own weights (what `attnx parity --model` holds it to)
    stated = stated_config(whole.proto) if checkpoint is None else None
    if checkpoint is not None and source is None:
        source = CheckpointLayers(checkpoint)
    report = AuditReport(whole.path, checkpoint, [], [], strict=strict)
    seen = 0
    asked = set(layers) if layers is not None else None
    hints = source if source is not None else StatedConfig(stated, {}) if stated is not None else None
    for block in read_blocks(whole, report.unread, hints, None if asked is None else asked.__contains__,
                             report.others):  # fmt: skip
        seen += 1
        if layers is not None and block.index not in layers:
            continue
        say(f"block {block.index}: {block.node}")
        held = StatedConfig(stated, block.weights) if stated is not None and block.weights is not None else source
        report.blocks.append(audit_block(graph, block, held, backends, report.skipped, strict))
        del block  # one block's weights and tables at a time: the next block's are read before it is handed over
    if not seen and not report.unread:
        raise UsageError(f"{whole.path}: no attention block found")
    caches = whole.caches
    report.not_applicable = graph.shapes.not_applicable(decoding=bool(caches))
    if isinstance(source, CheckpointLayers):
        pairing_findings(report, source, whole=layers is None)
    if layers is None and seen and "ort-cpu" in backends:
        _run.decode_whole(whole.path, graph, caches, whole.presents, report)
    missing = sorted(set(layers or ()) - {b.index for b in report.blocks})
    if missing:
        raise UsageError(f"--layers {','.join(map(str, missing))}: the model has {seen} block(s) read"
                         + (f" (0 to {seen - 1})" if seen else ""))  # fmt: skip
    return report


def audit_block(graph: AuditGraph, block: Any, source: Any, backends: Sequence[str], skipped: list[str],
                 strict: bool = False) -> BlockAudit:  # fmt: skip
    findings, not_checked, checks = [], [], []
    """One block read by read_blocks (its computed terms read), cut out, run on each backend, held to `source`."""
    layer = None
    config, weights = block.config, block.weights
    imported = source is not None
    if source is not None:
        layer = source.pair(block.weights)
        if layer is None:
            findings.append(f"block {block.index}: no checkpoint layer has a projection of its shapes")
        else:
            paired = source.layer(layer)  # this block's layer alone, dropped with the block's audit
            findings += compare_terms(block, paired.config, paired.weights, layer, source.label)
            config, weights = paired.config, paired.weights  # the reference is the checkpoint's layer
    if config is not None:
        config = dataclasses.replace(config, kv_cache=False, key_padding_mask=False)
    terms = tuple(t for t in (config.terms if config is not None else ()) if TERMS[t].listed)
    audit = BlockAudit(block.index, block.node, block.core, layer, terms, findings, checks, not_checked,
                       "attnx.config" if isinstance(source, StatedConfig) else "checkpoint layer", strict=strict)  # fmt: skip
    # a table no theta fits (a scaled rope) is held to the source's rope instead (compare_terms): read, with one
    rope_held = (imported and block.reading.rope.tables is not None and block.unread is not None
                 and block.unread.kind is UnreadKind.UNFIT_TABLE)  # fmt: skip
    if block.unread and not rope_held:
        if not imported:  # nothing to hold the block to: nothing is run
            not_checked.append(f"block {block.index}: {block.unread}: not run without a checkpoint (give --checkpoint "
                               "to hold it to its source's layer)")  # fmt: skip
            return audit
        not_checked.append(f"block {block.index}: {block.unread}: the block is held to the checkpoint's layer by "
                           "its numbers alone")  # fmt: skip
    level = block.quantization["accuracy_level"] if block.quantization is not None else None
    if level not in (None, 0, 1, 4):
        not_checked.append(f"block {block.index}: MatMulNBits accuracy_level {level} (fp16/bf16 compute): its error "
                           "model is not built yet (levels 0, 1 and 4 are checked)")  # fmt: skip
        return audit
    if block.dtype not in NP_DTYPES:
        not_checked.append(f"block {block.index}: a {block.dtype} block: the audit feeds fp32 and fp16 blocks")
        return audit
    # at accuracy_level 4 the kernel also rounds the latent's inner inputs (q_b_proj's, kv_b_proj's) to int8, whose
    # roundings reach y through the scores: no error model follows them yet, so the block runs as its float32 twin
    twin = level == 4 and config.latent is not None
    if twin:
        not_checked.append(f"block {block.index}: MatMulNBits accuracy_level 4 rounds the latent's inner inputs "
                           "(q_b_proj's, kv_b_proj's) to int8, which the error model does not follow yet: checked "
                           "with its MatMulNBits computing in float32 (accuracy_level 1)")  # fmt: skip
    if block.quantization is not None and imported:
        # the file's own dequantized weights: the quantization is what the int4 form is, not a finding
        weights = {**weights, **{k: v for k, v in block.weights.items() if is_projection_weight(k)}}
    shapes = graph.shapes
    rng = np.random.Generator(np.random.PCG64(block.index))
    x = rng.standard_normal((shapes.batch, shapes.tokens, config.d_model), dtype=np.float32)
    x = x.astype(NP_DTYPES[block.dtype]).astype(np.float32)  # the values the block is fed, in its own dtype
    positions = np.broadcast_to(np.arange(shapes.tokens, dtype=np.int64), x.shape[:2])
    feeds = {"x": x, "position_ids": positions} if config.rope is not None else {"x": x}
    block_size = block.quantization["block_size"] if level == 4 and not twin else None
    size = problem_size(config, weights, feeds)
    tol = tolerance_for(block.dtype)

    def reference(**call: np.ndarray) -> tuple[np.ndarray, Requantization | None]:
        # a padded row's call hides its padding (key_padding_mask); at accuracy_level 4, with z's rounding slack
        held = dataclasses.replace(config, key_padding_mask=True) if "key_padding_mask" in call else config
        return reference_of(held, weights, call, block_size, tol, size)

    ref = reference(**feeds)
    compute_in_cut(graph.model, block)
    try:
        cut = cut_block(graph, block)
        if twin:
            import onnx

            model = onnx.load_from_string(cut)
            float32_compute(model)
            cut = model.SerializeToString()
    except UsageError:
        raise  # too large for this machine (check_cut_fits): said, exit 2
    except Exception as e:  # noqa: BLE001 - onnx's error types, on an untrusted graph
        not_checked.append(f"block {block.index}: it cannot be cut out of the graph: {first_line(e)}")
        return audit
    needs = graph_inputs_needed(graph.model, block, [block.outputs["y"]])
    ran = False
    with cut_file(cut) as path:
        del cut  # on disk now: the block's weights once in memory, in the runtime's own copy
        for backend in backends:
            try:
                runner = _run.runner_for(backend, path)
            except Exception as e:  # noqa: BLE001 - each runtime's own error types: a backend asked for cannot read it
                findings.append(f"block {block.index}: {backend} cannot load {block.node}: {first_line(e)}")
                continue
            if isinstance(runner, str):  # unavailable on this machine: a skip, as in parity
                if f"{backend}: {runner}" not in skipped:
                    skipped.append(f"{backend}: {runner}")
                continue
            ran = True
            failed = len(audit.findings)
            with runner:
                _run.run_checks(functools.partial(_run.run_block, runner, block, needs), backend, block, needs, feeds,
                                ref, reference, size, audit, shapes)  # fmt: skip
            if len(audit.findings) > failed and not audit.localised:
                audit.localised = _run.localise_block(graph, block, backend, needs, config, weights, feeds, size)
    if not ran and not audit.findings:
        not_checked.append(f"block {block.index}: not run: no backend asked for ({', '.join(backends)}) runs here")
    return audit


def float32_compute(model: Any) -> None:
    """Every MatMulNBits of `model` (a ModelProto) at accuracy_level 1 (float32 compute), in place; every other byte
    the same (the audit's twin of an int4 MLA block, the proof's float32 twins)."""
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = 1
