"""What a core's emitter writes into and reads from (Emit: the graph, the config and its weights, the form, the
core), and the pieces cores share: the projections, q and k scored (their norms and rotation), the cache's heads,
the rows a query sees, a fully hidden row set to 0; the buffer form of a core of standard ops (BufferSpan: each row's
positions from seqlens_k, its new tokens written into the buffer by TensorScatter-24)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
from onnx import TensorProto, helper

from attnx.export._graph import Graph, heads, linear
from attnx.export._llm import norm_and_rotate
from attnx.export.terms import emit_qk
from attnx.model.config import AttentionConfig
from attnx.model.contract import MS_DOMAIN
from attnx.model.cores import Core
from attnx.model.terms import terms_at

__all__ = ["BOUND", "BufferSpan", "Emit", "Emitter", "LOWEST", "cache_heads", "packed_projection"]

_F = TensorProto.FLOAT
LOWEST = float(np.finfo(np.float32).min)
# where a core's q, k and v come from (Emit.bound): projected from x, or bound at a model's own projections
BOUND = ("x", "separate", "packed")


@dataclasses.dataclass
class Emit:
    """What an emitter writes into and reads from: the graph, the config and its weights, the form, the
    core, and the opsets and metadata the model will carry. Its helpers are the pieces cores share."""

    g: Graph
    c: AttentionConfig
    weights: Mapping[str, np.ndarray]
    form: str  # "full", "growing" or "buffer"
    core: Core
    attention: str  # the lowering the graph is recorded as (ATTENTION_KEY)
    half: bool = False  # the graph will be float16: the lowest value a contrib op fills hidden scores with
    rope_positions: int | None = None
    readable: bool = True  # every node named (named()); False: the stages alone
    # where q, k and v come from (BOUND): "x", projected here from the hidden state; "separate", the model's inputs
    # q, k, v; "packed", its input qkv [B, S, (H + 2 Hkv) * hd] (a core spliced at a whole model's own projections)
    bound: str = "x"
    ring_cache: bool = False  # GroupQueryAttention's past keeps only a window (sliding_window_cache), as bound
    span: BufferSpan | None = None  # the buffer form's positions (Emit.buffer_span), made once
    domains: dict[str, int] = dataclasses.field(default_factory=dict)
    metadata: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def step(self) -> bool:
        return self.form != "full"

    @property
    def kpm(self) -> str | None:
        return "key_padding_mask" if self.c.key_padding_mask else None

    @property
    def keys_from(self) -> str:
        """The graph input keys and values are projected from: memory (cross), else x."""
        return "memory" if self.c.cross else "x"

    @property
    def fill(self) -> float:
        """The value a contrib op gives a hidden score (mask_filter_value): the graph dtype's lowest."""
        return float(np.finfo(np.float16 if self.half else np.float32).min)

    def ms(self) -> None:
        self.domains[MS_DOMAIN] = 1

    def zero(self) -> str:
        return self.g.const("zero_f", np.asarray(0, np.float32))

    def lowest(self) -> str:
        return self.g.const("lowest", np.asarray(LOWEST, np.float32))

    def projections(self) -> tuple[str, str, str]:
        """q [B, S, H*hd], k [B, L, Hkv*hd], v [B, L, Hkv*vhd], biases included, named as the stages; where they are
        bound (Emit.bound), the model's own inputs (a packed one split)."""
        c, g = self.c, self.g
        if self.bound == "separate":
            return "q", "k", "v"
        if self.bound == "packed":
            return tuple(g.op("Split", "qkv", g.ints("qkv_split", [c.q_dim, c.kv_q_dim, c.kv_v_dim]), outputs=3,
                              axis=-1))  # fmt: skip
        q = linear(g, "x", self.weights, "q_proj", c.bias, out=g.stage("q"))
        k = linear(g, self.keys_from, self.weights, "k_proj", c.bias, out=g.stage("k"))
        v = linear(g, self.keys_from, self.weights, "v_proj", c.bias, out=g.stage("v"))
        return q, k, v

    def packed_projections(self, qkv: str | None = None) -> tuple[str, str, str]:
        """q, k and v as Emit.projections gives them, from one packed q/k/v MatMul and a Split (packed_projection)
        where q, k and v all project x (or the model's own packed input, split): one GEMM instead of three, the
        weights read in one pass. qkv: the packed projection made already (the buffer form's switch core makes it
        once for both branches), split."""
        if qkv is None:
            if self.c.cross or self.bound == "separate":  # k and v project memory, or the model's q, k, v are bound
                return self.projections()
            qkv = packed_projection(self)
        c, g = self.c, self.g
        g.op("Split", qkv, g.ints("qkv_split", [c.q_dim, c.kv_q_dim, c.kv_v_dim]), outputs=3, axis=-1)
        g.nodes[-1].output[:] = q, k, v = g.stage("q"), g.stage("k"), g.stage("v")
        return q, k, v

    def unbiased_projections(self) -> tuple[str, str, str, str | None]:
        """q, k, v without their biases, and the biases packed [Dq | Dk | Dv] for an op's bias input (None
        without biases): a fused op adds them inside its kernel."""
        c, g = self.c, self.g
        if self.bound != "x":  # bound at the model's own projections, their biases already added
            return (*self.projections(), None)
        # without biases the MatMuls' outputs are the stages q, k, v themselves
        q, k, v = (linear(g, src, self.weights, f"{n}_proj", False, out=None if c.bias else g.stage(n))
                   for n, src in (("q", "x"), ("k", self.keys_from), ("v", self.keys_from)))  # fmt: skip
        if not c.bias:
            return q, k, v, None
        packed = np.concatenate([np.asarray(self.weights[f"{n}_proj.bias"], np.float32) for n in "qkv"])
        return q, k, v, g.const("qkv_proj.bias", packed)

    def packed(self, name: str = "qkv_proj") -> dict[str, np.ndarray]:
        """The q, k and v weights (and biases) packed along the output: [Dq + Dk + Dv, d_model]."""
        out = {f"{name}.weight": np.concatenate([np.asarray(self.weights[f"{n}_proj.weight"], np.float32)
                                                for n in "qkv"])}  # fmt: skip
        if self.c.bias:
            out[f"{name}.bias"] = np.concatenate([np.asarray(self.weights[f"{n}_proj.bias"], np.float32) for n in "qkv"])
        return out

    def scored(self, q: str, k: str) -> tuple[str, str]:
        """q and k after the terms of place "qk": the norms and rotation in the core's operators (Core.term_ops,
        attnx.export._llm.norm_and_rotate), then the terms written in standard ops whatever the core
        (attnx.export.terms.emit_qk: the norm after rope, the temperature)."""
        if set(terms_at(self.c, "qk")) & {"qk_norm", "rope"}:
            q, k = norm_and_rotate(self.g, self.c, self.weights, q, k, self.core.term_ops)
        return emit_qk(self.g, self.c, q, k, self.step)  # the terms after them, in standard ops

    def visible_rows(self, keep: str) -> str:
        """bool [B, S|1, 1]: whether query i of batch b sees some key, from keep int32 [B, L] (1 keeps):
        any key (padding alone) or any key j <= i (causal, S == L), without the [B, S, L] grid."""
        g = self.g
        if self.c.causal:
            seen = g.op("CumSum", keep, g.const("one_i32", np.asarray(1, np.int32)))  # [B, S]: keys j <= i kept
        else:
            seen = g.op("ReduceMax", keep, g.ints("axes_1", [1]), keepdims=1)  # [B, 1]
        return g.op("Unsqueeze", g.op("Cast", seen, to=TensorProto.BOOL), g.ints("axes_2", [2]))

    def zero_hidden(self, z: str, visible: str, squeeze: bool = True) -> str:
        """z with the rows of fully hidden queries set to 0 (the formula's rule, docs/concepts/formula.md),
        named as the stage z. visible: bool [B|1, 1, S, 1] (visibility) or [B, S|1, 1] (squeeze=False)."""
        g = self.g
        row = g.op("Squeeze", visible, g.ints("axes_1b", [1])) if squeeze else visible
        return g.op("Where", row, z, self.zero(), name=g.stage("z"))

    def buffer_span(self) -> BufferSpan:
        """The call's BufferSpan, made once (Emit.span); each token's position is also the graph value
        "position_ids" [B, S] (the rope's cos/sin read it, as the growing form's input: attnx.export._llm)."""
        if self.span is not None:
            return self.span
        g = self.g
        one = g.const("one_i64", np.asarray(1, np.int64))
        seq = g.op("Shape", "x", start=1, end=2)  # [1]
        write = g.op("Add", g.op("Sub", g.op("Cast", "seqlens_k", to=TensorProto.INT64), seq), one)  # [B]
        tokens = g.op("Range", g.const("zero_i64", np.asarray(0, np.int64)), g.op("Squeeze", seq), one)  # [S]
        positions = g.op("Add", g.op("Unsqueeze", write, g.ints("axes_1", [1])), tokens, name="position_ids")  # [B, S]
        total = g.op("Cast", "total_sequence_length", to=TensorProto.INT64)
        keys = g.op("Range", g.const("zero_i64", np.asarray(0, np.int64)), total, one)  # [T]
        self.span = BufferSpan(write, total, g.op("Unsqueeze", positions, g.ints("axes_13", [1, 3])),
                               g.op("Unsqueeze", keys, g.ints("axes_012", [0, 1, 2])))  # fmt: skip
        return self.span

    def cached(self, past: str, new: str, present: str) -> str:
        """What a step's queries are scored against from one cache tensor, [B, heads, T, d]: the growing form's past
        joined before this call's `new` (present, a new tensor); the buffer form's buffer with each row's new tokens
        written at its positions (TensorScatter-24 along the length: present, written in place where present is bound
        to past's memory) and its first total_sequence_length positions read."""
        g = self.g
        if self.form != "buffer":
            return g.op("Concat", past, new, axis=2, name=present)
        span = self.buffer_span()
        g.op("TensorScatter", past, new, span.write, axis=2, name=present)
        end = g.op("Unsqueeze", span.total, g.ints("axis0", [0]))
        return g.op("Slice", present, g.ints("zero1", [0]), end, g.ints("axis2", [2]))


def branches_of(e: Emit, builds: dict[str, Callable[[], str]],
                outputs: tuple[str, ...] = ("present_key", "present_value")) -> dict[str, object]:  # fmt: skip
    """Each build's nodes moved out of the main graph into a branch graph of its own (an If's), its values renamed
    with the build's name (q/grouped-mha, ...), so that no name is made twice; its outputs the value the build
    returns (z), then `outputs` (the caches a branch writes). The constants stay in the main graph, which every
    branch reads; the branches' stages are not the main graph's."""
    g = e.g
    made, main_stages = {}, set(g.stages)
    for core, build in builds.items():
        start = len(g.nodes)
        z = build()
        nodes, g.nodes[start:] = g.nodes[start:], []
        renamed = {out: f"{out}/{core}" for node in nodes for out in node.output if out}
        for node in nodes:
            node.input[:] = [renamed.get(i, i) for i in node.input]
            node.output[:] = [renamed.get(o, o) for o in node.output]
            node.name = f"{node.name}/{core}"
        values = [helper.make_tensor_value_info(renamed[v], TensorProto.FLOAT, None) for v in (z, *outputs)]
        made[core] = helper.make_graph(nodes, core, [], values)
    for name in set(g.stages) - main_stages:
        del g.stages[name]
    return made


Emitter = Callable[[Emit], str]


class BufferSpan(NamedTuple):
    """Where a call of the buffer form sits in each row (docs/concepts/step-forms.md): row b's new tokens at positions
    seqlens_k[b] + 1 - seq .. seqlens_k[b], the keys read the buffer's first total_sequence_length positions."""

    write: str  # int64 [B]: each row's first new position, where TensorScatter writes its new tokens
    total: str  # int64 []: the positions read (total_sequence_length: the longest row's)
    qcol: str  # int64 [B, 1, S, 1]: each query's position (its token index: the form has no padding)
    krow: str  # int64 [1, 1, 1, T]: each key's


def cache_heads(e: Emit, k: str, v: str) -> tuple[str, str]:
    """The keys and values every query is scored against, per head [B, Hkv, T, d]: the cache's and this
    call's (present_key/present_value: growing or buffer, Emit.cached), or this call's alone (full)."""
    c, g = e.c, e.g
    kh, vh = heads(g, k, c.n_kv_heads, c.head_dim, "k"), heads(g, v, c.n_kv_heads, c.v_head_dim, "v")
    if not e.step:
        return kh, vh
    return e.cached("past_key", kh, "present_key"), e.cached("past_value", vh, "present_value")


def packed_projection(e: Emit) -> str:
    """The buffer form's q/k/v projection: one MatMul [d_model, (H + 2 Hkv) * head_dim] that its op splits
    itself, one GEMV reading every projection weight instead of three (at batch 1 a step is a weight read); bound
    (Emit.bound), the model's own packed input, or its q, k, v joined."""
    if e.bound == "packed":
        return "qkv"
    if e.bound == "separate":
        return e.g.op("Concat", "q", "k", "v", axis=-1)
    return linear(e.g, "x", e.packed(), "qkv_proj", e.c.bias)
