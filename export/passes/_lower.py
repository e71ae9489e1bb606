"""The declared pipelines of each lowering, and lower(), which runs one on a model.

    LOWERING_PIPELINES[name](dtype) -> the list of passes, in order

The fp16 conversion (attnx.export.passes.fp16) runs at the end of every pipeline when dtype
is fp16. The lowering the graph really holds afterwards (read from the graph by lowering_of,
not assumed) goes in the model's metadata (the contract's ATTENTION_KEY). `auto`, which
measures the pipelines on a runtime, is a workflow above this layer (attnx.workflows.lower).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from attnx.errors import UsageError
from attnx.export.passes._base import PipelineReport, run_pipeline
from attnx.export.passes._fuse_mha import FuseAttentionToMHA
from attnx.export.passes._names import NameStages
from attnx.export.passes._pack import FuseMHAToPackedAttention, PackQkvProjections
from attnx.export.passes._probe import lowering_of
from attnx.export.passes.fp16 import ConvertToFloat16
from attnx.export.passes.quantize import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, QuantizeProjections
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    ATTENTION_KEY,
    AUTO,
    OPTIMIZE_ATTENTIONS,
    QUANTIZATIONS,
    check_choice,
    check_llm_support,
    check_lowering,
    check_model_dtype,
)

__all__ = ["LOWERING_PIPELINES", "LoweringResult", "lowering_passes", "lower"]


def _cleanup() -> ir.passes.PassBase:
    return RemoveUnusedNodesPass()


# The pipelines, as data, one per lowering of the contract. "decomposed" and "onnx" are what
# the exporter writes: no pass.
LOWERING_PIPELINES: dict[str, Callable[[str], list[ir.passes.PassBase]]] = {
    "decomposed": lambda dtype: [],
    "onnx": lambda dtype: [],
    "ort-fused": lambda dtype: [FuseAttentionToMHA(dtype), _cleanup()],
    # The cleanup between: a projection MatMul can only be replaced once the bias Add the
    # fusion left dead no longer uses it.
    "ort-fused-packed": lambda dtype: [FuseAttentionToMHA(dtype), _cleanup(), PackQkvProjections(), _cleanup()],
    "ort-attention": lambda dtype: [FuseAttentionToMHA(dtype), _cleanup(), FuseMHAToPackedAttention(), _cleanup()],
}


def lowering_passes(
    lowering: str,
    dtype: str = "fp32",
    keep_io_fp32: bool = False,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
) -> list[ir.passes.PassBase]:
    """The passes of one lowering, in order, with the precision pass last: the fp16 conversion
    for fp16, the projections' quantization for int8 and int4 (block_size and accuracy_level:
    int4's MatMulNBits). The lowering's own passes see the float32 graph. NameStages names the
    float graph they leave (README, "Names"); the quantization after it keeps the names."""
    check_choice("lowering", lowering, LOWERING_PIPELINES)
    check_model_dtype(dtype, "dtype")
    float_dtype = "fp32" if dtype in QUANTIZATIONS else dtype
    passes = LOWERING_PIPELINES[lowering](float_dtype)
    if dtype == "fp16":
        passes.append(ConvertToFloat16(keep_io_fp32=keep_io_fp32))
    passes.append(NameStages())
    if dtype in QUANTIZATIONS:
        passes += [QuantizeProjections(dtype, block_size, accuracy_level), _cleanup()]
    return passes


@dataclasses.dataclass
class LoweringResult:
    model: ir.Model
    requested: str
    lowering: str  # what the graph holds now (lowering_of)
    report: PipelineReport
    auto: Any = None  # auto's measured choice (attnx.workflows.AutoChoice), when it chose

    def lines(self) -> list[str]:
        out = [] if self.auto is None else self.auto.lines()
        head = f"lowering: {self.lowering}"
        if self.requested not in (self.lowering, AUTO):
            head += f" (requested {self.requested}: see the pass notes)"
        return out + [head] + self.report.lines()


def lower(
    model: ir.Model,
    config: AttentionConfig,
    *,
    attention: str = "ort-fused",
    dtype: str = "fp32",
    keep_io_fp32: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
) -> LoweringResult:
    """Run the pipeline of `attention` on `model` in place and record the lowering the graph
    then holds in its metadata. `auto` is measured, not declared: attnx.workflows.lower."""
    if attention == AUTO:
        raise UsageError("auto measures the lowerings on a runtime: attnx.workflows.lower, not the graph passes")
    if attention == "onnx" and lowering_of(model) != "onnx":
        raise UsageError("--attention onnx is written by the exporter at opset 23 (attnx export --attention onnx)")
    if attention != "onnx":
        check_choice("--attention", attention, OPTIMIZE_ATTENTIONS)
    check_lowering(config, attention)
    check_llm_support(config, attention, dtype)  # rope, softcap, ...: a lowering that expresses them, fp32
    if config.llm_keys and attention != "decomposed":
        raise UsageError(
            f"the graph passes do not rewrite a graph with {', '.join(config.llm_keys)}: its {attention} graph is built "
            f"directly (attnx export --attention {attention})"
        )
    if attention == "decomposed" and lowering_of(model) != "decomposed":
        raise UsageError(f"the model's attention is {lowering_of(model)} already: no pass turns it back into decomposed")
    passes = lowering_passes(attention, dtype, keep_io_fp32, block_size=block_size, accuracy_level=accuracy_level)
    model, report = run_pipeline(model, passes)
    lowering = lowering_of(model)
    model.metadata_props[ATTENTION_KEY] = lowering
    return LoweringResult(model, attention, lowering, report)
