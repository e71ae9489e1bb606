"""attnx.export: torch to ONNX, graph passes, model checks, packaging."""

from __future__ import annotations

from attnx.export._check import VALIDATION_SHAPES, check_dims, check_model_file, validate_against_torch
from attnx.export._export import (
    CONFIG_METADATA_KEY,
    IR_VERSION,
    LOWERINGS,
    default_opset,
    export_onnx,
    save_model,
)
from attnx.export._pipeline import EXPORT_DTYPES, ExportReport, export_model

__all__ = [
    "CONFIG_METADATA_KEY",
    "IR_VERSION",
    "LOWERINGS",
    "EXPORT_DTYPES",
    "VALIDATION_SHAPES",
    "ExportReport",
    "check_dims",
    "check_model_file",
    "default_opset",
    "export_model",
    "export_onnx",
    "save_model",
    "validate_against_torch",
]
