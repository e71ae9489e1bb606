"""`ort-cpu` and `ort-cuda`: ONNX Runtime sessions on an exported model.

The provider a session asked for is checked against the providers the session really
got: ORT silently falls back to CPU when the CUDA provider cannot start, and
get_available_providers() lists CUDA whenever onnxruntime-gpu is installed. For ort-cuda
the check goes further (runtimes/cuda.py): ORT's own reason for a failed start is captured
from its C++ log, the provider options are read back, and no compute node may sit on CPU.

ort-cuda runs through IOBinding: inputs and outputs live on the device, a torch CUDA
tensor is bound by its data pointer (no copy), a numpy array is copied to the device
once, and outputs come back to the host only when asked (`run` fetches; `run_on_device`
does not).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import ModelFileError, ProviderUnavailable, UsageError
from attnx.model.config import TensorSpec
from attnx.model.contract import (
    CONFIG_KEY,
    IR_VERSION,
    PROVIDERS,
    RUNTIME_DTYPES,
    dtype_of_ort,
    require_model_file,
)
from attnx.model.int8 import int8_host_refusal
from attnx.runtimes._iobinding import (
    _ELEMENT_TYPES,
    DeviceOutputs,
    IoBinder,
    _host_array,
    resolve_shape,
)
from attnx.runtimes.base import ModelSource, Runner, register_backend, require_source, runtime_threads
from attnx.runtimes.cuda import (
    ASSIGNMENT_INFO_KEY,
    CPU_PROVIDER,
    CUDA_PROVIDER,
    CudaOptions,
    NodePlacement,
    capture_native_stderr,
    cuda_reading,
    ort_build_cuda_reason,
    ort_cuda_build_hint,
    ort_cuda_failure_reason,
    ort_states_its_requirement,
    placement_problems,
    placements_from_assignment_info,
    placements_from_profile,
    provider_option_mismatches,
    unreported_options,
)

__all__ = [
    "OrtRunner",
    "OrtCpuRunner",
    "OrtCudaRunner",
    "IoBinder",
    "DeviceOutputs",
    "ort_tensor_specs",
    "resolve_shape",
    "import_onnxruntime",
    "ort_cuda_unavailable_reason",
]

logger = logging.getLogger(__name__)

def import_onnxruntime(backend: str) -> Any:
    """onnxruntime, or ProviderUnavailable naming the extra that installs it: the runtime is
    an extra of attnx (cpu: onnxruntime, gpu: onnxruntime-gpu), not a base dependency."""
    try:
        import onnxruntime
    except ImportError as e:
        raise ProviderUnavailable(
            f"backend {backend!r} is unavailable: onnxruntime is not installed ({e}); "
            "pip install 'attnx[cpu]' (or 'attnx[gpu]' for CUDA)"
        ) from None
    return onnxruntime


def ort_tensor_specs(args: list[Any]) -> list[TensorSpec]:
    """TensorSpecs from a session's get_inputs()/get_outputs() (a dim without a name: "?")."""
    return [
        TensorSpec(a.name, dtype_of_ort(a.type), tuple(d if isinstance(d, int) else str(d or "?") for d in a.shape))
        for a in args
    ]


class OrtRunner(Runner):
    """Shared session handling. Subclasses give the provider they ask for (the contract's
    Provider: .name "cpu", .ort_name "CPUExecutionProvider")."""

    provider = PROVIDERS["cpu"]

    def __init__(self, source: Any, threads: int | None = None, session_options: Any = None) -> None:
        super().__init__(source)
        self.threads = runtime_threads(threads)
        self.session_options = session_options

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import_onnxruntime(cls.name)
        except ProviderUnavailable as e:
            return str(e)
        return None

    @property
    def ort_provider(self) -> str:
        """ONNX Runtime's name of the provider this runner asks for."""
        return self.provider.ort_name

    def provider_list(self) -> list[Any]:
        return [self.ort_provider]

    def make_session_options(self) -> Any:
        ort = import_onnxruntime(self.name)
        opts = self.session_options or ort.SessionOptions()
        # errors only (the CLI's output stays clean), or quieter where the caller's options say so (the audit,
        # which reports each error the runtime raises, logs none)
        opts.log_severity_level = max(opts.log_severity_level, 3)
        if self.threads:
            opts.intra_op_num_threads = self.threads
        return opts

    def load_impl(self) -> None:
        require_source(self, model_path=True)
        if self.source.dtype in RUNTIME_DTYPES:  # never the fp32 graph reported as a bf16 run
            raise ProviderUnavailable(
                f"backend {self.name!r} has no {self.source.dtype} form: ONNX Runtime runs the graph in its own "
                f"dtype, and attnx writes no {self.source.dtype} graph ({self.source.dtype} runs: torch, openvino)"
            )
        path = require_model_file(self.source.model_path)
        self.session = self.create_session(path)
        # The one check of a model's int8 width against this host, for every run of a model file (verify, load,
        # run, parity): 8-bit weights are computed wrong by MLAS's u8s8 GEMM on a CPU without VNNI.
        metadata = self.session.get_modelmeta().custom_metadata_map
        refusal = int8_host_refusal(metadata, path)
        if refusal is not None:
            del self.session
            raise ModelFileError(refusal)
        self.check_providers()
        self.contract = CONFIG_KEY in metadata  # Runner's doc
        self.inputs = ort_tensor_specs(self.session.get_inputs())
        self.outputs = ort_tensor_specs(self.session.get_outputs())
        self.output_names = [o.name for o in self.outputs]

    def create_session(self, path: str) -> Any:
        ort = import_onnxruntime(self.name)
        try:
            return ort.InferenceSession(path, self.make_session_options(), providers=self.provider_list())
        except Exception as e:
            raise ModelFileError(f"onnxruntime cannot load {path!r}: {_first_line(e)}") from e  # the runtime's own, chained

    def check_providers(self) -> None:
        got = self.session.get_providers()
        if not got or got[0] != self.ort_provider:
            raise ProviderUnavailable(
                f"backend {self.name!r} is unavailable: onnxruntime did not start {self.ort_provider} "
                f"(session providers: {', '.join(got)})"
            )

    def run_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.session.run(self.output_names, {k: _host_array(v) for k, v in feeds.items()})
        return dict(zip(self.output_names, outs))

    def run_step_impl(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One step with the cache kept in ORT's buffers: the presents come back as OrtValues
        (run_with_ort_values) and are fed back as they are, never copied through numpy."""
        ort = import_onnxruntime(self.name)
        self.check_feeds({k: v if not isinstance(v, ort.OrtValue) else _shape_only(v) for k, v in feeds.items()})
        values = {k: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(_host_array(v))
                  for k, v in feeds.items()}  # fmt: skip
        return dict(zip(self.output_names, self.session.run_with_ort_values(self.output_names, values)))

    def close_impl(self) -> None:
        del self.session


def _shape_only(value: Any) -> np.ndarray:
    """A zero-stride array with an OrtValue's shape and dtype, for check_feeds (no data read)."""
    dtype = _ELEMENT_TYPES.get(dtype_of_ort(value.data_type()), np.float32)
    shape = tuple(value.shape())
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape, strides=(0,) * len(shape))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@register_backend(PROVIDERS["cpu"].backend)
class OrtCpuRunner(OrtRunner):
    provider = PROVIDERS["cpu"]


# ort-cuda ---------------------------------------------------------------------------------------
_dlls_preloaded = False


@register_backend(PROVIDERS["cuda"].backend)
class OrtCudaRunner(OrtRunner):
    """ONNX Runtime on CUDAExecutionProvider, through IOBinding.

    load() refuses a session that did not really start CUDA (session providers, provider
    options read back, no compute node on CPU) with ProviderUnavailable and ORT's reason.
    """

    provider = PROVIDERS["cuda"]
    binding_device = "cuda"  # where IOBinding puts inputs and outputs

    def __init__(
        self,
        source: Any,
        threads: int | None = None,
        session_options: Any = None,
        *,
        options: CudaOptions | None = None,
    ) -> None:
        super().__init__(source, threads, session_options)
        self.options = options or CudaOptions()
        self.binder: IoBinder | None = None
        self.placements: list[NodePlacement] = []

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return super().unavailable_reason() or ort_cuda_unavailable_reason()

    def provider_list(self) -> list[Any]:
        # CPU stays in the list so shape ops may live there (ORT puts them there on purpose);
        # check_placement() refuses a session whose compute nodes went to CPU.
        return [(self.ort_provider, self.options.provider_options()), CPU_PROVIDER]

    def make_session_options(self) -> Any:
        opts = super().make_session_options()
        opts.add_session_config_entry(ASSIGNMENT_INFO_KEY, "1")
        for name, size in (self.options.fixed_dims or {}).items():
            opts.add_free_dimension_override_by_name(name, size)
        return opts

    def unavailable(self, reason: str) -> ProviderUnavailable:
        return ProviderUnavailable(f"backend {self.name!r} is unavailable: {reason}")

    def create_session(self, path: str) -> Any:
        ort = import_onnxruntime(self.name)
        reason = ort_build_cuda_reason(ort)
        if reason is not None:
            raise self.unavailable(reason)
        self._preload_dlls(ort)
        self.ort_log = ""
        # Severity 2 for the creation alone: ORT logs "Require cuDNN .. and CUDA .." as a
        # warning; capture_native_stderr puts the caller's severity back after.
        with capture_native_stderr(ort_severity=2) as log, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                session = ort.InferenceSession(path, self.make_session_options(), providers=self.provider_list())
            except Exception as e:  # noqa: BLE001 - ORT raises its own types; kept to report after the loop
                error = e
            else:
                error = None
        self.ort_log = log.text + "".join(f"{w.message}\n" for w in caught)
        if error is not None:
            text = _first_line(error)
            lowered = text.lower()
            if "cuda" in lowered or "cudnn" in lowered or "cublas" in lowered:
                # A CUDA failure at creation (bad device id, CUDA graph refused, driver
                # error): the provider is what failed, not the model file.
                logged = ort_cuda_failure_reason(self.ort_log)
                hint = ""
                if "graph capture" in lowered and not self.options.fixed_dims:
                    hint = (
                        " (CudaOptions.fixed_dims makes the shapes static, so ORT can fold the shape ops off the CPU)"
                    )
                raise self.unavailable(
                    f"onnxruntime could not create a {self.ort_provider} session: {text}"
                    + (f" ({logged})" if logged and logged not in text else "")
                    + hint
                ) from None
            raise ModelFileError(f"onnxruntime cannot load {path!r}: {text}") from error
        return session

    def _preload_dlls(self, ort: Any) -> None:
        global _dlls_preloaded
        if not self.options.preload_dlls or _dlls_preloaded or not hasattr(ort, "preload_dlls"):
            return
        _dlls_preloaded = True
        import contextlib
        import io

        # preload_dlls prints what it could not load; that is a hint, the session
        # creation's log is the reason. Keep it off the terminal, in the debug log.
        text = io.StringIO()
        with capture_native_stderr(), contextlib.redirect_stdout(text):
            try:
                ort.preload_dlls()
            except Exception as e:  # noqa: BLE001 - it raises for a directory that does not exist
                print(f"preload_dlls failed: {e}", file=text)
        if text.getvalue().strip():
            logger.debug("onnxruntime.preload_dlls():\n%s", text.getvalue().rstrip())

    def check_providers(self) -> None:
        got = self.session.get_providers()
        if not got or got[0] != self.ort_provider:
            ort = import_onnxruntime(self.name)
            reason = ort_cuda_failure_reason(self.ort_log) or (
                "onnxruntime logged no reason (its default logger severity may be above errors; "
                "attnx --debug shows ORT's log)"
            )
            hint = ort_cuda_build_hint(ort)
            raise self.unavailable(
                f"onnxruntime did not start {self.ort_provider}: {reason}"
                + (f" ({hint})" if hint and not ort_states_its_requirement(self.ort_log) else "")
                + f" [session providers: {', '.join(got)}]"
            )
        asked = self.options.provider_options()
        reported = self.session.get_provider_options().get(self.ort_provider)
        mismatches = provider_option_mismatches(asked, reported)
        if mismatches:
            raise self.unavailable(f"{self.ort_provider} did not take its options: {'; '.join(mismatches)}")
        unreported = unreported_options(asked, reported)
        if unreported:
            logger.debug("%s does not report options %s", self.ort_provider, ", ".join(unreported))
        unsafe, compute = cuda_reading(self.source.model_path)
        if unsafe:
            raise self.unavailable(f"{os.path.basename(self.source.model_path)} cannot run on {self.ort_provider}: "
                                   f"{'; '.join(unsafe[:3])} (--buffer-core gqa writes a cache CUDA runs in place)")
        self.placements = self.session_placements()
        problems = placement_problems(self.placements, self.ort_provider, holds_compute=compute)
        if problems:
            raise self.unavailable(
                f"onnxruntime placed compute nodes off the GPU for {os.path.basename(self.source.model_path)}: "
                f"{', '.join(problems[:5])}" + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
            )
        off_gpu = [p for p in self.placements if p.provider != self.ort_provider]
        if off_gpu:
            logger.debug("nodes on other providers (shape arithmetic): %s",
                         ", ".join(f"{p.op_type}@{p.provider}" for p in off_gpu))  # fmt: skip

    def session_placements(self) -> list[NodePlacement]:
        """Which EP each node of the optimized graph got: ORT's assignment record, or on an
        ORT without it, one profiled run of a throwaway session."""
        if hasattr(self.session, "get_provider_graph_assignment_info"):
            return placements_from_assignment_info(self.session.get_provider_graph_assignment_info())
        return self._placements_by_profiling()

    def _placements_by_profiling(self) -> list[NodePlacement]:
        import onnxruntime as ort

        with tempfile.TemporaryDirectory(prefix="attnx-profile-") as tmp:
            opts = ort.SessionOptions()  # a fresh one: the caller's session_options stay untouched
            opts.log_severity_level = 3
            opts.enable_profiling = True
            opts.profile_file_prefix = os.path.join(tmp, "placement")
            with capture_native_stderr():
                probe = ort.InferenceSession(self.source.model_path, opts, providers=self.provider_list())
            probe.run(None, _smallest_feeds(ort_tensor_specs(probe.get_inputs())))
            with open(probe.end_profiling(), encoding="utf-8") as f:
                events = json.load(f)
            del probe
        return placements_from_profile(events)

    # Runs ---------------------------------------------------------------------------------
    def load_impl(self) -> None:
        super().load_impl()
        self.binder = IoBinder(
            self.session, self.binding_device, self.options.device_id, static=self.options.cuda_graph
        )

    def run_impl(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return self._bound_run(feeds, None).numpy()

    def run_on_device(self, feeds: Mapping[str, Any], out: Mapping[str, Any] | None = None) -> DeviceOutputs:
        """Run with inputs and outputs on the GPU and leave the outputs there. out: torch
        CUDA tensors to write the outputs into (no copy), by output name."""
        if not self.is_loaded:
            raise UsageError(f"runner {self.name!r} is not loaded: call load() or use it as a context manager")
        self.check_feeds(feeds)
        return self._bound_run(feeds, out)

    def _bound_run(self, feeds: Mapping[str, Any], out: Mapping[str, Any] | None) -> DeviceOutputs:
        assert self.binder is not None
        self.binder.bind_inputs(feeds)
        self.binder.bind_outputs(self.outputs, self._dims(feeds), out)
        return self.binder.run(self.output_names, out)

    def _dims(self, feeds: Mapping[str, Any]) -> dict[str, int]:
        """The sizes of the inputs' symbolic dims, by name: what an output's buffer is shaped from. Empty for a model
        outside attnx's contract (its dims' names are its exporter's): ORT allocates its outputs."""
        dims: dict[str, int] = {}
        if not self.contract:
            return dims
        for spec in self.inputs:
            for dim, size in zip(spec.shape, feeds[spec.name].shape):
                if isinstance(dim, str):
                    dims[dim] = int(size)
        return dims

    def close_impl(self) -> None:
        self.binder = None
        super().close_impl()


def _smallest_feeds(specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """Feeds of size 1 on every symbolic dim: enough for a run that shows node placement."""
    feeds = {}
    for spec in specs:
        shape = tuple(d if isinstance(d, int) else 1 for d in spec.shape)
        dtype = _ELEMENT_TYPES.get(spec.dtype)
        if dtype is None:
            raise UsageError(f"cannot make a placement-check feed for input {spec.name!r} of dtype {spec.dtype}")
        feeds[spec.name] = np.zeros(shape, dtype=dtype)
    return feeds


# Probe ----------------------------------------------------------------------------------------
@functools.cache
def ort_cuda_unavailable_reason(device_id: int = 0) -> str | None:
    """Why an ort-cuda session cannot run here, or None when it can: it really creates one
    on a one-MatMul model through OrtCudaRunner (providers and placement checked, one run),
    never trusting get_available_providers(). Cached for the process."""
    with tempfile.TemporaryDirectory(prefix="attnx-cuda-probe-") as tmp:
        path = os.path.join(tmp, "probe.onnx")
        _write_probe_model(path)
        try:
            with OrtCudaRunner(ModelSource(model_path=path), options=CudaOptions(device_id=device_id)) as runner:
                y = runner.run({"x": np.ones((2, 8), dtype=np.float32)})["y"]
        except ProviderUnavailable as e:
            return str(e)
    if not np.allclose(y, 8.0):  # x (ones) @ W (ones): every entry is 8
        return f"the probe MatMul on {CUDA_PROVIDER} returned wrong values (max {float(np.max(y))}, expected 8)"
    return None


def _write_probe_model(path: str) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], [1.0] * 64)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="probe_matmul")], "probe", [x],
                              [y], [w])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)
    onnx.save(model, path)
