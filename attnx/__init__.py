"""attnx: one multi-head attention model from PyTorch to ONNX Runtime, verified number by number.

The public API, re-exported lazily: `import attnx` imports neither torch nor onnxruntime,
so a deployment machine with only numpy, onnx and onnxruntime can use the runtime side.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from attnx.errors import (
    AttnxError,
    CheckFailed,
    ConfigError,
    ExportError,
    InputError,
    ModelFileError,
    PackageError,
    ProviderUnavailable,
    UsageError,
    WeightsError,
)

try:
    __version__ = version("attnx")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

# name -> module that defines it
_EXPORTS = {
    "AttentionConfig": "attnx.model",
    "PRESETS": "attnx.model",
    "preset": "attnx.model",
    "load_config": "attnx.model",
    "init_weights": "attnx.model",
    "load_weights": "attnx.model",
    "save_weights": "attnx.model",
    "from_torch_mha_state_dict": "attnx.model",
    "from_torch_mha": "attnx.model",
    "reference_attention": "attnx.model",
    "MultiHeadAttention": "attnx.model",
    "build_module": "attnx.model",
    "describe": "attnx.model",
    "export_model": "attnx.workflows",
    "export_onnx": "attnx.export",
    "optimize_model": "attnx.workflows",
    "build_package": "attnx.workflows",
    "build_model_package": "attnx.workflows",
    "import_model": "attnx.workflows",
    "audit_model": "attnx.workflows",
    "import_weights": "attnx.model.importers",
    "create_runner": "attnx.runtimes",
    "ModelSource": "attnx.runtimes",
    "backend_names": "attnx.runtimes",
    "run_parity": "attnx.runtimes.parity",
    "load": "attnx.runtimes.package",
    "verify_package": "attnx.runtimes.package",
    "run_decode_parity": "attnx.runtimes.decode",
}

__all__ = [  # noqa: PLE0604 - *_EXPORTS: the lazy exports' names (str keys)
    "__version__",
    "AttnxError",
    "CheckFailed",
    "ConfigError",
    "ExportError",
    "InputError",
    "ModelFileError",
    "PackageError",
    "ProviderUnavailable",
    "UsageError",
    "WeightsError",
    *_EXPORTS,
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
