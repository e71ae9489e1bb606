"""optimize_file: write a saved model in another lowering, check it against the original, then write it.

What `attnx optimize IN.onnx --out OUT.onnx` does: the model's config (its metadata) and weights (read
back from its graph by their names: attnx.export.read_weights) written in the lowering asked, from the
registry (attnx.export.build_model), as `attnx export` would. Nothing is written unless the new
model passes the same checks as an export (onnx checker, contract dims, loads in
onnxruntime) and agrees with IN on shapes the export never saw, on the target provider.
The lowered model is written beside OUT under a temporary name and renamed into place only
then (data file first, so a model never points at a missing data file).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import onnx_ir as ir

from attnx._io import Staging, check_output_file, output_lock
from attnx.errors import CheckFailed, ModelFileError, UsageError
from attnx.export import read_weights, save_model
from attnx.export.passes import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE
from attnx.model.contract import QUANTIZATIONS, check_model_dtype, describe, get_provider
from attnx.model.int8 import int8_weight_bits
from attnx.runtimes import create_runner
from attnx.runtimes.base import ModelSource
from attnx.runtimes.compare import Comparison
from attnx.workflows._checks import PARITY_SHAPES, check_model_file, compare_models
from attnx.workflows._lower import AUTO_SHAPE, LoweringResult, lower

__all__ = ["OptimizeResult", "optimize_file"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class OptimizeResult:
    in_path: str
    out_path: str
    files: list[str]  # what was written; empty when the checks failed
    dtype: str
    lowering: LoweringResult
    parity: list[Comparison]

    @property
    def passed(self) -> bool:
        return bool(self.parity) and all(self.parity)

    def failures(self) -> list[str]:
        return [str(c) for c in self.parity if not c]


def optimize_file(
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    attention: str = "ort-fused",
    dtype: str | None = None,
    keep_io_fp32: bool = False,
    provider: str = "cpu",
    shapes: Sequence[tuple[int, int, int]] = PARITY_SHAPES,
    auto_shape: tuple[int, int, int] = AUTO_SHAPE,
    raise_on_failure: bool = True,
    progress: Callable[[str], None] = lambda msg: None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    int8_bits: int | str = "auto",
    opened: Any = None,
) -> OptimizeResult:
    """Lower IN, check OUT against IN on `provider` at `shapes`, write OUT only if it passes.

    dtype None keeps IN's dtype; int8_bits: an int8 model's weight width (7, 8, auto: attnx.model.int8). A
    failed check raises CheckFailed (exit 1), or with raise_on_failure=False returns a result whose `files`
    is empty. opened: IN as the command opened it (attnx.workflows.audit.whole.open_whole_model), read from
    that parse, never parsed again."""
    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    backend = get_provider(provider, "--provider").backend
    check_output_file(out_path, "--out")
    if os.path.abspath(out_path) == os.path.abspath(in_path):
        raise UsageError("--out must differ from the input model: the input is the reference of the parity check")
    progress(f"loading {in_path}")
    info = describe(in_path, opened.proto if opened is not None else None)
    config = info.require_config("optimize works on models written by attnx export")
    if config.kv_cache:
        raise UsageError(
            f"{in_path!r} is a step model ('kv_cache': true): write its lowering with attnx export "
            "--attention decomposed|onnx|ort-fused, not optimize"
        )
    dtype = dtype or info.dtype
    if info.dtype == "fp16" and dtype == "fp32":
        raise UsageError(f"{in_path!r} is a float16 model: it cannot be optimized back to fp32")
    check_model_dtype(dtype)
    int8_weight_bits(dtype, int8_bits)  # an explicit width for another dtype is refused before any work
    if info.dtype in QUANTIZATIONS:
        raise UsageError(f"{in_path!r} is an {info.dtype} model: optimize the float32 model it was quantized from")
    if provider != "cpu":
        progress(f"checking that {backend} runs here")
        with create_runner(backend, ModelSource(config, None, in_path, info.dtype)):
            pass  # ProviderUnavailable (exit 2) with ORT's reason otherwise
    try:
        model = ir.load(in_path) if opened is None else opened.model
    except Exception as e:  # noqa: BLE001 - describe() read it: only its external data can fail here
        raise ModelFileError(f"{in_path!r} cannot be loaded: {str(e).strip().splitlines()[0]}") from None
    progress(f"reading the weights of {in_path}")
    weights = read_weights(model, config)  # the tolerance is sized from them too
    del model
    if opened is not None:
        opened.release()  # the weights are copies: ONNX Runtime checks parity on its own copy of the file
    progress(f"writing the {attention} graph ({dtype})")
    result = lower(
        config, weights, attention=attention, dtype=dtype, keep_io_fp32=keep_io_fp32, provider=provider,
        auto_shape=auto_shape, progress=progress, block_size=block_size, accuracy_level=accuracy_level,
        int8_bits=int8_bits,
    )  # fmt: skip
    with output_lock(out_path), Staging(out_path) as stage:
        staged = stage.path()
        save_model(ir.from_proto(result.model), staged)
        result.model = None  # type: ignore[assignment]  # free it: a big model is on disk now
        progress("checking the optimized model (onnx checker, dims, onnxruntime load)")
        check_model_file(staged, config, f"{out_path} (not written)")
        progress(f"checking parity against {in_path} on {backend}")
        parity = compare_models(in_path, staged, config, dtype=dtype, provider=provider, shapes=shapes, weights=weights)
        out = OptimizeResult(in_path, out_path, [], dtype, result, parity)
        if not out.passed:
            if raise_on_failure:
                raise CheckFailed(
                    f"{out_path} not written: the optimized model disagrees with {in_path}: " + "; ".join(out.failures())
                )
            return out
        out.files = stage.publish()
    return out
