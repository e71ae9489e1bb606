"""Lowering with `auto`: each candidate lowering built, checked and timed on a runtime, the
fastest that passes kept. A static lowering is the graph layer's own (attnx.export.passes.lower);
this adds the measured choice, which needs a runtime and so lives above both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import onnx_ir as ir

from attnx.errors import UsageError
from attnx.export import save_model
from attnx.export.passes import (
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCK_SIZE,
    LoweringResult,
    lowering_of,
    lowering_passes,
    qk_weights,
    run_pipeline,
    v_weights,
)
from attnx.export.passes import lower as lower_graph
from attnx.model.config import AttentionConfig
from attnx.model.contract import AUTO, AUTO_KEY, LOWERINGS, check_llm_support, get_provider
from attnx.model.inputs import make_inputs
from attnx.model.resources import check_memory, estimate_case
from attnx.runtimes import ModelSource, create_runner
from attnx.workflows._checks import compare_models

__all__ = ["AUTO_CANDIDATES", "AUTO_SHAPE", "AutoChoice", "choose_lowering", "lower"]

# What auto measures: the model's own form ("base": what the exporter wrote) and every lowering
# the contract marks as an auto candidate.
AUTO_CANDIDATES = ("base", *(name for name, lw in LOWERINGS.items() if lw.auto))
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


def lower(
    model: ir.Model,
    config: AttentionConfig,
    *,
    attention: str = "ort-fused",
    dtype: str = "fp32",
    keep_io_fp32: bool = False,
    provider: str = "cpu",
    auto_shape: tuple[int, int, int] = AUTO_SHAPE,
    progress: Callable[[str], None] = lambda msg: None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
) -> LoweringResult:
    """Run the pipeline of `attention` on `model` in place (auto: measure, then run the
    fastest that passes parity on `provider`) and record the result in its metadata."""
    check_llm_support(config, attention, dtype)  # auto measures fused lowerings: refused for rope, softcap, ...
    quant = {"block_size": block_size, "accuracy_level": accuracy_level}
    if attention != AUTO:
        return lower_graph(model, config, attention=attention, dtype=dtype, keep_io_fp32=keep_io_fp32, **quant)
    auto = choose_lowering(
        model, config, dtype=dtype, keep_io_fp32=keep_io_fp32, provider=provider, shape=auto_shape, progress=progress,
        **quant,
    )  # fmt: skip
    result = lower_graph(model, config, attention=auto.choice, dtype=dtype, keep_io_fp32=keep_io_fp32, **quant)
    result.model.metadata_props[AUTO_KEY] = auto.to_json()
    result.requested, result.auto = AUTO, auto
    return result


def choose_lowering(
    model: ir.Model,
    config: AttentionConfig,
    *,
    dtype: str = "fp32",
    keep_io_fp32: bool = False,
    provider: str = "cpu",
    shape: tuple[int, int, int] = AUTO_SHAPE,
    candidates: Sequence[str] = AUTO_CANDIDATES,
    repeat: int = AUTO_REPEAT,
    progress: Callable[[str], None] = lambda msg: None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
) -> AutoChoice:
    """Build every candidate lowering from `model` (not changed), check its parity against
    `model` on `provider`, time those that pass at `shape`, and return the fastest.

    Each candidate is written to a temporary file and loaded from there, as a deployment
    would load it; the gpt3 preset's candidates are 2.4 GB each, so one exists at a time."""
    backend = get_provider(provider, "--provider").backend
    base_form = lowering_of(model)
    # each candidate is timed at `shape`; the exported form may hold the whole score matrix there
    check_memory(estimate_case(config, backend, base_form, *shape, dtype))
    times: dict[str, float | None] = {}
    status: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="attnx-auto-") as tmp:
        base_path = os.path.join(tmp, "base.onnx")
        save_model(model, base_path)
        weights = qk_weights(model)
        if weights is not None:  # a quantized form's error model also needs v
            weights.update(v_weights(model) or {})
        for name in candidates:
            label = f"base ({base_form})" if name == "base" else name
            progress(f"auto: building {label}")
            candidate = ir.load(base_path)
            lowering = base_form if name == "base" else name
            passes = lowering_passes(lowering, dtype, keep_io_fp32, block_size=block_size, accuracy_level=accuracy_level)
            try:
                candidate, report = run_pipeline(candidate, passes)
            except UsageError as e:  # a form the precision pass refuses (int8 of ort-attention)
                status[label], times[label] = f"not applicable: {e}", None
                continue
            got = lowering_of(candidate)
            if got != lowering:
                notes = [n for r in report.records for n in r.notes if n.startswith("not ")]
                status[label], times[label] = f"not applicable: {'; '.join(notes) or got}", None
                continue
            path = os.path.join(tmp, f"candidate-{name}.onnx")
            save_model(candidate, path)
            del candidate
            progress(f"auto: parity of {label} on {provider}")
            comparisons = compare_models(base_path, path, config, dtype=dtype, provider=provider, weights=weights)
            failed = [c for c in comparisons if not c]
            if failed:
                status[label], times[label] = f"fails parity: {failed[0]}", None
                continue
            progress(f"auto: timing {label}")
            times[label] = _median_ms(path, config, dtype, provider, shape, repeat)
            status[label] = "pass"
            os.remove(path)
    timed = {k: t for k, t in times.items() if t is not None}
    if not timed:
        raise UsageError(f"auto: no lowering passes parity on {provider}: " + "; ".join(f"{k}: {v}" for k, v in status.items()))
    best = min(timed, key=timed.__getitem__)
    choice = base_form if best.startswith("base") else best
    return AutoChoice(choice, provider, tuple(shape), times, status)


def _median_ms(
    path: str, config: AttentionConfig, dtype: str, provider: str, shape: tuple[int, int, int], repeat: int
) -> float:
    """Median milliseconds of `repeat` runs after two warm-up runs, timed around run only."""
    batch, seq, mem_seq = shape
    with create_runner(get_provider(provider).backend, ModelSource(config, None, path, dtype)) as runner:
        feeds = make_inputs(config, batch, seq, mem_seq if config.cross else None, dtype=runner.inputs[0].dtype)
        for _ in range(2):
            runner.run(feeds)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            runner.run(feeds)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
