"""`openvino`: attnx's ONNX graphs on the OpenVINO runtime, CPU (the extra attnx[openvino]).

OpenVINO reads the ONNX file itself (`Core.read_model`, its ONNX frontend): every attnx
lowering, com.microsoft.MultiHeadAttention and Attention included (measured with OpenVINO
2026.4.1). Not through ONNX Runtime's OpenVINO execution provider: that ships as
onnxruntime-openvino, a build of its own that owns the `onnxruntime` module (it cannot sit
beside the pinned onnxruntime-gpu), refuses bf16 on CPU (then silently runs the session on
CPUExecutionProvider), leaves MultiHeadAttention to ORT's CPU kernels and cannot read the
standard Attention op.

Its precision is never the machine's default. OpenVINO's CPU plugin computes in bf16 by
default where the CPU has bf16 instructions (AMX, AVX-512 BF16), which moves the numbers far past
float32's tolerance (measured: measurements/facts.md). So INFERENCE_PRECISION_HINT is always set
from the dtype asked (fp32 -> f32, bf16 -> bf16, fp16 -> f16), read back from the compiled model,
and a compiled model that computes in anything else is refused (ProviderUnavailable, with what it
got): a CPU without float16 compute compiles f16 as bf16, and that is not a float16 run. Threads
likewise (INFERENCE_NUM_THREADS), when given.

The CPU plugin's runtime cache of shape-specialised kernels is switched off
(CPU_RUNTIME_CACHE_CAPACITY 0): with it, OpenVINO 2026.4.1 computes plain self-attention (no
mask; every lowering) wrongly at seq >= 16 after a call at seq 1 on the same compiled model
(on the parity matrix's batch 1: seq 1, 7, then 128; right when seq 128 comes first; the error
measured: measurements/facts.md). Without the cache each new shape builds its kernels afresh,
and a run at one fixed shape costs a few percent more (measured: measurements/facts.md): the
price of right numbers.

One more fault is refused by name: OpenVINO 2026.4.1 reads com.microsoft.Attention (the
ort-attention lowering) but ignores its `scale` attribute, so a model with a custom scale
computes softmax(q.k / sqrt(head_dim)) instead (the error measured: measurements/facts.md).

And one precision: an fp16 model of a rope config keeps its rotary angle (position * inv_freq)
float32 (attnx.export.passes.fp16: in float16 its rounding is whole radians at position 8192);
under the f16 hint OpenVINO computes that region in f16 too, and fails parity at position 8192 by
several times the bound where ort-cpu stays far within it (tests' llama and llm layers, decomposed
and onnx lowerings; measured: measurements/facts.md). So fp16 of a rope model is refused with that
reason; precision="fp32" runs it (its float16 weights widened: within the bound).

attnx's quantized forms (int8, int4) run too, with the f32 hint: their float part (the attention
core, softmax, inputs and output) is float32 as on ONNX Runtime. OpenVINO reads their weights
from the graph (com.microsoft DynamicQuantizeMatMul's int8 per channel, MatMulNBits' 4-bit
blocks) but not the graph's quantization of the inputs: it runs each projection as one of its
compressed-weight FullyConnected nodes and quantizes the input itself, int8 in groups of
DYNAMIC_QUANTIZATION_GROUP_SIZE values along K (set here to OPENVINO_INPUT_GROUP, read back; 0
would switch it off). 32 is OpenVINO's default, kept: measured (OpenVINO 2026.4.1, the int8 graph
of the large preset; each group size's error and time: measurements/facts.md), float inputs are the
most accurate and the slowest, and groups of 32 are both faster and more accurate than one group per
row (ONNX Runtime's per-row scheme). The tolerance table's openvino rows (model/tolerance.py) take
that scheme's step, bounded by the row's peak: a group lies within a row. With the bf16 hint the same
graph computes its core in bf16 too (more error: measurements/facts.md): no form attnx verifies.

openvino is imported when a runner loads, never at module level.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import ModelFileError, ProviderUnavailable, UsageError
from attnx.model.contract import CONFIG_KEY, MS_DOMAIN, OPENVINO, QUANTIZATIONS, describe, float_dtype, host_dtype
from attnx.model.cores import CORES, LOWERINGS
from attnx.runtimes._iobinding import contiguous
from attnx.runtimes.base import Runner, register_backend, require_source, runtime_threads

__all__ = ["OPENVINO_INPUT_GROUP", "OPENVINO_PRECISIONS", "OpenvinoRunner", "compile_config", "openvino_unavailable_reason"]

# attnx's dtype -> OpenVINO's INFERENCE_PRECISION_HINT (an ov.Type's name).
OPENVINO_PRECISIONS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
# DYNAMIC_QUANTIZATION_GROUP_SIZE: how many values of a quantized projection's input share one int8
# scale (OpenVINO's own default, made explicit; it acts on compressed weights only, so float graphs
# are not touched).
OPENVINO_INPUT_GROUP = 32
_FROM_OPENVINO = {v: k for k, v in OPENVINO_PRECISIONS.items()}
DEVICE = "CPU"


def compile_config(precision: str, threads: int | None, *, shape_cache: bool = False) -> dict[str, Any]:
    """The CPU plugin's settings every OpenVINO run of attnx uses: the precision asked (its hint), the shape
    cache off (it gives wrong results: the module doc), the quantized forms' input groups, the threads."""
    config: dict[str, Any] = {
        "INFERENCE_PRECISION_HINT": OPENVINO_PRECISIONS[precision],
        "CPU_RUNTIME_CACHE_CAPACITY": 5000 if shape_cache else 0,  # its shape cache gives wrong results (module doc)
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": OPENVINO_INPUT_GROUP,  # the quantized forms' inputs (module doc)
    }
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    return config


def openvino_unavailable_reason() -> str | None:
    """Why the openvino backend cannot run here (the package is missing), or None."""
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed: pip install 'attnx[openvino]'"
    return None


@register_backend(OPENVINO)
class OpenvinoRunner(Runner):
    """An attnx ONNX model compiled by OpenVINO for the CPU, in an explicit precision.

    precision: "fp32", "bf16" or "fp16" (None: the source's dtype, the model's compute
    dtype; fp32 for an int8 or int4 model, whose float part is float32). The compiled model's
    precision is read back and must be the one asked for; `precision` then holds it (with the
    inputs' quantization for a quantized model). threads: INFERENCE_NUM_THREADS (None: OpenVINO's choice).
    A precision argument outside those is a UsageError at once; a source dtype outside them
    (a parity run in another dtype) makes the backend unavailable at load, with the reason."""

    def __init__(self, source: Any, *, precision: str | None = None, threads: int | None = None,
                 shape_cache: bool = False) -> None:  # fmt: skip
        """shape_cache: leave the CPU plugin's shape cache on (the fault of the module doc): only to
        reproduce that fault (tests/runtimes/test_localise.py localises it)."""
        super().__init__(source)
        self.shape_cache = shape_cache
        threads = runtime_threads(threads)
        if precision is not None and precision not in OPENVINO_PRECISIONS:
            raise UsageError(
                f"backend {OPENVINO!r} computes in {', '.join(OPENVINO_PRECISIONS)} (its INFERENCE_PRECISION_HINT), "
                f"not {precision!r}"
            )
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise UsageError(f"threads must be a positive integer, got {threads!r}")
        if precision not in (None, "fp32") and source.dtype in QUANTIZATIONS:
            raise UsageError(
                f"backend {OPENVINO!r} runs attnx's {source.dtype} form in fp32 (its float part), not {precision}: "
                f"a {precision} core on top of the quantized projections is no form attnx verifies"
            )
        self.requested = precision if precision is not None else float_dtype(source.dtype)
        self.threads = threads
        self.precision: str | None = None  # read back from the compiled model at load

    @classmethod
    def unavailable_reason(cls) -> str | None:
        reason = openvino_unavailable_reason()
        return None if reason is None else f"backend {OPENVINO!r} is unavailable: {reason}"

    def load_impl(self) -> None:
        require_source(self, model_path=True)
        reason = self.unavailable_reason()
        if reason is not None:
            raise ProviderUnavailable(reason)
        if self.requested not in OPENVINO_PRECISIONS:
            raise ProviderUnavailable(
                f"backend {OPENVINO!r} has no {self.requested} form: it computes in "
                f"{', '.join(OPENVINO_PRECISIONS)} (its INFERENCE_PRECISION_HINT)"
            )
        import openvino as ov

        path = self.source.model_path
        info = describe(path)  # the contract's names and dims (OpenVINO keeps none); a missing file: ModelFileError
        if info.decode is not None and LOWERINGS[info.lowering].contrib:  # decomposed and onnx step models pass
            raise ProviderUnavailable(
                f"backend {OPENVINO!r} cannot run the {info.lowering} step model ({info.decode} cache): OpenVINO "
                f"{ov.__version__} fails at run time on com.microsoft MultiHeadAttention/GroupQueryAttention with a "
                "past (a Reshape whose pattern disagrees with its input)"
            )
        core = ov.Core()
        if DEVICE not in core.available_devices:
            raise ProviderUnavailable(
                f"backend {OPENVINO!r} is unavailable: OpenVINO {ov.__version__} finds no {DEVICE} device "
                f"(devices: {', '.join(core.available_devices) or 'none'})"
            )
        if self.requested == "fp16" and info.config is not None and info.config.rope is not None:
            raise ProviderUnavailable(
                f"backend {OPENVINO!r} cannot run this rope model in fp16: under its f16 precision hint it computes the "
                "rotary angle, kept float32 in the model, in f16 (8-24x over the bound at position 8192); "
                "precision='fp32' runs it, or ort-cpu"
            )
        fault = _known_fault(path, info.lowering)
        if fault is not None:
            raise ProviderUnavailable(
                f"backend {OPENVINO!r} cannot run the {info.lowering} lowering of this model: {fault}"
            )
        try:
            model = core.read_model(path)
        except RuntimeError as e:  # OpenVINO's errors (GeneralFailure, ...) are RuntimeErrors with a long text
            raise ProviderUnavailable(
                f"backend {OPENVINO!r} cannot run the {info.lowering} lowering: OpenVINO {ov.__version__} cannot "
                f"read {os.path.basename(path)!r}: {_reason(e)}"
            ) from e  # the runtime's own, chained
        config = compile_config(self.requested, self.threads, shape_cache=self.shape_cache)
        try:
            self.compiled = core.compile_model(model, DEVICE, config)
        except RuntimeError as e:
            raise ProviderUnavailable(
                f"backend {OPENVINO!r} cannot compile the {info.lowering} lowering of {os.path.basename(path)!r} "
                f"in {self.requested}: {_reason(e)}"
            ) from e
        self.precision = self.check_compiled()
        if self.source.dtype in QUANTIZATIONS:
            self.precision += f", inputs int8 in groups of {OPENVINO_INPUT_GROUP}"
        self.request = self.compiled.create_infer_request()
        self.ov_version = ov.__version__
        self.lowering = info.lowering
        self.contract = CONFIG_KEY in info.metadata  # Runner's doc
        # Host arrays: float inputs and output in the graph's own dtype (fp32 for a bf16 run).
        self.inputs = [s.__class__(s.name, host_dtype(s.dtype), s.shape) for s in info.inputs]
        self.outputs = [s.__class__(s.name, host_dtype(s.dtype), s.shape) for s in info.outputs]
        compiled_names = sorted(p.get_any_name() for p in self.compiled.inputs)
        if compiled_names != sorted(s.name for s in self.inputs):
            raise ModelFileError(
                f"OpenVINO compiled {os.path.basename(path)!r} with inputs {compiled_names}, the file declares "
                f"{sorted(s.name for s in self.inputs)}"
            )
        self._ports = {p.get_any_name(): p for p in self.compiled.outputs}

    def check_compiled(self) -> str:
        """The precision the compiled model computes in, read back; ProviderUnavailable when it
        is not the one asked for (the CPU lacks it and OpenVINO chose another), or the input
        quantization's groups or the threads differ from those asked for."""
        got_type = self.compiled.get_property("INFERENCE_PRECISION_HINT")
        got = _FROM_OPENVINO.get(got_type.get_type_name(), got_type.get_type_name())
        if got != self.requested:
            raise ProviderUnavailable(
                f"backend {OPENVINO!r} cannot run in {self.requested} here: asked INFERENCE_PRECISION_HINT="
                f"{OPENVINO_PRECISIONS[self.requested]}, the compiled model computes in {got} "
                f"(this CPU has no {self.requested} compute OpenVINO uses)"
            )
        group = int(self.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE"))
        if group != OPENVINO_INPUT_GROUP:
            raise ProviderUnavailable(
                f"backend {OPENVINO!r}: asked DYNAMIC_QUANTIZATION_GROUP_SIZE={OPENVINO_INPUT_GROUP}, the compiled "
                f"model uses {group} (attnx sets every setting that changes the numbers, and checks it was taken)"
            )
        if self.threads is not None:
            threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))
            if threads != self.threads:
                raise ProviderUnavailable(
                    f"backend {OPENVINO!r}: asked INFERENCE_NUM_THREADS={self.threads}, the compiled model uses {threads}"
                )
        return got

    def run_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # share_outputs=False (the default): the results are copies, not views of the request's
        # buffers that the next run overwrites.
        results = self.request.infer({k: contiguous(v) for k, v in feeds.items()})
        return {name: np.asarray(results[port]) for name, port in self._ports.items()}

    def close_impl(self) -> None:
        del self.request
        del self.compiled


_SCALE_IGNORED = (MS_DOMAIN, "Attention")  # an op whose scale attribute OpenVINO ignores (measured)


def _known_fault(path: str, lowering: str) -> str | None:
    """Why OpenVINO would compute this model wrongly, for the faults measured (module doc), or None."""
    if not any((CORES[c].domain, CORES[c].op_type) == _SCALE_IGNORED for cs in LOWERINGS[lowering].cores.values()
               for c in cs):  # fmt: skip
        return None
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    for node in graph.node:
        if (node.domain, node.op_type) != _SCALE_IGNORED:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        hidden = attrs.get("qkv_hidden_sizes")
        if "scale" not in attrs or not hidden:
            continue
        default = 1.0 / math.sqrt(hidden[0] / attrs["num_heads"])
        if not math.isclose(attrs["scale"], default, rel_tol=1e-6):
            return (
                f"OpenVINO ignores {MS_DOMAIN}.Attention's scale attribute ({attrs['scale']:.6g} here, "
                f"it computes with {default:.6g}); the ort-fused lowering carries the scale it reads"
            )
    return None


def _reason(e: BaseException) -> str:
    """The informative line of an OpenVINO error (its first lines are a source location)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if "does not support" in line or "not supported" in line:
            return line[:300]
    return (lines[-1] if lines else type(e).__name__)[:300]
