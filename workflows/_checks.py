"""The checks run on every model attnx writes, by path, as the deployment machine will see it:
the onnx checker, the contract's dims, an ONNX Runtime load, and agreement at shapes the
export never saw, with the torch module (export) or with the model it was lowered from
(optimize, auto). Every run goes through a Runner, every comparison through the comparator.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from attnx.errors import CheckFailed, ExportError, ModelFileError
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    PROVIDERS,
    QUANTIZATIONS,
    contract_dims,
    describe,
    float_dtype,
    get_provider,
    quantization_of,
    sdpa_core_expresses,
)
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import ProblemSize, problem_size, reduction_length, tolerance_for
from attnx.runtimes import ModelSource, Runner, create_runner
from attnx.runtimes.compare import Comparison, case_label, compare_arrays, failed_run
from attnx.runtimes.ort_runner import import_onnxruntime

__all__ = [
    "VALIDATION_SHAPES",
    "PARITY_SHAPES",
    "Expected",
    "check_model_file",
    "check_dims",
    "check_runner",
    "validate_against_torch",
    "torch_expected",
    "check_against_expected",
    "compare_models",
]

logger = logging.getLogger(__name__)

# (batch, seq, mem_seq) the exported model is run at, none of them the export's example
# (2, 5, 6): seq 1, a batch of 3, and a length over 1000 (at batch 1: for the gpt3 preset
# each of its float64 comparison temporaries is then 100 MB, not 200).
VALIDATION_SHAPES = ((1, 1, 3), (3, 17, 1), (1, 1031, 13))
# (batch, seq, mem_seq) a lowered model is compared with its source at: none is the export's
# example (2, 5, 6); seq 1, a batch of 3 (whose element 1 hides every key), and a length past
# one block of ORT's CPU flash kernel.
PARITY_SHAPES: tuple[tuple[int, int, int], ...] = ((1, 1, 3), (3, 17, 1), (2, 600, 13))


def check_runner(path: str | os.PathLike[str], provider: str = "cpu") -> Runner:
    """An ORT runner for a check (not loaded). A check runs a few shapes: speed does not matter,
    memory does. Prepacking would give MatMul a second, repacked copy of every weight (2.4 GB
    more for the gpt3 preset), so it is off."""
    backend = get_provider(provider).backend
    opts = import_onnxruntime(backend).SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", "1")
    return create_runner(backend, ModelSource(model_path=os.fspath(path)), session_options=opts)


def check_dims(path: str | os.PathLike[str], config: AttentionConfig) -> None:
    """Every input and output has the contract's shape, dynamic dims named batch/seq/mem_seq."""
    info = describe(path)
    values = {s.name: list(s.shape) for s in (*info.inputs, *info.outputs)}
    for name, dims in contract_dims(config, info.decode).items():
        if name not in values:
            raise ExportError(f"model has no {name!r}")
        if values[name] != dims:
            raise ExportError(f"model's {name!r} has shape {values[name]}, the contract says {dims}")


def check_model_file(path: str | os.PathLike[str], config: AttentionConfig, label: str | None = None) -> None:
    """onnx checker by path (external data included), contract dims, loads in onnxruntime.
    label names the model in the errors (the output a staged file will become)."""
    path = os.fspath(path)
    name = label or repr(path)
    try:
        onnx.checker.check_model(path)
    except Exception as e:  # noqa: BLE001 - the checker raises its own ValidationError and protobuf's errors
        raise ExportError(f"onnx checker rejects {name}: {str(e).strip().splitlines()[0]}") from None
    try:
        check_dims(path, config)
        with check_runner(path):
            pass
    except ExportError as e:
        raise ExportError(f"{name}: {e}") from None
    except ModelFileError as e:  # onnxruntime cannot load what was just written: a failed check
        raise ExportError(f"{name}: {str(e).replace(repr(path), 'it')}") from None


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
    io_dtype = io_dtype or dtype
    # The SDPA core: the same module with a fused kernel, so that the expected outputs at seq
    # 1031 do not hold the whole score matrix (0.4 GB per copy for the gpt3 preset).
    expected = []
    # A quantized form is held to the float module (its error model sizes the tolerance).
    quantized = dtype in QUANTIZATIONS
    dtype, io_dtype = float_dtype(dtype), float_dtype(io_dtype)
    core = "sdpa" if sdpa_core_expresses(config) else "decomposed"  # no softcap, no sinks in SDPA
    with create_runner("torch", ModelSource(config, weights, None, dtype), core=core) as module:
        for batch, seq, mem_seq in shapes:
            mem = mem_seq if config.cross else None
            feeds = make_inputs(config, batch, seq, mem, dtype=dtype, seed=seq)
            y = np.asarray(module.run(feeds)["y"], dtype=np.float32)
            case_feeds = make_inputs(config, batch, seq, mem, dtype=io_dtype, seed=seq)
            size = problem_size(config, weights, case_feeds, activations=quantized)
            expected.append(Expected(batch, seq, mem, y, size))
    return expected


def check_against_expected(
    path: str | os.PathLike[str],
    config: AttentionConfig,
    expected: list[Expected],
    dtype: str = "fp32",
    io_dtype: str | None = None,
    label: str | None = None,
) -> list[Comparison]:
    """Run the model on ORT CPU at each expected shape and compare. Every shape is checked
    and logged; one CheckFailed lists all failures (label names the model in it)."""
    io_dtype = io_dtype or dtype
    name = label or os.fspath(path)
    results, failures = [], []
    quantization = quantization_of(describe(path).metadata) if dtype in QUANTIZATIONS else None
    with check_runner(path) as runner:
        tol = tolerance_for(dtype, runner.name, quantization)
        for e in expected:
            feeds = make_inputs(config, e.batch, e.seq, e.mem_seq, dtype=float_dtype(io_dtype), seed=e.seq)
            try:
                y = runner.run(feeds)["y"]
            except Exception as err:  # noqa: BLE001 - ORT's own error types: a shape the graph cannot run
                raise CheckFailed(
                    f"{name} fails at batch={e.batch} seq={e.seq}: {str(err).strip().splitlines()[0][:300]}"
                ) from None
            cmp = compare_arrays(e.label, y, e.y, tol, e.size)
            logger.info("%s", cmp)
            results.append(cmp)
            if not cmp:
                failures.append(str(cmp))
    if failures:
        raise CheckFailed(f"{name} disagrees with torch: " + "; ".join(failures))
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


def compare_models(
    reference: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    config: AttentionConfig,
    *,
    dtype: str = "fp32",
    provider: str = "cpu",
    shapes: Sequence[tuple[int, int, int]] = PARITY_SHAPES,
    weights: Mapping[str, np.ndarray] | None = None,
) -> list[Comparison]:
    """y of `candidate` (on ort-<provider>) against y of `reference` (on ort-cpu) at `shapes`.

    The inputs come from make_inputs (batch element 1 of a key padding mask hides every key,
    so the fully hidden row is always checked). dtype is the candidate's compute dtype (it
    picks the tolerance row). weights, the q/k projections (attnx.export.passes.qk_weights),
    size the tolerance by the largest attention score; without them the rule's score term is
    0, which is stricter. Raises ProviderUnavailable when the provider cannot run here; a
    candidate that fails to run is a failed comparison."""
    backend = get_provider(provider).backend
    quantization = quantization_of(describe(candidate).metadata) if dtype in QUANTIZATIONS else None
    if quantization is not None and (weights is None or "v_proj.weight" not in weights):
        raise ModelFileError(f"{os.fspath(candidate)!r}: the {dtype} error model needs the q, k and v projections")
    tol = tolerance_for(dtype, backend, quantization)
    ref_runner = create_runner(PROVIDERS["cpu"].backend, ModelSource(config, None, os.fspath(reference), "fp32"))
    cand_runner = create_runner(backend, ModelSource(config, None, os.fspath(candidate), dtype))
    results: list[Comparison] = []
    with ref_runner, cand_runner:
        ref_dtype, cand_dtype = ref_runner.inputs[0].dtype, cand_runner.inputs[0].dtype
        for batch, seq, mem_seq in shapes:
            mem = mem_seq if config.cross else None
            label = case_label(batch, seq, mem)
            ref_feeds = make_inputs(config, batch, seq, mem, dtype=ref_dtype, seed=seq)
            cand_feeds = make_inputs(config, batch, seq, mem, dtype=cand_dtype, seed=seq)
            ref_y = ref_runner.run(ref_feeds)["y"]
            try:
                y = cand_runner.run(cand_feeds)["y"]
            except Exception as e:  # noqa: BLE001 - ORT raises its own types; the reason is the result
                results.append(failed_run(label, e))
                continue
            size = (
                problem_size(config, weights, ref_feeds, activations=quantization is not None)
                if weights is not None
                else ProblemSize(reduction_length(config, mem or seq))
            )
            cmp = compare_arrays(label, np.asarray(y, np.float32), ref_y, tol, size)
            logger.info("%s", cmp)
            results.append(cmp)
    return results
