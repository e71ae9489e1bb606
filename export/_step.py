"""The step model (config.kv_cache): one decode step of the attention layer, built as an ONNX graph.

    inputs   x [batch, seq, d_model]
             past_key [batch, n_kv_heads, past_seq, head_dim], past_value [.., v_head_dim]
             key_padding_mask bool [batch, total_seq]   (config.key_padding_mask; True hides)
             position_ids int64 [batch, seq]             (config.rope: the new tokens' positions)
    outputs  y [batch, seq, d_model], present_key / present_value [batch, n_kv_heads, total_seq, ..]

total_seq = past_seq + seq; query i of the step sits at position past_seq + i and key j at
position j, and the causal mask is over positions (README, "Decoding"). past_seq = 0 is the
prefill: the same model serves prefill and decode.

The graph is written here node by node rather than traced from the torch module: the
exporter has no form of the opset-23 Attention op or of ORT's contrib ops with a cache, and
the concatenation of the cache is the point of the graph. The torch module and the numpy
reference compute the same step (model/module.py, model/reference.py); the step parity
(attnx.runtimes.decode) checks this graph against the reference, step by step.

Lowerings (contract.STEP_LOWERINGS):
- decomposed: Concat the new keys/values onto the cache, MatMul, Softmax, MatMul. The modern-LLM
  terms (README, "Modern LLM attention") are written here only: q/k RMSNorm and rope before the
  cache (it holds the keys as scored), softcap, the window in the mask over token index, a sink
  logit per head concatenated to the scores and dropped after the softmax. Grouped
  heads without a copy of the cache: the query heads of a group are stacked along the query
  axis ([batch, n_kv_heads, group*seq, head_dim]) and multiply their one key head.
- onnx: the opset-23 Attention op, with past_key/past_value and q_num_heads/kv_num_heads.
- ort-fused: com.microsoft MultiHeadAttention with past_key/past_value when every query head has
  its own key/value head (measured faster than GroupQueryAttention's growing cache: large preset,
  past 2048/8192, core alone 2.0/8.6 ms against 2.7/9.7 ms), else com.microsoft
  GroupQueryAttention (grouped heads natively; left padding as an additive attention_bias).
  The buffer form is GroupQueryAttention for every config: on one shared buffer it measured
  0.86/2.7 ms against MultiHeadAttention's 1.4/4.2 ms (past_sequence_length).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

from attnx import __version__
from attnx.errors import ExportError, UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    ATTENTION_KEY,
    CONFIG_KEY,
    DECODE_FORMS,
    DECODE_KEY,
    IR_VERSION,
    MS_DOMAIN,
    QUANT_KEY,
    buffer_form_specs,
    check_choice,
    check_lowering,
)
from attnx.model.rope import rope_frequencies

__all__ = ["build_step_model"]

_F = TensorProto.FLOAT


class _Graph:
    """A tiny builder: nodes, initializers and unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", name: str | None = None,
           **attrs) -> str | list[str]:  # fmt: skip
        self.n += 1
        outs = [name] if name and outputs == 1 else [f"{op_type.lower()}_{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self.n}", domain=domain,
                                           **attrs))  # fmt: skip
        return outs[0] if outputs == 1 else outs

    def const(self, name: str, value: np.ndarray) -> str:
        if any(t.name == name for t in self.inits):  # one initializer per name
            return name
        self.inits.append(helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape,
                                             value.tobytes(), raw=True))  # fmt: skip
        return name

    def ints(self, name: str, values: list[int]) -> str:
        return self.const(name, np.asarray(values, dtype=np.int64))


def _linear(g: _Graph, x: str, weights: Mapping[str, np.ndarray], name: str, bias: bool, out: str | None = None) -> str:
    w = g.const(f"{name}.weight_t", np.ascontiguousarray(np.asarray(weights[f"{name}.weight"], np.float32).T))
    y = g.op("MatMul", x, w, name=None if bias else out)
    if bias:
        y = g.op("Add", y, g.const(f"{name}.bias", np.asarray(weights[f"{name}.bias"], np.float32)), name=out)
    return y


def _heads(g: _Graph, x: str, n: int, d: str, label: str) -> str:
    """[B, S, n*d] -> [B, n, S, d]."""
    return g.op("Transpose", g.op("Reshape", x, g.ints(f"{label}_shape", [0, 0, n, int(d)])), perm=[0, 2, 1, 3])


def _positions(g: _Graph, c: AttentionConfig, kpm: str | None) -> tuple[str, str, str, str]:
    """(hidden bool [B|1, 1, S, T], visible-rows bool [B|1, 1, S, 1], past_seq, total_seq as
    int64 scalars): key j hidden from query i when j > past_seq + i or key_padding_mask[b, j]."""
    zero = g.const("zero_i64", np.asarray(0, np.int64))
    one = g.const("one_i64", np.asarray(1, np.int64))
    past = g.op("Squeeze", g.op("Shape", "past_key", start=2, end=3), g.ints("axis0", [0]))  # scalar P
    seq = g.op("Squeeze", g.op("Shape", "x", start=1, end=2), g.ints("axis0b", [0]))  # scalar S
    total = g.op("Add", past, seq)  # scalar T
    qpos = g.op("Range", past, total, one)  # [S]: positions of this step's queries
    kpos = g.op("Range", zero, total, one)  # [T]: positions of every key
    krow, qcol = g.op("Unsqueeze", kpos, g.ints("axes_0", [0])), g.op("Unsqueeze", qpos, g.ints("axes_1", [1]))
    hidden = g.op("Greater", krow, qcol)  # [S, T]: key j after query i
    if c.sliding_window is not None:  # outside the window: j <= i - W (over token index)
        start = g.op("Sub", qcol, g.const("window_i64", np.asarray(c.sliding_window, np.int64)))
        hidden = g.op("Or", hidden, g.op("LessOrEqual", krow, start))
    hidden = g.op("Unsqueeze", hidden, g.ints("axes_01", [0, 1]))  # [1, 1, S, T]
    if kpm is not None:
        hidden = g.op("Or", hidden, g.op("Unsqueeze", kpm, g.ints("axes_12", [1, 2])))  # [B, 1, S, T]
    seen = g.op("ReduceMax", g.op("Cast", g.op("Not", hidden), to=TensorProto.INT32), g.ints("axes_last", [-1]),
                keepdims=1)  # fmt: skip
    visible = g.op("Cast", seen, to=TensorProto.BOOL)  # [B|1, 1, S, 1]: some key visible to the query
    return hidden, visible, past, total


def _norm_and_rotate(
    g: _Graph, c: AttentionConfig, weights: Mapping[str, np.ndarray], q: str, k: str
) -> tuple[str, str]:
    """q [B, S, H*hd] and k [B, S, Hkv*hd] after qk_norm (RMSNorm over each head's head_dim) and rope
    (pair i turned by position_ids * inv_freq_i, from the rope table; the angle in float32)."""
    H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
    q4 = g.op("Reshape", q, g.ints("q4_shape", [0, 0, H, hd]))  # [B, S, H, hd]
    k4 = g.op("Reshape", k, g.ints("k4_shape", [0, 0, Hkv, hd]))  # [B, S, Hkv, hd]
    if c.qk_norm is not None:
        eps = g.const("qk_norm_eps", np.asarray(c.qk_norm.eps, np.float32))

        def rms_norm(u: str, name: str) -> str:
            mean_sq = g.op("ReduceMean", g.op("Mul", u, u), g.ints("axes_last", [-1]), keepdims=1)
            normed = g.op("Div", u, g.op("Sqrt", g.op("Add", mean_sq, eps)))
            return g.op("Mul", normed, g.const(f"{name}.weight", np.asarray(weights[f"{name}.weight"], np.float32)))

        q4, k4 = rms_norm(q4, "q_norm"), rms_norm(k4, "k_norm")
    if c.rope is not None:
        cos, sin = _rope_cos_sin(g, c)  # [B, S, 1, dim/2]
        q4, k4 = _rotate(g, c, q4, cos, sin, "q"), _rotate(g, c, k4, cos, sin, "k")
    return (g.op("Reshape", q4, g.ints("q_flat", [0, 0, H * hd])),
            g.op("Reshape", k4, g.ints("k_flat", [0, 0, Hkv * hd])))  # fmt: skip


def _rope_cos_sin(g: _Graph, c: AttentionConfig) -> tuple[str, str]:
    """cos and sin of position_ids * inv_freq times attention_factor, [B, S, 1, dim/2] float32
    (longrope: its long set for the whole call once max(position_ids) + 1 > the original length)."""
    short, factor = rope_frequencies(c.rope)
    inv_freq = g.const("rope_inv_freq", short.astype(np.float32))
    if c.rope.rope_type == "longrope":
        original = c.rope.scaling["original_max_position_embeddings"]
        long = rope_frequencies(c.rope, original + 1)[0]
        largest = g.op("ReduceMax", "position_ids", keepdims=0)  # scalar: the call's largest position
        switch = g.op("Greater", largest, g.const("rope_original_minus1", np.asarray(original - 1, np.int64)))
        inv_freq = g.op("Where", switch, g.const("rope_inv_freq_long", long.astype(np.float32)), inv_freq)
    positions = g.op("Unsqueeze", g.op("Cast", "position_ids", to=_F), g.ints("axes_2_3", [2, 3]))  # [B, S, 1, 1]
    angle = g.op("Mul", positions, inv_freq)  # [B, S, 1, dim/2]
    f = g.const("rope_attention_factor", np.asarray(factor, np.float32))
    return g.op("Mul", g.op("Cos", angle), f), g.op("Mul", g.op("Sin", angle), f)


def _rotate(g: _Graph, c: AttentionConfig, u: str, cos: str, sin: str, label: str) -> str:
    """u [B, S, heads, hd] with pair i of its first rope.dim dims turned by angle i; the rest pass."""
    dim, hd = c.rope.dim, c.head_dim
    last = g.ints("axes_m1", [-1])

    def part(start: int, end: int, step: int = 1) -> str:
        bounds = g.ints(f"s{start}", [start]), g.ints(f"e{end}", [end])
        return g.op("Slice", u, *bounds, last, g.ints(f"st{step}", [step]))

    if c.rope.interleaved:  # pairs (2i, 2i + 1): turned, then woven back [.., dim/2, 2] -> [.., dim]
        a, b = part(0, dim, 2), part(1, dim, 2)
    else:  # pairs (i, i + dim/2)
        a, b = part(0, dim // 2), part(dim // 2, dim)
    a2 = g.op("Sub", g.op("Mul", a, cos), g.op("Mul", b, sin))
    b2 = g.op("Add", g.op("Mul", b, cos), g.op("Mul", a, sin))
    if c.rope.interleaved:
        pairs = g.op("Concat", g.op("Unsqueeze", a2, last), g.op("Unsqueeze", b2, last), axis=-1)
        turned = g.op("Reshape", pairs, g.ints("rot_flat", [0, 0, 0, dim]))
    else:
        turned = g.op("Concat", a2, b2, axis=-1)
    return turned if dim == hd else g.op("Concat", turned, part(dim, hd), axis=-1)


def build_step_model(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    attention: str = "decomposed",
    form: str = "growing",
    dtype: str = "fp32",
    block_size: int | None = None,
    accuracy_level: int | None = None,
) -> onnx.ModelProto:
    """The step model of `config` (kv_cache true) in the lowering `attention`, in the growing-cache
    form or the buffer form (ort-fused only; README, "Decoding": the buffer form). dtype int8/int4
    quantizes its projections (the buffer form's packed q/k/v too) with the full-sequence forms'
    pass, QuantizeProjections, which records the same metadata (contract.QUANT_KEY)."""
    model = _build_float(config, weights, attention, form)
    if dtype == "fp32":
        return model
    return quantize_step_model(model, dtype, block_size, accuracy_level)


def quantize_step_model(model: onnx.ModelProto, dtype: str, block_size: int | None = None,
                        accuracy_level: int | None = None) -> onnx.ModelProto:  # fmt: skip
    """The fp32 step model `model` with its four projections (or the packed q/k/v and out)
    quantized to `dtype` by QuantizeProjections; a projection the pass does not find is an error."""
    import onnx_ir as ir

    from attnx.export.passes.quantize import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, QuantizeProjections

    qpass = QuantizeProjections(
        dtype,
        DEFAULT_BLOCK_SIZE if block_size is None else block_size,
        DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level,
    )
    irm = ir.from_proto(model)
    qpass(irm)
    roles = set(json.loads(irm.metadata_props[QUANT_KEY])["projections"]) if QUANT_KEY in irm.metadata_props else set()
    expected = {"qkv", "out"} if irm.metadata_props.get(DECODE_KEY) == "buffer" else {"q", "k", "v", "out"}
    if roles != expected:  # e.g. a projection the pass did not recognise, filed under "out"
        raise ExportError(f"quantizing the step model found projections {sorted(roles)}, expected {sorted(expected)}")
    out = ir.to_proto(irm)
    out.ir_version = IR_VERSION
    return out


def _build_float(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    attention: str,
    form: str,
) -> onnx.ModelProto:
    c = config
    if not c.kv_cache:
        raise UsageError("the step model is for configs with 'kv_cache': true")
    check_lowering(c, attention, step=True)
    check_choice("decode form", form, DECODE_FORMS)
    if form == "buffer":
        return _buffer_model(c, weights, attention)
    H, Hkv, G, hd, vhd = c.n_heads, c.n_kv_heads, c.group_size, c.head_dim, c.v_head_dim
    g = _Graph()
    kpm = "key_padding_mask" if c.key_padding_mask else None
    q = _linear(g, "x", weights, "q_proj", c.bias)  # [B, S, H*hd]
    k = _linear(g, "x", weights, "k_proj", c.bias)  # [B, S, Hkv*hd]
    v = _linear(g, "x", weights, "v_proj", c.bias)  # [B, S, Hkv*vhd]
    lowest = float(np.finfo(np.float32).min)
    opsets = [helper.make_opsetid("", 18)]
    if attention == "decomposed":
        hidden, visible, _, _ = _positions(g, c, kpm)
        if c.qk_norm is not None or c.rope is not None:  # q and k as they are scored (and cached)
            q, k = _norm_and_rotate(g, c, weights, q, k)
        present_k = g.op("Concat", "past_key", _heads(g, k, Hkv, hd, "k"), axis=2, name="present_key")
        present_v = g.op("Concat", "past_value", _heads(g, v, Hkv, vhd, "v"), axis=2, name="present_value")
        # q [B, S, H*hd] -> [B, S, Hkv, G, hd] -> [B, Hkv, G, S, hd] -> [B, Hkv, G*S, hd]: a group's
        # query heads stacked along the query axis, so each multiplies its one key head (no copy).
        q5 = g.op("Transpose", g.op("Reshape", q, g.ints("q_shape", [0, 0, Hkv, G, hd])), perm=[0, 2, 3, 1, 4])
        qg = g.op("Reshape", q5, g.ints("qg_shape", [0, 0, -1, hd]))
        scores = g.op("MatMul", qg, g.op("Transpose", present_k, perm=[0, 1, 3, 2]))  # [B, Hkv, G*S, T]
        scores = g.op("Mul", scores, g.const("scale", np.asarray(c.softmax_scale, np.float32)))
        if c.softcap is not None:  # c * tanh(s / c), after the scale, before the masks
            cap = g.const("softcap", np.asarray(c.softcap, np.float32))
            scores = g.op("Mul", g.op("Tanh", g.op("Div", scores, cap)), cap)
        scores = g.op("Reshape", scores, g.ints("bhst", [0, H, -1, 0]))  # [B, H, S, T]
        scores = g.op("Where", hidden, g.const("lowest", np.asarray(lowest, np.float32)), scores)
        if c.sinks:
            # One more logit per head, [B, H, S, 1], joins the softmax and is dropped after it (no value).
            sink_shape = g.op("Concat", g.op("Shape", scores, start=0, end=3), g.ints("one1", [1]), axis=0)
            sink = g.op("Expand", g.const("sinks", np.asarray(weights["sinks"], np.float32).reshape(1, H, 1, 1)),
                        sink_shape)  # fmt: skip
            p = g.op("Softmax", g.op("Concat", scores, sink, axis=-1), axis=-1)
            p = g.op("Slice", p, g.ints("zero1", [0]), g.ints("minus1", [-1]), g.ints("axes_m1", [-1]))
        else:
            p = g.op("Softmax", scores, axis=-1)
        p = g.op("Reshape", p, g.ints("bkgst", [0, Hkv, -1, 0]))  # [B, Hkv, G*S, T]
        z = g.op("Reshape", g.op("MatMul", p, present_v), g.ints("bhsv", [0, H, -1, vhd]))  # [B, H, S, vhd]
        z = g.op("Where", visible, z, g.const("zero_f", np.asarray(0, np.float32)))  # all-hidden rows: 0
        z = g.op("Reshape", g.op("Transpose", z, perm=[0, 2, 1, 3]), g.ints("z_shape", [0, 0, H * vhd]))
    elif attention == "onnx":
        hidden, visible, _, _ = _positions(g, c, kpm)
        opsets = [helper.make_opsetid("", 23)]
        # The op's causal flag aligns its mask top-left; the mask over positions is given instead.
        attend = g.op("Not", hidden)  # [B|1, 1, S, T]: True takes part
        z, present_k, present_v = g.op(
            "Attention", q, k, v, attend, "past_key", "past_value", outputs=3,
            q_num_heads=H, kv_num_heads=Hkv, scale=c.softmax_scale,
        )  # fmt: skip
        g.nodes[-1].output[:] = [z, "present_key", "present_value"]
        row = g.op("Squeeze", visible, g.ints("axes_1b", [1]))  # [B|1, S, 1]
        z = g.op("Where", row, z, g.const("zero_f", np.asarray(0, np.float32)))
    elif Hkv == H:  # ort-fused, one k/v head per query head: com.microsoft MultiHeadAttention with past
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        inputs = [q, k, v, "", ""]
        if kpm is not None:
            inputs[4] = g.op("Cast", g.op("Not", kpm), to=TensorProto.INT32)  # [B, T], 1 keeps
        z, present_k, present_v = g.op(
            "MultiHeadAttention", *inputs, "", "past_key", "past_value", outputs=3, domain=MS_DOMAIN,
            num_heads=H, scale=c.softmax_scale, unidirectional=1, mask_filter_value=lowest,
        )  # fmt: skip
        g.nodes[-1].output[:] = [z, "present_key", "present_value"]
        if kpm is not None:  # the op averages a fully hidden row: zero it, as the formula says
            _, visible, _, _ = _positions(g, c, kpm)
            row = g.op("Squeeze", visible, g.ints("axes_1b", [1]))  # [B, S, 1]
            z = g.op("Where", row, z, g.const("zero_f", np.asarray(0, np.float32)))
    else:  # ort-fused, grouped heads: com.microsoft GroupQueryAttention
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        past = g.op("Shape", "past_key", start=2, end=3)  # [1]
        seq = g.op("Shape", "x", start=1, end=2)
        batch = g.op("Shape", "x", start=0, end=1)
        total = g.op("Add", past, seq)  # [1] int64
        total32 = g.op("Cast", g.op("Squeeze", total, g.ints("axis0", [0])), to=TensorProto.INT32)
        # seqlens_k: per batch row, its total length - 1 (every row as long as the cache here).
        seqlens = g.op("Expand", g.op("Sub", g.op("Cast", total, to=TensorProto.INT32),
                                      g.const("one_i32", np.asarray([1], np.int32))), batch)  # fmt: skip
        inputs = [q, k, v, "past_key", "past_value", seqlens, total32]
        if kpm is not None:
            # Left padding: an additive bias [B, 1, S, T], lowest where the key is padding.
            bias = g.op("Where", g.op("Unsqueeze", kpm, g.ints("axes_12", [1, 2])),
                        g.const("lowest", np.asarray(lowest, np.float32)),
                        g.const("zero_f", np.asarray(0, np.float32)))  # fmt: skip
            seq_t = g.op("Concat", batch, g.ints("one1", [1]), seq, total, axis=0)
            bias = g.op("Expand", bias, seq_t)
            inputs += ["", "", "", bias]
        z, present_k, present_v = g.op(
            "GroupQueryAttention", *inputs, outputs=3, domain=MS_DOMAIN,
            num_heads=H, kv_num_heads=Hkv, scale=c.softmax_scale,
        )  # fmt: skip
        g.nodes[-1].output[:] = [z, "present_key", "present_value"]
        if kpm is not None:
            _, visible, _, _ = _positions(g, c, kpm)
            row = g.op("Squeeze", visible, g.ints("axes_1b", [1]))  # [B, S, 1]
            z = g.op("Where", row, z, g.const("zero_f2", np.asarray(0, np.float32)))
    _linear(g, z, weights, "out_proj", c.bias, out="y")

    def info(name: str, elem: int, shape: tuple) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, list(shape))

    elem = {"fp32": _F, "bool": TensorProto.BOOL, "int64": TensorProto.INT64}
    inputs = [info(s.name, elem[s.dtype], s.shape) for s in c.inputs()]
    outputs = [info(s.name, _F, s.shape) for s in c.outputs()]
    graph = helper.make_graph(g.nodes, "attnx_step", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="attnx",
                              producer_version=__version__)  # fmt: skip
    for key, value in ((CONFIG_KEY, c.to_json()), (ATTENTION_KEY, attention), (DECODE_KEY, "growing")):
        model.metadata_props.add(key=key, value=value)
    return model


def _buffer_model(c: AttentionConfig, weights: Mapping[str, np.ndarray], attention: str) -> onnx.ModelProto:
    """The buffer form: GroupQueryAttention on one fixed-capacity cache bound as both past and
    present (the op writes the new tokens' keys/values at their positions, in place).

        inputs   x [batch, seq, d_model]
                 past_key [batch, n_kv_heads, capacity, head_dim], past_value [.., v_head_dim]
                 seqlens_k int32 [batch]: positions filled after this step, minus 1
                 total_sequence_length int32 []: positions filled after this step
        outputs  y, present_key / present_value: the same buffers (bind one OrtValue to both)
    """
    if attention != "ort-fused":
        raise UsageError(
            f"the buffer form is built as ort-fused ({MS_DOMAIN}.GroupQueryAttention writes into the cache in "
            f"place); --attention {attention} has the growing-cache form only"
        )
    if c.key_padding_mask:
        raise UsageError("the buffer form takes no key_padding_mask (its rows are as long as seqlens_k says)")
    H, Hkv = c.n_heads, c.n_kv_heads
    g = _Graph()
    # One packed projection [d_model, (H + 2 Hkv) * head_dim] that the op splits itself: one GEMV
    # reading every projection weight instead of three (at batch 1 the step is a weight read).
    packed = {"qkv.weight": np.concatenate([np.asarray(weights[f"{n}_proj.weight"], np.float32) for n in "qkv"])}
    if c.bias:
        packed["qkv.bias"] = np.concatenate([np.asarray(weights[f"{n}_proj.bias"], np.float32) for n in "qkv"])
    qkv = _linear(g, "x", packed, "qkv", c.bias)  # [B, S, (H + 2 Hkv) * head_dim]
    z, _, _ = g.op(
        "GroupQueryAttention", qkv, "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length",
        outputs=3, domain=MS_DOMAIN, num_heads=H, kv_num_heads=Hkv, scale=c.softmax_scale,
    )  # fmt: skip
    g.nodes[-1].output[:] = [z, "present_key", "present_value"]
    _linear(g, z, weights, "out_proj", c.bias, out="y")
    elem = {"fp32": _F, "int32": TensorProto.INT32}
    inputs, outputs = (
        [helper.make_tensor_value_info(t.name, elem[t.dtype], list(t.shape)) for t in specs]
        for specs in buffer_form_specs(c)
    )
    graph = helper.make_graph(g.nodes, "attnx_step_buffer", inputs, outputs, g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS_DOMAIN, 1)],
        ir_version=IR_VERSION,
        producer_name="attnx",
        producer_version=__version__,
    )
    for key, value in ((CONFIG_KEY, c.to_json()), (ATTENTION_KEY, attention), (DECODE_KEY, "buffer")):
        model.metadata_props.add(key=key, value=value)
    return model
