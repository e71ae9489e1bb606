"""attnx.model, the ground layer: the config, presets, the contract (names of lowerings,
dtypes, providers and backends, metadata keys, describe(model)), the torch module, the numpy
reference, weight I/O and the tolerance table. It imports nothing of attnx's upper layers.

Torch is imported only when the torch module is asked for, so that the reference and
weight I/O work on a deployment machine without torch.
"""

from __future__ import annotations

from typing import Any

from attnx.model.config import PRESETS, AttentionConfig, load_config, preset
from attnx.model.contract import ModelInfo, describe
from attnx.model.reference import reference_attention
from attnx.model.weights import (
    check_weights,
    from_torch_mha,
    from_torch_mha_state_dict,
    init_weights,
    load_weights,
    save_weights,
    weight_shapes,
)

__all__ = [
    "AttentionConfig",
    "PRESETS",
    "preset",
    "load_config",
    "describe",
    "ModelInfo",
    "reference_attention",
    "weight_shapes",
    "init_weights",
    "check_weights",
    "load_weights",
    "save_weights",
    "from_torch_mha_state_dict",
    "from_torch_mha",
    "MultiHeadAttention",
    "build_module",
]

_TORCH_NAMES = {"MultiHeadAttention", "build_module"}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from attnx.model import module

        return getattr(module, name)
    raise AttributeError(f"module 'attnx.model' has no attribute {name!r}")
