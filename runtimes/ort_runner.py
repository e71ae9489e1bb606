"""`ort-cpu` and `ort-cuda`: ONNX Runtime sessions on an exported model.

The provider a session asked for is checked against the providers the session really
got: ORT silently falls back to CPU when the CUDA provider cannot start, and
get_available_providers() lists CUDA whenever onnxruntime-gpu is installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import ModelFileError, ProviderUnavailable
from attnx.model.config import TensorSpec
from attnx.runtimes.base import Runner, register_backend, require_source

__all__ = ["OrtCpuRunner", "OrtCudaRunner", "ort_tensor_specs", "ORT_TYPES"]

# ORT's type strings to attnx dtype names.
ORT_TYPES = {
    "tensor(float)": "fp32",
    "tensor(float16)": "fp16",
    "tensor(bfloat16)": "bf16",
    "tensor(double)": "fp64",
    "tensor(bool)": "bool",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
}


def ort_tensor_specs(args: list[Any]) -> list[TensorSpec]:
    """TensorSpecs from a session's get_inputs()/get_outputs()."""
    return [
        TensorSpec(a.name, ORT_TYPES.get(a.type, a.type), tuple(d if isinstance(d, int) else str(d) for d in a.shape))
        for a in args
    ]


class OrtRunner(Runner):
    """Shared session handling. Subclasses give the providers they ask for."""

    provider = "CPUExecutionProvider"

    def __init__(self, source: Any, threads: int | None = None, session_options: Any = None) -> None:
        super().__init__(source)
        self.threads = threads
        self.session_options = session_options

    def provider_list(self) -> list[Any]:
        return [self.provider]

    def make_session_options(self) -> Any:
        import onnxruntime as ort

        opts = self.session_options or ort.SessionOptions()
        opts.log_severity_level = 3  # errors only: the CLI's output stays clean
        if self.threads:
            opts.intra_op_num_threads = self.threads
        return opts

    def load_impl(self) -> None:
        require_source(self, model_path=True)
        import onnxruntime as ort

        path = self.source.model_path
        if not os.path.isfile(path):
            raise ModelFileError(f"model file {path!r} does not exist")
        try:
            self.session = ort.InferenceSession(path, self.make_session_options(), providers=self.provider_list())
        except Exception as e:  # ORT raises its own Fail/InvalidGraph/... types
            raise ModelFileError(f"onnxruntime cannot load {path!r}: {_first_line(e)}") from None
        self.check_providers()
        self.inputs = ort_tensor_specs(self.session.get_inputs())
        self.outputs = ort_tensor_specs(self.session.get_outputs())
        self.output_names = [o.name for o in self.outputs]

    def check_providers(self) -> None:
        got = self.session.get_providers()
        if not got or got[0] != self.provider:
            raise ProviderUnavailable(
                f"backend {self.name!r} is unavailable: onnxruntime did not start {self.provider} "
                f"(session providers: {', '.join(got)})"
            )

    def run_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.session.run(self.output_names, {k: np.ascontiguousarray(v) for k, v in feeds.items()})
        return dict(zip(self.output_names, outs))

    def close_impl(self) -> None:
        del self.session


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@register_backend("ort-cpu")
class OrtCpuRunner(OrtRunner):
    provider = "CPUExecutionProvider"


@register_backend("ort-cuda")
class OrtCudaRunner(OrtRunner):
    provider = "CUDAExecutionProvider"

    def provider_list(self) -> list[Any]:
        # CPU stays in the list so shape ops may live there; check_providers() refuses a
        # session where CUDA itself did not start.
        return [(self.provider, {"device_id": 0, "use_tf32": 0}), "CPUExecutionProvider"]
