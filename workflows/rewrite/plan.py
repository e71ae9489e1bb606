"""What each block of a whole model becomes: the config and weights it is written from (the graph's, or with a
checkpoint its paired layer's, each difference a repair), how the new core is bound into the graph (Plan), and the
cores that compute it there; or why it is kept.

    the whole block     rebuilt from its hidden state (float32 projections: a weight can be repaired too)
    the core alone      bound at the graph's own projections (q, k, v or the packed qkv), its z handed to the
                        graph's output projection: where the projections stay as they are (MatMulNBits, fp16)
    its I/O             the cache under its own names; GroupQueryAttention's lengths (seqlens_k and
                        total_sequence_length, computed by the graph from attention_mask: right padding, and a past
                        that may be one buffer of the model's whole length) bound as they are, so only a core that
                        reads each row's length computes it (LENGTHS_CORES); transformers' attention_mask as the
                        padding mask; the positions the graph rotates by (position_ids, or the Range it counts
                        them with), or the op's own cos/sin caches
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from attnx.errors import UsageError
from attnx.export.cores import UnreadKind
from attnx.export.passes.walk import positions_of
from attnx.export.terms import GRAPH_TERMS, Context
from attnx.export.terms import compare_terms as compare_graph_terms
from attnx.model.config import AttentionConfig
from attnx.model.cores import CORES, LENGTHS_CORES, LOWERING_OF_CORE, core_for
from attnx.model.weights import weight_shapes
from attnx.workflows.audit.compare import compare_weights, is_projection_weight
from attnx.workflows.audit.cut import NP_DTYPES, AuditGraph, graph_value
from attnx.workflows.rewrite.report import BlockRewrite

__all__ = ["LENGTHS_CORES", "LOWERING", "LOWERINGS_TRIED", "Plan", "plan_block"]

LOWERING = "ort-fused"
# the lowerings a block's core is taken from, in this order: the first whose cores compute its formula under its I/O
# (ONNX Runtime's fused kernels, then the lowering of the core in standard ops, Core.fallback, which expresses every
# term: multi-head latent attention's absorbed step, which no fused kernel computes)
LOWERINGS_TRIED = (LOWERING, *(LOWERING_OF_CORE[name] for name, core in CORES.items() if core.fallback))
# the projections a core bound at them does not write (its own weights, q/k norms and sinks, it does)
PROJECTIONS = tuple(f"{p}_proj.{t}" for p in ("q", "k", "v", "out") for t in ("weight", "bias"))


@dataclasses.dataclass
class Plan:
    """How one block is rewritten: the config and weights its core is written from, the form and dtype, where its
    q, k, v come from (bound: "x", the whole block from its hidden state; "separate"/"packed", the core alone at the
    graph's projections: attnx.export.build_model's bound), and the graph's tensor each input of the core's model is
    bound to (binds: input -> the graph's tensor)."""

    block: Any
    config: AttentionConfig
    weights: dict[str, np.ndarray]
    form: str
    dtype: str
    bound: str
    binds: dict[str, str]
    lowering: str = LOWERING  # the lowering its core is written by (LOWERINGS_TRIED)
    ring_cache: bool = False
    rope_positions: int | None = None  # the rows of a cos/sin table of its own (not bound to the graph's)
    positions_expand: bool = False  # the graph's positions are not [batch, seq]: expanded to it
    core: str | None = None
    # a core that writes its own projections (the latent's) takes the graph's quantized ones as they are: weight
    # name -> the MatMulNBits's tensors and attributes (Block.nbits), which the splice writes in place of its MatMul
    nbits: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def cores(self) -> tuple[str, ...] | None:
        """The cores that may compute it under its I/O (None: any of the lowering's for its form)."""
        return LENGTHS_CORES if "seqlens_k" in self.binds else None


def plan_block(block: Any, rewrite: BlockRewrite, source: Any, graph: AuditGraph,
               lowerings: tuple[str, ...] = LOWERINGS_TRIED) -> Plan | None:  # fmt: skip
    """The Plan of a block to rewrite, or None with rewrite.kept saying why; its lowering the first of `lowerings`
    whose cores compute it (one lowering: the one asked, attnx optimize --attention)."""
    # a table no theta fits (a scaled rope) is held to the checkpoint's rope (the audit's rule)
    if block.unread and not (source is not None and block.unread.kind is UnreadKind.UNFIT_TABLE):
        rewrite.kept = f"not read: {block.unread}"
        return None
    if block.dtype not in NP_DTYPES:
        rewrite.kept = f"a {block.dtype} block: attnx proves fp32 and fp16 blocks"
        return None
    kept_projections = block.quantization is not None or block.dtype != "fp32"
    nbits: dict[str, dict[str, Any]] = {}  # the latent core's own projections, as the graph quantized them
    if kept_projections and block.config is not None and block.config.latent is not None:
        own = [name for name in weight_shapes(block.config) if is_projection_weight(name)]
        missing = [name for name in own if name not in block.nbits]
        if block.dtype != "fp32" or missing:
            rewrite.kept = (f"multi-head latent attention whose projections are {projections_said(block)}: its core "
                            "writes its own projections, and takes quantized ones as they are only where every one "
                            f"is a MatMulNBits of a float32 block ({', '.join(missing) or block.dtype} not): "
                            "kept")  # fmt: skip
            return None
        nbits, kept_projections = block.nbits, False
    config, weights = block.config, block.weights
    rope_repaired = False
    if source is not None:
        rewrite.layer = source.pair(block.weights)
        if rewrite.layer is None:
            rewrite.kept = "no checkpoint layer has a projection of its shapes"
            return None
        paired = source.layer(rewrite.layer)
        ctx = Context(f"layer {rewrite.layer}", source.label)
        terms = compare_graph_terms(block.config, block.reading, paired.config, ctx)
        differ = compare_weights(block, paired.config, paired.weights, rewrite.layer, source.label)
        rewrite.repairs = terms + list(differ.values())  # written as the checkpoint states, unless kept
        fixed = [name for name in differ if name in PROJECTIONS or (nbits and is_projection_weight(name))]
        if (kept_projections or nbits) and fixed:
            rewrite.kept = (f"{', '.join(fixed)} differ from the checkpoint's, and its projections "
                            f"({projections_said(block)}) are kept as they are: not repaired")  # fmt: skip
            return None
        rope_repaired = bool(GRAPH_TERMS["rope"].compare(block.config, block.reading, paired.config, ctx))
        config, weights = paired.config, paired.weights
        if nbits:  # the projections compute with the file's own weights: the halves folded from them too
            weights = {**weights, **{k: v for k, v in block.weights.items() if is_projection_weight(k)}}
    inputs = {v.name for v in graph.model.graph.inputs}
    binds = {"x": block.inputs["x"]}
    plan = Plan(block, config, weights, "full", block.dtype, "x", binds, nbits=nbits)
    if kept_projections and not _bind_projections(block, plan, rewrite):
        return None
    cached = "past_key" in block.inputs
    if cached:
        binds.update(past_key=block.inputs["past_key"], past_value=block.inputs["past_value"])
    if "seqlens_k" in block.inputs:  # GroupQueryAttention's lengths: the buffer form, each row's length bound
        if not cached:
            rewrite.kept = "GroupQueryAttention's lengths without its cache: not rewritten in this version"
            return None
        plan.form = "buffer"
        binds.update(seqlens_k=block.inputs["seqlens_k"], total_sequence_length=block.inputs["total_sequence_length"])
        plan.ring_cache = block.ring_cache
        if plan.ring_cache and config.sliding_window != block.config.sliding_window:
            rewrite.kept = ("its cache is a ring buffer of the graph's window (sliding_window_cache): the "
                            "checkpoint's window needs another cache, not rewritten in place")  # fmt: skip
            return None
        plan.config = dataclasses.replace(config, kv_cache=True, key_padding_mask=False)
        if config.rope is not None:
            caches = block.reading.rope.caches
            if caches is not None and not rope_repaired:  # the op's own cos/sin caches: the rope as the block has it
                binds.update(rope_cos_cache=caches[0], rope_sin_cache=caches[1])
            else:
                tables = block.reading.rope.tables
                rows = [n for n in (tables[0].shape[0] if tables is not None else None,
                                    source.max_positions if source is not None else None) if n]  # fmt: skip
                plan.rope_positions = max(rows) if rows else None
    else:
        plan.form = "growing" if cached else "full"
        unbound = _unbound_mask_inputs(block, graph)
        if unbound:
            rewrite.kept = (f"its mask reads the graph input {unbound[0]}, which the rewrite does not bind (it binds "
                            "transformers' attention_mask as the padding mask): kept")  # fmt: skip
            return None
        plan.config = dataclasses.replace(config, kv_cache=cached, key_padding_mask="attention_mask" in inputs)
        if config.rope is not None and not _bind_positions(block, plan, graph, inputs, rewrite):
            return None
    reasons = []
    for lowering in lowerings:
        try:
            core_for(lowering, plan.config, plan.dtype, plan.form, core=plan.cores[0] if plan.cores else None,
                     what=None)  # fmt: skip
        except UsageError as e:
            reasons.append(str(e))
            continue
        plan.lowering = lowering
        return plan
    rewrite.kept = reasons[0]  # the fused lowering's reasons: what a reader compares against first
    return None


# the graph inputs a block's mask may be computed from that the rewrite binds or computes alike (the padding mask,
# the positions and lengths the grid is counted from, the cache whose length offsets it)
_MASK_INPUTS = ("attention_mask", "input_ids", "position_ids", "past_key_values")


def _unbound_mask_inputs(block: Any, graph: AuditGraph) -> list[str]:
    """The graph inputs the block's mask tensors are computed from that the rewrite would not bind (attnx's own
    key_padding_mask input, a mask of another tool's): a core written without them would drop the mask."""
    seen, found, queue = set(), [], [graph_value(graph.model, name) for name, _ in block.masks]
    while queue:
        value = queue.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if value.is_graph_input():
            if not value.name.startswith(_MASK_INPUTS):
                found.append(value.name)
        elif (node := value.producer()) is not None:
            queue += [i for i in node.inputs if i is not None]
    return found


def projections_said(block: Any) -> str:
    q = block.quantization
    return f"{q['op']} {q['bits']}-bit" if q is not None else block.dtype


def _bind_projections(block: Any, plan: Plan, rewrite: BlockRewrite) -> bool:
    """The core alone, bound at the graph's own projections (block.stages q, k, v: one packed tensor's columns, or
    three tensors) and handing its z to the graph's output projection; False (kept, said) where they are not
    tensors of the graph."""
    stages = [block.stages.get(role) for role in ("q", "k", "v")]
    if any(s is None for s in stages) or "z" not in block.stages:
        rewrite.kept = (f"its projections ({projections_said(block)}) are kept, and their outputs are not tensors of "
                        "the graph (the op adds their bias itself): the core cannot be bound at them")  # fmt: skip
        return False
    c = plan.config
    names = {s[0] for s in stages}
    if len(names) == 1:  # one packed tensor: [q | k | v] in that order, whole
        ends = [0, c.q_dim, c.q_dim + c.kv_q_dim, c.q_dim + c.kv_q_dim + c.kv_v_dim]
        if [s[1] for s in stages] != [(a, b) for a, b in zip(ends[:-1], ends[1:])]:
            rewrite.kept = "its packed projection is not [q | k | v] whole: the core cannot be bound at it"
            return False
        plan.bound = "packed"
        plan.binds["qkv"] = names.pop()
    elif all(s[1] is None for s in stages):
        plan.bound = "separate"
        plan.binds.update(q=stages[0][0], k=stages[1][0], v=stages[2][0])
    else:
        rewrite.kept = "its q, k and v are columns of different tensors: the core cannot be bound at them"
        return False
    plan.binds["z"] = block.stages["z"][0]
    return True


def _bind_positions(block: Any, plan: Plan, graph: AuditGraph, inputs: set[str], rewrite: BlockRewrite) -> bool:
    """The positions the new core rotates by: the model's position_ids input, else the positions the graph itself
    computes its rotary tables from (a Range counted from the cache's length: Optimum's exports without a
    position_ids input), expanded to [batch, seq]; False (kept, said) where neither is found."""
    if "position_ids" in inputs:
        plan.binds["position_ids"] = "position_ids"
        return True
    tables = block.reading.rope.tensors
    cos = graph_value(graph.model, tables[0]) if tables else None
    found = positions_of(cos) if cos is not None else None
    if found is None:
        rewrite.kept = ("a rotary block in a model without a position_ids input, whose rotary tables are computed "
                        "from no positions attnx finds: kept")  # fmt: skip
        return False
    plan.binds["position_ids"] = found.name
    plan.positions_expand = True
    return True
