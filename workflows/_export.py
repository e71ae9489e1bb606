"""export_model: export, lower, save and check, the one function `attnx export` calls."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Mapping

import numpy as np

from attnx._io import Staging, check_output_file, output_lock
from attnx.export import EXPORTED_LOWERINGS, export_onnx, release_rewriter_state, save_model
from attnx.model.config import AttentionConfig
from attnx.export.passes import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE
from attnx.model.contract import EXPORT_ATTENTIONS, check_choice, check_model_dtype, check_opset
from attnx.model.resources import check_memory, estimate_export
from attnx.model.weights import check_finite, check_fits, check_weights, init_weights, load_weights
from attnx.runtimes.compare import Comparison
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
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
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
    about twice the weights, not three times: 4.4 GB for the gpt3 preset's 2.4 GB).

    check=False skips the file check (and validate): for a caller that checks the file
    itself after releasing the weights, as `attnx build` does.
    """
    check_choice("--attention", attention, EXPORT_ATTENTIONS)
    check_model_dtype(dtype)
    # The exporter writes the lowerings that are not passes; the others start from decomposed.
    base = attention if attention in EXPORTED_LOWERINGS else "decomposed"
    opset = check_opset(attention, opset)
    check_output_file(out, "--out")
    shapes = VALIDATION_SHAPES if check and validate else ()
    check_memory(estimate_export(config, shapes, core=base), max_mem_gb)
    with output_lock(out), Staging(out) as stage:
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
        progress(f"exporting ({base} attention)")
        model = export_onnx(config, weights, attention=base, opset=opset)
        pass_lines: list[str] = []
        if attention != base or dtype != "fp32":
            progress("running graph passes")
            # auto measures each lowering on ORT CPU at batch 1, seq 512 (attnx optimize --provider
            # picks another target) and records its choice and timings in the model's metadata.
            result = lower(
                model, config, attention=attention, dtype=dtype, keep_io_fp32=keep_io_fp32, progress=progress,
                block_size=block_size, accuracy_level=accuracy_level,
            )  # fmt: skip
            model, pass_lines = result.model, result.lines()
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
            del weights  # torch is done with them: onnxruntime loads its own copy next
            gc.collect()  # the exported program and torch module hold them in reference cycles
            progress("checking the saved model (onnx checker, dims, onnxruntime load)")
            label = f"{os.fspath(out)} (not written)"
            check_model_file(stage.path(), config, label)
            if validate:
                progress("validating onnxruntime against torch at those shapes")
                validation = check_against_expected(stage.path(), config, expected, dtype, io_dtype, label)
        files = stage.publish()
    return ExportReport(os.fspath(out), files, attention, dtype, opset_used, validation, pass_lines)
