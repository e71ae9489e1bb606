"""`attnx optimize` of a model attnx wrote: a whole model with one block, the graph itself (issue 52).

attnx.workflows.optimize_model takes every model; this is what its steps are where the model states what it is
(its attnx.config metadata), each step the whole-model pipeline's own, for one block that is the whole graph:

    read     the block's config, as its attnx.config states it, and its weights by the names attnx gives them
             (attnx.export.read_weights): attnx reading its own emission, exact for every config attnx exports
             (cross-attention included)
    plan     the lowering asked (--attention: decomposed, onnx, ort-fused, ...; measure: each candidate lowering
             written, held to the decomposed form on the provider and timed at --auto-seq, the fastest kept:
             attnx.workflows._lower) and the dtype asked (--dtype: fp16, bf16, int8, int4; default the model's)
    choose   the lowering's core for the config (the registry's, as attnx export writes it), the core named
             (--core), or with --core measure each core of the lowering that computes it timed and the fastest kept
    write    the block is the graph: written whole from the registry in the lowering, core and dtype, under the
             contract's names (x, memory, key_padding_mask -> y), its metadata saying what it holds
    prove    the onnx checker, the contract's dims and an ONNX Runtime load; then y against the input's on the
             provider at shapes the export never saw, under the tolerance table's row of the dtype
    publish  only when every proof holds (attnx._io.Staging), never over the input

A step model (kv_cache), a quantized model and fp16 back to fp32 are refused (exit 2): the step models are written
by attnx export, and a quantized model's float32 weights are gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable

import onnx_ir as ir

from attnx._io import Staging, check_output_file, output_lock, write_json_atomic
from attnx.errors import ModelFileError, UsageError
from attnx.export import build_model, core_of, read_weights, save_model
from attnx.export.passes import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE
from attnx.model.config import AttentionConfig
from attnx.model.contract import AUTO, LOWERINGS, QUANTIZATIONS, check_model_dtype, describe, get_provider
from attnx.model.cores import MEASURE, why_not
from attnx.model.int8 import int8_weight_bits
from attnx.runtimes import create_runner
from attnx.runtimes.base import ModelSource
from attnx.workflows._checks import PARITY_SHAPES, check_model_file, compare_models
from attnx.workflows._lower import AUTO_SHAPE, LoweringResult, lower, median_ms
from attnx.workflows._proof import Proof, ProofStats, ProofStatus
from attnx.workflows.audit.whole import WholeModel
from attnx.workflows.rewrite.choose import CoreChoice, Timing
from attnx.workflows.rewrite.report import BlockRewrite, ModelOptimizeReport

__all__ = ["optimize_layer"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """What optimize_model's flags ask of a model attnx wrote (the module doc)."""

    lowering: str = "ort-fused"
    core: str | None = None  # None: the lowering's own (the registry's); MEASURE: measured; else that core
    dtype: str | None = None  # None: the model's own
    keep_io_fp32: bool = False
    auto_seq: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    int8_bits: int | str = "auto"


def optimize_layer(whole: WholeModel, out_path: str, options: LayerOptions, *, provider: str = "cpu",
                   json_path: str | None = None,
                   progress: Callable[[str], None] | None = None) -> ModelOptimizeReport:  # fmt: skip
    """The module doc's steps for `whole` (a model attnx wrote, opened once: never parsed again), OUT published
    only when every proof holds; the report as optimize_model's (one block)."""
    say = progress or (lambda _m: None)
    path, out_path = whole.path, os.fspath(out_path)
    backend = get_provider(provider, "--provider").backend
    check_output_file(out_path, "--out")
    if os.path.abspath(out_path) == os.path.abspath(path):
        raise UsageError("--out must differ from the input model: the input is what the output is proven against")
    info = describe(path, whole.proto)
    config = info.require_config("optimize reads a model attnx wrote by its attnx.config")
    if config.kv_cache:
        raise UsageError(f"{path!r} is a step model ('kv_cache': true): write its lowering with attnx export "
                         "--attention decomposed|onnx|ort-fused, not optimize")  # fmt: skip
    dtype = options.dtype or info.dtype
    if info.dtype in QUANTIZATIONS:
        raise UsageError(f"{path!r} is an {info.dtype} model: optimize the float32 model it was quantized from")
    if info.dtype == "fp16" and dtype == "fp32":
        raise UsageError(f"{path!r} is a float16 model: it cannot be optimized back to fp32")
    check_model_dtype(dtype)
    int8_weight_bits(dtype, options.int8_bits)  # an explicit width for another dtype is refused before any work
    lowering, core = options.lowering, options.core
    if lowering == AUTO and core not in (None, MEASURE):
        raise UsageError(f"--core {core} is one core of one lowering: name the lowering (--attention), not "
                         f"{AUTO}")  # fmt: skip
    if core not in (None, MEASURE):
        _check_core(core, lowering, config, dtype)
    if provider != "cpu":
        say(f"checking that {backend} runs here")
        with create_runner(backend, ModelSource(config, None, path, info.dtype)):
            pass  # ProviderUnavailable (exit 2) with ONNX Runtime's reason otherwise
    say(f"reading the weights of {path} by their names")
    try:
        model = whole.model
        before = core_of(model)
        weights = read_weights(model, config)  # the tolerance is sized from them too
    except ModelFileError:
        raise
    except Exception as e:  # noqa: BLE001 - describe() read it: only its external data can fail here
        raise ModelFileError(f"{path!r} cannot be loaded: {str(e).strip().splitlines()[0]}") from None
    del model
    whole.release()  # the weights are copies: ONNX Runtime proves OUT against its own copy of the file
    report = ModelOptimizeReport(path, out_path, None, [], [], provider=provider)
    block = BlockRewrite(0, "the whole graph (a model attnx wrote)", before, config=config.to_dict(),
                         splice="the whole block: the model is the layer")  # fmt: skip
    report.blocks.append(block)
    shape = AUTO_SHAPE if options.auto_seq is None else (AUTO_SHAPE[0], options.auto_seq, options.auto_seq)
    if core == MEASURE and lowering != AUTO:
        block.choice = _measure_cores(config, weights, lowering, dtype, provider, shape, say)
        core = block.choice.core
    say(f"writing the {lowering} graph ({dtype})")
    result = lower(config, weights, attention=lowering, dtype=dtype, keep_io_fp32=options.keep_io_fp32,
                   provider=provider, auto_shape=shape, progress=say, block_size=options.block_size,
                   accuracy_level=options.accuracy_level, int8_bits=options.int8_bits, core=core)  # fmt: skip
    block.written = core_of(ir.from_proto(result.model))
    if result.auto is not None:
        block.choice = _lowerings_measured(result, block.written)
    report.proofs += _said(result, dtype)
    with output_lock(out_path), Staging(out_path) as stage:
        staged = stage.path()
        save_model(ir.from_proto(result.model), staged)
        result.model = None  # type: ignore[assignment]  # free it: a big model is on disk now
        say("checking the written model (onnx checker, dims, onnxruntime load)")
        check_model_file(staged, config, f"{out_path} (not written)")
        report.proofs.append(Proof(ProofStatus.PASS, "the written model", "the onnx checker, the contract's dims "
                                                                          "and an ONNX Runtime load"))  # fmt: skip
        say(f"proving y against {path} on {backend}")
        parity = compare_models(path, staged, config, dtype=dtype, provider=provider, shapes=PARITY_SHAPES,
                                weights=weights)  # fmt: skip
        report.proofs += [Proof.verdict(bool(c), c.name, f"against the input's on {backend}: {c.detail()}",
                                        ProofStats.of(c), quoted=True) for c in parity]  # fmt: skip
        report.passed = bool(parity) and all(parity)
        if report.passed:
            stage.publish()
            report.written = True
    if json_path is not None:
        write_json_atomic(json_path, report.to_dict())
    return report


def _check_core(core: str, lowering: str, config: AttentionConfig, dtype: str) -> None:
    """--core `core`: one of `lowering`'s full-sequence cores that computes `config`, or one UsageError."""
    written = LOWERINGS[lowering].cores.get("full", ())
    if core not in written:
        raise UsageError(f"--core {core}: the {lowering} lowering writes no {core} core for a full-sequence model "
                         f"(it writes: {', '.join(written)})")  # fmt: skip
    reasons = why_not(core, config, "fp32" if dtype == "fp16" else dtype, "full")
    if reasons:
        raise UsageError(f"--core {core} does not compute this model: {'; '.join(reasons)}")


def _measure_cores(config: AttentionConfig, weights: dict, lowering: str, dtype: str, provider: str,
                   shape: tuple[int, int, int], say: Callable[[str], None]) -> CoreChoice:  # fmt: skip
    """--core measure: each full-sequence core of `lowering` that computes `config` written (float32: the dtype's
    conversion is the same for each) and timed at `shape` on `provider`, the fastest chosen (the one that computes it
    alone: chosen untimed)."""
    names = [c for c in LOWERINGS[lowering].cores.get("full", ()) if not why_not(c, config, "fp32", "full")]
    if not names:
        raise UsageError(f"--attention {lowering}: no core of the lowering computes this model")
    said = {"prefill": shape[1], "past": 0, "steps": 0}
    if len(names) == 1:
        return CoreChoice(names[0], f"the one core of the {lowering} lowering that computes it", said)
    times: dict[str, Timing] = {}
    with tempfile.TemporaryDirectory(prefix="attnx-cores-") as folder:
        for name in names:
            say(f"timing the {name} core on {provider}")
            path = os.path.join(folder, f"{name}.onnx")
            save_model(ir.from_proto(build_model(config, weights, lowering, "full", "fp32", core=name)), path)
            times[name] = Timing(median_ms(path, config, "fp32", provider, shape))
    best = min(times, key=lambda n: times[n].prefill_ms)
    others = ", ".join(f"{n} {t.prefill_ms:.4g}" for n, t in times.items() if n != best)
    return CoreChoice(best, f"the fastest: {times[best].prefill_ms:.4g} ms a call; {others}", said, times=times)


def _lowerings_measured(result: LoweringResult, written: str) -> CoreChoice:
    """--attention measure's measurements (attnx.workflows._lower.AutoChoice) as the block's choice."""
    auto = result.auto
    batch, seq, _ = auto.shape
    times = {name: Timing(t) if t is not None else Timing(error=auto.status[name]) for name, t in auto.times_ms.items()}
    return CoreChoice(written, f"the fastest lowering that passes parity: {auto.choice}",
                      {"prefill": seq, "past": 0, "steps": 0}, times=times)  # fmt: skip


def _said(result: LoweringResult, dtype: str) -> list[Proof]:
    """What was written, said among the proofs: measure's measurements, the lowering, its core and precision."""
    said = [] if result.auto is None else [Proof(ProofStatus.SAID, line.strip()) for line in result.auto.lines()]
    return said + [Proof(ProofStatus.SAID, f"written in the {result.lowering} lowering ({dtype})",
                         "; ".join(result.notes))]  # fmt: skip
