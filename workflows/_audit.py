"""`attnx audit`: the attention blocks of a whole model another tool exported, each read back
(attnx.export._blocks), cut out of the graph at its own tensors, run on each backend asked and held against attnx's
float64 reference; with a Hugging Face checkpoint (or, for a model attnx wrote, its attnx.config), each block is
paired with the source's layer by its weights' values (never by names) and every term that differs is a finding.

Each block is cut at its hidden state, with the graph inputs its mask, lengths and rotary are computed from
(attention_mask, position_ids: fed as transformers makes them; _compute_in_cut), and runs a full sequence, a padded
batch in its convention (right padding for GroupQueryAttention and a mask_index, left for transformers' masks), then a
prefill and single-token steps through the model's own cache inputs: its output against the reference of the
source's layer (or, without one, of the layer read from the graph) under the tolerance table. A failing block is
localised to its first stage (_localise). A MatMulNBits graph is held against the model as it computes: its
dequantized weights, and at accuracy_level 4 its projections' inputs in int8 blocks (int8_blocks). The whole model's
decoding is run once (_decode_whole). The model is untrusted input: it is checked before anything parses it
(attnx.runtimes._untrusted.check_model_file: external data inside its folder, sizes, cycles, domains).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.errors import UsageError
from attnx.export._blocks import half_table, iter_blocks, rope_of_table, rope_table_error
from attnx.model.config import AttentionConfig
from attnx.model.contract import CONFIG_KEY, PROVIDERS, config_from_metadata
from attnx.model.importers import PROJECTIONS, import_weights, projection_shape, read_checkpoint_config, read_projection
from attnx.model.reference import reference_attention
from attnx.model.resources import available_memory_bytes
from attnx.model.rope import rope_frequencies
from attnx.model.stages import STAGES
from attnx.model.tolerance import problem_size, stored_bound, tolerance_for
from attnx.runtimes._untrusted import check_cut_fits, check_model_file
from attnx.runtimes.base import runtime_threads
from attnx.runtimes.compare import Comparison, compare_arrays
from attnx.runtimes.localise import compare_stages, reference_stages
from attnx.runtimes.openvino_runner import DEVICE, compile_config, openvino_unavailable_reason
from attnx.runtimes.ort_runner import ort_cuda_unavailable_reason

__all__ = ["AuditReport", "BlockAudit", "CheckpointLayers", "audit_model", "AUDIT_SHAPE"]

# (full-sequence tokens, prefill tokens, single steps): past an 8-token window, within a 128-row rope table;
# the padded batch's second row is `padding` tokens shorter
# an additive mask's entry at or below this hides its key (-1e4: BERT's and ONNX Runtime's mask_filter_value; -inf,
# finfo.min and -65504 in other exports); a visible key's entry is 0 (or a position bias, far above it)
MASKED = -1000.0
# the longest prompt a computed mask is read at (a [tokens, tokens] grid): windows up to it are read
MASK_PROBE_MAX = 8194
# the longest prompt a computed rotary table is read at (a [tokens, dim/2] table): a source's original length past it
# is not probed
ROPE_PROBE_MAX = 65537
AUDIT_SHAPE = {"tokens": 12, "prefill": 9, "steps": 3, "batch": 2, "padding": 3, "rope_positions": 128}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shapes the audit feeds a model: AUDIT_SHAPE's where the model's dims are dynamic, the model's own where
    it fixes them (model_shapes), so that every run is one the model's dims allow."""

    batch: int
    tokens: int  # a full sequence's
    prefill: int | None  # decoding: a prefill of this many tokens, then single steps to `tokens`; None: none fits
    fixed: dict[str, str] = dataclasses.field(default_factory=dict)  # batch/sequence/cache -> the input fixing it
    padding: int = AUDIT_SHAPE["padding"]  # the padded batch's last row is this many tokens shorter

    @property
    def padded(self) -> bool:
        """Whether a padded batch fits: two rows or more, and a row shorter than the sequence."""
        return self.batch >= 2 and self.tokens > self.padding

    def not_applicable(self) -> list[str]:
        """The checks the model's dims rule out, each with the dim and the input that fixes it."""
        lines = []
        if self.batch < 2:
            lines.append(f"a padded batch: the model's batch is fixed at {self.batch} ({self.fixed['batch']})")
        elif not self.padded:
            lines.append(f"a padded batch: the model's sequence is fixed at {self.tokens} tokens "
                         f"({self.fixed['sequence']}), too short to pad a row by {self.padding}")  # fmt: skip
        if "sequence" in self.fixed:
            lines.append(f"decoding step by step: the model's sequence is fixed at {self.tokens} tokens "
                         f"({self.fixed['sequence']}), so no single-token step can be fed")  # fmt: skip
        return lines


# graph inputs whose first dim is the batch; whose second is the sequence (the tokens of this call); a cache's third
_BATCH_FIRST = ("x", "memory", "input_ids", "attention_mask", "position_ids", "token_type_ids", "key_padding_mask")
_SEQUENCE_SECOND = ("x", "input_ids", "position_ids", "token_type_ids")


def model_shapes(model: Any) -> Shapes:
    """The shapes a model's own graph inputs allow (a batch or a sequence fixed by its dims, say by a torch.onnx
    export whose batch was not made dynamic), else AUDIT_SHAPE's."""

    def said(value: Any) -> str:
        return f"input {value.name} [{', '.join(str(d) for d in value.shape)}]"

    fixed: dict[str, str] = {}
    batch = tokens = None
    caches = [v for v in model.graph.inputs if v.name.startswith("past")]
    for value in model.graph.inputs:
        dims = list(value.shape) if value.shape is not None else []
        cache = value in caches
        if not dims or not (value.name in _BATCH_FIRST or cache):
            continue
        if isinstance(dims[0], int) and batch is None:
            batch, fixed["batch"] = dims[0], said(value)
        sequence = 1 if value.name in _SEQUENCE_SECOND or (value.name == "attention_mask" and not caches) else None
        if sequence is not None and len(dims) > sequence and isinstance(dims[sequence], int) and tokens is None:
            tokens, fixed["sequence"] = dims[sequence], said(value)
        if cache and len(dims) == 4 and isinstance(dims[2], int) and "cache" not in fixed:
            fixed["cache"] = said(value)
        if value.name == "attention_mask" and caches and isinstance(dims[1], int) and "cache" not in fixed:
            fixed["cache"] = said(value)  # a total length fixed: a static cache
    prefill = AUDIT_SHAPE["prefill"] if tokens is None and "cache" not in fixed else None
    return Shapes(batch if batch is not None else AUDIT_SHAPE["batch"],
                  tokens if tokens is not None else AUDIT_SHAPE["tokens"], prefill, fixed)  # fmt: skip


@dataclasses.dataclass
class BlockAudit:
    """One block's audit. Its verdict says what was proven: it passes when at least one check ran and every check
    run agrees, with no finding; a check its model cannot run (`not_checked`: why, and what the model then cannot
    serve) is a gap, named on its own line, that fails the block only under `strict`. A check the model's own dims
    rule out (a batch fixed at 1 has no padded batch) is neither: AuditReport.not_applicable names it."""

    index: int
    node: str
    core: str  # the registry's name of its core (attnx.model.cores)
    layer: int | None  # the checkpoint's layer it pairs with
    terms: tuple[str, ...]
    findings: list[str]
    checks: list[Comparison]
    not_checked: list[str]
    source: str = "checkpoint layer"  # what it is held to: a checkpoint's layer, or the attnx.config of attnx's model
    localised: str | None = None  # a failing block's first stage beyond its bound
    strict: bool = False  # a gap fails the block

    @property
    def passed(self) -> bool:
        return bool(self.checks) and not self.findings and all(self.checks) and not (self.strict and self.not_checked)

    def worst(self) -> Comparison | None:
        return max(self.checks, key=lambda c: c.max_abs / max(c.atol, 1e-30), default=None)

    def line(self) -> str:
        verdict = "pass" if self.passed else "FAIL" if (self.findings or not all(self.checks)) else "not checked"
        worst = self.worst()
        err = f"max_abs {worst.max_abs:.3g} (atol {worst.atol:.3g})" if worst is not None else "not run"
        paired = "" if self.layer is None else f" = {self.source}" + (f" {self.layer}" if self.source != "attnx.config" else "")
        return f"block {self.index}{paired}: {verdict:<11} {err}  {self.core}  {','.join(self.terms)}  [{self.node}]"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "core": self.core, "layer": self.layer, "source": self.source,
                "terms": list(self.terms),
                "passed": self.passed, "findings": self.findings, "not_checked": self.not_checked,
                "localised": self.localised,
                "checks": [{"name": c.name, "passed": c.passed, "atol": c.atol, "rtol": c.rtol, **c.stats()}
                           for c in self.checks]}  # fmt: skip


@dataclasses.dataclass
class AuditReport:
    """The audit of a whole model. It passes when every attention node was read into a block, every block passes
    (BlockAudit) and the whole model raised no finding; its gaps (a check some block, or the whole model's decoding,
    could not run) are listed, and fail it only under `strict`."""

    model: str
    checkpoint: str | None
    blocks: list[BlockAudit]
    unread: list[str]
    skipped: list[str] = dataclasses.field(default_factory=list)  # a backend unavailable on this machine, and why
    findings: list[str] = dataclasses.field(default_factory=list)  # of the whole model as exported
    others: list[str] = dataclasses.field(default_factory=list)  # Softmaxes not attention's (a router's), named
    not_checked: list[str] = dataclasses.field(default_factory=list)  # the whole model's gaps (its decoding)
    not_applicable: list[str] = dataclasses.field(default_factory=list)
    strict: bool = False

    @property
    def gaps(self) -> list[str]:
        """Every check that applies to the model and could not run: the blocks' and the whole model's."""
        return [line for b in self.blocks for line in b.not_checked] + self.not_checked

    @property
    def passed(self) -> bool:
        return (all(b.passed for b in self.blocks) and not self.unread and not self.findings
                and not (self.strict and self.not_checked))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "checkpoint": self.checkpoint, "passed": self.passed, "strict": self.strict,
                "blocks": [b.to_dict() for b in self.blocks], "unread": self.unread,
                "skipped": self.skipped, "findings": self.findings, "not_checked": self.not_checked,
                "not_applicable": self.not_applicable, "gaps": len(self.gaps), "others": self.others}  # fmt: skip


class CheckpointLayers:
    """A checkpoint's layers as the audit needs them, one at a time: each layer's four projections kept only as a
    sample of their rows (each read alone, read_projection), which pairs a block with its layer by value; the
    paired layer's attention imported (import_weights) when its block is checked, and dropped after. So a
    checkpoint larger than memory is held a layer at a time, plus the samples (at most SAMPLE_ROWS rows of each
    projection per layer)."""

    SAMPLE_ROWS = 32
    # a sampled row matches a block's when it is within this fraction of its largest |value|: int4's half step is
    # 1/14 of its block's largest, fp16's 1e-3; another layer's row differs by about all of it
    MATCH = 0.25
    label = "the checkpoint"  # as findings name it

    def __init__(self, folder: str) -> None:
        hf = read_checkpoint_config(folder)
        self.window = int(hf.get("sliding_window") or 0)  # how far a computed mask is read (_read_mask_terms)
        self.rope_original = _original_length(hf)  # where a computed rotary table is read (_read_computed_terms)
        n_layers = int(hf.get("num_hidden_layers") or hf.get("n_layer") or 0)
        self.folder = folder
        # layer -> attnx's weight name -> (the projection's shape, the rows sampled, their values)
        self.samples: dict[int, dict[str, tuple[tuple[int, ...], np.ndarray, np.ndarray]]] = {}
        for i in range(n_layers):
            self.samples[i] = {}
            for role, name in PROJECTIONS.items():
                shape = projection_shape(folder, i, role)
                rows = self._rows(shape[0])
                self.samples[i][name] = (tuple(shape), rows, read_projection(folder, i, role, rows))

    def _rows(self, n: int) -> np.ndarray:
        """The rows sampled of a projection of n rows: all of a small one, else evenly spread."""
        return np.unique(np.linspace(0, n - 1, min(n, self.SAMPLE_ROWS)).round().astype(np.int64))

    def pair(self, weights: dict[str, np.ndarray]) -> int | None:
        """The layer whose projections match the block's `weights` on the most sampled rows (never names), so that a
        fault in one projection of a layer (its heads permuted, its rows scaled) still pairs the block with its own
        layer; layers tied on those counts are told apart by their rows' errors, then by their whole q projections.
        None where no layer has a projection of the block's shapes."""

        def errors(theirs: np.ndarray, ours: np.ndarray) -> np.ndarray:  # each row's, relative to its largest value
            theirs = np.asarray(theirs, np.float64)
            scale = np.maximum(np.abs(theirs).max(axis=-1), 1e-30)
            return np.abs(theirs - np.asarray(ours, np.float64)).max(axis=-1) / scale

        scores: dict[int, tuple[int, float]] = {}
        for i, sampled in self.samples.items():
            matched, total, compared = 0, 0.0, False
            for name, (shape, rows, sample) in sampled.items():
                ours = weights.get(name)
                if ours is None or tuple(ours.shape) != shape:
                    continue
                e = errors(sample, np.asarray(ours)[rows])
                matched, total, compared = matched + int((e <= self.MATCH).sum()), total + float(e.sum()), True
            if compared:
                scores[i] = (-matched, total)
        if not scores:
            return None
        best = min(scores.values())
        tied = [i for i, score in scores.items() if score == best]
        q = weights["q_proj.weight"]
        shape, rows, _ = self.samples[tied[0]]["q_proj.weight"]
        if len(tied) == 1 or tuple(q.shape) != shape or len(rows) == q.shape[0]:
            return tied[0]
        return min(tied, key=lambda i: float(errors(read_projection(self.folder, i, "q"), q).max()))

    def layer(self, i: int) -> Any:
        """Layer i's attention, imported now (an ImportResult)."""
        return import_weights(self.folder, layer=i)


def _original_length(hf: dict[str, Any]) -> int:
    """A checkpoint's original_max_position_embeddings, wherever its config.json keeps it (top level, rope_scaling,
    rope_parameters, or rope_parameters per layer type), or 0."""
    found = [hf.get("original_max_position_embeddings")]
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key)
        if isinstance(params, dict):
            found += [params.get("original_max_position_embeddings")]
            found += [p.get("original_max_position_embeddings") for p in params.values() if isinstance(p, dict)]
    return max((int(v) for v in found if isinstance(v, int) and not isinstance(v, bool)), default=0)


class StatedConfig:
    """The source of a model attnx wrote: the config its metadata states (attnx.config), with the block's own
    weights (one block), in CheckpointLayers' interface."""

    label = "its attnx.config"

    def __init__(self, config: AttentionConfig, weights: dict[str, np.ndarray]) -> None:
        self.config, self.weights = config, weights
        self.window = config.sliding_window or 0
        scaling = config.rope.scaling.to_dict() if config.rope is not None and config.rope.scaling else {}
        self.rope_original = int(scaling.get("original_max_position_embeddings") or 0)

    def pair(self, weights: dict[str, np.ndarray]) -> int:
        return 0

    def layer(self, i: int) -> Any:
        return types.SimpleNamespace(config=self.config, weights=self.weights)


def _compare_terms(block: Any, config: AttentionConfig, weights: dict[str, np.ndarray], layer: int,
                   source: str = "the checkpoint") -> list[str]:
    """Every difference between the formula the graph states and the checkpoint layer's, by term."""
    g, facts, found = block.config, block.facts, []
    where = f"layer {layer}"
    for key in ("n_heads", "n_kv_heads", "head_dim"):
        if getattr(g, key) != getattr(config, key):
            found.append(f"{where}: {key} {getattr(g, key)} in the graph, {getattr(config, key)} in {source}")
    if g.causal != config.causal:
        found.append(f"{where}: {'a causal mask' if g.causal else 'no causal mask'} in the graph"
                     f"{' (' + facts['mask'] + ')' if 'mask' in facts else ''}, {'causal' if config.causal else 'not causal'} "
                     f"in {source}")  # fmt: skip
    if not np.isclose(g.softmax_scale, config.softmax_scale, rtol=1e-6):
        found.append(f"{where}: scale {g.softmax_scale:.6g} in the graph, {config.softmax_scale:.6g} in {source}")
    if (g.softcap or None) != (config.softcap or None) and not (
        g.softcap and config.softcap and np.isclose(g.softcap, config.softcap, rtol=1e-6)
    ):
        found.append(f"{where}: softcap {g.softcap} in the graph, {config.softcap} in {source}")
    if g.sliding_window != config.sliding_window:
        how = (f"local_window_size {facts['local_window_size']}" if "local_window_size" in facts
               else f"its mask: {facts.get('mask', 'not read')}")  # fmt: skip
        graph_says = f"window {g.sliding_window} in the graph ({how})" if g.sliding_window else f"no window in the graph ({how})"
        ckpt = f"sliding_window {config.sliding_window}" if config.sliding_window else "no window"
        found.append(f"{where}: {graph_says}, {ckpt} in {source}"
                     + (f": every query past {config.sliding_window} sees keys it must not"
                        if config.sliding_window and not g.sliding_window else ""))  # fmt: skip
    if g.sinks != config.sinks:
        found.append(f"{where}: sinks {'in the graph' if g.sinks else 'missing from the graph'}, "
                     f"{'in' if config.sinks else 'not in'} {source}")  # fmt: skip
    if (g.qk_norm is None) != (config.qk_norm is None):
        found.append(f"{where}: q/k norm {'in the graph' if g.qk_norm else 'missing from the graph'}, "
                     f"{'in' if config.qk_norm else 'not in'} {source}")  # fmt: skip
    if config.rope is not None:
        tables = facts.get("rope_tables")
        if tables is None:
            found.append(f"{where}: no rotary in the graph, rope in {source}")
        else:
            # a table the graph computes, read at each prompt length (its rows for that call); a constant one,
            # whatever the length: its rows are the positions
            at = facts.get("rope_tables_at") or {tables[0].shape[0]: tables}
            for tokens, (cos, sin) in sorted(at.items()):
                inv_freq, factor = rope_frequencies(config.rope, tokens)
                if cos.shape[1] != inv_freq.shape[0]:
                    found.append(f"{where}: rotary on {2 * cos.shape[1]} of each head's dims in the graph, "
                                 f"{2 * inv_freq.shape[0]} in {source}")  # fmt: skip
                    break
                err, ratio = rope_table_error(cos, sin, inv_freq, factor)
                if ratio > 1:  # beyond float32's rounding of the angles (rope_table_error)
                    prompt = f" for a prompt of {tokens} tokens" if "rope_tables_at" in facts else ""
                    found.append(f"{where}: rotary table{prompt} differs from {source}'s rope ({config.rope.rope_type}, "
                                 f"theta {config.rope.theta:g}) by {err:.3g}, {ratio:.3g} times its bound (graph theta "
                                 f"fit {facts.get('rope_theta', float('nan')):.6g})")  # fmt: skip
            if block.facts.get("rotary_interleaved") != config.rope.interleaved:
                found.append(f"{where}: rotary_interleaved {int(block.facts.get('rotary_interleaved', 0))} in the graph, "
                             f"{source}'s rope pairs {'(2i, 2i+1)' if config.rope.interleaved else '(i, i+dim/2)'}")  # fmt: skip
    # weights: the graph's (dequantized where quantized) against the source's; a bias the source has not is zero there
    quantized = block.quantization is not None
    for name in sorted(set(block.weights) - set(weights)):
        if name.endswith(".bias") and np.any(block.weights[name]):
            found.append(f"{where}: {name} in the graph (largest |value| {float(np.abs(block.weights[name]).max()):.3g}), "
                         f"none in {source}")  # fmt: skip
    for name, theirs in weights.items():
        ours = block.weights.get(name)
        if ours is None:
            if name == "sinks" and not g.sinks:
                continue  # said above, as the term
            if np.any(theirs):
                found.append(f"{where}: {name} is in {source}, not in the graph")
            continue
        if ours.shape != theirs.shape:
            found.append(f"{where}: {name} shape {list(ours.shape)} in the graph, {list(theirs.shape)} in {source}")
            continue
        ref = np.asarray(theirs, np.float64)
        diff = np.abs(ours - ref)
        if quantized and name.endswith("_proj.weight"):
            # b-bit blocks along the input: each weight within one step of its block (|w| max of the block / levels)
            n, bits = int(block.quantization.get("block_size", 32)), int(block.quantization.get("bits", 4))
            levels = 2 ** (bits - 1) - 1
            step = np.repeat(_blocks_of(np.abs(ref), n).max(axis=2) / levels, n, axis=1)[:, : ref.shape[1]]
            bad = diff > step * (1 + 1e-3) + 1e-12
            if bad.any():
                r, k = np.argwhere(bad)[0]
                found.append(f"{where}: {name} differs from {source}'s by more than its {bits}-bit step in "
                             f"{int(bad.sum())} weight(s), first [{r}, {k}] (block {k // n})")  # fmt: skip
            continue
        err = float(diff.max() / max(np.abs(ref).max(), 1e-30))
        if err > stored_bound(block.weight_dtype):  # the source's values stored in the graph's dtype
            found.append(f"{where}: {name} differs from {source}'s by {err:.3g} of its largest value")
    return found


_BOUNDARY = ("x", "seqlens_k", "total_sequence_length", "mask_index", "past_key", "past_value")


def _graph_inputs_needed(model: Any, block: Any, outputs: Sequence[str], within: bool = True) -> list[str]:
    """The graph inputs the block's outputs depend on (attention_mask, position_ids, the shape of input_ids: what a
    mask or a rotary computed once for all layers reads), in the graph's order; within: not through its boundary."""
    boundary = {block.inputs[k] for k in _BOUNDARY if k in block.inputs} if within else set()
    values = {v.name: v for node in model.graph for v in node.outputs}
    graph_inputs = {v.name for v in model.graph.inputs}
    needed, seen, todo = set(), set(), list(outputs)
    while todo:
        name = todo.pop()
        if name in seen or name in boundary:
            continue
        seen.add(name)
        if name in graph_inputs:
            needed.add(name)
            continue
        value = values.get(name)
        producer = value.producer() if value is not None else None
        if producer is None:
            continue  # an initializer
        todo += [i.name for i in producer.inputs if i is not None]
        for attr in producer.attributes.values():  # an If's branches read outer values
            if attr.type == ir.AttributeType.GRAPH:
                todo += [i.name for n in attr.value for i in n.inputs if i is not None]
    return [v.name for v in model.graph.inputs if v.name in needed]


_FED = ("attention_mask", "position_ids", "input_ids", "token_type_ids", "key_padding_mask")  # graph inputs the audit feeds (_run_block)


def _compute_in_cut(model: Any, block: Any) -> None:
    """The block's lengths (GroupQueryAttention's seqlens_k and total_sequence_length, Attention's mask_index) computed
    in its cut from the graph inputs they come from, as the model computes them from attention_mask, rather than fed:
    a fault in that subgraph is the block's. Fed where they come from something else (the node that also makes the
    hidden state, as BERT's EmbedLayerNormalization; a graph input the audit does not feed)."""
    x = block.inputs["x"]
    for role in ("seqlens_k", "total_sequence_length", "mask_index"):
        name = block.inputs.get(role)
        if name is None:
            continue
        needed = _graph_inputs_needed(model, block, [name], within=False)
        if needed and all(n in _FED or n.startswith("past") for n in needed) and not _made_with(model, name, x):
            block.facts.setdefault("computed", []).append(role)
            del block.inputs[role]


def _made_with(model: Any, name: str, other: str) -> bool:
    """Whether a node on the way to `name` also makes `other`."""
    values = {v.name: v for node in model.graph for v in node.outputs}
    seen, todo = set(), [name]
    while todo:
        v = values.get(todo.pop())
        node = v.producer() if v is not None else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if any(o.name == other for o in node.outputs):
            return True
        todo += [i.name for i in node.inputs if i is not None]
    return False


def _value(model: Any, name: str) -> Any:
    """The graph's value of that name (a graph input or a node's output), or None."""
    for value in model.graph.inputs:
        if value.name == name:
            return value
    return next((v for node in model.graph for v in node.outputs if v.name == name), None)


@dataclasses.dataclass
class _Graph:
    """The model under audit as each step reads it: its graph (onnx-ir, external data read as a block reaches it),
    the structure blocks are cut from (onnx's Extractor over the graph without its data, typed once), the folder its
    data lies in, and the shapes its own dims allow."""

    model: Any
    extractor: Any
    base_dir: str
    shapes: Shapes


def _cut(graph: _Graph, block: Any, outputs: Sequence[str] | None = None, boundary: bool | None = None) -> bytes:
    """The block as a model of its own: the graph's nodes between its boundary tensors and the graph inputs its
    outputs read (onnx's Extractor over the whole graph, typed once), with only their own tensors' external data
    read (the graph has none); `outputs`: others than the block's own (its mask, read by running it)."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    model, extractor = graph.model, graph.extractor
    outs = list(outputs) if outputs is not None else [block.outputs[k] for k in ("y", "present_key", "present_value")
                                                        if k in block.outputs]  # fmt: skip
    within = outputs is None if boundary is None else boundary  # at the block's boundary, or from the graph's inputs
    names = [block.inputs[k] for k in _BOUNDARY if k in block.inputs] if within else []
    names += _graph_inputs_needed(model, block, outs, within=within)
    int32 = {block.inputs.get(k) for k in ("seqlens_k", "total_sequence_length", "mask_index")} - {None}
    for name in names + outs:  # a value shape inference left untyped (the output of a contrib op): typed by its dtype
        if name not in extractor.value_infos and name not in extractor.initializers:
            value = _value(model, name)
            elem = (value.dtype.value if value is not None and value.dtype is not None else
                    onnx.TensorProto.INT32 if name in int32 else onnx.TensorProto.FLOAT)  # fmt: skip
            extractor.value_infos[name] = onnx.helper.make_tensor_value_info(name, elem, None)
    cut = extractor.extract_model(list(dict.fromkeys(names)), outs)
    for value in cut.graph.input:  # a scalar (GroupQueryAttention's schema); shape inference may leave it unranked
        if value.name == block.inputs.get("total_sequence_length"):
            value.type.tensor_type.shape.Clear()
    check_cut_fits(cut, graph.base_dir, f"block {block.index} ({block.node})")  # before its data is read
    load_external_data_for_model(cut, graph.base_dir)
    return cut.SerializeToString()


Run = Callable[[dict[str, np.ndarray]], list[np.ndarray]]  # feeds by the cut's input names -> y, presents


class NotFed(Exception):
    """A graph input the block reads that the audit does not know how to feed."""


_NP = {"fp32": np.float32, "fp16": np.float16}


def _run_block(run: Run, block: Any, needs: Sequence[str], x: np.ndarray, past_len: int,
               past: tuple[np.ndarray, np.ndarray], lengths: np.ndarray | None = None,
               left: np.ndarray | None = None) -> list[np.ndarray]:  # fmt: skip
    """One call of the cut block on `x` after `past_len` cached tokens. GroupQueryAttention's convention: each
    row's length in seqlens_k (`lengths`: a right-padded prompt). Hugging Face's (attention_mask, position_ids):
    `left`, each row's padding tokens at its start (position_ids as transformers makes them: cumsum(mask) - 1)."""
    batch, tokens, _ = x.shape
    total = past_len + tokens
    dtype = _NP[block.dtype]
    feeds = {block.inputs["x"]: x.astype(dtype)}
    if "seqlens_k" in block.inputs:
        seqlens = np.full((batch,), total, np.int32) if lengths is None else np.asarray(lengths, np.int32)
        feeds[block.inputs["seqlens_k"]] = seqlens - 1
        feeds[block.inputs["total_sequence_length"]] = np.array(total, np.int32)
    if "mask_index" in block.inputs:  # com.microsoft Attention's: each row's length (right padding)
        feeds[block.inputs["mask_index"]] = np.full((batch,), total, np.int32) if lengths is None else \
            np.asarray(lengths, np.int32)  # fmt: skip
    if "past_key" in block.inputs:
        feeds[block.inputs["past_key"]], feeds[block.inputs["past_value"]] = (p.astype(dtype) for p in past)
    mask = np.ones((batch, total), np.int64)
    if left is not None:
        mask[np.arange(total)[None, :] < np.asarray(left)[:, None]] = 0
    elif lengths is not None:  # right padding: each row's keys past its length
        mask[np.arange(total)[None, :] >= np.asarray(lengths)[:, None]] = 0
    other_cache = feeds.get(block.inputs.get("past_key"))  # another layer's cache input, read for its length
    feeds.update(_graph_feeds(needs, mask, past_len, other_cache))
    outputs = run(feeds)
    if block.y_bias is not None:  # the output projection's bias, added by the fused op after the block
        outputs[0] = outputs[0] + block.y_bias
    return outputs


def _graph_feeds(names: Sequence[str], mask: np.ndarray, past_len: int,
                 cache: np.ndarray | None) -> dict[str, np.ndarray]:  # fmt: skip
    """The graph inputs a block's cut reads besides its boundary, as transformers makes them for a batch whose
    attention_mask is `mask` [batch, past_len + tokens] (position_ids counted from each row's first token, ids read
    for their shape, attnx's key_padding_mask True where a key is hidden); `cache`: what a cache input is fed (read
    for its length), None where the block has none to give."""
    batch, tokens = mask.shape[0], mask.shape[1] - past_len
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)[:, past_len:]
    feeds: dict[str, np.ndarray] = {}
    for name in names:
        if name == "attention_mask":
            feeds[name] = mask
        elif name == "position_ids":
            feeds[name] = positions.astype(np.int64)
        elif name in ("input_ids", "token_type_ids"):  # read for their shape (the hidden state is the block's input)
            feeds[name] = np.zeros((batch, tokens), np.int64)
        elif name == "key_padding_mask":  # attnx's own: True hides a key
            feeds[name] = mask == 0
        elif name.startswith("past") and cache is not None:
            feeds[name] = np.zeros_like(cache)
        else:
            raise NotFed(f"the block reads graph input {name!r}, which the audit does not feed (it feeds "
                         "attention_mask, position_ids, input_ids and token_type_ids as transformers makes them, and "
                         "attnx's key_padding_mask)")  # fmt: skip
    return feeds


BACKENDS = ("ort-cpu", "openvino", "ort-cuda")


def _runner(backend: str, cut: bytes) -> Run | str:
    """The cut block loaded on `backend` (a Run), or why the backend is unavailable on this machine (a str: a
    skip). A backend that is here but cannot read or compile the block raises: a finding."""
    if backend == "openvino":
        reason = openvino_unavailable_reason()
        if reason is not None:
            return reason
        import openvino as ov

        with tempfile.TemporaryDirectory(prefix="attnx-audit-") as folder:  # OpenVINO reads ONNX from a file
            path = os.path.join(folder, "block.onnx")
            with open(path, "wb") as f:
                f.write(cut)
            core = ov.Core()
            compiled = core.compile_model(core.read_model(path), DEVICE, compile_config("fp32", runtime_threads()))
        return lambda feeds: [np.asarray(v) for v in compiled(feeds).values()]
    import onnxruntime as ort

    provider = PROVIDERS["cuda" if backend == "ort-cuda" else "cpu"].ort_name
    if backend == "ort-cuda" and (reason := ort_cuda_unavailable_reason()) is not None:
        return reason
    options = ort.SessionOptions()
    options.log_severity_level = 4  # ORT's own error lines: the audit reports the error it raises
    if (threads := runtime_threads()) is not None:  # ATTNX_THREADS, as every attnx session
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(cut, options, providers=[provider])
    if session.get_providers()[0] != provider:  # never a CUDA run that fell back to the CPU
        raise RuntimeError(f"onnxruntime did not start {provider} (session providers: {session.get_providers()})")
    return lambda feeds: session.run(None, feeds)


def audit_model(
    model_path: str,
    *,
    checkpoint: str | None = None,
    layers: Sequence[int] | None = None,
    backends: Sequence[str] = ("ort-cpu",),
    strict: bool = False,
    progress: Callable[[str], None] | None = None,
) -> AuditReport:
    """Audit every attention block of `model_path` (see the module's docstring). strict: a check the model cannot
    run (a gap, AuditReport.gaps) fails the audit; without it, the gap is named and the verdict is what was run."""
    say = progress or (lambda _m: None)
    for name in backends:
        if name not in BACKENDS:
            raise UsageError(f"backend {name!r}: the audit runs on {', '.join(BACKENDS)}")
    check_model_file(model_path)  # untrusted input: refused before anything parses it for real
    import onnx
    from onnx.utils import Extractor

    model = ir.load(model_path)  # external data read tensor by tensor, as a block reaches it
    # the structure the blocks are cut from, without its data, typed once (Extractor runs shape inference)
    structure = onnx.load(model_path, load_external_data=False)
    try:
        extractor = Extractor(onnx.shape_inference.infer_shapes(structure))
    except onnx.shape_inference.InferenceError as e:
        raise UsageError(f"{model_path}: its shapes contradict each other: {_first_line(e)}") from None
    graph = _Graph(model, extractor, os.path.dirname(os.path.abspath(model_path)), model_shapes(model))
    # a model attnx wrote states its config (attnx.config): the source each block is held to, as a checkpoint's
    # layer would be, with the graph's own weights (what `attnx parity --model` holds it to)
    stated = _stated_config(structure) if checkpoint is None else None
    source = CheckpointLayers(checkpoint) if checkpoint is not None else None
    report = AuditReport(model_path, checkpoint, [], [], strict=strict)
    seen = 0
    caches: dict[str, tuple[int, int, int]] = {}  # a block's cache input -> (kv heads, capacity, head_dim)
    asked = set(layers) if layers is not None else None
    for block in iter_blocks(model, report.unread, None if asked is None else asked.__contains__, report.others):
        seen += 1
        if block.config is not None:
            capacity = block.config.sliding_window if block.facts.get("sliding_window_cache") else 0
            for role in ("past_key", "past_value"):
                if role in block.inputs:
                    caches[block.inputs[role]] = (block.config.n_kv_heads, capacity, block.config.head_dim)
        if layers is not None and block.index not in layers:
            continue
        say(f"block {block.index}: {block.node}")
        if stated is not None and block.weights is not None:
            source = StatedConfig(stated, block.weights)
        report.blocks.append(_audit_block(graph, block, source, backends, report.skipped, strict))
        block.weights = None  # one block's weights at a time
    if not seen and not report.unread:
        raise UsageError(f"{model_path}: no attention block found")
    report.not_applicable = [line for line in graph.shapes.not_applicable()
                             if caches or not line.startswith("decoding")]  # fmt: skip
    if isinstance(source, CheckpointLayers):
        _pairing_findings(report, source, whole=layers is None)
    if layers is None and seen and "ort-cpu" in backends:
        _decode_whole(model_path, graph, caches, report)
    missing = sorted(set(layers or ()) - {b.index for b in report.blocks})
    if missing:
        raise UsageError(f"--layers {','.join(map(str, missing))}: the model has {seen} block(s) read"
                         + (f" (0 to {seen - 1})" if seen else ""))  # fmt: skip
    return report


def _pairing_findings(report: AuditReport, source: CheckpointLayers, whole: bool) -> None:
    """Each checkpoint layer paired with one block, and (auditing them all) every layer with one: a block that is
    another layer's copy, or a layer the graph left out, is a finding."""
    paired: dict[int, list[int]] = {}
    for b in report.blocks:
        if b.layer is not None:
            paired.setdefault(b.layer, []).append(b.index)
    for layer, blocks in sorted(paired.items()):
        if len(blocks) > 1:
            report.findings.append(f"blocks {', '.join(map(str, blocks))} all pair with checkpoint layer {layer}: the "
                                   "graph holds one layer's weights more than once")  # fmt: skip
    missing = sorted(set(source.samples) - set(paired))
    if whole and missing:
        report.findings.append(f"checkpoint layer(s) {', '.join(map(str, missing))}: no block of the graph pairs with "
                               "them")  # fmt: skip


def _audit_block(graph: _Graph, block: Any, source: Any, backends: Sequence[str], skipped: list[str],
                 strict: bool = False) -> BlockAudit:  # fmt: skip
    findings, not_checked, checks = [], [], []
    layer = None
    if source is not None:
        block.facts["window_hint"], block.facts["rope_hint"] = source.window, source.rope_original
    if block.config is not None:
        try:
            _read_computed_terms(graph, block)
        except Exception as e:  # noqa: BLE001 - the runtime's own error types, on a subgraph of an untrusted model
            block.unread = f"what the graph computes for it (its mask, its rotary tables) does not run: {_first_line(e)}"
    config, weights = block.config, block.weights
    imported = source is not None
    if source is not None:
        layer = source.pair(block.weights)
        if layer is None:
            findings.append(f"block {block.index}: no checkpoint layer has a projection of its shapes")
        else:
            paired = source.layer(layer)  # this block's layer alone, dropped with the block's audit
            findings += _compare_terms(block, paired.config, paired.weights, layer, source.label)
            config, weights = paired.config, paired.weights  # the reference is the checkpoint's layer
    if config is not None:
        config = dataclasses.replace(config, kv_cache=False, key_padding_mask=False)
    terms = tuple(t for t in (config.terms if config is not None else ()) if t != "causal")
    audit = BlockAudit(block.index, block.node, block.core, layer, terms, findings, checks, not_checked,
                       "attnx.config" if isinstance(source, StatedConfig) else "checkpoint layer", strict=strict)  # fmt: skip
    # a table no theta fits (a scaled rope) is held to the source's rope instead (_compare_terms): read, with one
    rope_held = imported and "rope_tables" in block.facts and block.unread == f"rope {block.facts.get('rope')}"
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
    if block.dtype not in _NP:
        not_checked.append(f"block {block.index}: a {block.dtype} block: the audit feeds fp32 and fp16 blocks")
        return audit
    if block.quantization is not None and imported:
        # the file's own dequantized weights: the quantization is what the int4 form is, not a finding
        weights = {**weights, **{k: v for k, v in block.weights.items() if k.endswith("_proj.weight")}}
    shapes = graph.shapes
    rng = np.random.Generator(np.random.PCG64(block.index))
    x = rng.standard_normal((shapes.batch, shapes.tokens, config.d_model), dtype=np.float32)
    x = x.astype(_NP[block.dtype]).astype(np.float32)  # the values the block is fed, in its own dtype
    positions = np.broadcast_to(np.arange(shapes.tokens, dtype=np.int64), x.shape[:2])
    feeds = {"x": x, "position_ids": positions} if config.rope is not None else {"x": x}
    block_size = block.quantization["block_size"] if level == 4 else None

    def reference(**call: np.ndarray) -> np.ndarray:
        return _reference(config, weights, call, block_size)

    ref = reference(**feeds)
    size = problem_size(config, weights, feeds)
    _compute_in_cut(graph.model, block)
    try:
        cut = _cut(graph, block)
    except UsageError:
        raise  # too large for this machine (check_cut_fits): said, exit 2
    except Exception as e:  # noqa: BLE001 - onnx's error types, on an untrusted graph
        not_checked.append(f"block {block.index}: it cannot be cut out of the graph: {_first_line(e)}")
        return audit
    needs = _graph_inputs_needed(graph.model, block, [block.outputs["y"]])
    ran = False
    for backend in backends:
        try:
            run = _runner(backend, cut)
        except Exception as e:  # noqa: BLE001 - each runtime's own error types: a backend asked for cannot read it
            findings.append(f"block {block.index}: {backend} cannot load {block.node}: {_first_line(e)}")
            continue
        if isinstance(run, str):  # unavailable on this machine: a skip, as in parity
            if f"{backend}: {run}" not in skipped:
                skipped.append(f"{backend}: {run}")
            continue
        ran = True
        failed = len(audit.findings)
        _run_checks(functools.partial(_run_block, run, block, needs), backend, block, needs, feeds, ref, reference,
                    size, audit, shapes)  # fmt: skip
        if len(audit.findings) > failed and not audit.localised:
            audit.localised = _localise(graph, block, backend, needs, config, weights, feeds, size)
    if not ran and not audit.findings:
        not_checked.append(f"block {block.index}: not run: no backend asked for ({', '.join(backends)}) runs here")
    return audit


def _localise(graph: _Graph, block: Any, backend: str, needs: Sequence[str],
              config: AttentionConfig, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray], size: Any) -> str:  # fmt: skip
    """The first stage of the formula (attnx.model.stages) where the block's full sequence leaves its bound: the
    stages the graph holds as tensors (the projections, their rotations, the heads' output, y) exposed in its cut and
    each held to the reference's under its own bound (attnx.runtimes.localise.compare_stages)."""
    if block.quantization is not None:
        return f"block {block.index}: not localised: a quantized block's stages have no float reference"
    order = [s.name for s in STAGES if s.name in block.stages]
    names = list(dict.fromkeys(block.stages[s][0] for s in order))
    try:
        run = _runner(backend, _cut(graph, block, outputs=names, boundary=True))
        if isinstance(run, str):
            return f"block {block.index}: not localised: {run}"
        x = feeds["x"]
        empty = _empty_cache(block, x.shape[0])
        values = dict(zip(names, _run_block(run, block, needs, x, 0, (empty, empty))))
    except Exception as e:  # noqa: BLE001 - the runtime's own error types
        return f"block {block.index}: not localised: the block with its stages exposed fails on {backend}: {_first_line(e)}"
    found = {}
    batch, tokens = x.shape[:2]
    for stage in order:
        tensor, columns = block.stages[stage]
        value = np.asarray(values[tensor], np.float64)
        if columns is not None:
            value = value[..., columns[0] : columns[1]]
        if value.ndim == 4:  # [batch, heads, tokens, dim] or [batch, tokens, heads, dim]
            value = value.transpose(0, 2, 1, 3) if value.shape[1] != tokens else value
            value = value.reshape(batch, tokens, -1)
        found[stage] = value
    ref = reference_stages(config, weights, feeds, False)
    result = compare_stages(backend, config, found, ref, tolerance_for(block.dtype), size)
    if result.stage is None:
        return f"block {block.index}: not localised: every stage the graph holds agrees ({', '.join(found)})"
    check = next(c for c in result.checks if c.stage == result.stage)
    agree = f"; {', '.join(result.agree)} agree{'s' if len(result.agree) == 1 else ''}" if result.agree else ""
    error = (f"max_abs {check.max_abs:.3g} > atol {check.atol:.3g}" if check.max_abs is not None and check.atol is not None
             and np.isfinite(check.max_abs) else check.detail or "its shape differs")  # fmt: skip
    return f"block {block.index}: localised to stage {result.stage} (tensor {block.stages[result.stage][0]}): {error}{agree}"


def _stated_config(structure: Any) -> AttentionConfig | None:
    """The AttentionConfig a model attnx wrote states in its metadata (attnx.config), or None."""
    metadata = {p.key: p.value for p in structure.metadata_props}
    if CONFIG_KEY not in metadata:
        return None
    return config_from_metadata(metadata, "the model's attnx.config")


def _decode_whole(model_path: str, graph: _Graph, caches: dict[str, tuple[int, int, int]], report: AuditReport) -> None:
    """The whole model as exported, on ONNX Runtime's CPU: a prefill then single steps through its own cache (every
    present fed back as the next past), which fails in some exports though every block cut out alone runs (a
    buffer the runtime plans from the graph's dim labels). It only has to run: its numbers are the blocks'."""
    import onnxruntime as ort

    model, shapes = graph.model, graph.shapes
    if not caches or "input_ids" not in {v.name for v in model.graph.inputs}:
        return  # nothing to decode, or a model that is its blocks (from a hidden state): each block says
    if shapes.prefill is None:
        if "cache" in shapes.fixed:
            report.not_checked.append(f"the whole model's decoding: its cache is fixed ({shapes.fixed['cache']}), a "
                                      "static cache the audit does not fill")  # fmt: skip
        return  # a sequence fixed by its dims: not applicable (report.not_applicable says so)
    size = sum(os.path.getsize(os.path.join(graph.base_dir, f)) for f in os.listdir(graph.base_dir))
    memory = available_memory_bytes()
    if memory is not None and size > memory // 2:
        report.not_checked.append(f"the whole model's decoding: its folder ({size / 2**30:.1f} GiB) is more than half "
                                  f"the memory available ({memory / 2**30:.1f} GiB); each block's is checked")  # fmt: skip
        return
    known = ("input_ids", "attention_mask", "position_ids")
    other = [v.name for v in model.graph.inputs if v.name not in known and v.name not in caches]
    if other:
        report.not_checked.append(f"the whole model's decoding: it reads {', '.join(other)}, which the audit does "
                                  "not feed")  # fmt: skip
        return
    options = ort.SessionOptions()
    options.log_severity_level = 4
    if (threads := runtime_threads()) is not None:
        options.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(model_path, options, providers=[PROVIDERS["cpu"].ort_name])
    except Exception as e:  # noqa: BLE001 - the runtime's own error types, on the model as exported
        report.findings.append(f"the whole model as exported does not load on ort-cpu: {_first_line(e)}")
        return
    types = {v.name: v.type for v in session.get_inputs()}
    np_of = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    names = [o.name for o in session.get_outputs()]
    batch, prefill, steps = shapes.batch, shapes.prefill, shapes.tokens - shapes.prefill
    past = {name: np.zeros((batch, kv, capacity, hd), np_of.get(types.get(name, ""), np.float32))
            for name, (kv, capacity, hd) in caches.items()}  # fmt: skip
    presents = {name: "present" + name[len("past_key_values"):] if name.startswith("past_key_values") else None
                for name in caches}  # fmt: skip
    done = 0
    for step, tokens in enumerate([prefill] + [1] * steps):
        feeds = {"input_ids": np.ones((batch, tokens), np.int64),
                 "attention_mask": np.ones((batch, done + tokens), np.int64),
                 "position_ids": np.broadcast_to(np.arange(done, done + tokens, dtype=np.int64), (batch, tokens))}  # fmt: skip
        feeds = {k: v for k, v in feeds.items() if k in types} | past
        what = f"the prefill of {prefill} tokens" if step == 0 else f"decoding step {step} (after {done} tokens)"
        try:
            outputs = dict(zip(names, session.run(None, feeds)))
        except Exception as e:  # noqa: BLE001 - the runtime's own error types, on the model as exported
            report.findings.append(f"the whole model as exported fails at {what} on ort-cpu: {_first_line(e)}")
            return
        if any(presents[n] not in outputs for n in caches):
            report.not_checked.append("the whole model's decoding: its cache outputs are not named present.* after "
                                      "its past_key_values.* inputs")  # fmt: skip
            return
        past = {n: outputs[presents[n]] for n in caches}
        done += tokens


def _evaluate(graph: _Graph, block: Any, names: Sequence[str], tokens: int) -> list[np.ndarray]:
    """Tensors of the graph that the block's terms are computed from (its mask, its rotary tables), cut out with
    what they read and run once on ONNX Runtime's CPU for one prompt of `tokens` tokens at positions 0.. (in each row
    of a batch the model's dims fix)."""
    import onnxruntime as ort

    session = ort.InferenceSession(_cut(graph, block, outputs=names), providers=[PROVIDERS["cpu"].ort_name])
    dtype = _NP.get(block.dtype, np.float32)
    batch = graph.shapes.batch if "batch" in graph.shapes.fixed else 1
    names = [v.name for v in session.get_inputs()]
    x = block.inputs.get("x")
    feeds = {x: np.zeros((batch, tokens, block.config.d_model), dtype)} if x in names else {}  # read for its shape
    empty = np.zeros((batch, block.config.n_kv_heads, 0, block.config.head_dim), dtype)  # every cache input: no past
    feeds.update(_graph_feeds([n for n in names if n != x], np.ones((batch, tokens), np.int64), 0, empty))
    return [np.asarray(a) for a in session.run(None, feeds)]


def _probe_tokens(graph: _Graph, wanted: int) -> int:
    """The tokens a computed term is read at: `wanted`, or the sequence the model's dims fix."""
    return graph.shapes.tokens if "sequence" in graph.shapes.fixed else wanted


def _read_computed_terms(graph: _Graph, block: Any) -> None:
    """The terms of a block that the graph computes rather than states, read by running what computes them: its
    rotary tables (from position_ids) and its mask's (causal, a window)."""
    if "rope_tensors" in block.facts:
        positions = _probe_tokens(graph, AUDIT_SHAPE["rope_positions"])
        names = list(block.facts.pop("rope_tensors")) + list(block.facts.pop("k_rope_tensors", ()))
        # at the probe's length, and on each side of the source's original length, where a rope that switches on
        # the prompt's length (longrope's short and long factors) changes tables
        original = block.facts.get("rope_hint") or 0
        wanted = (positions, original, original + 1) if original else (positions,)
        lengths = dict.fromkeys(_probe_tokens(graph, n) for n in wanted if n <= ROPE_PROBE_MAX)
        at = {}
        for tokens in lengths:
            try:
                tables = [a.reshape(-1, a.shape[-1])[: max(tokens, positions)]
                          for a in _evaluate(graph, block, names, tokens)]  # fmt: skip
            except NotFed as e:
                block.unread = f"its rotary tables not read: {e}"
                return
            at[tokens] = half_table(*tables[:2])
            if len(tables) == 4 and not all(np.array_equal(a, b) for a, b in zip(half_table(*tables[2:]), at[tokens])):
                block.unread = "q and k rotated by different tables"
                return
        cos, sin = at[positions]
        rope, facts = rope_of_table(cos, sin, block.facts["rotary_interleaved"])
        block.facts.update(facts, rope_tables=(cos, sin), rope_tables_at=at)
        block.config = dataclasses.replace(block.config, rope=rope)
        if rope is None:
            block.unread = f"rope {facts['rope']}"
    if block.mask is not None:
        try:
            block.config = _read_mask_terms(graph, block)
        except NotFed as e:
            block.unread = f"its mask {block.mask} not read: {e}"


def _read_mask_terms(graph: _Graph, block: Any) -> AttentionConfig:
    """The block's config with the terms of the mask the graph computes for its core (causal, a window), run for a
    full prompt past any window."""
    # past the widest window the graph or the source states (a wider one reads as none): GQA's local_window_size,
    # the checkpoint's sliding_window
    hint = max(block.facts.get("local_window_size", -1), block.facts.get("window_hint") or 0)
    tokens = _probe_tokens(graph, max(AUDIT_SHAPE["tokens"], min(hint + 2, MASK_PROBE_MAX)))
    masks = block.masks or [(block.mask, "additive" if block.core != "attention23" else "kept")]
    grid = np.arange(tokens)
    allowed = np.ones((tokens, tokens), bool)
    for (name, how), mask in zip(masks, _evaluate(graph, block, [m for m, _ in masks], tokens)):
        # a float mask is added to the scores (a large negative hides); a boolean one keeps where True (ONNX's
        # Attention, a Where(keep, scores, lowest)) or hides where True (a Where(hide, lowest, scores))
        kept = mask > MASKED if mask.dtype.kind == "f" else mask.astype(bool) ^ (how == "where-masked")
        while kept.ndim > 2:  # [batch, heads, queries, keys]: the first row's first head
            kept = kept[0]
        if kept.ndim == 1 or kept.shape[0] == 1:  # a mask of the keys alone ([batch, keys], [.., 1, keys])
            kept = np.broadcast_to(kept.reshape(1, -1), (tokens, kept.shape[-1]))
        if kept.shape != (tokens, tokens):
            raise NotFed(f"{name} is {list(mask.shape)}, not a [{tokens}, {tokens}] grid of a prompt")
        allowed &= kept
    causal = grid[None, :] <= grid[:, None]
    if allowed.all():
        terms: dict[str, Any] = {"causal": False}
    elif not (allowed & ~causal).any() and allowed[grid, grid].all():
        width = int(allowed[-1].sum())  # the keys the last query sees
        if not np.array_equal(allowed, causal & (grid[None, :] > grid[:, None] - width)):
            raise NotFed("it is neither causal nor a causal window")
        terms = {"causal": True, "sliding_window": width if width < tokens else None}
    else:
        raise NotFed("it is neither causal nor a causal window")
    block.facts["mask"] = ("causal" if terms["causal"] else "none") + (
        f", window {terms['sliding_window']}" if terms.get("sliding_window") else "")  # fmt: skip
    # with what the op itself states (GroupQueryAttention's causal and local_window_size, Attention's is_causal)
    terms["causal"] = terms["causal"] or block.config.causal
    terms["sliding_window"] = terms.get("sliding_window") or block.config.sliding_window
    return dataclasses.replace(block.config, **terms)


def _empty_cache(block: Any, batch: int) -> np.ndarray:
    """A block's past before its first token: no position, or a window's worth where the window is kept in a ring
    buffer (GroupQueryAttention's sliding_window_cache, whose past has the window's capacity)."""
    config = block.config
    capacity = config.sliding_window if block.facts.get("sliding_window_cache") else 0
    return np.zeros((batch, config.n_kv_heads, capacity, config.head_dim), np.float32)


def _run_checks(run: Callable[..., list[np.ndarray]], backend: str, block: Any, needs: Sequence[str],
                feeds: dict[str, np.ndarray], ref: np.ndarray, reference: Callable[..., np.ndarray], size: Any,
                audit: BlockAudit, shapes: Shapes) -> None:  # fmt: skip
    """The block on one backend at the shapes its model allows: a full sequence, a padded batch (in the block's
    convention), a prefill and steps through its cache. A check that fails to run is a finding naming the check and
    the runtime's error, except where the runtime refuses that input by its operator's own rule (a padded batch with
    a ring-buffer window): a gap, named with what the model then cannot serve."""
    x = feeds["x"]
    batch, tokens = x.shape[:2]
    empty = _empty_cache(block, batch)
    tol = tolerance_for(block.dtype)
    label = f"{backend}: " if backend != "ort-cpu" else ""
    short = tokens - shapes.padding
    right = block.core == "gqa" or block.padding == "right"

    def full() -> tuple[np.ndarray, np.ndarray]:
        return run(x, 0, (empty, empty))[0], ref

    def padded() -> tuple[np.ndarray, np.ndarray]:
        # the last row `padding` tokens shorter, the others whole; each row at its own tokens' positions (the short
        # row's padding left out of both sides)
        fill = np.zeros((1, tokens - short, ref.shape[-1]))
        last = np.concatenate([reference(**{k: v[-1:, :short] for k, v in feeds.items()}), fill], axis=1)
        expected = np.concatenate([ref[:-1], last])
        lengths = np.array([tokens] * (batch - 1) + [short])
        if right:  # right padding: each row's length in seqlens_k (GroupQueryAttention's rule) or its mask
            y = run(x, 0, (empty, empty), lengths=lengths)[0]
            mine = y[-1:, :short]
        else:  # transformers' convention: left padding in attention_mask, the row's tokens at the end
            shifted = np.concatenate([np.zeros_like(x[-1:, : tokens - short]), x[-1:, :short]], axis=1)
            y = run(np.concatenate([x[:-1], shifted]), 0, (empty, empty), left=tokens - lengths)[0]
            mine = y[-1:, tokens - short :]
        if y.shape != ref.shape:  # an output of another shape: the comparison says so
            return y, expected
        return np.concatenate([y[:-1], np.concatenate([mine, fill], axis=1)]), expected

    def decode() -> tuple[np.ndarray, np.ndarray]:
        # the model's own cache: what the block returns as present is the next step's past (a window kept in
        # a ring buffer, sliding_window_cache, returns its buffer of the window's capacity)
        y, pk, pv = run(x[:, : shapes.prefill], 0, (empty, empty))
        steps = [y]
        for t in range(shapes.prefill, tokens):
            y, pk, pv = run(x[:, t : t + 1], t, (pk, pv))
            steps.append(y)
        return np.concatenate(steps, axis=1), ref

    # what the block's inputs and the model's dims allow: a padded batch where it reads each row's length
    # (seqlens_k, attention_mask) and two rows fit, decoding where it has a cache and single steps fit
    plan = [(f"{label}full sequence ({tokens} tokens)", full)]
    lengths_read = "seqlens_k" in block.inputs or "mask_index" in block.inputs or \
        bool({"attention_mask", "key_padding_mask"} & set(needs))  # fmt: skip
    if lengths_read and shapes.padded:
        rows = f"{batch - 1} row(s) of {tokens} and one of {short}" if batch > 2 else f"rows of {tokens} and {short}"
        plan.append((f"{label}padded batch ({rows} tokens, {'right' if right else 'left'}-padded)", padded))
    if "past_key" in block.inputs and shapes.prefill is not None:
        plan.append((f"{label}prefill {shapes.prefill} + {tokens - shapes.prefill} steps", decode))
    elif "past_key" in block.inputs and "cache" in shapes.fixed:
        audit.not_checked.append(f"block {block.index}: {label}decoding: its cache is fixed ({shapes.fixed['cache']}), "
                                 "a static cache the audit does not fill")  # fmt: skip
    for name, check in plan:
        try:
            out, expected = check()
        except NotFed as e:
            audit.not_checked.append(f"block {block.index}: {name}: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - the runtime's own error types, on the model as exported
            if check is padded and block.facts.get("sliding_window_cache"):
                # ORT 1.31 refuses a row shorter than the prompt when the window is kept in a ring buffer
                audit.not_checked.append(f"block {block.index}: {name}: {backend} refuses it with a "
                                         f"sliding_window_cache ({_first_line(e)}): on {backend} this model cannot "
                                         "serve prompts of different lengths in one batch")  # fmt: skip
            else:
                audit.findings.append(f"block {block.index}: {name}: {block.node} fails to run as exported: "
                                      f"{_first_line(e)}")  # fmt: skip
            continue
        c = compare_arrays(name, out, expected, tol, size)
        audit.checks.append(c)
        if c.shape_error is not None:  # an output of another shape (OpenVINO's empty one, on one thread)
            audit.findings.append(f"block {block.index}: {c.name}: {c.shape_error}")
        elif not c:
            audit.findings.append(f"block {block.index}: {c.name} against the reference fails: max_abs "
                                  f"{c.max_abs:.3g} > atol {c.atol:.3g}, first at position "
                                  f"{_first_position(out, expected, c)}")  # fmt: skip


def int8_blocks(a: np.ndarray, block: int) -> np.ndarray:
    """`a` as MatMulNBits at accuracy_level 4 computes with it: each row's blocks of `block` values along the last
    axis quantized to int8, symmetric, scale = max |a| / 127, rounded to nearest even, and back (float64)."""
    a = np.asarray(a, np.float32)
    rows = _blocks_of(a, block)
    amax = np.abs(rows).max(axis=2, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.clip(np.rint(rows * inverse), -127, 127)
    back = (q * (amax / np.float32(127))).reshape(rows.shape[0], -1)[:, : a.shape[-1]]
    return back.reshape(a.shape).astype(np.float64)


def _blocks_of(a: np.ndarray, n: int) -> np.ndarray:
    """a [..., k] as [rows, ceil(k / n), n], zero-padded along k: the blocks MatMulNBits quantizes along its input."""
    k = a.shape[-1]
    return np.pad(a.reshape(-1, k), ((0, 0), (0, (-k) % n))).reshape(-1, -(-k // n), n)


def _reference(config: AttentionConfig, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray],
               block_size: int | None) -> np.ndarray:  # fmt: skip
    """The float64 reference; with block_size, of the model as MatMulNBits computes at accuracy_level 4: the
    projections' inputs (x, and the heads' output z before out_proj) in int8 blocks (int8_blocks)."""
    if block_size is None:
        return np.asarray(reference_attention(config, weights, **feeds))
    stages: dict[str, np.ndarray] = {}
    reference_attention(config, weights, **{**feeds, "x": int8_blocks(feeds["x"], block_size)}, stages=stages,
                        core_stages=False)  # fmt: skip
    z = int8_blocks(stages["z"].astype(np.float32), block_size)
    bias = weights.get("out_proj.bias")  # a config without biases has none
    return z @ np.asarray(weights["out_proj.weight"], np.float64).T + (0.0 if bias is None else np.asarray(bias, np.float64))


def _first_line(e: BaseException) -> str:
    """A runtime's message in one line: ONNX Runtime's without its "[ONNXRuntimeError] : 2 : ... : " prefix, with
    the node it names ("node N (Op): ..."); OpenVINO's informative line (its first lines are source locations)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].startswith("Exception from src/"):
        return next((line for line in lines if "not supported" in line), lines[-1])[:300]
    text = " ".join(lines)
    node = re.search(r"running (\w+) node\. Name:'([^']*)'", text)
    message = text.rsplit(" : ", 1)[-1]
    message = message.split("Status Message: ", 1)[-1] if node else message  # the node is named once, before it
    return (f"node {node.group(2)} ({node.group(1)}): " if node else "") + message[:300]


def _first_position(out: np.ndarray, ref: np.ndarray, c: Comparison) -> int:
    """The first token position where some output is outside the comparison's bound."""
    bad = np.abs(np.asarray(out, np.float64) - ref) > c.atol + c.rtol * np.abs(ref)
    return int(np.argmax(bad.any(axis=(0, 2))))
