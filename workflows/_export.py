"""export_model: export, lower, save and check, the one function `attnx export` calls."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from attnx._io import Staging, check_output_file, output_lock
from attnx.errors import ExportError, UsageError
from attnx.export import (
    build_decomposed_model,
    build_step_model,
    export_onnx,
    graph_opset,
    half_precision,
    release_rewriter_state,
    save_model,
)
from attnx.export.passes import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, convert_precision
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    AUTO,
    EXPORT_ATTENTIONS,
    check_choice,
    check_model_dtype,
    check_opset,
    describe,
)
from attnx.model.cores import LOWERINGS, core_for, export_core
from attnx.model.int8 import INT8_BITS_KEY, int8_bits_of, int8_bits_text, int8_weight_bits
from attnx.model.resources import check_memory, estimate_export
from attnx.model.weights import check_finite, check_fits, check_weights, init_weights, load_weights
from attnx.runtimes.base import ModelSource
from attnx.runtimes.compare import Comparison
from attnx.runtimes.decode import run_buffer_parity, run_decode_parity
from attnx.workflows._checks import VALIDATION_SHAPES, check_against_expected, check_model_file, torch_expected
from attnx.workflows._lower import lower

__all__ = ["ExportReport", "export_model"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ExportReport:
    path: str
    files: list[str]
    attention: str
    dtype: str
    opset: int
    validation: list[Comparison]
    passes: list[str] = dataclasses.field(default_factory=list)  # one line per graph pass


# The weights below which the reference cycles still holding them (torch's exported program and module) are left to
# the collector's own schedule: a full collection walks every object of the process (a test worker holds millions:
# 82 calls took 20 s of CPU in one), and what it frees below this is less than one runtime session's arena (a
# GPT-2-size layer, 9.4 MB of weights: export's peak RSS 571 MB collected, 579 MB not; the gpt3 preset's 2.4 GB are
# collected: measurements/ci_time/README.md).
COLLECT_ABOVE_BYTES = 64 << 20


def weights_nbytes(weights: Mapping[str, np.ndarray]) -> int:
    return sum(int(np.asarray(w).nbytes) for w in weights.values())


def release_weights(nbytes: int) -> None:
    """After the last use of `nbytes` of weights: collect the cycles that still hold them where it pays (a large
    model's weights, freed before a runtime loads its own copy: measurements/facts.md, the gpt3 preset)."""
    if nbytes >= COLLECT_ABOVE_BYTES:
        gc.collect()


def export_model(
    config: AttentionConfig,
    out: str | os.PathLike[str],
    weights: Mapping[str, np.ndarray] | str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    attention: str = "decomposed",
    dtype: str = "fp32",
    opset: int | None = None,
    keep_io_fp32: bool = False,
    validate: bool = True,
    check: bool = True,
    max_mem_gb: float | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    decode_form: str = "growing",
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    buffer_core: str | None = None,
    int8_bits: int | str = "auto",
) -> ExportReport:
    """Export `config` to `out`, check the written file (onnx checker, contract dims, loads in
    onnxruntime, and with validate agrees with torch at shapes the export never saw), and only
    then publish it: `out` is written under a temporary name beside it and renamed once every
    check passed (attnx._io.Staging). On any failure or interrupt the file that was at `out`
    is untouched. Arguments, the output path and the memory the export needs are checked
    before any work; a second writer of the same `out` is refused at once.

    weights are the arrays, a safetensors file, or None for seeded ones (`seed`). Given as a
    file or None, export_model holds the only reference and drops the weights before
    onnxruntime loads the written model, so the two never hold them at once (peak memory
    about twice the weights, not three times: measurements/facts.md, the gpt3 preset).

    check=False skips the file check (and validate): for a caller that checks the file
    itself after releasing the weights, as `attnx build` does.

    int8_bits: the width of an int8 model's weights, 7, 8 or auto (8 on a host with VNNI, else 7:
    attnx.model.int8); with another dtype only auto.
    """
    check_choice("--attention", attention, EXPORT_ATTENTIONS)
    check_model_dtype(dtype)
    int8_weight_bits(dtype, int8_bits)  # an explicit width for another dtype is refused before any work
    # what the lowering's core cannot express in this form and dtype: refused by name, before any work
    export_core(config, attention, dtype, decode_form, buffer_core)
    if config.kv_cache:
        return _export_step_model(config, out, weights, seed=seed, attention=attention, dtype=dtype, opset=opset,
                                  check=check, validate=validate, progress=progress, form=decode_form,
                                  max_mem_gb=max_mem_gb, block_size=block_size,
                                  accuracy_level=accuracy_level, keep_io_fp32=keep_io_fp32,
                                  buffer_core=buffer_core, int8_bits=int8_bits)  # fmt: skip
    # The decomposed form is the torch module's export (traced from PyTorch); every other lowering is
    # written from the registry (build_model), and auto measures those candidates that compute the config.
    traced = attention in LOWERINGS and LOWERINGS[attention].traced
    if traced:
        opset = check_opset(attention, opset)
    elif attention != AUTO:
        graph_opset(config, attention, dtype=dtype)  # refused before any work, as every other check
    check_output_file(out, "--out")
    shapes = VALIDATION_SHAPES if check and validate else ()
    check_memory(estimate_export(config, shapes, core="decomposed" if traced else attention), max_mem_gb)
    with output_lock(out), Staging(out) as stage:
        weights = _resolve_weights(config, weights, seed, dtype, progress)
        pass_lines: list[str] = []
        if traced:
            progress("exporting (decomposed attention, traced from the torch module)")
            model = export_onnx(config, weights, attention="decomposed", opset=opset)
            if dtype != "fp32":
                progress(f"converting to {dtype}")
                result = convert_precision(model, dtype, keep_io_fp32, block_size=block_size,
                                           accuracy_level=accuracy_level, int8_bits=int8_bits)  # fmt: skip
                model, pass_lines = result.model, ["lowering: decomposed (traced)", *result.report.lines()]
        else:
            result = lower(config, weights, attention=attention, dtype=dtype, keep_io_fp32=keep_io_fp32, opset=opset,
                           progress=progress, block_size=block_size, accuracy_level=accuracy_level,
                           int8_bits=int8_bits)  # fmt: skip
            model, pass_lines = ir.from_proto(result.model), result.lines()
            del result
        opset_used = model.opset_imports.get("", 0)
        progress(f"saving {os.fspath(out)} (published once it passes its checks)")
        save_model(model, stage.path())
        del model
        release_rewriter_state()  # the lowering's rewrite rules may still hold the graph, and so the weights
        validation: list[Comparison] = []
        if check:
            io_dtype = "fp32" if keep_io_fp32 else dtype
            expected = []
            if validate:
                shapes_text = ", ".join(f"{b}x{s}" for b, s, _ in VALIDATION_SHAPES)
                progress(f"running torch at the validation shapes {shapes_text}")
                expected = torch_expected(config, weights, dtype, VALIDATION_SHAPES, io_dtype)
            held = weights_nbytes(weights)
            del weights  # torch is done with them: onnxruntime loads its own copy next
            release_weights(held)  # the exported program and torch module hold them in reference cycles
            progress("checking the saved model (onnx checker, dims, onnxruntime load)")
            label = f"{os.fspath(out)} (not written)"
            check_model_file(stage.path(), config, label)
            if validate:
                progress("validating onnxruntime against torch at those shapes")
                validation = check_against_expected(stage.path(), config, expected, dtype, io_dtype, label)
        files = stage.publish()
    return ExportReport(os.fspath(out), files, attention, dtype, opset_used, validation, pass_lines)


# The step model's validation: prefill then steps against the reference's full forward, at a
# prefill the export never saw, batch 2 (docs/concepts/step-forms.md).
STEP_VALIDATION = {"batch": 2, "prefills": (0, 5), "steps": 3}
# The buffer form of a core that reads each row's length (Core.row_lengths): one more case, rows of these prompt
# lengths stepping together (run_buffer_parity's rows)
STEP_ROWS = (4, 1, 6)


def _export_step_model(
    config: AttentionConfig,
    out: str | os.PathLike[str],
    weights: Mapping[str, np.ndarray] | str | os.PathLike[str] | None,
    *,
    seed: int,
    attention: str,
    dtype: str,
    opset: int | None,
    check: bool,
    validate: bool,
    progress: Callable[[str], None],
    form: str = "growing",
    max_mem_gb: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    keep_io_fp32: bool = False,
    buffer_core: str | None = None,
    int8_bits: int | str = "auto",
) -> ExportReport:
    """export_model for a config with kv_cache: the step model (attnx.export.build_step_model),
    checked like every export and validated step by step against the reference. dtype int8/int4
    quantizes its projections with the full-sequence forms' pass and metadata; the validation
    then holds it to the quantized error model (run_decode_parity); fp16 converts the whole graph
    (its rotary angle kept float32), its inputs, outputs and cache float16."""
    if keep_io_fp32:
        raise UsageError("--keep-io-fp32 is for the full-sequence model: a step model's cache is its input and "
                         "output, in the model's dtype")  # fmt: skip
    needed = graph_opset(config, attention, form, buffer_core, dtype)
    if opset is not None and opset != needed:
        raise UsageError(f"the step model's {attention} lowering is written at opset {needed}")
    check_output_file(out, "--out")
    total = max(STEP_VALIDATION["prefills"]) + STEP_VALIDATION["steps"]
    check_memory(estimate_export(config, [(STEP_VALIDATION["batch"], total, None)], reference=validate), max_mem_gb)
    with output_lock(out), Staging(out) as stage:
        weights = _resolve_weights(config, weights, seed, dtype, progress)
        progress(f"building the step model ({attention}, {form} form, {dtype})")
        model = ir.from_proto(build_step_model(config, weights, attention, form, dtype, block_size, accuracy_level,
                                               buffer_core=buffer_core, int8_bits=int8_bits))  # fmt: skip
        bits = model.metadata_props.get(INT8_BITS_KEY)
        core = core_for(attention, config, dtype, form, buffer_core)
        opset_used = model.opset_imports.get("", 0)
        save_model(model, stage.path())
        del model
        validation: list[Comparison] = []
        if check:
            label = f"{os.fspath(out)} (not written)"
            check_model_file(stage.path(), config, label)
            if validate:
                progress("validating prefill + steps on onnxruntime against the reference's full forward")
                source = ModelSource(config, weights, stage.path(), dtype=dtype)
                if form == "buffer":
                    report = run_buffer_parity(source, "ort-cpu", **STEP_VALIDATION,
                                               rows=STEP_ROWS if core.row_lengths else ())  # fmt: skip
                else:
                    report = run_decode_parity(source, ["ort-cpu"], **STEP_VALIDATION)
                failed = [c for c in report.cases if c.status != "pass"]
                if failed:
                    raise ExportError(f"{label}: step-by-step validation failed: {failed[0].reason}")
        files = stage.publish()
    lines = [f"lowering: {attention} (step model, {form} form, core {core.name}: {core.label})"]
    if dtype == "fp16":
        lines.append("precision: fp16 (ConvertToFloat16: inputs, outputs and the cache float16)")
    elif dtype != "fp32":
        lines.append(f"precision: {dtype} projections (QuantizeProjections)"
                     + (f", {int8_bits_text(int(bits), int8_bits)}" if bits else ""))  # fmt: skip
    return ExportReport(os.fspath(out), files, attention, dtype, opset_used, validation, lines)


def _resolve_weights(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray] | str | os.PathLike[str] | None,
    seed: int,
    dtype: str,
    progress: Callable[[str], None],
) -> Mapping[str, np.ndarray]:
    """The weights to export: drawn from `seed` (None), read from a file (a path), or the given
    arrays checked against the config; in every case checked to fit `dtype`."""
    if weights is None:
        progress(f"drawing seeded weights (seed {seed}, {config.n_params:,} parameters)")
        weights = init_weights(config, seed)
    elif isinstance(weights, (str, os.PathLike)):
        progress(f"reading {os.fspath(weights)}")
        weights = load_weights(weights, config)
    else:
        check_weights(config, weights)
        check_finite(weights)
    check_fits(weights, dtype)
    return weights


def write_decomposed_form(source: ModelSource, directory: str) -> onnx.ModelProto:
    """The model of `source` (its config, weights, dtype, quantization) in the decomposed lowering (a
    step model's growing form), unchecked: what localisation compares a fused operator with
    (attnx.runtimes.localise; registered there when this package is imported). Built by hand
    (attnx.export.build_decomposed_model, fp16 by half_precision: milliseconds, no trace, never
    written); the exporter's form, written into `directory` and read back, for cross-attention."""
    info = describe(source.model_path)
    quant = info.quantization or {}
    options = {k: quant[k] for k in ("block_size", "accuracy_level") if quant.get(k) is not None}
    dtype = quant.get("dtype", info.dtype)
    if dtype == "int8":  # the model's own width (a model written before the key: 7)
        options["int8_bits"] = int8_bits_of(info.metadata)
    if dtype != "fp16":
        return build_decomposed_model(source.config, source.weights, dtype, readable=False, **options)
    model = build_decomposed_model(source.config, source.weights, readable=False)
    return half_precision(model, keep_io_fp32=info.io_dtype == "fp32" and not source.config.kv_cache)[0]
