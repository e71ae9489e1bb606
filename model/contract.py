"""The contract: every name attnx speaks of, in one place.

Each concept has one table here and every layer reads it: the lowerings of the attention core
(and the torch core each is exported from), the dtypes and their spellings in numpy, torch,
ONNX and ONNX Runtime, the providers and the backends that run them, the metadata keys a
model carries, the IR version and opsets, how an operator is named in reports, and
describe(), the one reader of "what is this model file".

Where a new thing is added:
- a lowering: one entry in LOWERINGS (and its passes in attnx.export.passes' pipelines);
- a dtype: one entry in DTYPES (MODEL_DTYPES when a model may compute in it; its tolerance
  in attnx.model.tolerance);
- a provider: one entry in PROVIDERS (its Runner registered in attnx.runtimes);
- a metadata key: one constant below.

No torch, onnx-ir or onnxruntime here: the deployment side reads this module. A model file is
read without onnx (attnx.model._onnx_proto: onnx's package imports ml_dtypes, 0.55 s on an AMD EPYC).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

from attnx._io import not_a_file
from attnx.errors import ConfigError, ModelFileError, UsageError
from attnx.model._onnx_proto import read_model
from attnx.model.config import AttentionConfig, TensorSpec
from attnx.model.cores import (
    AUTO,
    BUFFER_CORES,
    DEFAULT_BUFFER_CORE,
    LOWERING_OF_CORE,
    LOWERINGS,
    MS_DOMAIN,
    core_for,
)
from attnx.model.dtypes import (
    BF16_RUNTIMES,
    DTYPES,
    MODEL_DTYPES,
    QUANTIZATIONS,
    QUANTIZED_DTYPES,
    DType,
    Quantization,
    check_choice,
    check_model_dtype,
    dtype_name,
    dtype_of_onnx,
    dtype_of_ort,
    float_dtype,
    numpy_dtype,
)
from attnx.model.onnx_tensors import all_nodes, external_locations, external_tensors, initializer_bytes
from attnx.model.recognise import graph_core
from attnx.model.seen import Seen, seen_in
from attnx.model.stages import STAGES, STAGES_KEY, stage_layouts

__all__ = [
    "BUFFER_CORES",
    "DEFAULT_BUFFER_CORE",
    "core_for",
    "SDPA_LACKS",
    "STAGES",
    "STAGES_KEY",
    "IR_VERSION",
    "DEFAULT_OPSET",
    "MAX_OPSET",
    "check_opset",
    "MS_DOMAIN",
    "EXTERNAL_DATA_THRESHOLD",
    "CONFIG_KEY",
    "ATTENTION_KEY",
    "AUTO_KEY",
    "DTYPE_KEY",
    "IO_DTYPE_KEY",
    "ORT_OPTIMIZED_KEY",
    "DType",
    "DTYPES",
    "MODEL_DTYPES",
    "numpy_dtype",
    "dtype_name",
    "dtype_of_onnx",
    "dtype_of_ort",
    "Provider",
    "PROVIDERS",
    "get_provider",
    "provider_of_backend",
    "backend_device",
    "AUDIT_BACKENDS",
    "BACKEND_NAMES",
    "REFERENCE",
    "LOWERINGS",
    "AUTO",
    "TORCH_CORES",
    "sdpa_core_expresses",
    "EXPORT_ATTENTIONS",
    "OPTIMIZE_ATTENTIONS",
    "BENCH_ORT_LOWERINGS",
    "BUILD_ATTENTION",
    "check_choice",
    "contract_dims",
    "op_label",
    "op_counts",
    "lowering_from_nodes",
    "all_nodes",
    "ModelInfo",
    "describe",
    "io_specs",
    "ModelForm",
    "model_form",
    "config_from_metadata",
    "external_data_locations",
    "external_data_tensors",
    "DECODE_KEY",
    "DECODE_FORMS",
    "buffer_form_specs",
    "DEFAULT_ROPE_POSITIONS",
    "ROPE_POSITIONS_KEY",
    # Reduced precision (issue 12)
    "QUANT_KEY",
    "INT8_BITS_KEY",
    "Quantization",
    "QUANTIZATIONS",
    "QUANTIZED_DTYPES",
    "BF16_RUNTIMES",
    "float_dtype",
    "check_model_dtype",
    "quantization_of",
    "OPENVINO",
    "RUNTIME_DTYPES",
    "graph_dtype",
    "host_dtype",
    "runs_onnx_model",
    "quantized_form_unavailable",
    "require_model_file",
]

# Model files ------------------------------------------------------------------------------------
# IR version of every model attnx writes: onnxruntime-gpu 1.31 reads at most 13, and onnx 1.23's
# helpers would write 14. 10 is what the exporter writes and every ORT since 1.16 reads.
IR_VERSION = 10
# The opset of the standard-op lowerings: the oldest every pinned tool handles well.
DEFAULT_OPSET = 18
# The newest opset every lowering is exported at and loads in the pinned onnxruntime (measured:
# the exporter writes up to 26 and silently falls back to 18 beyond; ORT 1.31 refuses the
# standard Attention op at 26).
MAX_OPSET = 25
# Above this many bytes of initializers a model is saved with external data: protobuf's 2 GiB limit on one
# file, less 64 MiB of room for the graph, its names and its small constants.
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3 - 64 * 1024**2

# Metadata keys (model.metadata_props) --------------------------------------------------------------
CONFIG_KEY = "attnx.config"  # the AttentionConfig as JSON: a bare model.onnx describes itself
ATTENTION_KEY = "attnx.attention"  # the lowering the graph holds (read from the graph when written)
AUTO_KEY = "attnx.auto"  # auto's measurements and choice (JSON)
DTYPE_KEY = "attnx.dtype"  # the compute dtype, where it is not the inputs' (fp16 with fp32 I/O)
IO_DTYPE_KEY = "attnx.io_dtype"  # the dtype of the float inputs and output
ORT_OPTIMIZED_KEY = "attnx.ort_optimized"  # ONNX Runtime offline optimization: provider, level, version
DECODE_KEY = "attnx.decode"  # the step model's form (DECODE_FORMS), on models with config kv_cache
QUANT_KEY = "attnx.quantization"  # a quantized form's scheme, bits, block size, projections (JSON)
INT8_BITS_KEY = "attnx.int8_weight_bits"  # int8's weight width, 7 or 8 (none: 7; attnx.model.int8)


def quantization_of(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The quantization a model's metadata records (QUANT_KEY), or None for a float model."""
    import json

    text = metadata.get(QUANT_KEY)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise ModelFileError(f"the model's {QUANT_KEY!r} metadata is not JSON") from None
    if not isinstance(value, dict) or value.get("dtype") not in QUANTIZATIONS:
        raise ModelFileError(f"the model's {QUANT_KEY!r} metadata names no known quantized dtype")
    return value


# Providers and backends ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Provider:
    """An ONNX Runtime execution provider as attnx names it (--provider)."""

    name: str  # "cpu"
    backend: str  # the attnx backend that runs a model there: "ort-cpu"
    ort_name: str  # ONNX Runtime's name: "CPUExecutionProvider"
    torch_backend: str  # the torch backend on the same device: "torch" ("torch eager" in bench ratios)


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("cpu", "ort-cpu", "CPUExecutionProvider", "torch"),
        Provider("cuda", "ort-cuda", "CUDAExecutionProvider", "torch-cuda"),
    )
}

# The name of every backend attnx has, in the order reports list them (each name's runner class: the registry
# attnx.runtimes.RUNNERS).
REFERENCE = "reference"  # the numpy float64 formula every backend is compared with
BACKEND_NAMES = (REFERENCE, "torch", "ort-cpu", "ort-cuda", "torch-cuda", "openvino")
# The backends `attnx audit` runs a cut block on (those that run a model file: runs_onnx_model), in its order.
AUDIT_BACKENDS = ("ort-cpu", "openvino", "ort-cuda")


def get_provider(name: str, what: str = "provider") -> Provider:
    """The provider named `name` ("cpu", "cuda"), or one UsageError listing them."""
    return PROVIDERS[check_choice(what, name, PROVIDERS)]


def provider_of_backend(backend: str) -> Provider | None:
    """The provider an ONNX Runtime backend runs on; None for the other backends."""
    return next((p for p in PROVIDERS.values() if p.backend == backend), None)


def backend_device(backend: str) -> str | None:
    """The device an ONNX Runtime or torch backend computes on ("cpu", "cuda"); None for the
    numpy reference."""
    return next((p.name for p in PROVIDERS.values() if backend in (p.backend, p.torch_backend)), None)


# Lowerings and cores of the attention (attnx.model.cores: the registry) --------------------------------
# The torch module's cores (attnx.model.module): decomposed exports to MatMul/Softmax/MatMul,
# sdpa (F.scaled_dot_product_attention) to the standard Attention op at opset 23.
TORCH_CORES = ("decomposed", "sdpa")
# The terms F.scaled_dot_product_attention has not: the module's sdpa core refuses them rather than drop
# them (ALiBi it takes as its additive float mask; softcap would come after that mask there).
SDPA_LACKS = ("softcap", "sinks")


def sdpa_core_expresses(config: AttentionConfig) -> bool:
    """Whether the torch module's sdpa core (F.scaled_dot_product_attention) computes `config`."""
    return not any(t in SDPA_LACKS for t in config.terms)


# What each command's --attention takes (from the registry's LOWERINGS).
EXPORT_ATTENTIONS = tuple(lw.name for lw in LOWERINGS.values() if lw.export) + (AUTO,)
# optimize: every lowering, written afresh from the model's config and the weights read back from its graph
OPTIMIZE_ATTENTIONS = (*LOWERINGS, AUTO)
BENCH_ORT_LOWERINGS = tuple(lw.name for lw in LOWERINGS.values() if lw.bench)
# The lowering `attnx build` uses unless told otherwise: com.microsoft MultiHeadAttention, ORT's
# fused kernel on CPU and CUDA (faster than the decomposed graph at long sequences, and a fraction of
# its memory: measurements/cpu_baseline). Not "auto": it times candidates, so
# two builds could choose differently and the timings it records would differ byte for byte.
BUILD_ATTENTION = "ort-fused"


def check_opset(attention: str, opset: int | None) -> int:
    """The opset an export of `attention` is written at: `opset`, or the lowering's own when None.
    One outside what the lowering supports is a UsageError naming the range (never silently
    written at another opset)."""
    low = LOWERINGS[attention].opset if attention in LOWERINGS else DEFAULT_OPSET  # auto starts decomposed
    if opset is None:
        return low
    if isinstance(opset, bool) or not isinstance(opset, int) or not low <= opset <= MAX_OPSET:
        raise UsageError(f"--opset {opset!r} is outside what --attention {attention} supports ({low} to {MAX_OPSET})")
    return opset


def contract_dims(config: AttentionConfig, decode: str | None = None) -> dict[str, list[int | str]]:
    """Each graph input's and output's shape in the contract, dynamic dims by name (decode
    "buffer": the step model's buffer form, buffer_form_specs)."""
    if decode == "buffer":
        inputs, outputs = buffer_form_specs(config)
        return {s.name: list(s.shape) for s in inputs + outputs}
    return {s.name: list(s.shape) for s in config.inputs() + config.outputs()}


# Decode: the step model (config kv_cache) ---------------------------------------------------------
# Its forms (docs/concepts/step-forms.md): "growing" takes past_key/past_value [batch, n_kv_heads, past_seq, ..]
# and returns present_* [.., total_seq, ..] (a new cache each step); "buffer" binds one
# fixed-capacity cache as both past and present and writes only the new token's keys/values.
DECODE_FORMS = ("growing", "buffer")
def buffer_form_specs(config: AttentionConfig, dtype: str = "fp32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of the step model's buffer form (docs/concepts/step-forms.md): each cache tensor the
    config's core declares (config.cache_specs: past_key and past_value, or past_latent) is one buffer of `capacity`
    positions bound as both past_* and present_* (the same memory); seqlens_k int32 [batch] is the number of
    positions filled after this step minus 1 (each row its own) and total_sequence_length int32 [] the number filled
    after this step (the longest row's)."""
    c = config
    caches = c.cache_specs(dtype, "capacity")
    inputs = [
        TensorSpec("x", dtype, ("batch", "seq", c.d_model)),
        *(TensorSpec(spec.name, dtype, spec.shape) for spec in caches),
        TensorSpec("seqlens_k", "int32", ("batch",)),
        TensorSpec("total_sequence_length", "int32", ()),
    ]
    outputs = [
        TensorSpec("y", dtype, ("batch", "seq", c.d_model)),
        *(TensorSpec(spec.present, dtype, spec.shape) for spec in caches),
    ]
    return inputs, outputs


# The rows of the buffer form's cos/sin table (GroupQueryAttention do_rotary) unless told: positions
# 0..32767 (16 MB of float32 for a head of 128). A position past it is the op's error.
DEFAULT_ROPE_POSITIONS = 32768
ROPE_POSITIONS_KEY = "attnx.rope_positions"  # the buffer form's table rows (its positions 0..rows-1)


# Operators --------------------------------------------------------------------------------------
_DEFAULT_DOMAINS = ("", "ai.onnx")


def op_label(domain: str, op_type: str) -> str:
    """'MatMul' for the default domain, 'com.microsoft.MultiHeadAttention' for any other: the
    one spelling of every report (pass reports, inspect, ORT offline, the CUDA placement check)."""
    return op_type if domain in _DEFAULT_DOMAINS else f"{domain}.{op_type}"


def op_counts(nodes: Iterable[Any]) -> dict[str, int]:
    """{op_label: count} over `nodes`: onnx NodeProtos (graph.node) or onnx-ir nodes (a graph),
    anything with .domain and .op_type; subgraphs are not entered."""
    return dict(collections.Counter(op_label(n.domain, n.op_type) for n in nodes))


def lowering_from_nodes(nodes: Iterable[Seen]) -> str:
    """The lowering a graph holds, read from its nodes (attnx.model.seen.Seen: seen_in(graph) for a GraphProto):
    the lowering of the core found (attnx.model.recognise.graph_core). The one probe: the passes read onnx-ir
    graphs through it, describe() files."""
    return LOWERING_OF_CORE[graph_core(nodes)]


# Reading a model file ---------------------------------------------------------------------------
def config_from_metadata(metadata: Mapping[str, str], source: str, needed_for: str = "") -> AttentionConfig:
    """The AttentionConfig stored in a model's metadata, or one ModelFileError (exit 2)."""
    text = metadata.get(CONFIG_KEY)
    if text is None:
        raise ModelFileError(
            f"{source!r} has no {CONFIG_KEY!r} metadata"
            + (f": {needed_for}" if needed_for else ": it was not written by attnx export")
            + " (a model another tool exported: `attnx audit MODEL.onnx [--checkpoint HF_DIR]` checks its attention)"
        )
    try:
        return AttentionConfig.from_json(text)
    except ConfigError as e:
        raise ModelFileError(f"{source!r} has an invalid {CONFIG_KEY!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a model file is, read from the file alone (its external data is not opened)."""

    path: str
    config: AttentionConfig | None  # None: no (valid) attnx.config metadata; see config_error
    config_error: str | None
    lowering: str  # read from the graph (lowering_from_nodes), never from the metadata
    dtype: str  # the compute dtype: attnx.dtype metadata, else the dtype of input x
    io_dtype: str  # the dtype of input x (what a caller feeds)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    ir_version: int
    opsets: dict[str, int]
    producer: str
    metadata: dict[str, str]
    operators: dict[str, int]
    initializers: int
    initializer_bytes: int  # from their shapes and types: external data is not read
    external_data: tuple[str, ...]
    file_bytes: int
    decode: str | None = None  # the step model's form (DECODE_FORMS) when config kv_cache, else None
    quantization: dict[str, Any] | None = None  # QUANT_KEY's record, for the quantized forms

    def require_config(self, needed_for: str = "") -> AttentionConfig:
        """The config, or one ModelFileError saying why the model has none."""
        if self.config is None:
            config_from_metadata(self.metadata, self.path, needed_for)  # raises with the reason
        assert self.config is not None
        return self.config

    def to_dict(self) -> dict[str, Any]:
        """What `attnx inspect --json` prints."""
        return {
            "path": self.path,
            "ir_version": self.ir_version,
            "opsets": self.opsets,
            "producer": self.producer,
            "config": self.config.to_dict() if self.config is not None else None,
            **({"config_error": self.config_error} if self.config is None and self.config_error else {}),
            "lowering": self.lowering,
            "dtype": self.dtype,
            **({"quantization": _quant_summary(self.quantization)} if self.quantization else {}),
            "metadata": {k: v for k, v in self.metadata.items() if k not in (CONFIG_KEY, QUANT_KEY, STAGES_KEY)},
            # the formula's stages the graph names (attnx.model.stages; docs/concepts/localisation.md)
            "stages": list(stage_layouts(self.metadata)),
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
            "nodes": sum(self.operators.values()),
            "operators": dict(sorted(self.operators.items())),
            "initializers": self.initializers,
            "initializer_bytes": self.initializer_bytes,
            "external_data": list(self.external_data),
            "file_bytes": self.file_bytes,
            "decode": self.decode,
        }


def require_model_file(path: str) -> str:
    """`path`, when it is a file; else the one ModelFileError every reader of a model file gives."""
    if (why := not_a_file(path)) is not None:
        raise ModelFileError(f"model file {path!r} {why}")
    return path


def external_data_locations(model_path: str | os.PathLike[str]) -> list[str]:
    """The `location` of every tensor stored outside the model file, read from the model's
    protobuf alone (no data file is opened): initializers, sparse ones, node attributes,
    subgraphs, functions and training info."""
    path = os.fspath(model_path)
    return external_locations(_load_proto(path), path)


def external_data_tensors(model_path: str | os.PathLike[str]) -> list[Any]:
    """Every TensorProto stored outside the model file (external_data_locations' walk), each with its
    location, offset and length entries; ModelFileError for one with no location."""
    path = os.fspath(model_path)
    return external_tensors(_load_proto(path), path)


def _load_proto(path: str) -> Any:
    from google.protobuf.message import DecodeError

    require_model_file(path)
    try:
        proto = read_model(path)  # without importing onnx (its helpers load ml_dtypes: attnx.model._onnx_proto)
    except (DecodeError, OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"{path!r} is not an ONNX model: {first}") from None
    if not proto.graph.node and not proto.graph.input and not proto.graph.output:
        # protobuf parses many non-ONNX byte strings as an empty ModelProto
        raise ModelFileError(f"{path!r} is not an ONNX model: it has no graph")
    return proto


def _specs(values: Any) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(
            v.name,
            dtype_of_onnx(v.type.tensor_type.elem_type),
            tuple(_dim(d) for d in v.type.tensor_type.shape.dim),
        )
        for v in values
    )


def io_specs(proto: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) a ModelProto declares, as describe() reads them: name, dtype, dims (a dim's name or size)."""
    return _specs(proto.graph.input), _specs(proto.graph.output)


def _dim(d: Any) -> int | str:
    """A dim's name, else its size, else "?" (a dim shape inference left unknown: neither is set)."""
    return d.dim_param or (d.dim_value if d.HasField("dim_value") else "?")


def describe(path: str | os.PathLike[str], proto: Any = None) -> ModelInfo:
    """Read what the model file at `path` is: config, lowering (from the graph), dtype, inputs
    and outputs with dim names, IR version, opsets, operators, external data. ModelFileError
    (exit 2) for a file that is not an ONNX model. proto: the file's ModelProto as a command read it already
    (attnx.workflows.audit.whole: the input parsed once), not read again."""
    path = os.fspath(path)
    proto = _load_proto(path) if proto is None else proto
    metadata = {p.key: p.value for p in proto.metadata_props}
    try:
        config, config_error = config_from_metadata(metadata, path), None
    except ModelFileError as e:
        config, config_error = None, str(e)
    nodes = list(all_nodes(proto.graph))  # an If's branches too (the buffer form's switch core)
    lowering_name = lowering_from_nodes(seen_in(proto.graph))
    inputs, outputs = io_specs(proto)
    floats = [s for s in inputs if s.dtype in ("fp32", "fp16", "bf16")]  # a whole model's first is input_ids
    x = next((s for s in inputs if s.name == "x"), floats[0] if floats else inputs[0] if inputs else None)
    io_dtype = x.dtype if x is not None else "fp32"
    return ModelInfo(
        path=path,
        config=config,
        config_error=config_error,
        lowering=lowering_name,
        dtype=metadata.get(DTYPE_KEY, io_dtype),
        io_dtype=io_dtype,
        inputs=inputs,
        outputs=outputs,
        ir_version=proto.ir_version,
        opsets={o.domain or "ai.onnx": o.version for o in proto.opset_import},
        producer=f"{proto.producer_name} {proto.producer_version}".strip(),
        metadata=metadata,
        operators=op_counts(nodes),
        initializers=len(proto.graph.initializer),
        initializer_bytes=initializer_bytes(proto),
        external_data=tuple(external_locations(proto, path)),
        file_bytes=os.path.getsize(path),
        decode=metadata.get(DECODE_KEY),
        quantization=_quantization_or_none(metadata),
    )


@dataclasses.dataclass(frozen=True)
class ModelForm:
    """What a command runs a model file as: its config, dtype, lowering and decode form, each the
    model's own (model_form)."""

    info: ModelInfo
    config: AttentionConfig
    dtype: str  # the dtype a run computes in: the model's, or a runtime dtype (bf16) of its fp32 graph
    lowering: str  # read from the graph
    decode: str | None  # the step model's form (DECODE_FORMS), None for a full-sequence model

    def agree(
        self,
        *,
        config: AttentionConfig | None = None,
        dtype: str | None = None,
        lowering: str | None = None,
        decode: str | None = None,
        flags: Mapping[str, str] | None = None,
    ) -> ModelForm:
        """This form with the values a caller gave checked against it: a value not given is the
        model's; one that contradicts the model is one UsageError naming both, the flag spelt as
        `flags` says ({"dtype": "--dtype", ...}). bf16 agrees with an fp32 model: it is a runtime
        precision of the fp32 graph (RUNTIME_DTYPES)."""
        flags = {"config": "--config", "dtype": "--dtype", "lowering": "--attention", "decode": "--decode-form",
                 **(flags or {})}  # fmt: skip
        path = self.info.path
        where = f"the model {os.path.basename(path)!r}"
        leave = "leave {} out to use the model's (attnx inspect " + path + " shows it)"
        if config is not None and config != self.config:
            mine, its = config.to_dict(), self.config.to_dict()
            differ = ", ".join(f"{k} {mine.get(k)!r} vs {v!r}" for k, v in its.items() if mine.get(k) != v)
            raise UsageError(f"{flags['config']} contradicts {where}, which was exported from another config "
                             f"({differ}); " + leave.format(flags["config"]))  # fmt: skip
        its = {
            "dtype": (dtype, graph_dtype(dtype or "") != self.dtype, self.dtype),
            "lowering": (lowering, lowering != self.lowering, f"{self.lowering} (read from its graph)"),
            "decode": (decode, decode != self.decode,
                       f"the {self.decode} step model" if self.decode else "a full-sequence model"),
        }  # fmt: skip
        for what, (given, differs, model_value) in its.items():
            if given is not None and differs:
                raise UsageError(f"{flags[what]} {given} contradicts {where}, which is {model_value}; "
                                 + leave.format(flags[what]))  # fmt: skip
        return dataclasses.replace(self, dtype=dtype or self.dtype)


def model_form(path: str | os.PathLike[str], **given: Any) -> ModelForm:
    """The model at `path` describes itself: its config, dtype, lowering and decode form, read from
    the file (describe), with the values in `given` checked against them (ModelForm.agree)."""
    info = describe(path)
    config = info.require_config("attnx needs the config it was exported with")
    return ModelForm(info, config, info.dtype, info.lowering, info.decode).agree(**given)


def _quantization_or_none(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    try:
        return quantization_of(metadata)
    except ModelFileError:
        return None  # describe() reads what is there; the checks that need it raise


def _quant_summary(q: Mapping[str, Any]) -> dict[str, Any]:
    """What `attnx inspect` shows of a quantization: its scheme, and per projection its size and
    the relative RMS error its step gives the weights (the tolerance's input)."""
    keys = ("op", "bits", "weights", "per_channel", "block_size", "accuracy_level", "activations")
    out = {k: q.get(k) for k in keys if q.get(k) is not None}
    out["projections"] = {
        role: f"[{p['k']}, {p['n']}] step rms {p['step_rms']:.3g}, weight rel error {p['rel_error']:.3g}"
        for role, p in dict(q.get("projections") or {}).items()
    }
    return out


# Runtimes beside ONNX Runtime, and the precisions a runtime makes itself ------------------------
# OpenVINO (the `openvino` backend, the extra attnx[openvino]): its own runtime, on the CPU, reading
# attnx's ONNX graphs. Its precision is its INFERENCE_PRECISION_HINT, set from the dtype asked and
# read back from the compiled model (attnx.runtimes.openvino_runner).
OPENVINO = "openvino"
# Dtypes a runtime computes in from attnx's fp32 graph (or the torch module), converting as it
# compiles: no graph of their own is written. bf16: the torch module in torch.bfloat16, OpenVINO's
# bf16 precision hint. Inputs and outputs stay float32 on the host (numpy has no bfloat16).
RUNTIME_DTYPES = ("bf16",)


def graph_dtype(dtype: str) -> str:
    """The dtype of the ONNX graph a run in `dtype` reads: fp32 for a runtime dtype (bf16)."""
    return "fp32" if dtype in RUNTIME_DTYPES else dtype


def host_dtype(dtype: str) -> str:
    """The dtype of the host (numpy) arrays a run in `dtype` takes and returns: the dtype itself,
    or fp32 where numpy has none (bf16)."""
    d = DTYPES.get(dtype)
    if dtype in QUANTIZATIONS:  # issue 12: a quantized model's inputs and output are float32
        return "fp32"
    return dtype if d is not None and d.numpy is not None else "fp32"


def quantized_form_unavailable(backend: str, dtype: str) -> str | None:
    """Why `backend` does not run attnx's quantized `dtype` graph (int8, int4), or None where it
    does: the ort-* backends, and openvino (which quantizes the inputs its own way: its own rows in
    the tolerance table, attnx.runtimes.openvino_runner)."""
    if dtype not in QUANTIZATIONS or runs_onnx_model(backend):
        return None
    op = QUANTIZATIONS[dtype].op
    return f"backend {backend!r} does not run attnx's {dtype} form: it runs no ONNX graph, and {op} is ONNX Runtime's"


def runs_onnx_model(backend: str) -> bool:
    """Whether a backend runs an ONNX model file (ort-*, openvino) rather than the torch module
    or the numpy reference."""
    return provider_of_backend(backend) is not None or backend == OPENVINO
