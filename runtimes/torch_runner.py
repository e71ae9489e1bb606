"""`torch` and `torch-cuda`: the attnx torch module itself, eager.

torch is imported inside the runner, never at module level (a deployment machine may
have no torch).

torch-cuda sets its numerics on purpose for the run and puts the caller's settings back
at close: TF32 off (it rounds float32 matmul inputs to 10 mantissa bits, which breaks
float32 parity) and, for half precision, no reduced-precision reductions (cuBLAS may
otherwise sum split-K partials in float16). A benchmark may ask for either
(allow_tf32=True, reduced_precision_reduction=True). After loading, the module's parameters are checked to be on the GPU: a
torch-cuda run never computes on the CPU.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import InputError, ProviderUnavailable, UsageError
from attnx.model.contract import DTYPES, PROVIDERS, host_dtype
from attnx.runtimes.base import Runner, register_backend, require_source

__all__ = ["TorchRunner", "TorchCudaRunner", "torch_cuda_unavailable_reason"]

logger = logging.getLogger(__name__)


@register_backend(PROVIDERS["cpu"].torch_backend)
class TorchRunner(Runner):
    device = "cpu"
    core = "decomposed"  # the module's attention core: "decomposed" or "sdpa" (the contract's TORCH_CORES)

    def __init__(self, source: Any, *, core: str | None = None) -> None:
        super().__init__(source)
        if core is not None:
            self.core = core

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if importlib.util.find_spec("torch") is not None else "torch is not installed"

    def load_impl(self) -> None:
        require_source(self, config=True, weights=True)
        if importlib.util.find_spec("torch") is None:
            raise ProviderUnavailable(f"backend {self.name!r} is unavailable: torch is not installed")
        import torch

        from attnx.model.module import build_module

        self._torch = torch
        cfg = self.source.config
        self._dtype = getattr(torch, DTYPES[self.source.dtype].torch)
        self.module = build_module(cfg, self.source.weights, core=self.core).to(self.device, self._dtype)
        # bf16: float32 on the host (numpy has no bfloat16), cast to the module's dtype in to_device
        self.inputs = cfg.inputs(host_dtype(self.source.dtype))
        self.outputs = cfg.outputs(host_dtype(self.source.dtype))
        self.precision = self.source.dtype

    def to_device(self, value: Any) -> Any:
        torch = self._torch
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
        if tensor.is_floating_point() and tensor.dtype != self._dtype:  # float32 feeds of a bf16 run
            tensor = tensor.to(self._dtype)
        return tensor.to(self.device)

    def forward(self, feeds: Mapping[str, Any]) -> Any:
        """y as a torch tensor on the runner's device (no host copy)."""
        torch = self._torch
        kwargs = {name: self.to_device(value) for name, value in feeds.items()}
        with torch.inference_mode():
            return self.module(**kwargs)

    def run_impl(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        y = self.forward(feeds)
        out_dtype = getattr(self._torch, DTYPES[self.source.dtype].numpy or "float32")  # numpy has no bf16
        if self.source.config.kv_cache:  # the step model: y, present_key, present_value
            return {s.name: t.to(out_dtype).cpu().numpy() for s, t in zip(self.outputs, y)}
        return {"y": y.to(out_dtype).cpu().numpy()}

    def close_impl(self) -> None:
        del self.module


def torch_cuda_unavailable_reason(device_id: int = 0) -> str | None:
    """Why torch cannot run on CUDA device `device_id` here, or None when it can. It
    allocates on the device, so a driver or architecture mismatch shows here, not later."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable CUDA device"
    count = torch.cuda.device_count()
    if not 0 <= device_id < count:
        return f"CUDA device {device_id} does not exist (torch sees {count})"
    try:
        probe = torch.ones(8, device=f"cuda:{device_id}")
        ok = float((probe @ probe).item()) == 8.0
    except Exception as e:  # noqa: BLE001 - RuntimeError from the CUDA runtime: no kernel image, OOM, ...
        text = str(e).strip().splitlines()
        return f"torch cannot compute on cuda:{device_id}: {text[0] if text else type(e).__name__}"
    if not ok:
        return f"torch computed a wrong value on cuda:{device_id}"
    return None


@register_backend(PROVIDERS["cuda"].torch_backend)
class TorchCudaRunner(TorchRunner):
    """The torch module on one GPU, float32 (TF32 off unless asked) or float16/bfloat16."""

    def __init__(
        self,
        source: Any,
        *,
        device_id: int = 0,
        core: str | None = None,
        allow_tf32: bool = False,
        reduced_precision_reduction: bool = False,
    ) -> None:
        super().__init__(source, core=core)
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise UsageError(f"CUDA device id must be a non-negative integer, got {device_id!r}")
        self.device = f"cuda:{device_id}"
        self.device_id = device_id
        self.allow_tf32 = allow_tf32
        # Half-precision GEMMs may sum split-K partials in half precision: torch's default and
        # faster, but not the parity setting. A benchmark sets it to compare with torch as shipped.
        self.reduced_precision_reduction = reduced_precision_reduction
        self._saved_flags: dict[str, bool] | None = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return torch_cuda_unavailable_reason()

    def load_impl(self) -> None:
        reason = torch_cuda_unavailable_reason(self.device_id)
        if reason is not None:
            raise ProviderUnavailable(f"backend {self.name!r} is unavailable: {reason}")
        import torch

        self._set_numerics(torch)
        try:
            super().load_impl()
            self.check_placement()
        except BaseException:
            self._restore_numerics(torch)
            raise

    def _numerics_flags(self, torch: Any) -> dict[str, tuple[Any, str]]:
        return {
            "matmul.allow_tf32": (torch.backends.cuda.matmul, "allow_tf32"),
            "cudnn.allow_tf32": (torch.backends.cudnn, "allow_tf32"),
            "matmul.allow_fp16_reduced_precision_reduction": (
                torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
            "matmul.allow_bf16_reduced_precision_reduction": (
                torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
        }  # fmt: skip

    def _set_numerics(self, torch: Any) -> None:
        flags = self._numerics_flags(torch)
        self._saved_flags = {key: bool(getattr(obj, attr)) for key, (obj, attr) in flags.items()}
        wanted = {
            "matmul.allow_tf32": self.allow_tf32,
            "cudnn.allow_tf32": self.allow_tf32,
            "matmul.allow_fp16_reduced_precision_reduction": self.reduced_precision_reduction,
            "matmul.allow_bf16_reduced_precision_reduction": self.reduced_precision_reduction,
        }
        for key, (obj, attr) in flags.items():
            setattr(obj, attr, wanted[key])

    def _restore_numerics(self, torch: Any) -> None:
        if self._saved_flags is None:
            return
        for key, (obj, attr) in self._numerics_flags(torch).items():
            setattr(obj, attr, self._saved_flags[key])
        self._saved_flags = None

    def check_placement(self) -> None:
        """Every parameter and buffer of the module on this runner's GPU (checked against the
        GPU the runner was made for, not against self.device: the check must catch a
        device string that went wrong too)."""
        want = f"cuda:{self.device_id}"
        tensors = [*self.module.parameters(), *self.module.buffers()]
        off = sorted({str(t.device) for t in tensors} - {want})
        if off or not tensors:
            raise ProviderUnavailable(
                f"backend {self.name!r} is unavailable: the module's tensors are on {', '.join(off) or 'nothing'}, "
                f"not {want}"
            )

    def to_device(self, value: Any) -> Any:
        torch = self._torch
        if isinstance(value, torch.Tensor) and value.device.type == "cuda" and value.device.index != self.device_id:
            raise InputError(f"a feed is on {value.device}, this runner computes on {self.device}")
        return super().to_device(value)

    def run_on_device(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Outputs as torch tensors on the GPU, not copied to the host. torch runs
        asynchronously: the caller synchronizes (torch.cuda.synchronize) before timing."""
        if not self.is_loaded:
            raise UsageError(f"runner {self.name!r} is not loaded: call load() or use it as a context manager")
        self.check_feeds(feeds)
        return {"y": self.forward(feeds)}

    def close_impl(self) -> None:
        super().close_impl()
        self._restore_numerics(self._torch)
