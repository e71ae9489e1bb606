"""Checks run on every model attnx writes: by path, as the deployment machine will see it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import numpy as np
import onnx

from attnx.errors import CheckFailed, ExportError, ModelFileError
from attnx.model.config import AttentionConfig
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import Comparison, compare_arrays, problem_size, tolerance_for

__all__ = ["VALIDATION_SHAPES", "check_model_file", "check_dims", "validate_against_torch", "ort_session"]

logger = logging.getLogger(__name__)

# (batch, seq, mem_seq) the exported model is run at, none of them the export's example
# (2, 5, 6): seq 1, a length over 1000, and a batch of 3.
VALIDATION_SHAPES = ((1, 1, 3), (3, 17, 1), (2, 1031, 13))


def ort_session(path: str, provider: str = "CPUExecutionProvider"):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(path, opts, providers=[provider])
    except Exception as e:
        raise ModelFileError(f"onnxruntime {ort.__version__} cannot load {path!r}: {str(e).strip().splitlines()[0]}") from None


def check_dims(proto: onnx.ModelProto, config: AttentionConfig) -> None:
    """Every input and output has the contract's shape, dynamic dims named batch/seq/mem_seq."""
    from attnx.export._export import contract_dims

    expected = contract_dims(config)
    values = {v.name: v for v in [*proto.graph.input, *proto.graph.output]}
    for name, dims in expected.items():
        if name not in values:
            raise ExportError(f"model has no {name!r}")
        got = [d.dim_param or d.dim_value for d in values[name].type.tensor_type.shape.dim]
        if got != dims:
            raise ExportError(f"model's {name!r} has shape {got}, the contract says {dims}")


def check_model_file(path: str | os.PathLike[str], config: AttentionConfig) -> None:
    """onnx checker by path (external data included), contract dims, loads in onnxruntime."""
    path = os.fspath(path)
    try:
        onnx.checker.check_model(path)
    except Exception as e:
        raise ExportError(f"onnx checker rejects {path!r}: {str(e).strip().splitlines()[0]}") from None
    check_dims(onnx.load(path, load_external_data=False), config)
    ort_session(path)


def validate_against_torch(
    path: str | os.PathLike[str],
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    dtype: str = "fp32",
    shapes: tuple[tuple[int, int, int], ...] = VALIDATION_SHAPES,
    io_dtype: str | None = None,
) -> list[Comparison]:
    """Run the model on ORT CPU at shapes the export never saw and compare with the torch
    module. Every shape is checked and logged; one CheckFailed lists all failures."""
    import torch

    from attnx.model.module import build_module

    io_dtype = io_dtype or dtype
    session = ort_session(os.fspath(path))
    module = build_module(config, weights).to(getattr(torch, {"fp32": "float32", "fp16": "float16"}[dtype]))
    tol = tolerance_for(dtype, "ort-cpu")
    results, failures = [], []
    for batch, seq, mem_seq in shapes:
        feeds = make_inputs(config, batch, seq, mem_seq if config.cross else None, dtype=io_dtype, seed=seq)
        try:
            (y,) = session.run(["y"], feeds)
        except Exception as e:  # ORT's own error types: a shape the graph cannot run
            raise CheckFailed(
                f"{os.fspath(path)} fails at batch={batch} seq={seq}: {str(e).strip().splitlines()[0][:300]}"
            ) from None
        with torch.inference_mode():
            t_feeds = {k: torch.from_numpy(v) for k, v in make_inputs(
                config, batch, seq, mem_seq if config.cross else None, dtype=dtype, seed=seq).items()}
            ref = module(**t_feeds).float().numpy()
        label = f"y[batch={batch},seq={seq}{f',mem_seq={mem_seq}' if config.cross else ''}]"
        cmp = compare_arrays(label, y, ref, tol, problem_size(config, weights, feeds))
        logger.info("%s", cmp)
        results.append(cmp)
        if not cmp:
            failures.append(str(cmp))
    if failures:
        raise CheckFailed(f"{os.fspath(path)} disagrees with torch: " + "; ".join(failures))
    return results
