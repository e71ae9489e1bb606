"""attnx.export.passes: graph passes, each an onnx-ir pass (`pass(model) -> PassResult(model, modified)`)
that keeps notes of what it changed: the precision of a graph (ConvertToFloat16, QuantizeProjections)
and the formula's names (NameStages, for the graph the torch exporter wrote). The attention core is not
a pass: each lowering is written by the registry's emitters (attnx.export.build_model). Graph work only:
nothing here runs a model.
"""

from __future__ import annotations

from attnx.export.passes._base import AttnxPass, PassRecord, PipelineReport, const_array, count_ops, run_pipeline
from attnx.export.passes._lower import PrecisionResult, convert_precision, precision_passes
from attnx.export.passes._masks import KeyMask
from attnx.export.passes._names import NameStages
from attnx.export.passes.fp16 import ConvertToFloat16
from attnx.export.passes.quantize import (
    BLOCK_SIZES,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCK_SIZE,
    QuantizeProjections,
    dequantize_node,
)
from attnx.export.passes.walk import NotRead

__all__ = [
    "AttnxPass",
    "BLOCK_SIZES",
    "ConvertToFloat16",
    "DEFAULT_ACCURACY_LEVEL",
    "DEFAULT_BLOCK_SIZE",
    "KeyMask",
    "NameStages",
    "NotRead",
    "PassRecord",
    "PipelineReport",
    "PrecisionResult",
    "QuantizeProjections",
    "const_array",
    "convert_precision",
    "count_ops",
    "dequantize_node",
    "precision_passes",
    "run_pipeline",
]
