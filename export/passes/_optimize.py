"""optimize_file: lower a saved model, check it against the original, then write it.

What `attnx optimize IN.onnx --out OUT.onnx` does. Nothing is written unless the lowered
model passes the same checks as an export (onnx checker, contract dims, loads in
onnxruntime) and agrees with IN on shapes the export never saw, on the target provider.
The lowered model is written beside OUT under a temporary name and renamed into place only
then (data file first, so a model never points at a missing data file).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Sequence

import onnx_ir as ir

from attnx.errors import CheckFailed, ConfigError, ModelFileError, UsageError
from attnx.export.passes._lower import AUTO_SHAPE, LoweringResult, lower
from attnx.export.passes._probe import qk_weights
from attnx.export.passes._verify import PARITY_SHAPES, compare_models
from attnx.model.config import AttentionConfig
from attnx.model.tolerance import Comparison

__all__ = ["OptimizeResult", "optimize_file", "load_attnx_model", "POST_LOWERING_HOOKS", "PROVIDERS"]

logger = logging.getLogger(__name__)

PROVIDERS = ("cpu", "cuda")

# Called on the lowered model before it is saved and checked. A test hook: the tests put a
# function here that breaks the model (as a faulty pass would) to see optimize refuse it.
POST_LOWERING_HOOKS: list[Callable[[ir.Model], None]] = []


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


def load_attnx_model(path: str | os.PathLike[str]) -> tuple[ir.Model, AttentionConfig]:
    """The model at `path` and the config stored in it, or one clear error (exit 2)."""
    from attnx.export._export import CONFIG_METADATA_KEY

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelFileError(f"model file {path!r} does not exist")
    try:
        model = ir.load(path)
    except Exception as e:  # protobuf's DecodeError and friends: not an ONNX file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"{path!r} is not an ONNX model: {first}") from None
    if len(model.graph) == 0 and not model.graph.outputs:
        # protobuf parses many non-ONNX byte strings as an empty ModelProto
        raise ModelFileError(f"{path!r} is not an ONNX model: it has no graph")
    text = model.metadata_props.get(CONFIG_METADATA_KEY)
    if text is None:
        raise ModelFileError(
            f"{path!r} has no {CONFIG_METADATA_KEY!r} metadata: optimize works on models written by attnx export"
        )
    try:
        config = AttentionConfig.from_json(text)
    except ConfigError as e:
        raise ModelFileError(f"{path!r} has an invalid {CONFIG_METADATA_KEY!r}: {e}") from None
    return model, config


def _model_dtype(model: ir.Model) -> str:
    x = model.graph.inputs[0] if model.graph.inputs else None
    if model.metadata_props.get("attnx.dtype") == "fp16" or (x is not None and x.dtype == ir.DataType.FLOAT16):
        return "fp16"
    return "fp32"


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
) -> OptimizeResult:
    """Lower IN, check OUT against IN on `provider` at `shapes`, write OUT only if it passes.

    dtype None keeps IN's dtype. A failed check raises CheckFailed (exit 1), or with
    raise_on_failure=False returns a result whose `files` is empty."""
    from attnx.export._check import check_model_file
    from attnx.export._export import publish_staged_model, save_model
    from attnx.runtimes import ModelSource, create_runner

    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    if provider not in PROVIDERS:
        raise UsageError(f"unknown --provider {provider!r} (known: {', '.join(PROVIDERS)})")
    parent = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(parent):
        raise UsageError(f"output folder {parent!r} does not exist")
    if os.path.abspath(out_path) == os.path.abspath(in_path):
        raise UsageError("--out must differ from the input model: the input is the reference of the parity check")
    progress(f"loading {in_path}")
    model, config = load_attnx_model(in_path)
    in_dtype = _model_dtype(model)
    dtype = dtype or in_dtype
    if in_dtype == "fp16" and dtype == "fp32":
        raise UsageError(f"{in_path!r} is a float16 model: it cannot be optimized back to fp32")
    if provider != "cpu":
        progress(f"checking that ort-{provider} runs here")
        with create_runner(f"ort-{provider}", ModelSource(config, None, in_path, in_dtype)):
            pass  # ProviderUnavailable (exit 2) with ORT's reason otherwise
    weights = qk_weights(model)  # before lowering: the tolerance is sized from IN's own weights
    progress(f"running graph passes ({attention}, {dtype})")
    result = lower(
        model, config, attention=attention, dtype=dtype, keep_io_fp32=keep_io_fp32, provider=provider,
        auto_shape=auto_shape, progress=progress,
    )  # fmt: skip
    for hook in POST_LOWERING_HOOKS:
        hook(result.model)
    name = os.path.basename(out_path)
    with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=parent) as tmp:
        staged = os.path.join(tmp, name)
        save_model(result.model, staged)
        result.model = None  # type: ignore[assignment]  # free it: a big model is on disk now
        progress("checking the optimized model (onnx checker, dims, onnxruntime load)")
        check_model_file(staged, config)
        progress(f"checking parity against {in_path} on ort-{provider}")
        parity = compare_models(in_path, staged, config, dtype=dtype, provider=provider, shapes=shapes, weights=weights)
        out = OptimizeResult(in_path, out_path, [], dtype, result, parity)
        if not out.passed:
            if raise_on_failure:
                raise CheckFailed(
                    f"{out_path} not written: the optimized model disagrees with {in_path}: " + "; ".join(out.failures())
                )
            return out
        out.files = publish_staged_model(tmp, name, parent)
    return out
