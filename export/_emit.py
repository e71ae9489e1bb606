"""Writing an attention layer as an ONNX graph from the registry: one emitter per core, one frame.

    build_model(config, weights, attention, form, dtype) -> onnx.ModelProto

The core is the registry's answer (attnx.model.cores.core_for: the first of the lowering's cores that
computes the config, every reason otherwise), and its emitter (CORE_EMITTERS[core]) writes it between
the projections and the output projection; the frame around it (inputs, the projections, the output
projection, opsets, metadata, names) is the same for every core:

    inputs   x [batch, seq, d_model]; memory [batch, mem_seq, kv_dim] (cross);
             past_key [batch, n_kv_heads, past_seq, head_dim], past_value [.., v_head_dim] (growing);
             key_padding_mask bool [batch, keys] (True hides); position_ids int64 [batch, seq] (rope)
    outputs  y [batch, seq, d_model]; present_key / present_value [batch, n_kv_heads, total_seq, ..]

The buffer form's frame is its own (contract.buffer_form_specs: one fixed-capacity cache bound as
past and present, seqlens_k and total_sequence_length; its q/k/v projection packed into one MatMul).
The forms (docs/concepts/step-forms.md): total_seq = past_seq + seq, query i of a step at token index
past_seq + i and key j at j; the masks are over token index, positions (position_ids) only rotate.

The decomposed full-sequence graph `attnx export` writes is the torch module's export (attnx.export
.export_onnx: the model traced from PyTorch); everything else is written here, and every graph is
checked against the reference when it is exported. The modern-LLM terms are pieces of attnx.export._llm
in each core's own operators. Precision (fp16, int8/int4 projections) is a pass over the float32
graph written here (with_dtype).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper
from onnx_ir.passes.common import ShapeInferencePass

from attnx import __version__
from attnx.errors import ExportError, UsageError
from attnx.export._graph import Graph, heads, linear, named
from attnx.export._llm import alibi_bias, norm_and_rotate, rope_table, visibility
from attnx.export.passes.fp16 import ConvertToFloat16
from attnx.export.passes.quantize import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, QuantizeProjections
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    ATTENTION_KEY,
    CONFIG_KEY,
    DECODE_KEY,
    DEFAULT_OPSET,
    DEFAULT_ROPE_POSITIONS,
    IR_VERSION,
    MAX_OPSET,
    MS_DOMAIN,
    QUANT_KEY,
    ROPE_POSITIONS_KEY,
    buffer_form_specs,
)
from attnx.model.cores import CORES, Core, core_for, form_of
from attnx.model.terms import TERMS

__all__ = ["CORE_EMITTERS", "Emit", "build_model", "graph_opset", "half_precision", "quantize_model", "with_dtype"]

_F = TensorProto.FLOAT
_LOWEST = float(np.finfo(np.float32).min)


def graph_opset(config: AttentionConfig, attention: str, form: str | None = None, buffer_core: str | None = None,
                dtype: str = "fp32") -> int:  # fmt: skip
    """The default-domain opset the graph of `config` in `attention` needs: its core's (23 for the
    opset-23 Attention), 23 for a q/k norm written as RMSNormalization-23 beside a contrib core (ONNX
    Runtime's SimplifiedLayerNormalization is no ONNX op: the checker refuses it), else DEFAULT_OPSET."""
    core = core_for(attention, config, dtype, form, buffer_core)
    needed = max(DEFAULT_OPSET, core.opset if not core.domain else DEFAULT_OPSET)
    if config.qk_norm is not None and core.name != "decomposed":
        needed = max(needed, 23)
    return needed


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
        return self.g.const("lowest", np.asarray(_LOWEST, np.float32))

    def projections(self) -> tuple[str, str, str]:
        """q [B, S, H*hd], k [B, L, Hkv*hd], v [B, L, Hkv*vhd], biases included, named as the stages."""
        c, g = self.c, self.g
        q = linear(g, "x", self.weights, "q_proj", c.bias, out=g.stage("q"))
        k = linear(g, self.keys_from, self.weights, "k_proj", c.bias, out=g.stage("k"))
        v = linear(g, self.keys_from, self.weights, "v_proj", c.bias, out=g.stage("v"))
        return q, k, v

    def unbiased_projections(self) -> tuple[str, str, str, str | None]:
        """q, k, v without their biases, and the biases packed [Dq | Dk | Dv] for an op's bias input (None
        without biases): a fused op adds them inside its kernel."""
        c, g = self.c, self.g
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

    def scored(self, q: str, k: str, style: str) -> tuple[str, str]:
        """q and k after their norms and rotation (the terms of place "qk"), in `style`'s operators
        (attnx.export._llm.norm_and_rotate: decomposed, onnx, ort-fused)."""
        if self.c.qk_norm is None and self.c.rope is None:
            return q, k
        return norm_and_rotate(self.g, self.c, self.weights, q, k, style)

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


Emitter = Callable[[Emit], str]
# {core: the function that writes it and returns z [B, S, H*vhd]}, one per core of the registry.
CORE_EMITTERS: dict[str, Emitter] = {}


def emitter(name: str) -> Callable[[Emitter], Emitter]:
    """Register the emitter of the registry's core `name`."""

    def register(fn: Emitter) -> Emitter:
        if name not in CORES:
            raise ValueError(f"no core {name!r} in the registry (attnx.model.cores)")
        CORE_EMITTERS[name] = fn
        return fn

    return register


def _cache_heads(e: Emit, k: str, v: str) -> tuple[str, str]:
    """The keys and values every query is scored against, per head [B, Hkv, T, d]: the cache's and this
    call's (present_key/present_value, growing), or this call's alone (full)."""
    c, g = e.c, e.g
    kh, vh = heads(g, k, c.n_kv_heads, c.head_dim, "k"), heads(g, v, c.n_kv_heads, c.v_head_dim, "v")
    if not e.step:
        return kh, vh
    return (g.op("Concat", "past_key", kh, axis=2, name="present_key"),
            g.op("Concat", "past_value", vh, axis=2, name="present_value"))  # fmt: skip


@emitter("decomposed")
def _decomposed(e: Emit) -> str:
    """MatMul, Softmax, MatMul. Grouped heads without a copy of the keys: the query heads of a group
    stacked along the query axis ([B, Hkv, G*S, hd]) multiply their one key head. softcap as
    Div/Tanh/Mul, the masks as a Where over a boolean grid (token index), sinks as one more logit column
    dropped after the softmax."""
    c, g = e.c, e.g
    H, Hkv, G, hd, vhd = c.n_heads, c.n_kv_heads, c.group_size, c.head_dim, c.v_head_dim
    q, k, v = e.projections()
    q, k = e.scored(q, k, "decomposed")
    present_k, present_v = _cache_heads(e, k, v)
    hidden, visible = visibility(g, c, e.kpm, e.step)
    # q [B, S, H*hd] -> [B, S, Hkv, G, hd] -> [B, Hkv, G, S, hd] -> [B, Hkv, G*S, hd]
    q5 = g.op("Transpose", g.op("Reshape", q, g.ints("q_shape", [0, 0, Hkv, G, hd])), perm=[0, 2, 3, 1, 4])
    qg = g.op("Reshape", q5, g.ints("qg_shape", [0, 0, -1, hd]))
    scores = g.op("MatMul", qg, g.op("Transpose", present_k, perm=[0, 1, 3, 2]))  # [B, Hkv, G*S, T]
    scores = g.op("Mul", scores, g.const("scale", np.asarray(c.softmax_scale, np.float32)))
    if c.softcap is not None:  # c * tanh(s / c), after the scale, before the masks
        cap = g.const("softcap", np.asarray(c.softcap, np.float32))
        scores = g.op("Mul", g.op("Tanh", g.op("Div", scores, cap)), cap)
    if c.alibi:  # slope_h * (j - i), after the softcap, before the masks
        scores = g.op("Reshape", scores, g.ints("bhst", [0, H, -1, 0]))  # [B, H, S, T]
        scores = g.op("Add", scores, alibi_bias(g, c, e.step), name=g.stage("scores", "b h t s"))
    else:
        scores = g.op("Reshape", scores, g.ints("bhst", [0, H, -1, 0]), name=g.stage("scores", "b h t s"))  # [B, H, S, T]
    if hidden is not None:
        scores = g.op("Where", hidden, e.lowest(), scores)
    if c.sinks:
        # One more logit per head, [B, H, S, 1], joins the softmax and is dropped after it (no value).
        sink_shape = g.op("Concat", g.op("Shape", scores, start=0, end=3), g.ints("one1", [1]), axis=0)
        sink = g.op("Expand", g.const("sinks", np.asarray(e.weights["sinks"], np.float32).reshape(1, H, 1, 1)),
                    sink_shape)  # fmt: skip
        p = g.op("Softmax", g.op("Concat", scores, sink, axis=-1), axis=-1)
        p = g.op("Slice", p, g.ints("zero1", [0]), g.ints("minus1", [-1]), g.ints("axes_m1", [-1]),
                 name=g.stage("probs", "b h t s"))  # fmt: skip
    else:
        p = g.op("Softmax", scores, axis=-1, name=g.stage("probs", "b h t s"))
    p = g.op("Reshape", p, g.ints("bkgst", [0, Hkv, -1, 0]))  # [B, Hkv, G*S, T]
    z = g.op("Reshape", g.op("MatMul", p, present_v), g.ints("bhsv", [0, H, -1, vhd]))  # [B, H, S, vhd]
    if visible is not None:
        z = g.op("Where", visible, z, e.zero())  # all-hidden rows: 0
    return g.op("Reshape", g.op("Transpose", z, perm=[0, 2, 1, 3]), g.ints("z_shape", [0, 0, H * vhd]), name=g.stage("z"))


@emitter("attention23")
def _attention23(e: Emit) -> str:
    """The opset-23 Attention op, q/k/v as [B, S, heads*d] (q_num_heads, kv_num_heads), the masks as its
    boolean attn_mask over token index (its causal flag aligns top-left: not a cache's rule, so it is
    used for the causal mask alone of a full sequence, where queries and keys are the same tokens, and
    no [S, T] grid is built), softcap as its attribute (after the scale, before the mask: measured), a
    cache as past_key/past_value."""
    c, g = e.c, e.g
    q, k, v = e.projections()
    q, k = e.scored(q, k, "onnx")
    masks = {t for t in c.terms if TERMS[t].place == "mask"}
    if not e.step and masks == {"causal"} and not c.alibi:
        attrs = {"q_num_heads": c.n_heads, "kv_num_heads": c.n_kv_heads, "scale": c.softmax_scale, "is_causal": 1}
        if c.softcap is not None:
            attrs["softcap"] = c.softcap
        g.op("Attention", q, k, v, name=g.stage("z"), **attrs)  # causal alone hides no row: nothing to zero
        return "z"
    hidden, visible = visibility(g, c, e.kpm, e.step)
    attend = g.op("Not", hidden) if hidden is not None else ""  # [B|1, 1, S, T]: True takes part
    if c.alibi:  # an additive float mask instead: slope_h * (j - i), hidden keys at the lowest value
        bias = alibi_bias(g, c, e.step)  # [1, H, S, T]
        attend = bias if hidden is None else g.op("Where", hidden, e.lowest(), bias)
    attrs = {"q_num_heads": c.n_heads, "kv_num_heads": c.n_kv_heads, "scale": c.softmax_scale}
    if c.softcap is not None:
        attrs["softcap"] = c.softcap
    if e.step:
        z = g.op("Attention", q, k, v, attend, "past_key", "past_value", outputs=3, **attrs)[0]
        g.nodes[-1].output[1:] = ["present_key", "present_value"]
    else:
        z = g.op("Attention", q, k, v, *([attend] if attend else []), **attrs)
    if visible is not None:  # z is what comes out of the zeroing, the op's output before it
        return e.zero_hidden(z, visible)
    g.nodes[-1].output[0] = g.stage("z")
    return "z"


@emitter("mha")
def _mha(e: Emit) -> str:
    """com.microsoft.MultiHeadAttention. Full sequence: the projections without their biases (the op
    adds them, packed [Dq | Dk | Dv]), the causal mask as unidirectional=1, the padding mask as int32
    [B, L] (1 keeps). A step: the new keys/values with past_key/past_value. The op averages a fully
    hidden row: it is set to 0 after, as the formula says."""
    c, g = e.c, e.g
    e.ms()
    attrs = {"num_heads": c.n_heads, "scale": c.softmax_scale, "mask_filter_value": e.fill}
    if c.causal:
        attrs["unidirectional"] = 1
    keep = g.op("Cast", g.op("Not", e.kpm), to=TensorProto.INT32) if e.kpm else ""  # [B, L], 1 keeps
    bias = alibi_bias(g, c, e.step) if c.alibi else ""  # attention_bias [1, H, S, T]: ALiBi
    if e.step:
        q, k, v = e.projections()
        z = g.op("MultiHeadAttention", q, k, v, "", keep, bias, "past_key", "past_value", outputs=3, domain=MS_DOMAIN,
                 **attrs)[0]  # fmt: skip
        g.nodes[-1].output[1:] = ["present_key", "present_value"]
        if e.kpm:
            return e.zero_hidden(z, visibility(g, c, e.kpm, e.step)[1])
    else:
        q, k, v, qkv_bias = e.unbiased_projections()
        inputs = [q, k, v, qkv_bias or "", keep, bias]
        while inputs[-1] == "":
            inputs.pop()
        z = g.op("MultiHeadAttention", *inputs, domain=MS_DOMAIN, **attrs)
        if e.kpm:
            return e.zero_hidden(z, e.visible_rows(keep), squeeze=False)
    g.nodes[-1].output[0] = g.stage("z")
    return "z"


@emitter("mha-packed")
def _mha_packed(e: Emit) -> str:
    """com.microsoft.MultiHeadAttention fed by one packed q/k/v MatMul and a Split: one GEMM instead of
    three (self-attention: q, k and v project the same x); the biases added inside the op."""
    c, g = e.c, e.g
    e.ms()
    packed = e.packed()
    qkv = linear(g, "x", {"qkv_proj.weight": packed["qkv_proj.weight"]}, "qkv_proj", False)
    q, k, v = g.op("Split", qkv, g.ints("qkv_split", [c.q_dim, c.kv_q_dim, c.kv_v_dim]), outputs=3, axis=-1)
    if not c.bias:  # without biases the Split's outputs are the stages q, k, v themselves
        g.nodes[-1].output[:] = q, k, v = g.stage("q"), g.stage("k"), g.stage("v")
    attrs = {"num_heads": c.n_heads, "scale": c.softmax_scale, "mask_filter_value": e.fill}
    if c.causal:
        attrs["unidirectional"] = 1
    keep = g.op("Cast", g.op("Not", e.kpm), to=TensorProto.INT32) if e.kpm else ""
    bias = g.const("qkv_proj.bias", packed["qkv_proj.bias"]) if c.bias else ""
    inputs = [q, k, v, bias, keep, alibi_bias(g, c, False) if c.alibi else ""]
    while inputs[-1] == "":
        inputs.pop()
    z = g.op("MultiHeadAttention", *inputs, domain=MS_DOMAIN, **attrs)
    if e.kpm:
        return e.zero_hidden(z, e.visible_rows(keep), squeeze=False)
    g.nodes[-1].output[0] = g.stage("z")
    return "z"


@emitter("ms-attention")
def _ms_attention(e: Emit) -> str:
    """com.microsoft.Attention: x and the packed q/k/v weights [d_model, Dq + Dk + Dv] (qkv_hidden_sizes)
    and bias (zeros without biases: the op requires one), the projection inside the op; the padding mask
    as mask_index int32 [B, L] (1 keeps), the causal mask as unidirectional=1."""
    c, g = e.c, e.g
    e.ms()
    packed = e.packed()
    w = g.const("qkv_proj.weight.T", np.ascontiguousarray(packed["qkv_proj.weight"].T))
    bias = packed.get("qkv_proj.bias", np.zeros(c.q_dim + c.kv_q_dim + c.kv_v_dim, np.float32))
    attrs = {"num_heads": c.n_heads, "scale": c.softmax_scale, "mask_filter_value": e.fill,
             "qkv_hidden_sizes": [c.q_dim, c.kv_q_dim, c.kv_v_dim]}  # fmt: skip
    if c.causal:
        attrs["unidirectional"] = 1
    keep = g.op("Cast", g.op("Not", e.kpm), to=TensorProto.INT32) if e.kpm else None
    z = g.op("Attention", "x", w, g.const("qkv_proj.bias", bias), *([keep] if keep else []), domain=MS_DOMAIN,
             **attrs)  # fmt: skip
    if keep:
        return e.zero_hidden(z, e.visible_rows(keep), squeeze=False)
    g.nodes[-1].output[0] = g.stage("z")
    return "z"


def _gqa_attrs(c: AttentionConfig) -> dict[str, object]:
    """GroupQueryAttention's attributes for `c`: heads, scale, and the modern-LLM terms it runs itself.
    local_window_size W is attnx's window: the op shows key j to query p iff p - W < j <= p (measured
    against both conventions: measurements/facts.md)."""
    attrs: dict[str, object] = {"num_heads": c.n_heads, "kv_num_heads": c.n_kv_heads, "scale": c.softmax_scale}
    if not c.causal:
        attrs["causal"] = 0
    if c.sliding_window is not None:
        attrs["local_window_size"] = c.sliding_window
    if c.softcap is not None:
        attrs["softcap"] = c.softcap
    return attrs


@emitter("gqa")
def _gqa(e: Emit) -> str:
    """com.microsoft.GroupQueryAttention: kv_num_heads, softcap, local_window_size and head_sink as its
    own; q/k norms and rope as their own nodes (the op's rotation, do_rotary, reads only position_ids[0, 0]
    of a prompt for every row (measured on a left-padded batch: measurements/facts.md), so it cannot take Hugging
    Face's per-row positions). seqlens_k says every row is as long as the cache: left padding is an
    additive attention_bias (the op adds it after its softcap: measured), so the op's token index is
    attnx's, and so is its window. The buffer form: _gqa_buffer."""
    if e.form == "buffer":
        return _gqa_buffer(e)
    c, g = e.c, e.g
    e.ms()
    q, k, v = e.projections()
    q, k = e.scored(q, k, "ort-fused")
    seq = g.op("Shape", "x", start=1, end=2)  # [1]
    batch = g.op("Shape", "x", start=0, end=1)
    total = g.op("Add", g.op("Shape", "past_key", start=2, end=3), seq) if e.step else seq  # [1] int64
    total32 = g.op("Cast", g.op("Squeeze", total, g.ints("axis0", [0])), to=TensorProto.INT32)
    seqlens = g.op("Expand", g.op("Sub", g.op("Cast", total, to=TensorProto.INT32),
                                  g.const("one_i32_1", np.asarray([1], np.int32))), batch)  # fmt: skip
    inputs = [q, k, v, "past_key" if e.step else "", "past_value" if e.step else "", seqlens, total32, "", "", "", "", ""]
    if e.kpm:  # an additive bias [B, 1, S, T], lowest where the key is padding
        bias = g.op("Where", g.op("Unsqueeze", e.kpm, g.ints("axes_12", [1, 2])), e.lowest(), e.zero())
        inputs[10] = g.op("Expand", bias, g.op("Concat", batch, g.ints("one1", [1]), seq, total, axis=0))
    if c.alibi:  # slope_h * (j - i) [1, H, S, T] in the same bias (the op adds it after its softcap)
        alibi = alibi_bias(g, c, e.step)
        inputs[10] = g.op("Add", inputs[10], alibi) if inputs[10] else alibi
    if c.sinks:  # head_sink: a logit per head in the softmax's denominator (measured: exp(sink))
        inputs[11] = g.const("sinks", np.asarray(e.weights["sinks"], np.float32))
    while inputs[-1] == "":
        inputs.pop()
    z = g.op("GroupQueryAttention", *inputs, outputs=3, domain=MS_DOMAIN, **_gqa_attrs(c))[0]
    gqa = g.nodes[-1]
    if e.step:
        gqa.output[1:] = ["present_key", "present_value"]
    if e.kpm:
        return e.zero_hidden(z, visibility(g, c, e.kpm, e.step)[1])
    gqa.output[0] = g.stage("z")
    return "z"


def _gqa_buffer(e: Emit, qkv: str | None = None) -> str:
    """z of the buffer form by GroupQueryAttention on the shared cache (seqlens_k: it writes the new
    keys/values at their positions, in place), rotating q and k itself (do_rotary) from a table of
    `rope_positions` rows (recorded in the metadata), each token at its token index: the buffer form has
    no padding, so that is its position. A position past the table is the op's error, never a number."""
    c, g = e.c, e.g
    e.ms()
    H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
    qkv = qkv or _packed_projection(e)
    qkv_inputs = [qkv, "", ""]
    if c.qk_norm is not None:  # the norms need q and k apart: split the packed projection
        g.op("Split", qkv, g.ints("qkv_split", [H * hd, Hkv * hd, Hkv * hd]), outputs=3, axis=-1)
        g.nodes[-1].output[:] = q, k, v = g.stage("q"), g.stage("k"), g.stage("v")
        q, k = norm_and_rotate(g, dataclasses.replace(c, rope=None), e.weights, q, k, "ort-fused")  # the op rotates
        qkv_inputs = [q, k, v]
    inputs = [*qkv_inputs, "past_key", "past_value", "seqlens_k", "total_sequence_length", "", "", "", "", ""]
    attrs = _gqa_attrs(c)
    if c.rope is not None:
        positions = DEFAULT_ROPE_POSITIONS if e.rope_positions is None else e.rope_positions
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
            raise UsageError(f"rope_positions must be a positive integer, got {positions!r}")
        cos, sin = rope_table(c, positions)
        inputs[7], inputs[8] = g.const("rope_cos_cache", cos), g.const("rope_sin_cache", sin)
        attrs.update(do_rotary=1, rotary_interleaved=int(c.rope.interleaved))
        if (ROPE_POSITIONS_KEY, str(positions)) not in e.metadata:
            e.metadata.append((ROPE_POSITIONS_KEY, str(positions)))
    if c.sinks:
        inputs[11] = g.const("sinks", np.asarray(e.weights["sinks"], np.float32))
    while inputs[-1] == "":
        inputs.pop()
    g.op("GroupQueryAttention", *inputs, outputs=3, domain=MS_DOMAIN, **attrs)
    g.nodes[-1].output[:] = [z := g.stage("z"), "present_key", "present_value"]
    return z


def _packed_projection(e: Emit) -> str:
    """The buffer form's q/k/v projection: one MatMul [d_model, (H + 2 Hkv) * head_dim] that its op splits
    itself, one GEMV reading every projection weight instead of three (at batch 1 a step is a weight read)."""
    return linear(e.g, "x", e.packed(), "qkv_proj", e.c.bias)


@emitter("grouped-mha")
def _grouped_mha(e: Emit, qkv: str | None = None) -> str:
    """z of the buffer form by com.microsoft.MultiHeadAttention over the shared cache (past_sequence_length:
    it writes the new keys/values at their positions, in place), the query heads of a group stacked as
    rows: row s*G + j of head n holds query head n*G + j of token s, so that the op reads each key/value
    head once for its whole group. The mask over tokens (causal, a sliding window: visibility, the
    decomposed form's) repeated for a token's G rows is an additive attention_bias [1, 1, S*G, total];
    q/k norms and rope are their own nodes (at the token index: the buffer form has no padding)."""
    c, g = e.c, e.g
    e.ms()
    H, Hkv, G, hd = c.n_heads, c.n_kv_heads, c.group_size, c.head_dim
    qkv = qkv or _packed_projection(e)
    g.op("Split", qkv, g.ints("qkv_split", [H * hd, Hkv * hd, Hkv * hd]), outputs=3, axis=-1)
    g.nodes[-1].output[:] = q, k, v = g.stage("q"), g.stage("k"), g.stage("v")
    axis0 = g.ints("axis0", [0])
    shape = g.op("Shape", "x")
    seq = g.op("Squeeze", g.op("Slice", shape, g.ints("d1", [1]), g.ints("d2", [2])), axis0)
    total = g.op("Cast", "total_sequence_length", to=TensorProto.INT64)
    past = g.op("Sub", total, seq)  # positions filled before this call
    if c.qk_norm is not None or c.rope is not None:
        tokens = g.op("Range", past, total, g.const("one_i64", np.asarray(1, np.int64)))  # [S]: their positions
        batch = g.op("Slice", shape, g.ints("d0", [0]), g.ints("d1", [1]))
        g.op("Expand", g.op("Unsqueeze", tokens, axis0), g.op("Concat", batch, g.op("Unsqueeze", seq, axis0), axis=0),
             name="position_ids")  # fmt: skip
        q, k = norm_and_rotate(g, c, e.weights, q, k, "ort-fused")
    rows = g.op("Transpose", g.op("Reshape", q, g.ints("q_groups", [0, 0, Hkv, G, hd])), perm=[0, 1, 3, 2, 4])
    rows = g.op("Reshape", rows, g.ints("q_rows", [0, -1, Hkv * hd]))  # [B, S*G, Hkv*hd]
    hidden, _ = visibility(g, c, None, True, span=(past, total))  # [1, 1, S, total]: a step model is causal
    hidden = g.op("Expand", g.op("Unsqueeze", hidden, g.ints("axis3", [3])), g.ints("group_rows", [1, 1, 1, G, 1]))
    hidden = g.op("Reshape", hidden, g.op("Concat", g.ints("rows_shape", [1, 1, -1]), g.op("Unsqueeze", total, axis0),
                                          axis=0))  # [1, 1, S*G, total]: row s*G + j as token s  # fmt: skip
    bias = g.op("Where", hidden, g.const("lowest_f", np.asarray(_LOWEST, np.float32)), e.zero())
    past32 = g.op("Reshape", g.op("Cast", past, to=TensorProto.INT32), g.ints("one_d", [1]))
    out = g.op("MultiHeadAttention", rows, k, v, "", "", bias, "past_key", "past_value", past32, outputs=3,
               domain=MS_DOMAIN, num_heads=Hkv, scale=c.softmax_scale)  # fmt: skip
    g.nodes[-1].output[1:] = ["present_key", "present_value"]
    z = g.op("Transpose", g.op("Reshape", out[0], g.ints("z_groups", [0, -1, G, Hkv, hd])), perm=[0, 1, 3, 2, 4])
    return g.op("Reshape", z, g.ints("z_heads", [0, 0, H * hd]), name=g.stage("z"))


@emitter("auto")
def _auto(e: Emit) -> str:
    """z of the buffer form's auto core: an If on the call's token count, the grouped core for one
    token, GroupQueryAttention's for more; the faster of the two for each on the CPU (docs/concepts/step-forms.md, "The buffer form"). Each branch writes the shared cache in place as its op does alone: ONNX Runtime
    hands the If's outputs, bound to the cache, to the branch's op. A branch's values carry its core's
    name (q/grouped-mha, ...), so that no name is made twice; the constants stay in the main graph,
    which both branches read."""
    g = e.g
    qkv = _packed_projection(e)
    branches, main_stages = {}, set(g.stages)
    for core, build in (("grouped-mha", _grouped_mha), ("gqa", _gqa_buffer)):
        start = len(g.nodes)
        z = build(e, qkv)
        nodes, g.nodes[start:] = g.nodes[start:], []
        renamed = {out: f"{out}/{core}" for node in nodes for out in node.output if out}
        for node in nodes:
            node.input[:] = [renamed.get(i, i) for i in node.input]
            node.output[:] = [renamed.get(o, o) for o in node.output]
            node.name = f"{node.name}/{core}"
        outputs = [helper.make_tensor_value_info(renamed[v], _F, None) for v in (z, "present_key", "present_value")]
        branches[core] = helper.make_graph(nodes, core, [], outputs)
    for name in set(g.stages) - main_stages:  # the branches' stages are not the main graph's
        del g.stages[name]
    tokens = g.op("Shape", "x", start=1, end=2)  # [1]: the call's token count
    one_token = g.op("Squeeze", g.op("Equal", tokens, g.ints("one_token", [1])), g.ints("axis0", [0]))
    g.op("If", one_token, outputs=3, then_branch=branches["grouped-mha"], else_branch=branches["gqa"])
    g.nodes[-1].output[:] = [z := g.stage("z"), "present_key", "present_value"]
    return z


def build_model(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    attention: str = "decomposed",
    form: str | None = None,
    dtype: str = "fp32",
    *,
    buffer_core: str | None = None,
    opset: int | None = None,
    rope_positions: int | None = None,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    keep_io_fp32: bool = False,
    readable: bool = True,
) -> onnx.ModelProto:
    """The graph of `config` with `weights` in the lowering `attention` (its core: the registry's
    core_for, refused with every reason before anything is written), in `form` (None: the config's own,
    full or growing; "buffer": the buffer form, with `buffer_core`) and `dtype` (fp16: the whole graph,
    with_dtype; int8/int4: its projections quantized). opset: the default domain's (None: what the core
    needs, graph_opset; below it is refused). rope_positions: the rows of the buffer form's cos/sin table.
    keep_io_fp32: an fp16 graph with float32 inputs and outputs, cast at the boundary (not for a step
    model: its cache would be a cast, not the buffer it is written into). readable=False names the stages
    alone (a graph no person reads: localisation's look inside)."""
    c = config
    form = form_of(c, form)
    core = core_for(attention, c, dtype, form, buffer_core)
    needed = graph_opset(c, attention, form, buffer_core, dtype)
    if opset is not None and not needed <= opset <= MAX_OPSET:
        raise UsageError(f"--opset {opset} is outside what the {core.label} graph of this config is written at "
                         f"({needed} to {MAX_OPSET})")  # fmt: skip
    if keep_io_fp32 and form != "full":
        raise UsageError("--keep-io-fp32 is for a full-sequence model: a step model's cache is the buffer itself")
    e = Emit(Graph(), c, weights, form, core, attention, half=dtype == "fp16", rope_positions=rope_positions,
             readable=readable, domains={"": opset or needed})  # fmt: skip
    z = CORE_EMITTERS[core.name](e)
    linear(e.g, z, weights, "out_proj", c.bias, out="y")
    model = _frame(e)
    return with_dtype(model, dtype, block_size, accuracy_level, keep_io_fp32)


def _frame(e: Emit) -> onnx.ModelProto:
    """The model around the graph `e` wrote: the contract's inputs and outputs, opsets, metadata, names."""
    c = e.c
    elem = {"fp32": _F, "bool": TensorProto.BOOL, "int64": TensorProto.INT64, "int32": TensorProto.INT32}
    if e.form == "buffer":
        specs_in, specs_out = buffer_form_specs(c)
    else:
        specs_in, specs_out = c.inputs(), c.outputs()
    inputs = [helper.make_tensor_value_info(s.name, elem[s.dtype], list(s.shape)) for s in specs_in]
    outputs = [helper.make_tensor_value_info(s.name, elem[s.dtype], list(s.shape)) for s in specs_out]
    name = {"full": "attnx", "growing": "attnx_step", "buffer": "attnx_step_buffer"}[e.form]
    graph = helper.make_graph(e.g.nodes, name, inputs, outputs, e.g.inits)
    opsets = [helper.make_opsetid(domain, version) for domain, version in e.domains.items()]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="attnx",
                              producer_version=__version__)  # fmt: skip
    meta = [(CONFIG_KEY, c.to_json()), (ATTENTION_KEY, e.attention)]
    if e.form != "full":
        meta.append((DECODE_KEY, e.form))
    for key, value in meta + e.metadata:
        model.metadata_props.add(key=key, value=value)
    return named(model, e.g, e.readable)


def with_dtype(model: onnx.ModelProto, dtype: str, block_size: int | None = None,
               accuracy_level: int | None = None, keep_io_fp32: bool = False) -> onnx.ModelProto:  # fmt: skip
    """A float32 graph written here in `dtype`: fp32 as it is, fp16 by half_precision (a step model's
    cache too), int8/int4 by quantize_model."""
    if dtype == "fp32":
        return model
    if dtype == "fp16":
        return half_precision(model, keep_io_fp32)[0]
    return quantize_model(model, dtype, block_size, accuracy_level)


def half_precision(model: onnx.ModelProto, keep_io_fp32: bool = False) -> tuple[onnx.ModelProto, list[str]]:
    """A float32 graph in float16 by the exporter's pass, ConvertToFloat16 (its rotary angle kept
    float32: attnx.export.passes.fp16), and the pass's notes. The graph declares the types of its inputs
    and outputs only: onnx's shape inference types the rest first (the pass reads them)."""
    irm = ir.from_proto(model)
    ShapeInferencePass()(irm)
    convert = ConvertToFloat16(keep_io_fp32=keep_io_fp32)
    convert(irm)
    out = ir.to_proto(irm)
    out.ir_version = IR_VERSION
    return out, convert.notes


def quantize_model(model: onnx.ModelProto, dtype: str, block_size: int | None = None,
                   accuracy_level: int | None = None) -> onnx.ModelProto:  # fmt: skip
    """The float32 graph `model` with its projections (q, k, v and out, or the packed q/k/v and out)
    quantized to `dtype` by QuantizeProjections; a projection the pass does not find is an error."""
    qpass = QuantizeProjections(
        dtype,
        DEFAULT_BLOCK_SIZE if block_size is None else block_size,
        DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level,
    )
    irm = ir.from_proto(model)
    qpass(irm)
    roles = set(json.loads(irm.metadata_props[QUANT_KEY])["projections"]) if QUANT_KEY in irm.metadata_props else set()
    packed = any(t.name == "qkv_proj.weight.T" for t in model.graph.initializer)
    expected = {"qkv", "out"} if packed else {"q", "k", "v", "out"}
    if roles != expected:  # e.g. a projection the pass did not recognise, filed under "out"
        raise ExportError(f"quantizing the model found projections {sorted(roles)}, expected {sorted(expected)}")
    out = ir.to_proto(irm)
    out.ir_version = IR_VERSION
    return out


# The forms by name, for the callers that build one of them ------------------------------------------
def build_step_model(config: AttentionConfig, weights: Mapping[str, np.ndarray], attention: str = "decomposed",
                     form: str = "growing", dtype: str = "fp32", block_size: int | None = None,
                     accuracy_level: int | None = None, rope_positions: int | None = None,
                     buffer_core: str | None = None) -> onnx.ModelProto:  # fmt: skip
    """The step model of `config` (kv_cache true) in `form` (growing, buffer): build_model."""
    if not config.kv_cache:
        raise UsageError("the step model is for configs with 'kv_cache': true")
    return build_model(config, weights, attention, form, dtype, buffer_core=buffer_core, rope_positions=rope_positions,
                       block_size=block_size, accuracy_level=accuracy_level)  # fmt: skip


def build_decomposed_model(config: AttentionConfig, weights: Mapping[str, np.ndarray], dtype: str = "fp32",
                           block_size: int | None = None, accuracy_level: int | None = None,
                           readable: bool = True) -> onnx.ModelProto:  # fmt: skip
    """The decomposed form of `config` written here, without torch (a step model's growing form for a
    kv_cache config): what localisation runs to look inside a fused operator (attnx.runtimes.localise);
    the full-sequence form `attnx export` writes is the torch module's export (attnx.export.export_onnx)."""
    return build_model(config, weights, "decomposed", None, dtype, block_size=block_size,
                       accuracy_level=accuracy_level, readable=readable)  # fmt: skip
