"""The dtypes attnx builds and runs (DTYPES), the quantized forms (QUANTIZATIONS), and each dtype's names in numpy,
torch, ONNX and ONNX Runtime: one table, read by the contract (attnx.model.contract re-exports it), the passes, the
runners and the tolerance table."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from attnx.errors import UsageError
from attnx.model.cores import MS_DOMAIN

__all__ = ["BF16_RUNTIMES", "check_choice", "DType", "DTYPES", "MODEL_DTYPES", "QUANTIZATIONS", "QUANTIZED_DTYPES", "Quantization",
           "check_model_dtype", "dtype_name", "dtype_of_onnx", "dtype_of_ort", "float_dtype", "numpy_dtype"]


def check_choice(what: str, value: Any, known: Iterable[str]) -> Any:
    """`value` when it is one of `known`, else one UsageError naming it and the choices."""
    known = list(known)
    if value not in known:
        raise UsageError(f"unknown {what} {value!r} (known: {', '.join(known)})")
    return value


# Dtypes -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DType:
    """One dtype and its spelling in each library. `name` is attnx's (fp32, fp16, ...)."""

    name: str
    numpy: str | None  # None: numpy has no such type (bfloat16)
    torch: str  # the torch attribute: torch.float32, ...
    onnx: int  # onnx.TensorProto.DataType (onnx-ir's ir.DataType has the same values)
    ort: str  # ONNX Runtime's type string in get_inputs()


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("fp32", "float32", "float32", 1, "tensor(float)"),
        DType("fp16", "float16", "float16", 10, "tensor(float16)"),
        DType("bf16", None, "bfloat16", 16, "tensor(bfloat16)"),
        DType("fp64", "float64", "float64", 11, "tensor(double)"),
        DType("bool", "bool", "bool", 9, "tensor(bool)"),
        DType("int32", "int32", "int32", 6, "tensor(int32)"),
        DType("int64", "int64", "int64", 7, "tensor(int64)"),
        DType("int8", "int8", "int8", 3, "tensor(int8)"),
        DType("uint8", "uint8", "uint8", 2, "tensor(uint8)"),
        DType("int4", None, "int4", 22, "tensor(int4)"),  # no numpy or torch int4 type
    )
}


# Quantized forms (issue 12) ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Quantization:
    """A precision form whose four projections are quantized and whose inputs, outputs and
    attention core stay float32 (attnx.export.passes.quantize writes it; its error model is in
    attnx.model.tolerance)."""

    name: str  # int8, int4
    op: str  # the ONNX Runtime operator each projection becomes
    bits: int
    weights: str  # how the weights are quantized
    activations: str  # how the projection's input is quantized at run time ("none": weight-only)


QUANTIZATIONS: dict[str, Quantization] = {
    q.name: q
    for q in (
        # DynamicQuantizeMatMul (MLAS u8s8 GEMM): the fastest of the int8 candidates measured
        # (measurements/quantized_forms).
        Quantization("int8", f"{MS_DOMAIN}.DynamicQuantizeMatMul", 8, "symmetric 7- or 8-bit per output channel (int8 storage)",
                     "dynamic uint8 per row (each row divided by its max |x|, then per tensor)"),
        Quantization("int4", f"{MS_DOMAIN}.MatMulNBits", 4, "asymmetric 4-bit per block of K (zero points)",
                     "int8 per block of K (accuracy_level 4)"),
    )
}  # fmt: skip


QUANTIZED_DTYPES = tuple(QUANTIZATIONS)


# The dtypes a model is written in (--dtype of export, optimize, build, parity, bench): float32, float16
# (the whole graph, a step model's cache too), or quantized projections around a float32 core. Which
# core takes which is the registry's (attnx.model.cores).
MODEL_DTYPES = ("fp32", "fp16", *QUANTIZED_DTYPES)


# bf16 is no graph of attnx's: ONNX Runtime's CPU provider has no fast bfloat16 MatMul (its bf16
# kernels are reference loops), so bf16 is a runtime precision set on the fp32 graph.
BF16_RUNTIMES = "OpenVINO with inference precision bf16 on the fp32 graph (backend openvino), or torch in bf16"


def float_dtype(dtype: str) -> str:
    """The float dtype a model of `dtype` takes and computes its attention core in: fp32 for the
    quantized forms (their inputs, outputs and core stay float), the dtype itself otherwise."""
    return "fp32" if dtype in QUANTIZATIONS else dtype


def check_model_dtype(dtype: str, what: str = "--dtype") -> str:
    """`dtype` when a model may be written in it; bf16 is refused saying where it runs."""
    if dtype == "bf16":
        raise UsageError(
            f"{what} bf16: no attnx graph computes in bfloat16 (ONNX Runtime's CPU provider has no fast bf16 "
            f"MatMul); bf16 is a runtime precision of the fp32 model: {BF16_RUNTIMES}"
        )
    return check_choice(what, dtype, MODEL_DTYPES)


_BY_NUMPY = {np.dtype(d.numpy): d.name for d in DTYPES.values() if d.numpy}


_BY_TORCH = {f"torch.{d.torch}": d.name for d in DTYPES.values()}


_BY_ONNX = {d.onnx: d.name for d in DTYPES.values()}


_BY_ORT = {d.ort: d.name for d in DTYPES.values()}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of an attnx dtype name (UsageError for one numpy has not: bf16)."""
    d = DTYPES.get(name)
    if d is None or d.numpy is None:
        raise UsageError(f"dtype {name!r} has no numpy type")
    return np.dtype(d.numpy)


def dtype_name(value: Any) -> str:
    """attnx's name (fp32, fp16, bool, ...) of a numpy or torch dtype, or of the dtype of a
    numpy array or a torch tensor; an unknown dtype keeps its own spelling."""
    dtype = value if isinstance(value, np.dtype) else getattr(value, "dtype", None)
    if dtype is None and type(value).__module__ == "torch":
        dtype = value  # a torch.dtype itself (never str(value): that formats a whole array)
    if dtype is None:
        return type(value).__name__
    if isinstance(dtype, np.dtype):
        return _BY_NUMPY.get(dtype, str(dtype))
    return _BY_TORCH.get(str(dtype), str(dtype).replace("torch.", ""))  # a torch dtype


def dtype_of_onnx(elem_type: int) -> str:
    """attnx's name of an ONNX element type (TensorProto or onnx-ir DataType value)."""
    return _BY_ONNX.get(int(elem_type), f"onnx type {int(elem_type)}")


def dtype_of_ort(type_string: str) -> str:
    """attnx's name of an ONNX Runtime type string ("tensor(float)" -> "fp32")."""
    return _BY_ORT.get(type_string, type_string)
