"""attnx.runtimes, the run layer: the Runner interface and its backends by name, the one
comparator (attnx.runtimes.compare), parity, and the deployment side of packages (verify,
load). It reads models, never builds them: it imports nothing of attnx.export.

No torch, no onnxruntime at module level: a deployment machine may have only numpy, onnx and
the runtime, and the runtime is imported when a runner loads.
"""

from __future__ import annotations

from attnx.runtimes import openvino_runner, ort_runner, reference_runner, torch_runner  # noqa: F401  (registers backends)
from attnx.runtimes.base import RUNNERS, ModelSource, Runner, backend_names, create_runner, register_backend
from attnx.runtimes.compare import Comparison, case_label, compare_arrays, failed_run

__all__ = [
    "RUNNERS",
    "Comparison",
    "ModelSource",
    "Runner",
    "backend_names",
    "case_label",
    "compare_arrays",
    "create_runner",
    "failed_run",
    "register_backend",
]
