"""Lowering: the graph of a config in one lowering, or with `auto` each candidate written, checked and
timed on a runtime and the fastest that passes kept. Writing a lowering is the graph layer's
(attnx.export.build_model, from the registry of cores); `auto` adds a measured choice, which needs a
runtime and so lives above both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from attnx.errors import UsageError
from attnx.export import build_model, core_of, half_precision
from attnx.export.passes import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE
from attnx.model.config import AttentionConfig
from attnx.model.contract import AUTO, AUTO_KEY, INT8_BITS_KEY, LOWERINGS, get_provider
from attnx.model.cores import CORES, why_not
from attnx.model.inputs import make_inputs
from attnx.model.int8 import int8_bits_text
from attnx.model.resources import check_memory, estimate_case
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.base import time_runner
from attnx.workflows._checks import compare_models

__all__ = ["AUTO_CANDIDATES", "AUTO_SHAPE", "AutoChoice", "LoweringResult", "choose_lowering", "lower", "median_ms"]

# What auto measures: the decomposed form (the torch module's export: the reference the others are compared with on
# the runtime) and every lowering the registry marks as an auto candidate, each where its core computes the config.
_BASE = next(name for name, lw in LOWERINGS.items() if lw.traced)
AUTO_CANDIDATES = (_BASE, *(name for name, lw in LOWERINGS.items() if lw.auto))
# (batch, seq, mem_seq) auto times at: the size the targets are set at.
AUTO_SHAPE = (1, 512, 512)
AUTO_REPEAT = 5


@dataclasses.dataclass
class AutoChoice:
    """What `auto` measured: per candidate, parity and the median time at `shape`."""

    choice: str
    provider: str
    shape: tuple[int, int, int]
    times_ms: dict[str, float | None]
    status: dict[str, str]  # "pass", or why the candidate was not timed

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def lines(self) -> list[str]:
        b, s, m = self.shape
        out = [f"auto on {self.provider}, batch {b} seq {s}: chose {self.choice}"]
        for name, status in self.status.items():
            t = self.times_ms.get(name)
            out.append(f"  {name:<17} {f'{t:9.2f} ms' if t is not None else '        -   '}  {status}")
        return out


@dataclasses.dataclass
class LoweringResult:
    """A model written in one lowering: the graph, the lowering asked and the one it holds, what was
    written (one line each), and auto's measured choice when it chose."""

    model: onnx.ModelProto
    requested: str
    lowering: str
    notes: list[str]
    auto: AutoChoice | None = None

    def lines(self) -> list[str]:
        out = [] if self.auto is None else self.auto.lines()
        return out + [f"lowering: {self.lowering}"] + [f"  {n}" for n in self.notes]


def lower(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    *,
    attention: str = "ort-fused",
    dtype: str = "fp32",
    keep_io_fp32: bool = False,
    opset: int | None = None,
    provider: str = "cpu",
    auto_shape: tuple[int, int, int] = AUTO_SHAPE,
    progress: Callable[[str], None] = lambda msg: None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    int8_bits: int | str = "auto",
    core: str | None = None,
) -> LoweringResult:
    """The full-sequence graph of `config` with `weights` in `attention` (auto: each candidate measured
    on `provider`, the fastest that passes parity written), its metadata saying what it holds. core: that one of
    the lowering's cores (None: the registry's for the config)."""
    options = {"block_size": block_size, "accuracy_level": accuracy_level, "int8_bits": int8_bits,
               "keep_io_fp32": keep_io_fp32, "opset": opset}  # fmt: skip
    auto = None
    if attention == AUTO:
        auto = choose_lowering(config, weights, dtype=dtype, provider=provider, shape=auto_shape, progress=progress,
                               **options)  # fmt: skip
        chosen = auto.choice
    else:
        chosen = attention
    progress(f"writing the {chosen} graph")
    model, notes = _build(config, weights, chosen, dtype, core=core, **options)
    if auto is not None:
        model.metadata_props.add(key=AUTO_KEY, value=auto.to_json())
    return LoweringResult(model, attention, chosen, notes, auto)


def _build(config: AttentionConfig, weights: Mapping[str, np.ndarray], attention: str, dtype: str, *,
           keep_io_fp32: bool = False, opset: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
           accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
           int8_bits: int | str = "auto", core: str | None = None) -> tuple[onnx.ModelProto, list[str]]:  # fmt: skip
    """build_model (`core`: that one of the lowering's), and one line each for the core written and the precision."""
    import onnx_ir as ir

    notes: list[str] = []
    if dtype == "fp16":  # the float32 graph converted, with the conversion's notes
        model = build_model(config, weights, attention, "full", "fp32", opset=opset, core=core)
        model, fp16_notes = half_precision(model, keep_io_fp32)
        notes.append("precision: fp16 (ConvertToFloat16)" + "".join(f"; {n}" for n in fp16_notes))
    else:
        model = build_model(config, weights, attention, "full", dtype, opset=opset, block_size=block_size,
                            accuracy_level=accuracy_level, int8_bits=int8_bits, keep_io_fp32=keep_io_fp32,
                            core=core)  # fmt: skip
        if dtype != "fp32":
            bits = {p.key: p.value for p in model.metadata_props}.get(INT8_BITS_KEY)
            notes.append(f"precision: {dtype} projections (QuantizeProjections)"
                         + (f", {int8_bits_text(int(bits), int8_bits)}" if bits else ""))  # fmt: skip
    core = CORES[core_of(ir.from_proto(model))]
    terms = ", ".join(config.terms) or "the plain formula"
    notes.insert(0, f"core {core.name}: {core.label}, written from the registry ({terms})")
    return model, notes


def choose_lowering(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray],
    *,
    dtype: str = "fp32",
    keep_io_fp32: bool = False,
    opset: int | None = None,
    provider: str = "cpu",
    shape: tuple[int, int, int] = AUTO_SHAPE,
    candidates: Sequence[str] = AUTO_CANDIDATES,
    repeat: int = AUTO_REPEAT,
    progress: Callable[[str], None] = lambda msg: None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    int8_bits: int | str = "auto",
) -> AutoChoice:
    """Write every candidate lowering whose core computes the config (why_not), check its parity against
    the decomposed form on `provider`, time those that pass at `shape`, and return the fastest.

    Each candidate is written to a temporary file and loaded from there, as a deployment would load
    it; the gpt3 preset's candidates are 2.4 GB each, so one exists at a time."""
    backend = get_provider(provider, "--provider").backend
    # each candidate is timed at `shape`; the decomposed form may hold the whole score matrix there
    check_memory(estimate_case(config, backend, _BASE, *shape, dtype))
    options = {"block_size": block_size, "accuracy_level": accuracy_level, "int8_bits": int8_bits,
               "keep_io_fp32": keep_io_fp32, "opset": opset}  # fmt: skip
    times: dict[str, float | None] = {}
    status: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="attnx-auto-") as tmp:
        base_path = os.path.join(tmp, "decomposed.onnx")
        onnx.save(_build(config, weights, _BASE, dtype, **options)[0], base_path)
        for name in candidates:
            cores = LOWERINGS[name].cores["full"]
            reasons = [r for core in cores for r in why_not(core, config, dtype, "full")]
            if all(why_not(core, config, dtype, "full") for core in cores):
                status[name], times[name] = f"not applicable: {'; '.join(reasons)}", None
                continue
            path = base_path
            if name != _BASE:  # the base model, written once above
                progress(f"auto: writing {name}")
                path = os.path.join(tmp, f"candidate-{name}.onnx")
                onnx.save(_build(config, weights, name, dtype, **options)[0], path)
                progress(f"auto: parity of {name} on {provider}")
                comparisons = compare_models(base_path, path, config, dtype=dtype, provider=provider, weights=weights)
                failed = [c for c in comparisons if not c]
                if failed:
                    status[name], times[name] = f"fails parity: {failed[0]}", None
                    continue
            progress(f"auto: timing {name}")
            times[name] = median_ms(path, config, dtype, provider, shape, repeat)
            status[name] = "pass"
            if path != base_path:
                os.remove(path)
    timed = {k: t for k, t in times.items() if t is not None}
    if not timed:
        raise UsageError(f"auto: no lowering passes parity on {provider}: " + "; ".join(f"{k}: {v}" for k, v in status.items()))
    best = min(timed, key=timed.__getitem__)
    return AutoChoice(best, provider, tuple(shape), times, status)


def median_ms(
    path: str, config: AttentionConfig, dtype: str, provider: str, shape: tuple[int, int, int], repeat: int = AUTO_REPEAT
) -> float:
    """Median milliseconds of `repeat` runs after two warm-up runs, timed around run only (time_runner)."""
    batch, seq, mem_seq = shape
    with create_runner(get_provider(provider).backend, ModelSource(config, None, path, dtype)) as runner:
        feeds = make_inputs(config, batch, seq, mem_seq if config.cross else None, dtype=runner.inputs[0].dtype)
        runner.run(feeds)  # the first of two warm-up runs; time_runner makes the second
        return time_runner(runner, feeds, repeat)
