"""attnx.export.passes: graph passes over the exported model, as declared pipelines.

Each pass is an onnx-ir pass (`pass(model) -> PassResult(model, modified)`) that keeps notes
of what it changed; a lowering is a list of passes (LOWERING_PIPELINES) and run_pipeline()
reports each one. lower_model() is what `attnx export` calls; optimize_file() is
`attnx optimize`.
"""

from __future__ import annotations

from attnx.export.passes._base import AttnxPass, PassRecord, PipelineReport, count_ops, run_pipeline
from attnx.export.passes._fuse_mha import FuseAttentionToMHA, FusionPlan, attention_cores
from attnx.export.passes._lower import (
    ATTENTION_KEY,
    AUTO_CANDIDATES,
    AUTO_KEY,
    AUTO_SHAPE,
    LOWERING_PIPELINES,
    PASS_LOWERINGS,
    AutoChoice,
    LoweringResult,
    choose_lowering,
    lower,
    lower_model,
    lowering_passes,
)
from attnx.export.passes._masks import KeyMask, NotFusable
from attnx.export.passes._pack import FuseMHAToPackedAttention, PackQkvProjections
from attnx.export.passes._probe import lowering_of, qk_weights
from attnx.export.passes._verify import PARITY_SHAPES, compare_models

__all__ = [
    "ATTENTION_KEY",
    "AUTO_CANDIDATES",
    "AUTO_KEY",
    "AUTO_SHAPE",
    "LOWERING_PIPELINES",
    "PARITY_SHAPES",
    "PASS_LOWERINGS",
    "AttnxPass",
    "AutoChoice",
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
    "choose_lowering",
    "compare_models",
    "count_ops",
    "lower",
    "lower_model",
    "lowering_of",
    "lowering_passes",
    "qk_weights",
    "run_pipeline",
]
