"""The passes over a graph the torch exporter wrote: its precision and its names, as a declared list.

Every lowering but the torch-exported decomposed form is written by the registry's emitters
(attnx.export.build_model), float32, then converted (with_dtype). The torch export, the decomposed
full-sequence model traced from PyTorch, goes through this list instead:

    ConvertToFloat16 (fp16), NameStages, QuantizeProjections (int8, int4)

NameStages names the float graph the conversion leaves (docs/reference/onnx-graph.md, "Names"); the quantization after it
finds the projections by those names and keeps them.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from attnx.export.passes._base import PipelineReport, run_pipeline
from attnx.export.passes._names import NameStages
from attnx.export.passes.fp16 import ConvertToFloat16
from attnx.export.passes.quantize import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, QuantizeProjections
from attnx.model.contract import QUANTIZATIONS, check_model_dtype

__all__ = ["PrecisionResult", "precision_passes", "convert_precision"]


def precision_passes(
    dtype: str = "fp32",
    keep_io_fp32: bool = False,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    int8_bits: int | str = "auto",
) -> list[ir.passes.PassBase]:
    """The passes that put a torch-exported float32 graph in `dtype`, in order: the fp16 conversion
    (keep_io_fp32: float32 inputs and outputs, cast at the boundary), the names, the projections'
    quantization for int8 and int4 (block_size and accuracy_level: int4's MatMulNBits; int8_bits: int8's
    weight width, attnx.model.int8)."""
    check_model_dtype(dtype, "dtype")
    passes: list[ir.passes.PassBase] = []
    if dtype == "fp16":
        passes.append(ConvertToFloat16(keep_io_fp32=keep_io_fp32))
    passes.append(NameStages())
    if dtype in QUANTIZATIONS:
        passes += [QuantizeProjections(dtype, block_size, accuracy_level, int8_bits), RemoveUnusedNodesPass()]
    return passes


@dataclasses.dataclass
class PrecisionResult:
    model: ir.Model
    report: PipelineReport


def convert_precision(model: ir.Model, dtype: str, keep_io_fp32: bool = False, *,
                      block_size: int = DEFAULT_BLOCK_SIZE, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                      int8_bits: int | str = "auto") -> PrecisionResult:  # fmt: skip
    """Run precision_passes on `model` in place."""
    passes = precision_passes(dtype, keep_io_fp32, block_size=block_size, accuracy_level=accuracy_level,
                              int8_bits=int8_bits)  # fmt: skip
    model, report = run_pipeline(model, passes)
    return PrecisionResult(model, report)
