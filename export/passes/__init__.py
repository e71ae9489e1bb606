"""attnx.export.passes: graph passes over the exported model, as declared pipelines.

Each pass is an onnx-ir pass (`pass(model) -> PassResult(model, modified)`) that keeps notes
of what it changed; a lowering is a list of passes (LOWERING_PIPELINES, one per lowering of
the contract) and run_pipeline() reports each one. lower() runs one lowering's pipeline on a
model. Graph work only: nothing here runs a model (the checks and `auto`'s measurements are
attnx.workflows).
"""

from __future__ import annotations

from attnx.export.passes._base import AttnxPass, PassRecord, PipelineReport, count_ops, run_pipeline
from attnx.export.passes._fuse_mha import FuseAttentionToMHA, FusionPlan, attention_cores
from attnx.export.passes._lower import LOWERING_PIPELINES, LoweringResult, lower, lowering_passes
from attnx.export.passes._masks import KeyMask, NotFusable
from attnx.export.passes._pack import FuseMHAToPackedAttention, PackQkvProjections

# Reduced precision (issue 12)
from attnx.export.passes._probe import (
    lowering_of,
    qk_weights,
    v_weights,
)
from attnx.export.passes.fp16 import ConvertToFloat16
from attnx.export.passes.quantize import (
    BLOCK_SIZES,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCK_SIZE,
    QuantizeProjections,
    dequantize_node,
)

__all__ = [
    "LOWERING_PIPELINES",
    "AttnxPass",
    "ConvertToFloat16",
    "FuseAttentionToMHA",
    "FuseMHAToPackedAttention",
    "FusionPlan",
    "KeyMask",
    "LoweringResult",
    "NotFusable",
    "PackQkvProjections",
    "PassRecord",
    "PipelineReport",
    "attention_cores",
    "count_ops",
    "lower",
    "lowering_of",
    "lowering_passes",
    "qk_weights",
    "run_pipeline",
    # Reduced precision (issue 12)
    "BLOCK_SIZES",
    "DEFAULT_ACCURACY_LEVEL",
    "DEFAULT_BLOCK_SIZE",
    "QuantizeProjections",
    "dequantize_node",
    "v_weights",
]
