"""Checks run on every model attnx writes: by path, as the deployment machine will see it."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import numpy as np
import onnx

from attnx.errors import CheckFailed, ExportError, ModelFileError
from attnx.model.config import TORCH_DTYPES, AttentionConfig
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import Comparison, ProblemSize, compare_arrays, problem_size, tolerance_for

__all__ = [
    "VALIDATION_SHAPES",
    "Expected",
    "case_label",
    "check_model_file",
    "check_dims",
    "validate_against_torch",
    "torch_expected",
    "check_against_expected",
    "ort_session",
]

logger = logging.getLogger(__name__)

# (batch, seq, mem_seq) the exported model is run at, none of them the export's example
# (2, 5, 6): seq 1, a batch of 3, and a length over 1000 (at batch 1: for the gpt3 preset
# each of its float64 comparison temporaries is then 100 MB, not 200).
VALIDATION_SHAPES = ((1, 1, 3), (3, 17, 1), (1, 1031, 13))


def ort_session(path: str, provider: str = "CPUExecutionProvider"):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # A check runs a few shapes: speed does not matter, memory does. Prepacking would give
    # MatMul a second, repacked copy of every weight (2.4 GB more for the gpt3 preset).
    opts.add_session_config_entry("session.disable_prepacking", "1")
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


def case_label(batch: int, seq: int, mem_seq: int | None) -> str:
    """How a checked output is named in reports: y[batch=3,seq=17(,mem_seq=1)]."""
    return f"y[batch={batch},seq={seq}{f',mem_seq={mem_seq}' if mem_seq else ''}]"


@dataclasses.dataclass(frozen=True)
class Expected:
    """The torch module's output at one validation shape, and the size the tolerance needs."""

    batch: int
    seq: int
    mem_seq: int | None
    y: np.ndarray
    size: ProblemSize

    @property
    def label(self) -> str:
        return case_label(self.batch, self.seq, self.mem_seq)


def torch_expected(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    dtype: str = "fp32",
    shapes: tuple[tuple[int, int, int], ...] = VALIDATION_SHAPES,
    io_dtype: str | None = None,
) -> list[Expected]:
    """The torch module's outputs at `shapes` (inputs: make_inputs with seed=seq)."""
    import torch

    from attnx.model.module import build_module

    io_dtype = io_dtype or dtype
    # The SDPA core: the same module with a fused kernel, so that the expected outputs at seq
    # 1031 do not hold the whole score matrix (0.4 GB per copy for the gpt3 preset).
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
    module = build_module(config, weights, attention="sdpa").to(torch_dtype)
    expected = []
    for batch, seq, mem_seq in shapes:
        mem = mem_seq if config.cross else None
        feeds = make_inputs(config, batch, seq, mem, dtype=dtype, seed=seq)
        with torch.inference_mode():
            y = module(**{k: torch.from_numpy(v) for k, v in feeds.items()}).float().numpy()
        size = problem_size(config, weights, make_inputs(config, batch, seq, mem, dtype=io_dtype, seed=seq))
        expected.append(Expected(batch, seq, mem, y, size))
    return expected


def check_against_expected(
    path: str | os.PathLike[str],
    config: AttentionConfig,
    expected: list[Expected],
    dtype: str = "fp32",
    io_dtype: str | None = None,
) -> list[Comparison]:
    """Run the model on ORT CPU at each expected shape and compare. Every shape is checked
    and logged; one CheckFailed lists all failures."""
    io_dtype = io_dtype or dtype
    session = ort_session(os.fspath(path))
    tol = tolerance_for(dtype, "ort-cpu")
    results, failures = [], []
    for e in expected:
        feeds = make_inputs(config, e.batch, e.seq, e.mem_seq, dtype=io_dtype, seed=e.seq)
        try:
            (y,) = session.run(["y"], feeds)
        except Exception as err:  # ORT's own error types: a shape the graph cannot run
            raise CheckFailed(
                f"{os.fspath(path)} fails at batch={e.batch} seq={e.seq}: {str(err).strip().splitlines()[0][:300]}"
            ) from None
        cmp = compare_arrays(e.label, y, e.y, tol, e.size)
        logger.info("%s", cmp)
        results.append(cmp)
        if not cmp:
            failures.append(str(cmp))
    if failures:
        raise CheckFailed(f"{os.fspath(path)} disagrees with torch: " + "; ".join(failures))
    return results


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
    # torch first, then ORT: the torch module is gone before the session loads, so the
    # two never hold the weights at the same time (2.4 GB each for the gpt3 preset).
    expected = torch_expected(config, weights, dtype, shapes, io_dtype)
    return check_against_expected(path, config, expected, dtype, io_dtype)
