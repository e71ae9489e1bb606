"""Writing an attention layer as an ONNX graph from the registry: one emitter per core, one frame.

    build_model(config, weights, attention, form, dtype) -> onnx.ModelProto

The core is the registry's answer (attnx.model.cores.core_for: the first of the lowering's cores that
computes the config, every reason otherwise), and its emitter (GRAPH_CORES[core].emit, attnx.export.cores) writes it between
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

import json
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper
from onnx_ir.passes.common import ShapeInferencePass

from attnx import __version__
from attnx.errors import ExportError, UsageError
from attnx.export._graph import Graph, linear, named
from attnx.export.cores import GRAPH_CORES, Emit
from attnx.export.cores._emit import BOUND
from attnx.export.passes.fp16 import ConvertToFloat16
from attnx.export.passes.quantize import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, QuantizeProjections
from attnx.export.terms import fused_opset
from attnx.model.config import AttentionConfig, TensorSpec
from attnx.model.contract import (
    ATTENTION_KEY,
    CONFIG_KEY,
    DECODE_KEY,
    DEFAULT_OPSET,
    IR_VERSION,
    MAX_OPSET,
    QUANT_KEY,
    buffer_form_specs,
)
from attnx.model.cores import TermOps, core_for, form_of

__all__ = ["build_model", "graph_opset", "half_precision", "quantize_model", "with_dtype"]

_F = TensorProto.FLOAT
def graph_opset(config: AttentionConfig, attention: str, form: str | None = None, buffer_core: str | None = None,
                dtype: str = "fp32", core: str | None = None) -> int:  # fmt: skip
    """The default-domain opset the graph of `config` in `attention` needs: its core's in the form (23 for the
    opset-23 Attention, 24 for the decomposed buffer form's TensorScatter), 23 for a q/k norm written as
    RMSNormalization-23 beside a contrib core (ONNX Runtime's SimplifiedLayerNormalization is no ONNX op: the checker
    refuses it), else DEFAULT_OPSET."""
    core = core_for(attention, config, dtype, form, buffer_core, core=core)
    needed = max(DEFAULT_OPSET, core.opset_of(form_of(config, form)) if not core.domain else DEFAULT_OPSET)
    if core.term_ops is not TermOps.STANDARD and (terms := fused_opset(config)) is not None:  # the terms' ops' own
        needed = max(needed, terms)
    return needed


def build_model(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    attention: str = "decomposed",
    form: str | None = None,
    dtype: str = "fp32",
    *,
    buffer_core: str | None = None,
    core: str | None = None,
    opset: int | None = None,
    rope_positions: int | None = None,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    int8_bits: int | str = "auto",
    keep_io_fp32: bool = False,
    readable: bool = True,
    bound: str = "x",
    ring_cache: bool = False,
) -> onnx.ModelProto:
    """The graph of `config` with `weights` in the lowering `attention` (its core: the registry's
    core_for, refused with every reason before anything is written), in `form` (None: the config's own,
    full or growing; "buffer": the buffer form, with `buffer_core`; `core`: that one of the lowering's cores for the
    form, as a measured choice names it) and `dtype` (fp16: the whole graph,
    with_dtype; int8/int4: its projections quantized, int8's weights in `int8_bits`: attnx.model.int8).
    opset: the default domain's (None: what the core needs, graph_opset; below it is refused).
    rope_positions: the rows of the buffer form's cos/sin table.
    keep_io_fp32: an fp16 graph with float32 inputs and outputs, cast at the boundary (not for a step
    model: its cache would be a cast, not the buffer it is written into). readable=False names the stages
    alone (a graph no person reads: localisation's look inside).
    bound: the core alone, at projections made elsewhere (a whole model's own, kept as they are: attnx optimize):
    "separate" takes q, k and v as inputs, "packed" one qkv [batch, seq, q_dim + kv_q_dim + kv_v_dim] (biases added),
    and it gives the heads' output z [batch, seq, n_heads * v_head_dim] before the output projection; x stays an
    input, read for its batch and sequence dims alone. ring_cache: GroupQueryAttention's past holds a window alone
    (sliding_window_cache), as the cache it is bound to does."""
    if bound not in BOUND:
        raise UsageError(f"bound {bound!r}: one of {', '.join(BOUND)}")
    c = config
    form = form_of(c, form)
    core = core_for(attention, c, dtype, form, buffer_core, core=core)
    needed = graph_opset(c, attention, form, buffer_core, dtype, core.name)
    if opset is not None and not needed <= opset <= MAX_OPSET:
        raise UsageError(f"--opset {opset} is outside what the {core.label} graph of this config is written at "
                         f"({needed} to {MAX_OPSET})")  # fmt: skip
    if keep_io_fp32 and form != "full":
        raise UsageError("--keep-io-fp32 is for a full-sequence model: a step model's cache is the buffer itself")
    g = Graph()
    if c.kv_cache:
        g.cache_from = c.cache_specs()[0].name  # past_key; past_latent
    if c.rope is not None and form != "buffer":  # position_ids [batch, seq]: the tokens' count, as x states it
        g.seq_from = "position_ids"
    if form == "growing" and c.key_padding_mask and not ring_cache and not c.cross:  # [batch, past_seq + seq]
        g.total_from = "key_padding_mask"
    e = Emit(g, c, weights, form, core, attention, half=dtype == "fp16", rope_positions=rope_positions,
             readable=readable, domains={"": opset or needed}, bound=bound, ring_cache=ring_cache)  # fmt: skip
    z = GRAPH_CORES[core.name].emit(e)
    if bound != "x":  # the core alone: its output is z, before an output projection that is not ours
        if z != "z":
            e.g.op("Identity", z, name="z")
    else:
        linear(e.g, z, weights, "out_proj", c.bias, out="y")
    model = _frame(e)
    return with_dtype(model, dtype, block_size, accuracy_level, keep_io_fp32, int8_bits)


def _frame(e: Emit) -> onnx.ModelProto:
    """The model around the graph `e` wrote: the contract's inputs and outputs, opsets, metadata, names."""
    c = e.c
    elem = {"fp32": _F, "bool": TensorProto.BOOL, "int64": TensorProto.INT64, "int32": TensorProto.INT32}
    if e.form == "buffer":
        specs_in, specs_out = buffer_form_specs(c)
    else:
        specs_in, specs_out = c.inputs(), c.outputs()
    if e.bound != "x":  # the core alone (build_model's bound): q, k, v (or qkv) in after x, z out instead of y
        widths = {"separate": [("q", c.q_dim), ("k", c.kv_q_dim), ("v", c.kv_v_dim)],
                  "packed": [("qkv", c.q_dim + c.kv_q_dim + c.kv_v_dim)]}[e.bound]  # fmt: skip
        specs_in = specs_in[:1] + [TensorSpec(n, "fp32", ("batch", "seq", w)) for n, w in widths] + specs_in[1:]
        specs_out = [TensorSpec("z", "fp32", ("batch", "seq", c.n_heads * c.v_head_dim))] + specs_out[1:]
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


def with_dtype(model: onnx.ModelProto, dtype: str, block_size: int | None = None, accuracy_level: int | None = None,
               keep_io_fp32: bool = False, int8_bits: int | str = "auto") -> onnx.ModelProto:  # fmt: skip
    """A float32 graph written here in `dtype`: fp32 as it is, fp16 by half_precision (a step model's
    cache too), int8/int4 by quantize_model."""
    if dtype == "fp32":
        return model
    if dtype == "fp16":
        return half_precision(model, keep_io_fp32)[0]
    return quantize_model(model, dtype, block_size, accuracy_level, int8_bits)


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
                   accuracy_level: int | None = None, int8_bits: int | str = "auto") -> onnx.ModelProto:  # fmt: skip
    """The float32 graph `model` with its projections (q, k, v and out, or the packed q/k/v and out)
    quantized to `dtype` by QuantizeProjections; a projection the pass does not find is an error."""
    qpass = QuantizeProjections(
        dtype,
        DEFAULT_BLOCK_SIZE if block_size is None else block_size,
        DEFAULT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level,
        int8_bits,
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
                     buffer_core: str | None = None, int8_bits: int | str = "auto") -> onnx.ModelProto:  # fmt: skip
    """The step model of `config` (kv_cache true) in `form` (growing, buffer): build_model."""
    if not config.kv_cache:
        raise UsageError("the step model is for configs with 'kv_cache': true")
    return build_model(config, weights, attention, form, dtype, buffer_core=buffer_core, rope_positions=rope_positions,
                       block_size=block_size, accuracy_level=accuracy_level, int8_bits=int8_bits)  # fmt: skip


def build_decomposed_model(config: AttentionConfig, weights: Mapping[str, np.ndarray], dtype: str = "fp32",
                           block_size: int | None = None, accuracy_level: int | None = None,
                           readable: bool = True, int8_bits: int | str = "auto") -> onnx.ModelProto:  # fmt: skip
    """The decomposed form of `config` written here, without torch (a step model's growing form for a
    kv_cache config): what localisation runs to look inside a fused operator (attnx.runtimes.localise);
    the full-sequence form `attnx export` writes is the torch module's export (attnx.export.export_onnx),
    the same graph (tests/export/test_decomposed_builders.py; why both: docs/concepts/lowerings.md)."""
    return build_model(config, weights, "decomposed", None, dtype, block_size=block_size,
                       accuracy_level=accuracy_level, int8_bits=int8_bits, readable=readable)  # fmt: skip
