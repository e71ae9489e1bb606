"""attnx.runtimes: the Runner interface, backends by name, and the parity comparison.

No torch at module level: a deployment machine may have only numpy and onnxruntime.
"""

from __future__ import annotations

from attnx.runtimes import ort_runner, reference_runner, torch_runner  # noqa: F401  (registers backends)
from attnx.runtimes.base import BACKENDS, ModelSource, Runner, backend_names, create_runner, register_backend

__all__ = ["BACKENDS", "ModelSource", "Runner", "backend_names", "create_runner", "register_backend"]
