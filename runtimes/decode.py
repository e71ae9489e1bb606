"""Decoding with the step model (config kv_cache): prefill, then one step at a time, on any backend,
and the step-by-step parity that proves it equals the full-sequence forward.

    runner = attnx.load(package)          # or any loaded Runner of a kv_cache model
    state = runner.prefill(x)             # x [batch, P, d_model]; state.y is the prompt's y
    y, state = runner.step(x_t, state)    # x_t [batch, 1, d_model]

(Runner.prefill/step, attnx.runtimes.base.) The state holds the cache (present_key/present_value
of the last run, fed back as past) and the key padding mask of every position so far. On ONNX
Runtime the cache stays in ORT's own buffers between steps (run_with_ort_values: the presents are
fed back as OrtValues, never copied through numpy); the reference and torch backends hold numpy
arrays. BufferDecoder runs the buffer form (one preallocated cache, IOBinding).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.errors import InputError, ProviderUnavailable, UsageError
from attnx.model.config import AttentionConfig, CacheSpec
from attnx.model.contract import (
    DECODE_KEY,
    REFERENCE,
    ROPE_POSITIONS_KEY,
    describe,
    float_dtype,
    numpy_dtype,
)
from attnx.model.inputs import position_ids_from_mask
from attnx.model.rope import uses_long_factors
from attnx.model.tolerance import ProblemSize, StageBound, Tolerance, problem_size, stage_tolerance, tolerance_for
from attnx.runtimes.base import DecodeState, ModelSource, Runner, create_runner
from attnx.runtimes.compare import compare_arrays
from attnx.runtimes.localise import Localisation, localisation_dict, localise_case
from attnx.runtimes.parity import (
    LOCALISE_MODES,
    MODULE_BACKENDS,
    ParityCase,
    ParityReport,
    quantized_skip,
    source_quantization,
)

__all__ = [
    "DEFAULT_PREFILLS",
    "DEFAULT_STEPS",
    "BufferDecoder",
    "bind_cache",
    "cache_buffers",
    "DecodeState",
    "decode_runs",
    "empty_cache",
    "first_divergence",
    "localise_decode",
    "make_decode_inputs",
    "run_buffer_parity",
    "is_buffer_form",
    "run_decode_parity",
]

logger = logging.getLogger(__name__)

DEFAULT_PREFILLS = (0, 1, 37)
DEFAULT_STEPS = 64


def empty_cache(config: AttentionConfig, batch: int, dtype: str = "fp32") -> tuple[np.ndarray, ...]:
    """past_key, past_value (past_latent for a latent config: config.cache_specs) with past_seq 0: what a prefill
    feeds."""
    dt = numpy_dtype(dtype)
    return tuple(np.zeros((batch, *spec.shape[1:2], 0, *spec.shape[3:]), dt) for spec in config.cache_specs())


class BufferDecoder:
    """Steps (the first one the prefill) over an ort-* runner of the buffer form: one cache buffer per tensor,
    [batch, n_kv_heads, capacity, ..], allocated once and bound through IOBinding as both the
    past input and the present output, so each step writes only its new tokens' keys/values.
    The state is the number of positions each row has filled (lengths; rows may differ: a prompt run into one row,
    step(x, row=b)). With rope, token i of every row is at position i (the op rotates from seqlens_k): positions
    0..capacity-1 must lie in the model's cos/sin table (attnx.rope_positions rows), checked here, before any step."""

    def __init__(self, runner: Runner, config: AttentionConfig, capacity: int, batch: int) -> None:
        import onnxruntime as ort

        session = getattr(runner, "session", None)
        if session is None:
            raise UsageError(f"the buffer form runs on ONNX Runtime (IOBinding), not on backend {runner.name!r}")
        rows = session.get_modelmeta().custom_metadata_map.get(ROPE_POSITIONS_KEY)
        if rows is not None and capacity > int(rows):
            raise InputError(
                f"a cache of {capacity} positions reaches past the model's rope table (positions 0..{int(rows) - 1}): "
                f"build the buffer form with rope_positions >= {capacity}"
            )
        self.runner, self.config, self.capacity, self.batch = runner, config, capacity, batch
        self.session = session
        device = getattr(runner, "binding_device", "cpu")
        self.device = device
        self.dtype = runner._float_dtype()  # the cache's (and x's) dtype, as the model declares past_key
        # the cache as the config's core lays it out (cache_specs): keys and values, or one latent
        self.cache = [(spec, ort.OrtValue.ortvalue_from_numpy(buffer, device, 0))
                      for spec, buffer in cache_buffers(config, batch, capacity, self.dtype)]  # fmt: skip
        self.binding = session.io_binding()
        self.lengths = np.zeros(batch, np.int64)  # positions filled, per row

    @property
    def length(self) -> int:
        """The positions the longest row has filled."""
        return int(self.lengths.max())

    def step(self, x: np.ndarray, row: int | None = None) -> np.ndarray:
        """y of the new tokens x [batch, seq, d_model]; each row's keys/values are written into the
        buffers at its positions lengths[b]..lengths[b]+seq-1 (rows of other lengths in one call: each its own).
        row: x [1, seq, d_model] is row `row`'s alone (a prompt run into its row: that row's part of each buffer
        bound by address, the others untouched)."""
        seq = x.shape[1]
        rows = slice(None) if row is None else slice(row, row + 1)
        if x.shape[0] != (self.batch if row is None else 1):
            raise InputError(f"x has batch {x.shape[0]}, the cache buffers were made for batch {self.batch}"
                             if row is None else f"x for row {row} has batch {x.shape[0]}, not 1")  # fmt: skip
        if row is not None and not 0 <= row < self.batch:
            raise InputError(f"row {row}: the cache buffers hold rows 0..{self.batch - 1}")
        ends = self.lengths[rows] + seq
        if ends.max() > self.capacity:
            raise InputError(f"the cache holds {self.capacity} positions: {int(ends.max()) - seq} + {seq} do not fit")
        b = self.binding if row is None else self.session.io_binding()
        b.bind_cpu_input("x", np.ascontiguousarray(x, self.dtype))
        b.bind_cpu_input("seqlens_k", (ends - 1).astype(np.int32))
        b.bind_cpu_input("total_sequence_length", np.asarray(ends.max(), np.int32))
        b.bind_output("y", self.device)
        if row is None:
            bind_cache(b, self.cache)
        else:
            _bind_row(b, self.cache, row, self.dtype, self.device)
        self.session.run_with_iobinding(b)
        self.lengths[rows] = ends
        return b.get_outputs()[0].numpy()

    def cache_numpy(self) -> tuple[np.ndarray, ...]:
        """The filled part of each cache tensor (past_key, past_value; past_latent), its first `length` positions: a
        copy (OrtValue.numpy() of a CPU buffer may be a view of its memory, freed with the decoder)."""
        return tuple(np.take(value.numpy(), range(self.length), axis=spec.grows).copy() for spec, value in self.cache)


def _bind_row(binding: Any, cache: Sequence[tuple[CacheSpec, Any]], row: int, dtype: Any, device: str) -> None:
    """bind_cache of row `row` alone: each buffer's [1, ...] part at its address (a row is contiguous, batch first)."""
    for spec, value in cache:
        shape = [1, *value.shape()[1:]]
        at = value.data_ptr() + row * int(np.prod(shape)) * np.dtype(dtype).itemsize
        binding.bind_input(spec.past, device, 0, np.dtype(dtype).type, shape, at)
        binding.bind_output(spec.present, device, 0, np.dtype(dtype).type, shape, at)


def cache_buffers(config: AttentionConfig, batch: int, capacity: int, dtype: Any) -> list[tuple[CacheSpec, np.ndarray]]:
    """The buffer form's cache, zeros of `capacity` positions, one array for each tensor the config's core declares
    (cache_specs): [batch, n_kv_heads, capacity, head_dim] and [.., v_head_dim]; [batch, 1, capacity, rope +
    kv_lora_rank] for a latent."""
    return [(spec, np.zeros(spec.sized(batch, capacity), dtype)) for spec in config.cache_specs()]


def bind_cache(binding: Any, cache: Sequence[tuple[CacheSpec, Any]]) -> None:
    """Binds each cache buffer (an OrtValue) as its past_<role> input and its present_<role> output: one buffer, the
    step writes its new positions in place."""
    for spec, value in cache:
        binding.bind_ortvalue_input(spec.past, value)
        binding.bind_ortvalue_output(spec.present, value)


def make_decode_inputs(config: AttentionConfig, batch: int, total: int, dtype: str = "fp32",
                       seed: int = 0, position_offset: int = 0, buffer: bool = False) -> dict[str, np.ndarray]:  # fmt: skip
    """x [batch, total, d_model] ~ N(0, 1) and, when the model takes one, a left-padded key
    padding mask [batch, total]: row b hides its first b*(total//(2*batch)) + b positions (row 0
    none; later rows more, so some queries see no key at all: y = bo there). A model with rope
    also takes position_ids [batch, total]: Hugging Face's rule over that left padding (without a
    mask, over the same padding, left_padding's rows), moved by position_offset. buffer: the buffer
    form's inputs: no padding (it takes no mask), each token at its token index (its positions are
    seqlens_k's)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    feeds = {"x": rng.standard_normal((batch, total, config.d_model), dtype=np.float32).astype(numpy_dtype(dtype))}
    pad = np.zeros((batch, total), bool)
    for b in range(batch if not buffer else 0):
        pad[b, : min(total - 1, b * (total // (2 * batch)) + b)] = True
    if config.key_padding_mask:
        feeds["key_padding_mask"] = pad
    if config.rope is not None:
        feeds["position_ids"] = position_ids_from_mask(~pad) + np.int64(position_offset)
    return feeds


def is_buffer_form(runner: Runner) -> bool:
    """Whether a loaded runner runs a step model of the buffer form (its seqlens_k input)."""
    return any(s.name == "seqlens_k" for s in runner.inputs)


def decode_sequence(
    runner: Runner, feeds: Mapping[str, np.ndarray], prefill: int, config: AttentionConfig | None = None
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """y over every position and the final cache (present_key, present_value, or present_latent, as numpy): a
    prefill of `prefill` tokens (an empty one when 0: the first token is then a step like the
    others), then one token per step, each feeding the cache back. A step model of either form:
    the growing form through runner.prefill/step, the buffer form through a BufferDecoder of
    every position (it takes no key padding mask nor positions)."""
    ys, cache = [], None
    for _, _, y, last in decode_runs(runner, feeds, prefill, config):
        ys.append(y)
        cache = last
    return np.concatenate(ys, axis=1), cache()


def decode_runs(
    runner: Runner, feeds: Mapping[str, np.ndarray], prefill: int, config: AttentionConfig | None = None
) -> Iterator[tuple[int, int, np.ndarray, Callable[[], tuple[np.ndarray, ...]]]]:
    """The runs of decode_sequence, one at a time: (start, stop, y, cache) with the run's tokens
    start..stop-1, their y, and a callable giving the cache as it stands after the run (numpy
    copies; called only when wanted: on ONNX Runtime the cache stays in its buffers)."""
    x, mask, positions = feeds["x"], feeds.get("key_padding_mask"), feeds.get("position_ids")
    if is_buffer_form(runner):
        dec = BufferDecoder(runner, config or runner.source.config, x.shape[1], x.shape[0])
        for start in [0] + list(range(max(prefill, 1), x.shape[1])):  # the first run: the prefill (or token 0)
            stop = max(prefill, 1) if start == 0 else start + 1
            yield start, stop, dec.step(x[:, start:stop]), dec.cache_numpy
        return

    def cut(a: np.ndarray | None, start: int, stop: int) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[:, start:stop])

    prefill = max(prefill, 1)  # no prefill: start from the empty cache with the first token, a step like the others
    state = runner.prefill(x[:, :prefill], cut(mask, 0, prefill), cut(positions, 0, prefill))
    yield 0, prefill, state.y, state.cache_numpy
    for t in range(prefill, x.shape[1]):
        y, state = runner.step(x[:, t : t + 1], state, cut(mask, t, t + 1), cut(positions, t, t + 1))
        yield t, t + 1, y, state.cache_numpy


def run_decode_parity(
    source: ModelSource,
    backends: Sequence[str],
    *,
    prefills: Iterable[int] = DEFAULT_PREFILLS,
    steps: int = DEFAULT_STEPS,
    batch: int = 2,
    seed: int = 0,
    runner_factory: Callable[..., Runner] = create_runner,
    progress: Callable[[str], None] = lambda msg: None,
    position_offset: int = 0,
    localise: str = "failing",
) -> ParityReport:
    """Per backend and prefill length P: a prefill of P tokens then `steps` single-token steps,
    feeding each present cache back as past, against the reference's full forward over the
    P + steps tokens (y at every position, and the final cache). The reference backend named
    among `backends` is checked the same way, step by step against its own full forward. A model
    with rope gets the position_ids of the left-padded batch, moved by position_offset (a long
    context: make_decode_inputs). localise (LOCALISE_MODES): a failing case (or every case, "all") is
    replayed step by step, and case.localisation says the first step, position and output beyond the
    bound and, where a step can be run alone, its first stage (localise_decode)."""
    config = source.config
    if config is None or not config.kv_cache:
        raise UsageError("decode parity needs a step model: a config with 'kv_cache': true")
    prefills = list(prefills)
    if steps < 1 or any(p < 0 for p in prefills) or batch < 1:
        raise UsageError(
            f"decode parity needs steps >= 1, prefills >= 0, batch >= 1 (got {steps}, {prefills}, {batch})"
        )
    # A quantized step model (int8, int4) runs on the ort-* backends that read its file; the
    # reference and the torch module compute the float formula, held to fp32's rule (as run_parity).
    quantization = source_quantization(source, "decode parity", "step model")
    buffer = source.model_path is not None and describe(source.model_path).metadata.get(DECODE_KEY) == "buffer"
    if localise not in LOCALISE_MODES:
        raise UsageError(f"localise must be one of {', '.join(LOCALISE_MODES)}, got {localise!r}")
    if buffer and position_offset:
        raise UsageError("the buffer form's positions are its token indices (from 0): no position offset")
    float_source = dataclasses.replace(source, dtype=float_dtype(source.dtype))

    def backend_source(name: str) -> ModelSource:
        """What backend `name` runs: the model file, or (the module backends) the float formula."""
        if name not in MODULE_BACKENDS:
            return source
        return dataclasses.replace(float_source, model_path=None) if name == REFERENCE else float_source

    ref = runner_factory(REFERENCE, backend_source(REFERENCE)).load()
    runners: dict[str, Runner | str] = {}
    for name in backends:
        if (skip := quantized_skip(name, source.dtype)) is not None:
            runners[name] = skip
            continue
        try:
            runners[name] = runner_factory(name, backend_source(name)).load()
        except ProviderUnavailable as e:
            runners[name] = str(e)
    cases: list[ParityCase] = []
    try:
        for i, prefill in enumerate(prefills):
            total = prefill + steps
            feeds = make_decode_inputs(config, batch, total, float_source.dtype, seed + i, position_offset, buffer)
            past = (spec.name for spec in config.cache_specs())  # past_key, past_value; past_latent
            full = {**feeds, **dict(zip(past, empty_cache(config, batch, float_source.dtype)))}
            progress(f"decode case {i + 1}/{len(prefills)}: prefill {prefill} + {steps} steps")
            ran = any(isinstance(r, Runner) for r in runners.values())
            expected = ref.run(full) if ran else {}  # no reference forward for backends that cannot run
            if ran and config.rope is not None and _longrope_switches(config, feeds["position_ids"], prefill):
                # longrope picks its factors per call (transformers' rule): a decode whose calls choose
                # differently from the full forward keeps keys rotated before the switch, so the
                # reference decodes the same calls (step by step, float64) to be compared with.
                y, cache = decode_sequence(ref, feeds, prefill, config)
                expected = {"y": y, **dict(zip(_presents(config), cache))}
            size = problem_size(config, source.weights, full, activations=quantization is not None) if ran else None
            for name, runner in runners.items():
                quantized = quantization is not None and name not in MODULE_BACKENDS
                case = _decode_case(name, runner, config, source.dtype if quantized else float_source.dtype, feeds,
                                    prefill, steps, expected, size, quantization if quantized else None)  # fmt: skip
                wanted = localise == "all" or (localise == "failing" and case.status == "fail")
                if isinstance(runner, Runner) and wanted:
                    progress(f"localising {name} prefill {prefill}: step by step")
                    case.localisation = _localisation(case, backend_source(name), runner, feeds, prefill, expected, size,
                                                      quantization if quantized else None, runner_factory)  # fmt: skip
                cases.append(case)
    finally:
        ref.close()
        for runner in runners.values():
            if isinstance(runner, Runner):
                runner.close()
    return ParityReport(cases)


def _longrope_switches(config: AttentionConfig, positions: np.ndarray, prefill: int) -> bool:
    """Whether a decode of `positions` (a prefill, then one token per call) has a call whose longrope
    factors differ from those of the full forward over every position."""
    if config.rope.switch_at is None:
        return False
    whole = uses_long_factors(config.rope, positions)
    calls = [positions[:, : max(prefill, 1)]] + [positions[:, t : t + 1] for t in range(max(prefill, 1),
                                                                                       positions.shape[1])]  # fmt: skip
    return any(uses_long_factors(config.rope, call) != whole for call in calls)


def _output_bounds(config: AttentionConfig, tol: Tolerance, size: ProblemSize,
                   expected: Mapping[str, np.ndarray]) -> dict[str, StageBound]:  # fmt: skip
    """The bound of each compared output (tolerance.stage_tolerance, the stages' one rule): y's, and
    the caches' own (a quantized model's k and v projection errors; the rotated keys' rope term)."""
    return {out: stage_tolerance(out, config, tol, size, np.asarray(expected[out]))
            for out in ("y", *_presents(config))}  # fmt: skip


def _presents(config: AttentionConfig) -> tuple[str, ...]:
    """The step model's cache outputs: present_key, present_value; present_latent (config.cache_specs)."""
    return tuple(spec.name for spec in config.cache_specs(prefix="present_"))


def _decode_case(name: str, runner: Runner | str, config: AttentionConfig, dtype: str, feeds: dict[str, np.ndarray],
                 prefill: int, steps: int, expected: dict[str, np.ndarray], size: Any,
                 quantization: dict | None = None) -> ParityCase:  # fmt: skip
    tol = tolerance_for(dtype, name, quantization)
    batch, total = feeds["x"].shape[:2]
    common = {"backend": name, "reference": REFERENCE, "dtype": dtype, "batch": batch, "seq": total, "mem_seq": None,
                  "prefill": prefill, "steps": steps}  # fmt: skip
    if isinstance(runner, str):
        return ParityCase(**common, status="skipped", reason=runner, max_abs=None, max_rel=None, atol=0.0,
                          rtol=tol.rtol)  # fmt: skip
    y, cache = decode_sequence(runner, feeds, prefill, config)
    label = f"[batch={batch},prefill={prefill},steps={steps}{',buffer' if is_buffer_form(runner) else ''}]"
    bounds = _output_bounds(config, tol, size, expected)
    cmps = [compare_arrays(f"{out}{label}", got, expected[out], bounds[out].tol, bounds[out].size)
            for out, got in (("y", y), *zip(_presents(config), cache))]  # fmt: skip
    failed = [c for c in cmps if not c]
    return ParityCase(**common, status="fail" if failed else "pass", reason=str(failed[0]) if failed else None,
                      atol=cmps[0].atol, rtol=cmps[0].rtol, **cmps[0].stats())  # fmt: skip


def first_divergence(runner: Runner, feeds: Mapping[str, np.ndarray], prefill: int, expected: Mapping[str, np.ndarray],
                     tol: Tolerance, size: ProblemSize,
                     config: AttentionConfig | None = None) -> tuple[int, int, str, int, int] | None:  # fmt: skip
    """Where a decode first leaves its bound: (step, position, output, start, stop), step 0 the first
    run (the prefill), position a token index, output the first of y, present_key, present_value
    beyond its bound there, start..stop-1 the step's tokens; None when no step does. The decode is
    replayed run by run (decode_runs); after each run its cache (positions 0..length-1: the growing
    form's whole cache, the filled part of the buffer form's) is compared with the expected cache up
    to that length, and its y with the expected y at its tokens, each held to the bound that holds
    the whole sequence (_decode_case: the tolerance, size and scale of the whole expected output)."""
    config = config or runner.source.config
    bounds = _output_bounds(config, tol, size, expected)
    # the outputs in the order the formula computes them: a tie (the same step and position) names the cache, which
    # y of that position is computed from
    order = (*_presents(config), "y")
    scales = {out: float(np.sqrt(np.mean(np.square(np.asarray(expected[out], np.float64))))) for out in order}
    for step, (start, stop, y, cache) in enumerate(decode_runs(runner, feeds, prefill, config)):
        found = {}
        outs = [(out, got, expected[out][:, :, : got.shape[2]], 0) for out, got in zip(_presents(config), cache())]
        for out, got, want, offset in [*outs, ("y", y, expected["y"][:, start:stop], start)]:
            axis = 1 if out == "y" else 2
            at = _first_position(got, want, axis, bounds[out].tol, bounds[out].size, scales[out])
            if at is not None:
                found[out] = offset + at
        if found:
            out = min(found, key=lambda o: (found[o], order.index(o)))
            return step, found[out], out, start, stop
    return None


def _first_position(got: np.ndarray, want: np.ndarray, axis: int, tol: Tolerance, size: ProblemSize,
                    scale: float) -> int | None:  # fmt: skip
    """The first index along `axis` (the tokens) where `got` leaves the bound compare_arrays holds the
    whole array to (scale: the whole array's); a cache of the wrong length diverges where it ends."""
    if got.shape != want.shape:
        same = got.ndim == want.ndim and all(g == w for i, (g, w) in enumerate(zip(got.shape, want.shape)) if i != axis)
        if not same:
            return 0
        common = min(got.shape[axis], want.shape[axis])
        inside = _first_position(np.take(got, range(common), axis), np.take(want, range(common), axis), axis, tol,
                                 size, scale)  # fmt: skip
        return common if inside is None else inside
    if compare_arrays("", got, want, tol, size, scale):
        return None
    for i in range(got.shape[axis]):
        if not compare_arrays("", np.take(got, [i], axis), np.take(want, [i], axis), tol, size, scale):
            return i
    return 0  # no token alone leaves it, all of them do (a quantized form's rel_rms bound)


def localise_decode(
    source: ModelSource,
    runner: Runner,
    feeds: Mapping[str, np.ndarray],
    prefill: int,
    expected: Mapping[str, np.ndarray],
    *,
    tol: Tolerance,
    size: ProblemSize,
    failing: bool = True,
    look_inside: bool = True,
    runner_factory: Callable[..., Runner] = create_runner,
) -> Localisation:
    """Localise one decode case (docs/concepts/localisation.md): the first step, position and output beyond
    the bound (first_divergence), then, for a step of the growing form on a backend that runs a model
    file or the torch module, that step run alone (attnx.runtimes.localise.localise_case) from the
    expected cache up to it, cast to the model's float dtype, so that its stages are compared with the
    reference's from the same past: the first stage beyond its bound. failing: the case failed (the
    stage run then tries each ONNX Runtime optimization level and, with look_inside, looks inside a fused
    operator);
    a passing case's last step is run with its stages, for a finding y alone would not show. source:
    what `runner` was made from (its config and weights: the reference's stages)."""
    config = source.config
    found = first_divergence(runner, feeds, prefill, expected, tol, size, config)
    step, position, output, start, stop = found if found else (None, None, None, None, None)
    if found is None:
        start, stop = (0, max(prefill, 1)) if feeds["x"].shape[1] <= max(prefill, 1) else (feeds["x"].shape[1] - 1,
                                                                                         feeds["x"].shape[1])  # fmt: skip
    why = None
    if is_buffer_form(runner):
        why = ("the buffer form: step, position and output only (its cache is one buffer bound as past and present; "
               "no step of it is run alone with its stages)")  # fmt: skip
    elif runner.name == REFERENCE:
        why = "the reference itself: no stage run (it is what the stages are compared with)"
    elif source.weights is None:
        why = "no weights: no reference stages to compare with"
    if why is not None:
        return Localisation(runner.name, None, [], [], [], [], step=step, position=position, output=output, note=why)
    dtype = runner._float_dtype()
    step_feeds = {"x": np.ascontiguousarray(feeds["x"][:, start:stop])}
    for past, present in zip((spec.name for spec in config.cache_specs()), _presents(config)):
        step_feeds[past] = np.ascontiguousarray(expected[present][:, :, :start], dtype)
    if "key_padding_mask" in feeds:
        step_feeds["key_padding_mask"] = np.ascontiguousarray(feeds["key_padding_mask"][:, :stop])
    if "position_ids" in feeds:
        step_feeds["position_ids"] = np.ascontiguousarray(feeds["position_ids"][:, start:stop])
    result = localise_case(source, runner.name, step_feeds, tol=tol, size=size, runner_factory=runner_factory,
                           levels=failing, look_inside=failing and look_inside, failed=failing)  # fmt: skip
    result.step, result.position, result.output = step, position, output
    if found is not None and result.stage is None and result.cause is None:
        result.cause = (f"what the decode carried into step {step}: that step alone, from the reference's cache, "
                        "agrees (the cache fed back between steps, or where it was written)")  # fmt: skip
    return result


def _localisation(case: ParityCase, source: ModelSource, runner: Runner, feeds: Mapping[str, np.ndarray], prefill: int,
                  expected: Mapping[str, np.ndarray], size: ProblemSize, quantization: dict | None,
                  runner_factory: Callable[..., Runner]) -> dict[str, Any]:  # fmt: skip
    """case.localisation of a decode case: localise_decode's dict with its line, or, when localisation
    itself fails, why (the case's verdict stands whatever it meets)."""
    return localisation_dict(lambda: localise_decode(
        source, runner, feeds, prefill, expected, tol=tolerance_for(case.dtype, case.backend, quantization), size=size,
        failing=case.status == "fail", runner_factory=runner_factory))  # fmt: skip


def run_buffer_parity(source: ModelSource, backend: str = "ort-cpu", *, prefills: Iterable[int] = DEFAULT_PREFILLS,
                      steps: int = DEFAULT_STEPS, batch: int = 2, seed: int = 0,
                      rows: Sequence[int] = ()) -> ParityReport:  # fmt: skip
    """run_decode_parity of one ort-* backend over a model of the buffer form: the cache
    preallocated at P + steps positions, one buffer bound as past and present. A backend that
    cannot run here is an error, not a skip. rows: each row's prompt length, for one more case of rows of other
    lengths in one call (a core that writes each row at its own length, seqlens_k: the decomposed core and
    GroupQueryAttention): each prompt run into its own row, then `steps` steps of every row at once, each row held
    to the reference's full forward over its own tokens (_rows_case)."""
    report = run_decode_parity(source, [backend], prefills=prefills, steps=steps, batch=batch, seed=seed)
    if rows:
        report.cases.append(_rows_case(source, backend, list(rows), steps, seed + len(list(prefills))))
    skipped = next((c.reason for c in report.cases if c.status == "skipped"), None)
    if skipped is not None:
        raise ProviderUnavailable(skipped)
    return report


def _rows_case(source: ModelSource, backend: str, lengths: list[int], steps: int, seed: int) -> ParityCase:
    """The buffer form over rows of other lengths (run_buffer_parity's rows): row b's prompt of lengths[b] tokens run
    into row b alone (BufferDecoder.step(row=b)), then `steps` one-token steps of every row in one call (each row
    writing and reading at its own length); y and the cache of every row against the reference's full forward of
    that row (float64), the rows' tokens joined along the token axis to be compared as one output."""
    config = source.config
    if any(n < 1 for n in lengths) or steps < 1:
        raise UsageError(f"rows of other lengths need prompts of 1 token or more and steps >= 1 (got {lengths}, {steps})")
    quantization = source_quantization(source, "buffer parity", "step model")
    dtype = source.dtype if quantization is not None else float_dtype(source.dtype)
    rng = np.random.Generator(np.random.PCG64(seed))
    xs = [rng.standard_normal((1, n + steps, config.d_model), dtype=np.float32).astype(numpy_dtype(float_dtype(dtype)))
          for n in lengths]  # fmt: skip
    ref = create_runner(REFERENCE, dataclasses.replace(source, model_path=None, dtype=float_dtype(source.dtype))).load()
    runner = create_runner(backend, source).load()
    try:
        wanted = []
        for x in xs:
            feeds = {"x": x, **dict(zip((spec.name for spec in config.cache_specs()),
                                        empty_cache(config, 1, float_dtype(dtype))))}  # fmt: skip
            if config.rope is not None:  # the buffer form's positions: token indices
                feeds["position_ids"] = np.arange(x.shape[1], dtype=np.int64)[None]
            wanted.append(ref.run(feeds))
        size = problem_size(config, source.weights, feeds, activations=quantization is not None)
        dec = BufferDecoder(runner, config, max(lengths) + steps, len(lengths))
        ys = [[dec.step(x[:, :n], row=b)] for b, (x, n) in enumerate(zip(xs, lengths))]
        for t in range(steps):
            y = dec.step(np.concatenate([x[:, n + t : n + t + 1] for x, n in zip(xs, lengths)]))
            for b, row in enumerate(ys):
                row.append(y[b : b + 1])
        caches = [value.numpy() for _, value in dec.cache]
    finally:
        runner.close()
        ref.close()
    got = {"y": np.concatenate([np.concatenate(row, axis=1) for row in ys], axis=1)}
    expected = {"y": np.concatenate([w["y"] for w in wanted], axis=1)}
    for out, (spec, cache) in zip(_presents(config), zip(config.cache_specs(), caches)):
        got[out] = np.concatenate([np.take(cache[b : b + 1], range(n + steps), axis=spec.grows)
                                   for b, n in enumerate(lengths)], axis=spec.grows)  # fmt: skip
        expected[out] = np.concatenate([w[out] for w in wanted], axis=spec.grows)
    tol = tolerance_for(dtype, backend, quantization)
    bounds = _output_bounds(config, tol, size, expected)
    label = f"[rows={','.join(map(str, lengths))},steps={steps},buffer]"
    cmps = [compare_arrays(f"{out}{label}", got[out], expected[out], bounds[out].tol, bounds[out].size)
            for out in ("y", *_presents(config))]  # fmt: skip
    failed = [c for c in cmps if not c]
    return ParityCase(backend=backend, reference=REFERENCE, dtype=dtype, batch=len(lengths), seq=max(lengths) + steps,
                      mem_seq=None, prefill=max(lengths), steps=steps, status="fail" if failed else "pass",
                      reason=str(failed[0]) if failed else None, atol=cmps[0].atol, rtol=cmps[0].rtol,
                      **cmps[0].stats())  # fmt: skip
