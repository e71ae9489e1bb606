"""`torch` and `torch-cuda`: the attnx torch module itself, eager.

torch is imported inside the runner, never at module level (a deployment machine may
have no torch).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import ProviderUnavailable
from attnx.model.config import DTYPES
from attnx.runtimes.base import Runner, register_backend, require_source

__all__ = ["TorchRunner", "TorchCudaRunner", "torch_cuda_unavailable_reason"]

_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}


@register_backend("torch")
class TorchRunner(Runner):
    device = "cpu"
    attention = "decomposed"  # the module's core: "decomposed" or "sdpa"

    def load_impl(self) -> None:
        require_source(self, config=True, weights=True)
        if importlib.util.find_spec("torch") is None:
            raise ProviderUnavailable(f"backend {self.name!r} is unavailable: torch is not installed")
        import torch

        from attnx.model.module import build_module

        self._torch = torch
        cfg = self.source.config
        self._dtype = getattr(torch, _TORCH_DTYPES[self.source.dtype])
        self.module = build_module(cfg, self.source.weights, attention=self.attention).to(self.device, self._dtype)
        self.inputs = cfg.inputs(self.source.dtype)
        self.outputs = cfg.outputs(self.source.dtype)

    def to_device(self, value: Any) -> Any:
        torch = self._torch
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        return torch.from_numpy(np.ascontiguousarray(value)).to(self.device)

    def run_impl(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        torch = self._torch
        kwargs = {name: self.to_device(value) for name, value in feeds.items()}
        with torch.inference_mode():
            y = self.module(**kwargs)
        out_dtype = DTYPES.get(self.source.dtype, "float32")  # numpy has no bf16: float32
        return {"y": y.to(getattr(torch, out_dtype)).cpu().numpy()}

    def close_impl(self) -> None:
        del self.module


def torch_cuda_unavailable_reason() -> str | None:
    """Why torch cannot run on a CUDA device here, or None when it can."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return "torch finds no usable CUDA device"
    return None


@register_backend("torch-cuda")
class TorchCudaRunner(TorchRunner):
    device = "cuda"

    def load_impl(self) -> None:
        reason = torch_cuda_unavailable_reason()
        if reason is not None:
            raise ProviderUnavailable(f"backend 'torch-cuda' is unavailable: {reason}")
        import torch

        # TF32 rounds float32 matmul inputs to 10 bits of mantissa: off for parity runs.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        super().load_impl()

    def run_impl(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        out = super().run_impl(feeds)
        self._torch.cuda.synchronize()
        return out
