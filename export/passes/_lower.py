"""lower_model: the declared pipelines of each lowering, and `auto`, which measures them.

    LOWERING_PIPELINES[name](dtype) -> the list of passes, in order

The fp16 conversion (attnx.export.passes.fp16, its own engineer's pass) runs at the end of
every pipeline when dtype is fp16. The lowering the graph really holds afterwards (read
from the graph by lowering_of, not assumed) goes in metadata_props["attnx.attention"].
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from attnx.errors import UsageError
from attnx.export.passes._base import PipelineReport, run_pipeline
from attnx.export.passes._fuse_mha import FuseAttentionToMHA
from attnx.export.passes._pack import FuseMHAToPackedAttention, PackQkvProjections
from attnx.export.passes._probe import lowering_of, qk_weights
from attnx.export.passes._verify import PARITY_SHAPES, compare_models
from attnx.model.config import AttentionConfig
from attnx.model.inputs import make_inputs

__all__ = [
    "LOWERING_PIPELINES",
    "AUTO_CANDIDATES",
    "AUTO_SHAPE",
    "PASS_LOWERINGS",
    "AutoChoice",
    "LoweringResult",
    "lowering_passes",
    "lower",
    "lower_model",
    "choose_lowering",
    "PARITY_SHAPES",
    "ATTENTION_KEY",
    "AUTO_KEY",
]

logger = logging.getLogger(__name__)

ATTENTION_KEY = "attnx.attention"
AUTO_KEY = "attnx.auto"


def _cleanup() -> ir.passes.PassBase:
    return RemoveUnusedNodesPass()


# The pipelines, as data. "decomposed" and "onnx" are what the exporter writes: no pass.
LOWERING_PIPELINES: dict[str, Callable[[str], list[ir.passes.PassBase]]] = {
    "decomposed": lambda dtype: [],
    "onnx": lambda dtype: [],
    "ort-fused": lambda dtype: [FuseAttentionToMHA(dtype), _cleanup()],
    # The cleanup between: a projection MatMul can only be replaced once the bias Add the
    # fusion left dead no longer uses it.
    "ort-fused-packed": lambda dtype: [FuseAttentionToMHA(dtype), _cleanup(), PackQkvProjections(), _cleanup()],
    "ort-attention": lambda dtype: [FuseAttentionToMHA(dtype), _cleanup(), FuseMHAToPackedAttention(), _cleanup()],
}
# Lowerings a pass can reach from an exported graph, auto included (not "onnx": the
# standard Attention op comes from the exporter at opset 23, see `attnx export`).
PASS_LOWERINGS = ("decomposed", "ort-fused", "ort-fused-packed", "ort-attention", "auto")
# What auto measures: the export's own form and every pass lowering.
AUTO_CANDIDATES = ("base", "ort-fused", "ort-fused-packed", "ort-attention")
# (batch, seq, mem_seq) auto times at: the size the targets are set at.
AUTO_SHAPE = (1, 512, 512)
AUTO_REPEAT = 5


def _fp16_pass(keep_io_fp32: bool) -> ir.passes.PassBase:
    try:
        from attnx.export.passes.fp16 import ConvertToFloat16
    except ImportError as e:
        raise UsageError(f"fp16 conversion is not available in this attnx (attnx.export.passes.fp16: {e})") from None
    return ConvertToFloat16(keep_io_fp32=keep_io_fp32)


def lowering_passes(lowering: str, dtype: str = "fp32", keep_io_fp32: bool = False) -> list[ir.passes.PassBase]:
    """The passes of one lowering, in order, with the fp16 conversion last for dtype fp16."""
    if lowering not in LOWERING_PIPELINES:
        raise UsageError(f"unknown lowering {lowering!r} (known: {', '.join(LOWERING_PIPELINES)})")
    if dtype not in ("fp32", "fp16"):
        raise UsageError(f"unknown dtype {dtype!r} (known: fp32, fp16)")
    passes = LOWERING_PIPELINES[lowering](dtype)
    if dtype == "fp16":
        passes.append(_fp16_pass(keep_io_fp32))
    return passes


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
    model: ir.Model
    requested: str
    lowering: str  # what the graph holds now (lowering_of)
    report: PipelineReport
    auto: AutoChoice | None = None

    def lines(self) -> list[str]:
        out = [] if self.auto is None else self.auto.lines()
        head = f"lowering: {self.lowering}"
        if self.requested not in (self.lowering, "auto"):
            head += f" (requested {self.requested}: see the pass notes)"
        return out + [head] + self.report.lines()


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
) -> LoweringResult:
    """Run the pipeline of `attention` on `model` in place (auto: measure, then run the
    fastest that passes parity on `provider`) and record the result in its metadata."""
    if attention == "onnx" and lowering_of(model) != "onnx":
        raise UsageError("--attention onnx is written by the exporter at opset 23 (attnx export --attention onnx)")
    if attention not in PASS_LOWERINGS and attention != "onnx":
        raise UsageError(f"unknown --attention {attention!r} (known: {', '.join(PASS_LOWERINGS)})")
    if attention == "decomposed" and lowering_of(model) != "decomposed":
        raise UsageError(f"the model's attention is {lowering_of(model)} already: no pass turns it back into decomposed")
    auto = None
    if attention == "auto":
        auto = choose_lowering(
            model, config, dtype=dtype, keep_io_fp32=keep_io_fp32, provider=provider, shape=auto_shape, progress=progress
        )
        chosen = auto.choice
    else:
        chosen = attention
    passes = lowering_passes(chosen, dtype, keep_io_fp32)
    model, report = run_pipeline(model, passes)
    lowering = lowering_of(model)
    model.metadata_props[ATTENTION_KEY] = lowering
    if auto is not None:
        model.metadata_props[AUTO_KEY] = auto.to_json()
    return LoweringResult(model, attention, lowering, report, auto)


def lower_model(
    model: ir.Model,
    config: AttentionConfig,
    attention: str = "ort-fused",
    dtype: str = "fp32",
    keep_io_fp32: bool = False,
    **kwargs,
) -> tuple[ir.Model, list[str]]:
    """The interface export_model calls: (lowered model, one report line per thing done)."""
    result = lower(model, config, attention=attention, dtype=dtype, keep_io_fp32=keep_io_fp32, **kwargs)
    return result.model, result.lines()


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
) -> AutoChoice:
    """Build every candidate lowering from `model` (not changed), check its parity against
    `model` on `provider`, time those that pass at `shape`, and return the fastest.

    Each candidate is written to a temporary file and loaded from there, as a deployment
    would load it; the gpt3 preset's candidates are 2.4 GB each, so one exists at a time."""
    from attnx.export._export import save_model

    base_form = lowering_of(model)
    times: dict[str, float | None] = {}
    status: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="attnx-auto-") as tmp:
        base_path = os.path.join(tmp, "base.onnx")
        save_model(model, base_path)
        weights = qk_weights(model)
        for name in candidates:
            label = f"base ({base_form})" if name == "base" else name
            progress(f"auto: building {label}")
            candidate = ir.load(base_path)
            lowering = base_form if name == "base" else name
            candidate, report = run_pipeline(candidate, lowering_passes(lowering, dtype, keep_io_fp32))
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
    from attnx.runtimes import ModelSource, create_runner

    batch, seq, mem_seq = shape
    with create_runner(f"ort-{provider}", ModelSource(config, None, path, dtype)) as runner:
        feeds = make_inputs(config, batch, seq, mem_seq if config.cross else None, dtype=runner.inputs[0].dtype)
        for _ in range(2):
            runner.run(feeds)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            runner.run(feeds)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)

