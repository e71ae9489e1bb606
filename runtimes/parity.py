"""Parity: every backend against a reference backend, case by case, with the comparator's
error statistics (attnx.runtimes.compare)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx._io import write_json_atomic
from attnx.errors import ProviderUnavailable, UsageError
from attnx.model.contract import (
    PROVIDERS,
    QUANTIZATIONS,
    REFERENCE,
    describe,
    float_dtype,
    quantization_of,
    quantized_form_unavailable,
)
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import ProblemSize, Tolerance, problem_size, tolerance_for
from attnx.runtimes.base import ModelSource, Runner, create_runner
from attnx.runtimes.compare import compare_arrays
from attnx.runtimes.localise import Localisation, localisation_dict, localise_case

__all__ = [
    "ParityCase", "ParityReport", "run_parity", "DEFAULT_BATCHES", "DEFAULT_SEQS", "DEFAULT_MEM_SEQS", "DEFAULT_MEANS",
    "MODULE_BACKENDS", "source_quantization", "quantized_skip", "LOCALISE_MODES", "localise_into",
]  # fmt: skip

logger = logging.getLogger(__name__)

DEFAULT_BATCHES = (1, 3)
DEFAULT_SEQS = (1, 7, 128)
DEFAULT_MEM_SEQS = (9,)
# The inputs' means, taken in turn by the cases (case i: DEFAULT_MEANS[i % 2]). Zero-mean inputs
# alone hide every fault that moves a whole weight column by one amount, a quantized weight's
# zero point off by one for one: its error, step * sum_k x_k, averages out when x has no mean and
# grows with K * mean when it has one (as real activations have: after a GELU, a LayerNorm's shift).
DEFAULT_MEANS = (0.0, 0.5)
# Which cases are localised (docs/concepts/localisation.md): none, the failing ones (the default), or every
# case (a passing case must then show no stage beyond its bound).
LOCALISE_MODES = ("off", "failing", "all")


@dataclasses.dataclass
class ParityCase:
    backend: str
    reference: str
    dtype: str
    batch: int
    seq: int
    mem_seq: int | None
    status: str  # "pass" | "fail" | "skipped"
    reason: str | None
    max_abs: float | None
    max_rel: float | None
    atol: float
    rtol: float
    mean_abs: float | None = None
    p99_abs: float | None = None
    cosine: float | None = None
    needed_atol: float | None = None  # the atol that would have passed
    prefill: int | None = None  # decode parity: the prefill length, then `steps` single-token steps
    steps: int | None = None
    rel_rms: float | None = None  # ||out - ref|| / ||ref||
    # What the backend computed in, as it reports it (openvino: read back from the compiled
    # model; torch: the module's dtype); None where the backend reports none.
    precision: str | None = None
    input_mean: float = 0.0  # x (and memory) ~ N(input_mean, 1)
    # Where the case diverges (attnx.runtimes.localise.Localisation.to_dict()): on a failing case,
    # and on every case with localise="all"; {"error": ...} when localisation itself could not run.
    localisation: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ParityReport:
    cases: list[ParityCase]

    @property
    def passed(self) -> bool:
        """No case failed and at least one ran."""
        return any(c.status == "pass" for c in self.cases) and not any(c.status == "fail" for c in self.cases)

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "cases": [c.to_dict() for c in self.cases]}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParityReport:
        return cls([ParityCase(**c) for c in data["cases"]])

    def summary(self) -> dict[str, dict[str, int]]:
        """{backend: {status: count}}."""
        out: dict[str, dict[str, int]] = {}
        for c in self.cases:
            out.setdefault(c.backend, {"pass": 0, "fail": 0, "skipped": 0})[c.status] += 1
        return out


def _case(
    backend: str,
    reference: str,
    dtype: str,
    batch: int,
    seq: int,
    mem_seq: int | None,
    runner: Runner | str,
    feeds: dict[str, np.ndarray],
    ref_y: np.ndarray,
    size: ProblemSize,
    quantization: dict | None = None,
    input_mean: float = 0.0,
    localise: str = "off",
    source: ModelSource | None = None,
    runner_factory: Callable[..., Runner] = create_runner,
    history: Sequence[Mapping[str, np.ndarray]] = (),
    ref_stages: Mapping[str, np.ndarray] | None = None,
) -> ParityCase:
    """Run one backend on one case and compare; a str runner is the reason it is skipped. localise
    (LOCALISE_MODES): whether to localise the case, from `source`; history: the feeds this runner ran
    before (replayed by the localisation); ref_stages: the reference's stages of the case, where it
    recorded them (the localisation computes what they lack)."""
    tol = tolerance_for(dtype, backend, quantization)
    common = dict(backend=backend, reference=reference, dtype=dtype, batch=batch, seq=seq, mem_seq=mem_seq,
                  input_mean=input_mean)  # fmt: skip
    if not isinstance(runner, str) and (mismatch := runner.fixed_dims_mismatch(feeds)) is not None:
        runner = f"not applicable: the model's own dims rule this case out ({mismatch})"
    if isinstance(runner, str):
        return ParityCase(**common, status="skipped", reason=runner, max_abs=None, max_rel=None, atol=0.0,
                          rtol=tol.rtol)  # fmt: skip
    cmp = compare_arrays("y", runner.run(feeds)["y"], ref_y, tol, size)
    case = ParityCase(
        **common, status="pass" if cmp else "fail", reason=None if cmp else str(cmp), atol=cmp.atol, rtol=cmp.rtol,
        **cmp.stats(), precision=getattr(runner, "precision", None),
    )  # fmt: skip
    if source is not None and (localise == "all" or (localise == "failing" and not cmp)):
        localise_into(case, source, feeds, tol, size, runner_factory, history=history, reference=ref_stages)
    return case


def localise_into(case: ParityCase, source: ModelSource, feeds: Mapping[str, np.ndarray], tol: Tolerance,
                  size: ProblemSize, runner_factory: Callable[..., Runner] = create_runner, **options: Any) -> None:  # fmt: skip
    """Set case.localisation (attnx.runtimes.localise): on a failing case with the optimization levels
    and a look inside a fused operator; on a passing one the stages alone. A localisation that cannot
    run leaves the case's verdict as it is and says why (localisation_dict)."""
    failing = case.status == "fail"

    def localise() -> Localisation:
        found = localise_case(source, case.backend, feeds, tol=tol, size=size, runner_factory=runner_factory,
                              levels=failing, look_inside=failing, failed=failing, **options)  # fmt: skip
        y_check = next((c for c in found.checks if c.stage == "y"), None)
        if failing and found.stage is None and y_check is not None and y_check.status == "pass":
            found.note = "; ".join(filter(None, [found.note, "the failure did not reproduce in this run (y agrees): "
                                                 "it depends on what ran before it, or on the stages not being outputs"]))
        return found

    case.localisation = localisation_dict(localise)


# The backends that compute the float formula from the config and weights (the reference, the torch
# module), not from the model file: a quantized model's parity holds them to its float dtype's rule.
MODULE_BACKENDS = frozenset({REFERENCE, *(p.torch_backend for p in PROVIDERS.values())})


def source_quantization(source: ModelSource, what: str = "parity", model: str = "model") -> dict | None:
    """The quantization record of a quantized source (int8, int4; None for a float one), read
    from its model file: a UsageError when there is no file or the file is not of that dtype."""
    dtype = source.dtype
    if dtype not in QUANTIZATIONS:
        return None
    if source.model_path is None:
        raise UsageError(f"{what} of {dtype} needs the quantized {model} (--model), written by attnx export --dtype {dtype}")
    quantization = quantization_of(describe(source.model_path).metadata)
    if quantization is None or quantization["dtype"] != dtype:
        raise UsageError(f"{source.model_path!r} is not an {dtype} model (attnx inspect shows its dtype)")
    return quantization


def quantized_skip(name: str, dtype: str) -> str | None:
    """Why backend `name` is skipped in a parity run of a quantized `dtype` model, or None: the
    module backends run the float formula; the others must run the model file itself."""
    return None if name in MODULE_BACKENDS else quantized_form_unavailable(name, dtype)


def _load(runner: Runner) -> Runner | str:
    """The loaded runner, or the reason it cannot run here (its cases are then skipped)."""
    try:
        return runner.load()
    except ProviderUnavailable as e:
        logger.info("%s", e)
        return str(e)


def run_parity(
    source: ModelSource,
    backends: Sequence[str],
    *,
    reference: str = REFERENCE,
    batches: Iterable[int] = DEFAULT_BATCHES,
    seqs: Iterable[int] = DEFAULT_SEQS,
    mem_seqs: Iterable[int] | None = None,
    means: Sequence[float] = DEFAULT_MEANS,
    seed: int = 0,
    runner_factory: Callable[..., Runner] = create_runner,
    progress: Callable[[str], None] = lambda msg: None,
    position_offset: int = 0,
    localise: str = "failing",
) -> ParityReport:
    """Compare each backend's y with the reference backend's on the same inputs.

    A backend that cannot run here is reported skipped with its reason in every case. The
    reference's outputs are computed once per shape. Case i draws its inputs with mean
    means[i % len(means)] (DEFAULT_MEANS: every second case has shifted inputs). A model with
    rope is fed position_ids as Hugging Face computes them for a left-padded batch (or from the
    key padding mask), every position moved by position_offset (make_inputs): a long context is
    a large offset. localise (LOCALISE_MODES): a failing case (or every case, "all") is run again with
    the formula's stages exposed, and case.localisation says where it diverges (attnx.runtimes.localise).
    runner_factory(name, source, **options) makes each runner; the options are create_runner's (a
    localisation passes session_options for ONNX Runtime's optimization levels).
    """
    config = source.config
    if config is None:
        raise UsageError("parity needs the model's config")
    # Naming the reference among the backends checks the reference itself: against the
    # torch module run in float64, an independent implementation of the same formula.
    check_reference = reference in backends
    backends = [b for b in backends if b != reference]
    mem_list: list[int | None] = list(mem_seqs or DEFAULT_MEM_SEQS) if config.cross else [None]
    shapes = list(itertools.product(list(batches), list(seqs), mem_list))
    for batch, seq, mem_seq in shapes:
        if batch < 1 or seq < 1 or (mem_seq is not None and mem_seq < 1):
            raise UsageError(f"batch, seq and mem_seq must be positive, got batch={batch} seq={seq} mem_seq={mem_seq}")
    if isinstance(position_offset, bool) or not isinstance(position_offset, int) or position_offset < 0:
        raise UsageError(f"the position offset must be a non-negative integer, got {position_offset!r}")
    if position_offset and config.rope is None:
        raise UsageError("a position offset moves rope's positions: this model has no rope")
    if localise not in LOCALISE_MODES:
        raise UsageError(f"localise must be one of {', '.join(LOCALISE_MODES)}, got {localise!r}")
    means = [float(m) for m in means]
    if not means or not all(math.isfinite(m) for m in means):
        raise UsageError(f"the inputs' means must be finite numbers, got {means}")
    dtype = source.dtype
    # A quantized model (int8, int4) runs on the backends that read its file; the torch module and
    # the reference compute the float formula, and are held to fp32's rule.
    reads_file = any(b not in MODULE_BACKENDS for b in backends)
    quantization = source_quantization(source) if reads_file else None
    float_source = dataclasses.replace(source, dtype=float_dtype(dtype))

    def case_source(name: str) -> ModelSource:
        return float_source if name in MODULE_BACKENDS else source

    def case_dtype(name: str) -> str:
        return case_source(name).dtype

    ref_runner = runner_factory(reference, float_source)
    ref_runner.load()  # a reference that cannot run is an error, not a skip
    runners: dict[str, Runner | str] = {
        name: quantized_skip(name, dtype) or _load(runner_factory(name, case_source(name))) for name in backends
    }
    if check_reference:
        checker = _load(runner_factory("torch", dataclasses.replace(source, dtype="fp64")))
        runners[reference] = checker if isinstance(checker, Runner) else f"cannot check the reference: {checker}"

    cases: list[ParityCase] = []
    history: list[dict[str, np.ndarray]] = []  # what every runner ran so far, in order (a localisation replays it)
    try:
        for i, (batch, seq, mem_seq) in enumerate(shapes):
            mean = means[i % len(means)]
            progress(f"case {i + 1}/{len(shapes)}: batch={batch} seq={seq}" + (f" mem_seq={mem_seq}" if mem_seq else "")
                     + (f" mean={mean:g}" if mean else ""))  # fmt: skip
            feeds = make_inputs(config, batch, seq, mem_seq, dtype=float_source.dtype, seed=seed + i, mean=mean,
                                position_offset=position_offset)  # fmt: skip
            # a case that may be localised keeps the reference's stages (computed anyway) for it
            recording = localise != "off" and hasattr(ref_runner, "stages")
            if recording:
                ref_runner.stages = {}
            ref_y = ref_runner.run(feeds)["y"]
            ref_stages = ref_runner.stages if recording else None
            if recording:
                ref_runner.stages = None
            size = problem_size(config, source.weights, feeds, activations=dtype in QUANTIZATIONS)
            if check_reference:
                f64 = {n: v.astype(np.float64) if v.dtype.kind == "f" else v for n, v in feeds.items()}
                cases.append(_case(reference, "torch-fp64", "fp64", batch, seq, mem_seq, runners[reference],
                                   f64, ref_y, size, input_mean=mean))  # fmt: skip
            for name in backends:
                cases.append(_case(name, reference, case_dtype(name), batch, seq, mem_seq, runners[name], feeds, ref_y,
                                   size, quantization if case_dtype(name) in QUANTIZATIONS else None, mean,
                                   localise, case_source(name), runner_factory, history, ref_stages))  # fmt: skip
            history.append(feeds)
    finally:
        ref_runner.close()
        for runner in runners.values():
            if isinstance(runner, Runner):
                runner.close()
    return ParityReport(cases)
