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
- decomposed: Concat the new keys/values onto the cache, MatMul, Softmax, MatMul. Grouped
  heads without a copy of the cache: the query heads of a group are stacked along the query
  axis ([batch, n_kv_heads, group*seq, head_dim]) and multiply their one key head.
- onnx: the opset-23 Attention op, with past_key/past_value and q_num_heads/kv_num_heads.
- ort-fused: com.microsoft MultiHeadAttention with past_key/past_value when every query head has
  its own key/value head (measured faster than GroupQueryAttention's growing cache: large preset,
  past 2048/8192, core alone 2.0/8.6 ms against 2.7/9.7 ms), else com.microsoft
  GroupQueryAttention (grouped heads natively; left padding as an additive attention_bias).
  The buffer form is GroupQueryAttention for every config: on one shared buffer it measured
  0.86/2.7 ms against MultiHeadAttention's 1.4/4.2 ms (past_sequence_length).

The modern-LLM terms (README, "Modern LLM attention"): q/k norms and rope before the cache (it holds
the keys as scored), in each lowering's operators (attnx.export._llm); softcap, the window over
token index and the sinks in the core: decomposed writes them as arithmetic (a sink logit
concatenated to the scores, dropped after the softmax); onnx as Attention-23's softcap and its
boolean mask (no sinks: refused); ort-fused as GroupQueryAttention's softcap, local_window_size and
head_sink (for every such config, grouped or not: MultiHeadAttention has none of them). The
growing form rotates with a RotaryEmbedding node fed the call's own position_ids: the op's own
rotation (do_rotary) reads only position_ids[0, 0] in a prompt, for every row (measured: 1.39 abs
error on a left-padded batch), so it cannot take Hugging Face's per-row positions. The buffer
form, whose positions are token indices (no padding), rotates inside the op (do_rotary).

The same graph without past and present is the full-sequence model of a modern-LLM config in onnx
and ort-fused (build_full_model); its decomposed one is the torch module's export.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper

from attnx import __version__
from attnx.errors import ExportError, UsageError
from attnx.export._graph import Graph, heads, linear, named
from attnx.export._llm import norm_and_rotate, rope_table, visibility
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    ALIBI_FORM,
    ATTENTION_KEY,
    CONFIG_KEY,
    DECODE_FORMS,
    DECODE_KEY,
    DEFAULT_ROPE_POSITIONS,
    IR_VERSION,
    MS_DOMAIN,
    QUANT_KEY,
    ROPE_POSITIONS_KEY,
    buffer_form_specs,
    check_buffer_form,
    check_choice,
    check_llm_support,
    check_lowering,
)

__all__ = ["build_decomposed_model", "build_full_model", "build_step_model", "graph_opset"]


def graph_opset(config: AttentionConfig, attention: str) -> int:
    """The default-domain opset of the hand-built graph of `config` in `attention`: 23 for the onnx
    lowering (Attention, RotaryEmbedding, RMSNormalization) and for a q/k norm in ort-fused
    (RMSNormalization-23: ONNX Runtime's SimplifiedLayerNormalization is no ONNX op, the checker
    refuses it), else 18."""
    return 23 if attention == "onnx" or (attention == "ort-fused" and config.qk_norm is not None) else 18

_F = TensorProto.FLOAT


def build_step_model(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    attention: str = "decomposed",
    form: str = "growing",
    dtype: str = "fp32",
    block_size: int | None = None,
    accuracy_level: int | None = None,
    rope_positions: int | None = None,
    buffer_core: str = "gqa",
) -> onnx.ModelProto:
    """The step model of `config` (kv_cache true) in the lowering `attention`, in the growing-cache
    form or the buffer form (ort-fused only; README, "Decoding": the buffer form; buffer_core, one of
    contract.BUFFER_CORES: its attention op). dtype int8/int4
    quantizes its projections (the buffer form's packed q/k/v too) with the full-sequence forms'
    pass, QuantizeProjections, which records the same metadata (contract.QUANT_KEY). rope_positions:
    the rows of the buffer form's cos/sin table (a config with rope; DEFAULT_ROPE_POSITIONS)."""
    check_llm_support(config, attention, dtype, step=True)  # what the form cannot express: refused by name
    if form == "buffer":
        check_buffer_form(config, attention, dtype, buffer_core)
    model = _build_float(config, weights, attention, form, rope_positions=rope_positions, buffer_core=buffer_core)
    return with_dtype(model, dtype, block_size, accuracy_level)


def with_dtype(model: onnx.ModelProto, dtype: str, block_size: int | None = None,
               accuracy_level: int | None = None) -> onnx.ModelProto:  # fmt: skip
    """A hand-built float32 graph in `dtype`: fp32 as it is, fp16 by half_precision (inputs, outputs
    and the cache float16 too), int8/int4 by quantize_step_model."""
    if dtype == "fp32":
        return model
    if dtype == "fp16":
        return half_precision(model)[0]
    return quantize_step_model(model, dtype, block_size, accuracy_level)


def half_precision(model: onnx.ModelProto, keep_io_fp32: bool = False) -> tuple[onnx.ModelProto, list[str]]:
    """A hand-built float32 graph in float16 by the exporter's pass, ConvertToFloat16 (its rotary angle
    kept float32: attnx.export.passes.fp16), and the pass's notes. The built graph declares the types of
    its inputs and outputs only: onnx's shape inference types the rest first (the pass reads them).
    keep_io_fp32: float32 inputs and outputs, cast at the boundary (not for a step model: its cache
    would be a cast, not the buffer it is written into)."""
    import onnx_ir as ir
    from onnx_ir.passes.common import ShapeInferencePass

    from attnx.export.passes.fp16 import ConvertToFloat16

    irm = ir.from_proto(model)
    ShapeInferencePass()(irm)
    convert = ConvertToFloat16(keep_io_fp32=keep_io_fp32)
    convert(irm)
    out = ir.to_proto(irm)
    out.ir_version = IR_VERSION
    return out, convert.notes


def quantize_step_model(model: onnx.ModelProto, dtype: str, block_size: int | None = None,
                        accuracy_level: int | None = None) -> onnx.ModelProto:  # fmt: skip
    """The fp32 step model `model` (or a hand-built full-sequence graph) with its four projections
    (or the packed q/k/v and out) quantized to `dtype` by QuantizeProjections; a projection the pass
    does not find is an error."""
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


def build_full_model(config: AttentionConfig, weights: Mapping[str, np.ndarray], attention: str,
                     dtype: str = "fp32", block_size: int | None = None,
                     accuracy_level: int | None = None) -> onnx.ModelProto:  # fmt: skip
    """The full-sequence graph (no cache) of a config with modern-LLM keys in `attention` onnx or
    ort-fused (the decomposed one is the torch module's export): the same graph as the step model's
    without past and present (README, "Modern LLM attention"); int8/int4 quantize its projections
    as build_step_model does."""
    c = config
    if c.kv_cache:
        raise UsageError("a config with 'kv_cache': true has the step model (build_step_model)")
    if not c.llm_keys or attention not in ("onnx", "ort-fused"):
        raise UsageError(
            f"build_full_model builds the onnx and ort-fused graphs of a modern-LLM config; {attention!r} of this "
            "config is the exporter's (attnx.export.export_onnx) and the graph passes'"
        )
    check_lowering(c, attention)
    check_llm_support(c, attention, dtype)
    model = _build_float(c, weights, attention, "growing", step=False)
    return with_dtype(model, dtype, block_size, accuracy_level)


def build_decomposed_model(config: AttentionConfig, weights: Mapping[str, np.ndarray], dtype: str = "fp32",
                           block_size: int | None = None, accuracy_level: int | None = None,
                           readable: bool = True) -> onnx.ModelProto:  # fmt: skip
    """The decomposed form of any self-attention config written by hand, without torch: the step
    model's growing form for a kv_cache config, else the same graph without past and present. What
    localisation runs to look inside a fused operator (attnx.runtimes.localise); the exporter's form
    (attnx.export.export_onnx) is the one attnx export writes. int8/int4 quantize its projections as
    build_step_model does. readable=False: the stages named, the other nodes not (Graph.named)."""
    c = config
    if c.cross:
        raise UsageError("the hand-built decomposed graph projects k and v from x: cross-attention is the exporter's")
    if c.kv_cache:
        return build_step_model(c, weights, "decomposed", "growing", dtype, block_size, accuracy_level)
    model = _build_float(c, weights, "decomposed", "growing", step=False, readable=readable)
    return with_dtype(model, dtype, block_size, accuracy_level)


def _build_float(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    attention: str,
    form: str,
    step: bool = True,
    rope_positions: int | None = None,
    readable: bool = True,
    buffer_core: str = "gqa",
) -> onnx.ModelProto:
    c = config
    if c.alibi:  # these graphs have no ALiBi term yet (contract.check_alibi)
        raise UsageError("the graphs built node by node (the step model, onnx and ort-fused, localisation's decomposed "
                         f"form) do not express alibi yet: ALiBi is built as {ALIBI_FORM} only")
    if step:
        if not c.kv_cache:
            raise UsageError("the step model is for configs with 'kv_cache': true")
        check_lowering(c, attention, step=True)
        check_choice("decode form", form, DECODE_FORMS)
        if form == "buffer":
            return _buffer_model(c, weights, attention, rope_positions, buffer_core)
    H, Hkv, G, hd, vhd = c.n_heads, c.n_kv_heads, c.group_size, c.head_dim, c.v_head_dim
    llm = bool(c.llm_keys)
    g = Graph()
    kpm = "key_padding_mask" if c.key_padding_mask else None
    q = linear(g, "x", weights, "q_proj", c.bias, out=g.stage("q"))  # [B, S, H*hd]
    k = linear(g, "x", weights, "k_proj", c.bias, out=g.stage("k"))  # [B, S, Hkv*hd]
    v = linear(g, "x", weights, "v_proj", c.bias, out=g.stage("v"))  # [B, S, Hkv*vhd]
    if c.qk_norm is not None or c.rope is not None:  # q and k as they are scored (and cached)
        q, k = norm_and_rotate(g, c, weights, q, k, attention)
    lowest = float(np.finfo(np.float32).min)
    opsets = [helper.make_opsetid("", graph_opset(c, attention))]
    zero_f = g.const("zero_f", np.asarray(0, np.float32))
    if attention == "decomposed":
        hidden, visible = visibility(g, c, kpm, step)
        if step:
            present_k = g.op("Concat", "past_key", heads(g, k, Hkv, hd, "k"), axis=2, name="present_key")
            present_v = g.op("Concat", "past_value", heads(g, v, Hkv, vhd, "v"), axis=2, name="present_value")
        else:  # the full-sequence graph (build_decomposed_model): this call's keys and values alone
            present_k, present_v = heads(g, k, Hkv, hd, "k"), heads(g, v, Hkv, vhd, "v")
        # q [B, S, H*hd] -> [B, S, Hkv, G, hd] -> [B, Hkv, G, S, hd] -> [B, Hkv, G*S, hd]: a group's
        # query heads stacked along the query axis, so each multiplies its one key head (no copy).
        q5 = g.op("Transpose", g.op("Reshape", q, g.ints("q_shape", [0, 0, Hkv, G, hd])), perm=[0, 2, 3, 1, 4])
        qg = g.op("Reshape", q5, g.ints("qg_shape", [0, 0, -1, hd]))
        scores = g.op("MatMul", qg, g.op("Transpose", present_k, perm=[0, 1, 3, 2]))  # [B, Hkv, G*S, T]
        scores = g.op("Mul", scores, g.const("scale", np.asarray(c.softmax_scale, np.float32)))
        if c.softcap is not None:  # c * tanh(s / c), after the scale, before the masks
            cap = g.const("softcap", np.asarray(c.softcap, np.float32))
            scores = g.op("Mul", g.op("Tanh", g.op("Div", scores, cap)), cap)
        scores = g.op("Reshape", scores, g.ints("bhst", [0, H, -1, 0]), name=g.stage("scores", "b h t s"))  # [B, H, S, T]
        if hidden is not None:  # (a full-sequence graph without masks has none)
            scores = g.op("Where", hidden, g.const("lowest", np.asarray(lowest, np.float32)), scores)
        if c.sinks:
            # One more logit per head, [B, H, S, 1], joins the softmax and is dropped after it (no value).
            sink_shape = g.op("Concat", g.op("Shape", scores, start=0, end=3), g.ints("one1", [1]), axis=0)
            sink = g.op("Expand", g.const("sinks", np.asarray(weights["sinks"], np.float32).reshape(1, H, 1, 1)),
                        sink_shape)  # fmt: skip
            p = g.op("Softmax", g.op("Concat", scores, sink, axis=-1), axis=-1)
            p = g.op("Slice", p, g.ints("zero1", [0]), g.ints("minus1", [-1]), g.ints("axes_m1", [-1]),
                     name=g.stage("probs", "b h t s"))  # fmt: skip
        else:
            p = g.op("Softmax", scores, axis=-1, name=g.stage("probs", "b h t s"))
        p = g.op("Reshape", p, g.ints("bkgst", [0, Hkv, -1, 0]))  # [B, Hkv, G*S, T]
        z = g.op("Reshape", g.op("MatMul", p, present_v), g.ints("bhsv", [0, H, -1, vhd]))  # [B, H, S, vhd]
        if visible is not None:
            z = g.op("Where", visible, z, zero_f)  # all-hidden rows: 0
        z = g.op("Reshape", g.op("Transpose", z, perm=[0, 2, 1, 3]), g.ints("z_shape", [0, 0, H * vhd]), name=g.stage("z"))
    elif attention == "onnx":
        hidden, visible = visibility(g, c, kpm, step)
        # The op's causal flag aligns its mask top-left; the mask over token index is given instead
        # (the window in it). Its softcap comes after the scale and before the mask (measured).
        attend = g.op("Not", hidden) if hidden is not None else ""  # [B|1, 1, S, T]: True takes part
        attrs = {"q_num_heads": H, "kv_num_heads": Hkv, "scale": c.softmax_scale}
        if c.softcap is not None:
            attrs["softcap"] = c.softcap
        if step:
            z, present_k, present_v = g.op("Attention", q, k, v, attend, "past_key", "past_value", outputs=3, **attrs)
            g.nodes[-1].output[:] = [z, "present_key", "present_value"]
        else:
            z = g.op("Attention", q, k, v, *([attend] if attend else []), **attrs)
        if visible is not None:  # z is what comes out of the zeroing, the op's output before it
            row = g.op("Squeeze", visible, g.ints("axes_1b", [1]))  # [B|1, S, 1]
            z = g.op("Where", row, z, zero_f, name=g.stage("z"))
        else:
            g.nodes[-1].output[0] = z = g.stage("z")
    elif Hkv == H and not llm:  # ort-fused, one k/v head per query head: com.microsoft MultiHeadAttention with past
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
            _, visible = visibility(g, c, kpm, step)
            row = g.op("Squeeze", visible, g.ints("axes_1b", [1]))  # [B, S, 1]
            z = g.op("Where", row, z, zero_f, name=g.stage("z"))
        else:
            g.nodes[-1].output[0] = z = g.stage("z")
    else:  # ort-fused, grouped heads or a modern-LLM config: com.microsoft GroupQueryAttention
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        seq = g.op("Shape", "x", start=1, end=2)  # [1]
        batch = g.op("Shape", "x", start=0, end=1)
        total = g.op("Add", g.op("Shape", "past_key", start=2, end=3), seq) if step else seq  # [1] int64
        total32 = g.op("Cast", g.op("Squeeze", total, g.ints("axis0", [0])), to=TensorProto.INT32)
        # seqlens_k: per batch row, its total length - 1 (every row as long as the cache here: left
        # padding is a bias, so the op's token index is attnx's, and so is its window).
        seqlens = g.op("Expand", g.op("Sub", g.op("Cast", total, to=TensorProto.INT32),
                                      g.const("one_i32", np.asarray([1], np.int32))), batch)  # fmt: skip
        inputs = [q, k, v, "past_key" if step else "", "past_value" if step else "", seqlens, total32, "", "", "", "", ""]
        if kpm is not None:
            # Left padding: an additive bias [B, 1, S, T], lowest where the key is padding (the op
            # adds it after its softcap: measured).
            bias = g.op("Where", g.op("Unsqueeze", kpm, g.ints("axes_12", [1, 2])),
                        g.const("lowest", np.asarray(lowest, np.float32)), zero_f)  # fmt: skip
            seq_t = g.op("Concat", batch, g.ints("one1", [1]), seq, total, axis=0)
            inputs[10] = g.op("Expand", bias, seq_t)
        if c.sinks:  # head_sink: a logit per head in the softmax's denominator (measured: exp(sink))
            inputs[11] = g.const("sinks", np.asarray(weights["sinks"], np.float32))
        while inputs[-1] == "":
            inputs.pop()
        z, present_k, present_v = g.op(
            "GroupQueryAttention", *inputs, outputs=3, domain=MS_DOMAIN, **_gqa_attrs(c),
        )  # fmt: skip
        gqa = g.nodes[-1]
        if step:
            gqa.output[:] = [z, "present_key", "present_value"]
        if kpm is not None:
            _, visible = visibility(g, c, kpm, step)
            row = g.op("Squeeze", visible, g.ints("axes_1b", [1]))  # [B, S, 1]
            z = g.op("Where", row, z, zero_f, name=g.stage("z"))
        else:
            gqa.output[0] = z = g.stage("z")
    linear(g, z, weights, "out_proj", c.bias, out="y")

    def info(name: str, elem: int, shape: tuple) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, list(shape))

    elem = {"fp32": _F, "bool": TensorProto.BOOL, "int64": TensorProto.INT64}
    inputs = [info(s.name, elem[s.dtype], s.shape) for s in c.inputs()]
    outputs = [info(s.name, _F, s.shape) for s in c.outputs()]
    graph = helper.make_graph(g.nodes, "attnx_step" if step else "attnx", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="attnx",
                              producer_version=__version__)  # fmt: skip
    meta = [(CONFIG_KEY, c.to_json()), (ATTENTION_KEY, attention)] + ([(DECODE_KEY, "growing")] if step else [])
    for key, value in meta:
        model.metadata_props.add(key=key, value=value)
    return named(model, g, readable)


def _gqa_attrs(c: AttentionConfig) -> dict[str, object]:
    """GroupQueryAttention's attributes for `c`: heads, scale, and the modern-LLM terms it runs
    itself. local_window_size W is attnx's window: the op shows key j to query p iff p - W < j <= p
    (measured, W 2 and 3: error 2e-7 against that rule, 1.8-2.5 against p - W <= j)."""
    attrs: dict[str, object] = {"num_heads": c.n_heads, "kv_num_heads": c.n_kv_heads, "scale": c.softmax_scale}
    if not c.causal:
        attrs["causal"] = 0
    if c.sliding_window is not None:
        attrs["local_window_size"] = c.sliding_window
    if c.softcap is not None:
        attrs["softcap"] = c.softcap
    return attrs


def _buffer_model(c: AttentionConfig, weights: Mapping[str, np.ndarray], attention: str,
                  rope_positions: int | None = None, core: str = "gqa") -> onnx.ModelProto:  # fmt: skip
    """The buffer form: a fused op on one fixed-capacity cache bound as both past and present (the op
    writes the new tokens' keys/values at their positions, in place); core (contract.BUFFER_CORES):
    GroupQueryAttention (_gqa_core), MultiHeadAttention with a group's query heads as rows
    (_grouped_mha), or auto, the one or the other by the call's token count (_core_by_token_count).

        inputs   x [batch, seq, d_model]
                 past_key [batch, n_kv_heads, capacity, head_dim], past_value [.., v_head_dim]
                 seqlens_k int32 [batch]: positions filled after this step, minus 1
                 total_sequence_length int32 []: positions filled after this step
        outputs  y, present_key / present_value: the same buffers (bind one OrtValue to both)

    With rope the op rotates q and k itself (do_rotary) from a cos/sin table of `rope_positions`
    rows, each token at its token index (seqlens_k's): the buffer form has no padding, so that is
    its position. A position past the table is the op's error, never a number (README).
    """
    check_buffer_form(c, attention, "fp32", core)
    g = Graph()
    # One packed projection [d_model, (H + 2 Hkv) * head_dim] that the op splits itself: one GEMV
    # reading every projection weight instead of three (at batch 1 the step is a weight read).
    packed = {"qkv_proj.weight": np.concatenate([np.asarray(weights[f"{n}_proj.weight"], np.float32) for n in "qkv"])}
    if c.bias:
        packed["qkv_proj.bias"] = np.concatenate([np.asarray(weights[f"{n}_proj.bias"], np.float32) for n in "qkv"])
    qkv = linear(g, "x", packed, "qkv_proj", c.bias)  # [B, S, (H + 2 Hkv) * head_dim]
    metadata = [(CONFIG_KEY, c.to_json()), (ATTENTION_KEY, attention), (DECODE_KEY, "buffer")]
    if core == "grouped-mha":
        z = _grouped_mha(g, c, weights, qkv)
    elif core == "gqa":
        z = _gqa_core(g, c, weights, qkv, rope_positions, metadata)
    else:
        z = _core_by_token_count(g, c, weights, qkv, rope_positions, metadata)
    return _buffer_proto(c, g, weights, z, attention, metadata)


def _gqa_core(g: Graph, c: AttentionConfig, weights: Mapping[str, np.ndarray], qkv: str, rope_positions: int | None,
              metadata: list[tuple[str, str]]) -> str:  # fmt: skip
    """z of the buffer form by com.microsoft.GroupQueryAttention on the shared cache (seqlens_k: it
    writes the new keys/values at their positions, in place), rotating q and k itself (do_rotary) from
    a table of `rope_positions` rows (recorded in metadata)."""
    H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
    qkv_inputs = [qkv, "", ""]
    if c.qk_norm is not None:  # the norms need q and k apart: split the packed projection
        g.op("Split", qkv, g.ints("qkv_split", [H * hd, Hkv * hd, Hkv * hd]), outputs=3, axis=-1)
        g.nodes[-1].output[:] = q, k, v = g.stage("q"), g.stage("k"), g.stage("v")
        c_norm = dataclasses.replace(c, rope=None)  # the op rotates
        q, k = norm_and_rotate(g, c_norm, weights, q, k, "ort-fused")
        qkv_inputs = [q, k, v]
    inputs = [*qkv_inputs, "past_key", "past_value", "seqlens_k", "total_sequence_length", "", "", "", "", ""]
    attrs = _gqa_attrs(c)
    if c.rope is not None:
        positions = DEFAULT_ROPE_POSITIONS if rope_positions is None else rope_positions
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
            raise UsageError(f"rope_positions must be a positive integer, got {positions!r}")
        cos, sin = rope_table(c, positions)
        inputs[7], inputs[8] = g.const("rope_cos_cache", cos), g.const("rope_sin_cache", sin)
        attrs.update(do_rotary=1, rotary_interleaved=int(c.rope.interleaved))
        metadata.append((ROPE_POSITIONS_KEY, str(positions)))
    if c.sinks:
        inputs[11] = g.const("sinks", np.asarray(weights["sinks"], np.float32))
    while inputs[-1] == "":
        inputs.pop()
    g.op("GroupQueryAttention", *inputs, outputs=3, domain=MS_DOMAIN, **attrs)
    g.nodes[-1].output[:] = [z := g.stage("z"), "present_key", "present_value"]
    return z


def _core_by_token_count(g: Graph, c: AttentionConfig, weights: Mapping[str, np.ndarray], qkv: str,
                         rope_positions: int | None, metadata: list[tuple[str, str]]) -> str:  # fmt: skip
    """z of the buffer form's auto core: an If on the call's token count, the grouped core
    (_grouped_mha) for one token, GroupQueryAttention's (_gqa_core) for more; the faster of the two
    for each on the CPU (README, "The buffer form"). Each branch writes the shared cache in place as
    its op does alone: ONNX Runtime hands the If's outputs, bound to the cache, to the branch's op.
    A branch's values carry its core's name (q/grouped-mha, ...), so that no name is made twice; the
    constants stay in the main graph, which both branches read."""
    branches, main_stages = {}, set(g.stages)
    for core, build in (("grouped-mha", lambda: _grouped_mha(g, c, weights, qkv)),
                        ("gqa", lambda: _gqa_core(g, c, weights, qkv, rope_positions, metadata))):  # fmt: skip
        start = len(g.nodes)
        z = build()
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


def _grouped_mha(g: Graph, c: AttentionConfig, weights: Mapping[str, np.ndarray], qkv: str) -> str:
    """z of the buffer form by com.microsoft.MultiHeadAttention over the shared cache (past_sequence_length:
    it writes the new keys/values at their positions, in place), the query heads of a group stacked as
    rows: row s*G + j of head n holds query head n*G + j of token s, so that the op reads each key/value
    head once for its whole group. The mask over tokens (causal, a sliding window: visibility, the
    decomposed form's) repeated for a token's G rows is an additive attention_bias [1, 1, S*G, total];
    q/k norms and rope are their own nodes (norm_and_rotate, at the token index: the buffer form has
    no padding)."""
    H, Hkv, G, hd = c.n_heads, c.n_kv_heads, c.group_size, c.head_dim
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
        q, k = norm_and_rotate(g, c, weights, q, k, "ort-fused")
    rows = g.op("Transpose", g.op("Reshape", q, g.ints("q_groups", [0, 0, Hkv, G, hd])), perm=[0, 1, 3, 2, 4])
    rows = g.op("Reshape", rows, g.ints("q_rows", [0, -1, Hkv * hd]))  # [B, S*G, Hkv*hd]
    hidden, _ = visibility(g, c, None, True, span=(past, total))  # [1, 1, S, total]: a step model is causal
    hidden = g.op("Expand", g.op("Unsqueeze", hidden, g.ints("axis3", [3])), g.ints("group_rows", [1, 1, 1, G, 1]))
    hidden = g.op("Reshape", hidden, g.op("Concat", g.ints("rows_shape", [1, 1, -1]), g.op("Unsqueeze", total, axis0),
                                          axis=0))  # [1, 1, S*G, total]: row s*G + j as token s  # fmt: skip
    bias = g.op("Where", hidden, g.const("lowest_f", np.asarray(np.finfo(np.float32).min, np.float32)),
                g.const("zero_f", np.asarray(0, np.float32)))  # fmt: skip
    past32 = g.op("Reshape", g.op("Cast", past, to=TensorProto.INT32), g.ints("one_d", [1]))
    out = g.op("MultiHeadAttention", rows, k, v, "", "", bias, "past_key", "past_value", past32, outputs=3,
               domain=MS_DOMAIN, num_heads=Hkv, scale=c.softmax_scale)  # fmt: skip
    g.nodes[-1].output[1:] = ["present_key", "present_value"]
    z = g.op("Transpose", g.op("Reshape", out[0], g.ints("z_groups", [0, -1, G, Hkv, hd])), perm=[0, 1, 3, 2, 4])
    return g.op("Reshape", z, g.ints("z_heads", [0, 0, H * hd]), name=g.stage("z"))


def _buffer_proto(c: AttentionConfig, g: Graph, weights: Mapping[str, np.ndarray], z: str, attention: str,
                  metadata: list[tuple[str, str]]) -> onnx.ModelProto:  # fmt: skip
    """The buffer form's model from its graph up to z: the output projection, the contract's inputs and
    outputs (buffer_form_specs), the opsets and the metadata."""
    linear(g, z, weights, "out_proj", c.bias, out="y")
    elem = {"fp32": _F, "int32": TensorProto.INT32}
    graph_inputs, graph_outputs = (
        [helper.make_tensor_value_info(t.name, elem[t.dtype], list(t.shape)) for t in specs]
        for specs in buffer_form_specs(c)
    )
    graph = helper.make_graph(g.nodes, "attnx_step_buffer", graph_inputs, graph_outputs, g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", graph_opset(c, attention)), helper.make_opsetid(MS_DOMAIN, 1)],
        ir_version=IR_VERSION,
        producer_name="attnx",
        producer_version=__version__,
    )
    for key, value in metadata:
        model.metadata_props.add(key=key, value=value)
    return named(model, g)
