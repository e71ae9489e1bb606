"""Localisation: when a backend disagrees, the first stage of the formula that diverges
(docs/concepts/localisation.md).

The case is run again with the stages the model names (attnx.model.stages: q, k, v, their norms and
rotations, scores, probs, z, y, the cache) exposed as extra outputs, and each is compared with the
float64 reference's value of that same stage under that stage's own bound (attnx.model.tolerance.
stage_tolerance). The finding is the first stage beyond its bound, in the formula's order; the
stages before it that agree; and the ONNX nodes that produce it. A fused operator hides the stages
inside it: what goes in and what comes out are compared, and the same case is then run on the
same backend with the decomposed form of the same model (every stage exposed), to say whether the
fused operator or the formula's terms disagree. On ONNX Runtime the case is also run with graph
optimizations off and at each level: an optimization level that changes the verdict is the cause.

No torch import unless the backend is torch, or a fused operator is looked inside: the decomposed form
is written by the exporter, a layer above (set_decomposed_writer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.errors import AttnxError, ProviderUnavailable, UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    DECODE_KEY,
    DTYPE_KEY,
    MS_DOMAIN,
    PROVIDERS,
    float_dtype,
)
from attnx.model.reference import reference_attention
from attnx.model.resources import attention_flops, available_memory_bytes, weights_bytes
from attnx.model.stages import stage_layouts, stages_of, to_canonical
from attnx.model.tolerance import ProblemSize, Tolerance, stage_tolerance
from attnx.model.weights import weight_shapes
from attnx.runtimes.base import ModelSource, Runner, create_runner
from attnx.runtimes.compare import Comparison, compare_arrays

__all__ = ["StageCheck", "Localisation", "localise_case", "compare_stages", "reference_stages", "ORT_LEVELS", "FUSED_OPS",
           "DecomposedWriter", "set_decomposed_writer", "file_weights", "localisation_dict"]

logger = logging.getLogger(__name__)

# ONNX Runtime's graph optimization levels, from none to all (its default for a session).
ORT_LEVELS = ("disabled", "basic", "extended", "all")
# The operators that compute several stages in one node: what is inside them is hidden.
FUSED_OPS = {("", "Attention"), (MS_DOMAIN, "MultiHeadAttention"), (MS_DOMAIN, "GroupQueryAttention"),
             (MS_DOMAIN, "Attention"), (MS_DOMAIN, "PackedAttention")}  # fmt: skip
_TORCH_BACKENDS = tuple(p.torch_backend for p in PROVIDERS.values())
# The stages inside the attention core: a runtime fuses the core whole unless one of them is an output.
_CORE_INSIDE = ("scores", "probs")
# The leading inputs that carry values, of the operators whose other inputs are shapes, axes or sizes
# (not followed when the nodes that compute a stage are traced back).
_DATA_INPUTS = {("", op): 1 for op in ("Reshape", "Expand", "Tile", "Slice", "Pad", "Unsqueeze", "Squeeze")} | {
    ("", "ConstantOfShape"): 0, ("", "Range"): 0}  # fmt: skip
# The nodes a report line names (the JSON gives them all).
_LINE_NODES = 3
# The most bytes a float64 copy of scores (or probs) may take for them to be compared (core_bytes).
CORE_STAGE_BYTES = 256 * 2**20
# A case of at most this many FLOPs (attnx.model.resources.attention_flops) is localised with sessions
# of one thread: starting a pool costs more than it saves, and competes for the cores with the failing
# runner's own, still held (tiny, batch 3, seq 7: 0.7 MFLOP, measured faster with one thread; base, seq 7:
# 99 MFLOP; measurements/facts.md).
SMALL_CASE_FLOPS = 10**7
# (source, directory) -> the same model in the decomposed lowering, an onnx.ModelProto (directory: where
# the writer may write what it needs)
DecomposedWriter = Callable[[ModelSource, str], Any]
_decomposed_writer: DecomposedWriter | None = None


@dataclasses.dataclass
class StageCheck:
    """One stage of the case: "pass", "fail", or "hidden" (the form does not expose it)."""

    stage: str
    status: str
    max_abs: float | None = None
    atol: float | None = None
    needed_atol: float | None = None
    rel_rms: float | None = None
    detail: str | None = None

    @classmethod
    def of(cls, stage: str, cmp: Comparison) -> StageCheck:
        stats = cmp.stats()
        return cls(stage, "pass" if cmp else "fail", stats["max_abs"], cmp.atol, stats["needed_atol"],
                   stats["rel_rms"], cmp.detail())  # fmt: skip


@dataclasses.dataclass
class Localisation:
    """Where one failing case diverges (docs/concepts/localisation.md)."""

    backend: str
    stage: str | None  # the first stage beyond its bound; None: every exposed stage agrees
    checks: list[StageCheck]
    agree: list[str]  # the stages before it that agree
    hidden: list[str]  # the stages this form does not expose
    nodes: list[dict[str, str]]  # the ONNX nodes that produce the stage: name, op_type, domain
    optimization: dict[str, str] | None = None  # ONNX Runtime: level -> "pass" | "fail"
    cause: str | None = None  # what the evidence names: an optimization level, a fused operator, a stage
    inside: dict[str, Any] | None = None  # the decomposed form of the same model on the same backend
    step: int | None = None  # a step-by-step case: the first step (0 = the prefill) and position that diverge
    position: int | None = None
    output: str | None = None  # ... and which output diverged first there: y, present_key, present_value
    weights: list[str] = dataclasses.field(default_factory=list)  # the model file's weights that are not the reference's
    note: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        """The one line a text report gives."""
        where = ""
        if self.step is not None:
            where = f" at step {self.step} (position {self.position}, {self.output} first)"
        if self.stage is None and not self.checks:  # no stage was run (a decode's step alone)
            text = f"localised: first beyond its bound{where}" if where else "localised: nothing beyond its bound"
        elif self.stage is None:
            text = f"localised: no stage beyond its bound{where}"
        else:
            check = next(c for c in self.checks if c.stage == self.stage)
            shown = self.nodes[:_LINE_NODES]
            nodes = ", ".join(f"{n['name']} ({n['op_type']})" for n in shown) or (
                "the torch module's" if self.backend in _TORCH_BACKENDS else "not in the graph")
            if len(self.nodes) > len(shown):
                nodes += f" and {len(self.nodes) - len(shown)} more"
            text = (f"localised: first stage beyond its bound: {self.stage}{where}, max_abs={_g(check.max_abs)} "
                    f"(atol {_g(check.atol)}); agree: {', '.join(self.agree) or 'none'}; nodes: {nodes}")  # fmt: skip
            if self.hidden:
                text += f"; hidden: {', '.join(self.hidden)}"
        if self.weights:
            text += f"; the model file's weights differ from the reference's: {', '.join(self.weights)}"
        if self.optimization:
            text += ("; fails with ONNX Runtime's graph optimizations off too (not the optimizer)"
                     if self.optimization.get("disabled") == "fail"
                     else "; ONNX Runtime levels: " + ", ".join(f"{k} {v}" for k, v in self.optimization.items()))  # fmt: skip
        if self.inside and self.inside.get("verdict") != "agrees":
            text += f"; decomposed form: {self.inside.get('verdict')}" + (
                f" at {self.inside['stage']}" if self.inside.get("stage") else "")
        if self.cause:
            text += f"; cause: {self.cause}"
        if self.note:
            text += f"; {self.note}"
        return text


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def reference_stages(config: AttentionConfig, weights: Mapping[str, np.ndarray],
                     feeds: Mapping[str, np.ndarray], core: bool = True) -> dict[str, np.ndarray]:  # fmt: skip
    """Every stage of the case in float64, from the reference (attnx.model.reference); core=False:
    without scores and probs."""
    stages: dict[str, np.ndarray] = {}
    reference_attention(
        config, weights, feeds["x"], feeds.get("memory"), feeds.get("key_padding_mask"), feeds.get("past_key"),
        feeds.get("past_value"), feeds.get("position_ids"), stages=stages, core_stages=core,
        past_latent=feeds.get("past_latent"),
    )  # fmt: skip
    return stages


def core_bytes(config: AttentionConfig, feeds: Mapping[str, np.ndarray]) -> int:
    """The bytes of one float64 copy of the case's scores (or probs): [batch, n_heads, seq, keys]."""
    batch, seq = feeds["x"].shape[:2]
    keys = feeds["memory"].shape[1] if config.cross else seq
    keys += _past_length(config, feeds)
    return batch * config.n_heads * seq * keys * 8


def case_flops(config: AttentionConfig, feeds: Mapping[str, np.ndarray]) -> int:
    """The FLOPs of the case (attention_flops), the keys of a past cache counted in its core."""
    batch, seq = feeds["x"].shape[:2]
    memory = feeds.get("memory")
    return attention_flops(config, batch, seq, None if memory is None else memory.shape[1], _past_length(config, feeds))


def _past_length(config: AttentionConfig, feeds: Mapping[str, np.ndarray]) -> int:
    """The positions a step's cache holds (its first cache_specs tensor along its growing dim), 0 without one."""
    spec = config.cache_specs()[0]
    return feeds[spec.name].shape[spec.grows] if config.kv_cache and spec.name in feeds else 0


def localise_case(
    source: ModelSource,
    backend: str,
    feeds: Mapping[str, np.ndarray],
    *,
    tol: Tolerance,
    size: ProblemSize,
    runner_factory: Callable[..., Runner] = create_runner,
    levels: bool = True,
    look_inside: bool = True,
    reference: Mapping[str, np.ndarray] | None = None,
    history: Sequence[Mapping[str, np.ndarray]] = (),
    failed: bool = False,
) -> Localisation:
    """Localise one case of `backend` on `source` (feeds: the case's inputs; tol and size: what its
    parity held y to). levels: on ONNX Runtime, read the stages with graph optimizations off and, when
    that passes, run each level up to the first that fails (its stages then); look_inside:
    when the first stage beyond its bound comes out of a fused operator, run the decomposed form.
    history: the feeds the failing runner ran before this case, replayed first on the exposed model
    (a fault that depends on a runtime's state, as OpenVINO's shape cache, needs them). failed: the
    case failed; when every exposed stage then agrees, the inside of the core (scores, probs) is left
    unexposed and the case run again: an output changes what a runtime fuses, and with it the fault
    (OpenVINO's shape-cache fault is in its fused attention: it shows with q, k, v and z exposed only)."""
    start = time.perf_counter()
    config, weights = source.config, source.weights
    if config is None or weights is None:
        raise UsageError("localisation needs the model's config and weights (the reference's stages)")
    # scores and probs, [batch, n_heads, seq, keys], are compared while a float64 copy of each fits in
    # CORE_STAGE_BYTES (gpt3 at seq 2048, batch 3: 9.7 GB each); beyond, they are left inside the graph
    big = core_bytes(config, feeds)
    core = big <= CORE_STAGE_BYTES
    step = bool(config.kv_cache)
    graph = None
    if backend not in _TORCH_BACKENDS:
        if source.model_path is None:
            raise UsageError(f"localisation on {backend!r} needs the model file")
        # the copy with its stages exposed holds the weights again, in memory and in its session, beside
        # the failing session: refused, saying so, where the machine has not that much left
        need = 2 * weights_bytes(config)
        free = available_memory_bytes()
        if free is not None and need > free:
            raise UsageError(f"localising needs about {need / 1e9:.1f} GB more (the model exposed and its session); "
                             f"{free / 1e9:.1f} GB are available")  # fmt: skip
        graph = _Graph(source.model_path)
        if graph.buffer_form:
            step = False  # the presents are the whole buffers: decode localisation compares the cache itself
        if case_flops(config, feeds) <= SMALL_CASE_FLOPS:
            runner_factory = functools.partial(runner_factory, threads=1)
    # the reference's stages: those given (the case's own run of the reference) where they hold every
    # stage the form exposes; scores and probs are computed (a second pass over the keys) only for a form
    # that names them, and for a look inside when its decomposed form diverges (full_reference)
    ref = dict(reference or {})
    exposes_core = core and (graph is None or any(s in graph.layouts for s in _CORE_INSIDE))
    if "y" not in ref or (exposes_core and "scores" not in ref):
        ref = reference_stages(config, weights, feeds, exposes_core)

    def full_reference() -> Mapping[str, np.ndarray]:
        nonlocal ref
        if core and "scores" not in ref:
            ref = reference_stages(config, weights, feeds, True)
        return ref

    ort_levels = graph is not None and levels and backend.startswith("ort-")
    if graph is None:
        found = _torch_stages(source, backend, feeds, runner_factory, history, core)
    else:
        # On ONNX Runtime the stages are read with graph optimizations off first: the graph runs as it is
        # written, each named tensor computed as named, and the run is that level's verdict too.
        found = _exposed_run(graph, source, backend, feeds, runner_factory, history,
                             None if core else _outside_core(graph), "disabled" if ort_levels else None)  # fmt: skip
    result = _compare(backend, config, step, found, ref, tol, size, graph)
    if ort_levels:
        outputs = ("y", *(s.name for s in config.cache_specs(prefix="present_"))) if step else ("y",)
        off = "fail" if any(c.status == "fail" for c in result.checks if c.stage in outputs) else "pass"
        optimization = {"disabled": off}
        if off == "pass":  # each level in turn, up to the first that fails; its stages then
            optimization.update(_levels(graph, source, backend, feeds, ref, tol, size, runner_factory, step))
            level = next((name for name, v in optimization.items() if v == "fail"), None)
            if level is not None:
                found = _exposed_run(graph, source, backend, feeds, runner_factory, history,
                                     None if core else _outside_core(graph), level)  # fmt: skip
                result = _compare(backend, config, step, found, ref, tol, size, graph)
                result.cause = f"ONNX Runtime's graph optimizer (level {level} changes the verdict)"
        result.optimization = optimization
    inner = [s for s in _CORE_INSIDE if s in found]
    if graph is not None and failed and result.stage is None and inner:
        found = _exposed_run(graph, source, backend, feeds, runner_factory, history, _outside_core(graph))
        again = _compare(backend, config, step, found, ref, tol, size, graph)
        if again.stage is not None:
            again.optimization, again.cause = result.optimization, result.cause
            result = again
            result.note = (f"reproduced with {', '.join(inner)} left inside the graph: exposed, they change what "
                           f"{backend} fuses, and the failure goes")  # fmt: skip
    if graph is not None and result.stage is not None:
        result.nodes = graph.producers(result.stage)
        result.weights = _weights_differ(graph.proto, config, weights)
        fused = [n for n in result.nodes if (n["domain"], n["op_type"]) in FUSED_OPS]
        if result.weights:  # a fault in what a stage reads, whatever computes it
            result.cause = f"the model file's weights are not the reference's ({', '.join(result.weights)})"
        elif fused and look_inside:
            result.inside = _look_inside(source, backend, feeds, tol, size, ref, full_reference, runner_factory, result,
                                         fused[0])  # fmt: skip
    if graph is not None and not graph.layouts:
        result.note = "this model names no stages (written before attnx named them): only its outputs are compared"
    if not core:
        result.note = "; ".join(filter(None, [result.note, f"scores and probs not compared: a float64 copy of each "
                                              f"would take {big / 1e9:.1f} GB (limit {CORE_STAGE_BYTES / 1e9:.2f} GB)"]))
    result.seconds = time.perf_counter() - start
    return result


def localisation_dict(localise: Callable[[], Localisation]) -> dict[str, Any]:
    """What a report holds of localise()'s Localisation: its to_dict(), "line" its one line; when the
    localisation itself fails, {"error", "line"}: "not localised: " and why (attnx's own errors by their
    message, which names what is wrong; any other by its type and the first line of its message). A
    diagnostic: the verdict of what it localises stands whatever it meets."""
    try:
        found = localise()
    except Exception as e:  # noqa: BLE001 - a diagnostic: the verdict stands whatever it meets
        logger.info("localisation failed: %s", e)
        text = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        why = text if isinstance(e, AttnxError) else f"{type(e).__name__}: {text}"
        return {"error": f"{type(e).__name__}: {text}", "line": f"not localised: {why}"}
    return {**found.to_dict(), "line": found.line()}


def compare_stages(backend: str, config: AttentionConfig, found: Mapping[str, np.ndarray],
                   ref: Mapping[str, np.ndarray], tol: Tolerance, size: ProblemSize) -> Localisation:  # fmt: skip
    """Stages a run exposed (found: stage -> its value in the canonical layout) against the reference's, each under its
    own bound, in the formula's order: the first beyond its bound (what `attnx audit` localises a block to)."""
    return _compare(backend, config, False, found, ref, tol, size, None)


def _compare(backend: str, config: AttentionConfig, step: bool, found: Mapping[str, np.ndarray],
             ref: Mapping[str, np.ndarray], tol: Tolerance, size: ProblemSize, graph: _Graph | None) -> Localisation:  # fmt: skip
    checks: list[StageCheck] = []
    for stage in stages_of(config, step):
        name = stage.name
        if name not in found or name not in ref:  # (not exposed, or too large to compare: CORE_STAGE_BYTES)
            checks.append(StageCheck(name, "hidden"))
            continue
        got, want = np.asarray(found[name]), np.asarray(ref[name])
        if name == "probs":  # a fully hidden row has no probabilities (model/stages.py)
            rows = np.asarray(ref["probs_rows"])
            got, want = (got[rows] if got.shape == want.shape else got), want[rows]
        bound = stage_tolerance(name, config, tol, size, np.asarray(ref[name]))
        cmp = compare_arrays(name, got, want, bound.tol, bound.size, bound.scale, p99=False)
        checks.append(StageCheck.of(name, cmp))
    first = next((c for c in checks if c.status == "fail"), None)
    agree = [c.stage for c in checks if c.status == "pass"]
    if first is not None:
        agree = [c.stage for c in checks[: checks.index(first)] if c.status == "pass"]
    hidden = [c.stage for c in checks if c.status == "hidden"]
    return Localisation(backend, first.stage if first else None, checks, agree, hidden, [])


class _Graph:
    """The model file's graph as localisation reads it: which stages it names, in which layout, and
    the nodes that produce each tensor."""

    def __init__(self, model: str | Any) -> None:
        """model: the model file's path, or the model itself (an onnx.ModelProto, its weights in it)."""
        import onnx

        self.path = model if isinstance(model, str) else None
        # read once, with the weights (the exposed copy is a whole model); a model over 2 GB keeps them beside it
        self.proto = onnx.load(model, load_external_data=False) if isinstance(model, str) else model
        graph = self.proto.graph
        self.external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer)
        if self.external:
            onnx.external_data_helper.load_external_data_for_model(self.proto, os.path.dirname(os.path.abspath(model)))
        self.metadata = {p.key: p.value for p in self.proto.metadata_props}
        self.layouts = stage_layouts(self.metadata)
        self.buffer_form = self.metadata.get(DECODE_KEY) == "buffer"
        self.outputs = [o.name for o in graph.output]
        self._producers = {out: n for n in graph.node for out in n.output}
        self._types = {v.name: v.type.tensor_type.elem_type for v in
                       [*graph.value_info, *graph.output, *graph.input]}  # fmt: skip
        # a stage the graph declares no type for is in the compute dtype (fp16 with fp32 inputs: fp16)
        x_type = self._types.get("x", onnx.TensorProto.FLOAT)
        fp16 = self.metadata.get(DTYPE_KEY) == "fp16" or x_type == onnx.TensorProto.FLOAT16
        self._compute_type = onnx.TensorProto.FLOAT16 if fp16 else onnx.TensorProto.FLOAT

    def producers(self, stage: str) -> list[dict[str, str]]:
        """The nodes that compute `stage` from what comes before it (the other stages the graph names,
        its inputs, its weights): the node that outputs it first, then back along its inputs (a
        fused operator under an elementwise node that zeroes fully masked rows is among them)."""
        known = set(self.layouts) - {stage}
        nodes, seen, todo = [], set(), [stage]
        while todo:
            node = self._producers.get(todo.pop(0))
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "Shape":
                continue  # the size of a tensor, not its values
            nodes.append({"name": node.name, "op_type": node.op_type, "domain": node.domain})
            data = node.input[: _DATA_INPUTS.get((node.domain, node.op_type), len(node.input))]
            todo.extend(i for i in data if i and i not in known)
        return nodes

    def exposed_copy(self, directory: str, stages: Sequence[str] | None = None) -> str:
        """The model with every named stage (or those of `stages`) also a graph output, written into
        `directory`."""
        import onnx
        from onnx import helper

        outputs = self.proto.graph.output
        n = len(outputs)
        for stage in self.layouts:
            if stage in self.outputs or (stages is not None and stage not in stages):
                continue
            outputs.append(helper.make_tensor_value_info(stage, self._types.get(stage, self._compute_type), None))
        path = os.path.join(directory, "exposed.onnx")
        try:
            if self.external:  # saving moves the weights out of the proto it is given: a copy
                copy = onnx.ModelProto()
                copy.CopyFrom(self.proto)
                onnx.save(copy, path, save_as_external_data=True, location="exposed.onnx.data")
            else:
                onnx.save(self.proto, path)
        finally:
            del outputs[n:]  # the proto stays the model's own
        return path


def _outside_core(graph: _Graph) -> list[str]:
    return [s for s in graph.layouts if s not in _CORE_INSIDE]


def _exposed_run(graph: _Graph, source: ModelSource, backend: str, feeds: Mapping[str, np.ndarray],
                 runner_factory: Callable[..., Runner], history: Sequence[Mapping[str, np.ndarray]] = (),
                 stages: Sequence[str] | None = None, level: str | None = None,
                 directory: str | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """The named stages of the case (or those of `stages`) on `backend`, in their canonical layouts
    (float64); level: ONNX Runtime's graph optimization level (ORT_LEVELS; None: the runner's own);
    directory: where the exposed copy is written (default: a temporary one of its own)."""
    config = source.config
    options = {} if level is None else {"session_options": _session_options(level)}
    with contextlib.ExitStack() as stack:
        tmp = directory or stack.enter_context(tempfile.TemporaryDirectory(prefix="attnx-localise-"))
        path = graph.exposed_copy(tmp, stages) if graph.layouts or graph.path is None else graph.path
        runner = runner_factory(backend, dataclasses.replace(source, model_path=path), **options)
        with runner.load() as r:
            for earlier in history:
                r.run(dict(earlier))
            outs = r.run(dict(feeds))
    found = {}
    layouts = dict(graph.layouts) or {o: "b t (h d)" if o == "y" else "b h s d" for o in outs}
    for stage, layout in layouts.items():
        if stage in outs:
            found[stage] = to_canonical(stage, np.asarray(outs[stage], np.float64), layout, config)
    return found


def _torch_stages(source: ModelSource, backend: str, feeds: Mapping[str, np.ndarray],
                  runner_factory: Callable[..., Runner], history: Sequence[Mapping[str, np.ndarray]] = (),
                  core: bool = True) -> dict[str, np.ndarray]:  # fmt: skip
    """The torch module's stages of the case (MultiHeadAttention.stages); core=False: without scores
    and probs."""
    runner = runner_factory(backend, dataclasses.replace(source, dtype=float_dtype(source.dtype)))
    with runner.load() as r:
        module = getattr(r, "module", None)
        if module is None:
            raise UsageError(f"backend {backend!r} exposes no stages")
        for earlier in history:
            r.run(dict(earlier))
        module.stages = {}
        try:
            r.run(dict(feeds))
            recorded = dict(module.stages)
        finally:
            module.stages = None
    return {name: value.double().cpu().numpy() for name, value in recorded.items()
            if core or name not in _CORE_INSIDE}  # fmt: skip


def _session_options(level: str) -> Any:
    """ONNX Runtime session options at graph optimization `level` (ORT_LEVELS)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = {
        "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    return opts


def _levels(graph: _Graph, source: ModelSource, backend: str, feeds: Mapping[str, np.ndarray],
            ref: Mapping[str, np.ndarray], tol: Tolerance, size: ProblemSize, runner_factory: Callable[..., Runner],
            step: bool) -> dict[str, str]:  # fmt: skip
    """y (and a step's cache) of the original model at each optimization level after "disabled", up to
    the first that fails: {level: "pass" | "fail"}."""
    outputs = ("y", *(s.name for s in source.config.cache_specs(prefix="present_"))) if step else ("y",)

    def verdict(name: str) -> str:
        try:
            runner = runner_factory(backend, source, session_options=_session_options(name))
            with runner.load() as r:
                outs = r.run(dict(feeds))
        except ProviderUnavailable as e:
            return f"not run: {e}"
        for out in outputs:
            bound = stage_tolerance(out, source.config, tol, size, np.asarray(ref[out]))
            if not compare_arrays(out, np.asarray(outs[out]), ref[out], bound.tol, bound.size, bound.scale):
                return "fail"
        return "pass"

    verdicts: dict[str, str] = {}
    for name in ORT_LEVELS[1:]:
        verdicts[name] = verdict(name)
        if verdicts[name] != "pass":
            break
    return verdicts


def _look_inside(source: ModelSource, backend: str, feeds: Mapping[str, np.ndarray], tol: Tolerance,
                 size: ProblemSize, ref: Mapping[str, np.ndarray], full_reference: Callable[[], Mapping[str, np.ndarray]],
                 runner_factory: Callable[..., Runner], result: Localisation, fused: Mapping[str, str]) -> dict[str, Any]:  # fmt: skip
    """The decomposed form of the same model on the same backend: which of the two disagrees (ref: the
    reference's stages so far; full_reference: with scores and probs, for naming where the decomposed
    form diverges)."""
    op = f"{fused['domain'] + '.' if fused['domain'] else ''}{fused['op_type']}"
    try:
        with tempfile.TemporaryDirectory(prefix="attnx-localise-") as tmp:
            inner = _Graph(_decomposed_model(source, tmp))  # in memory: written once, exposed
            # on ONNX Runtime with optimizations off: the decomposed formula as written (and a session built
            # faster: measurements/facts.md)
            level = "disabled" if backend.startswith("ort-") else None
            found = _exposed_run(inner, source, backend, feeds, runner_factory, level=level, directory=tmp)
    except (UsageError, ProviderUnavailable) as e:
        return {"form": "decomposed", "op": op, "verdict": f"not run: {e}"}
    step = bool(source.config.kv_cache) and not inner.buffer_form
    inside = _compare(backend, source.config, step, found, ref, tol, size, inner)
    if inside.stage is not None and any(s in found and s not in ref for s in _CORE_INSIDE):
        inside = _compare(backend, source.config, step, found, full_reference(), tol, size, inner)
    if inside.stage is None:
        result.cause = f"the fused operator {op} ({fused['name']}): the decomposed form of the same model agrees on {backend}"
        return {"form": "decomposed", "op": op, "verdict": "agrees", "stage": None}
    result.cause = (f"the formula's terms, not {op} alone: the decomposed form of the same model also diverges, first at "
                    f"{inside.stage}")  # fmt: skip
    return {"form": "decomposed", "op": op, "verdict": "diverges", "stage": inside.stage,
            "checks": [dataclasses.asdict(c) for c in inside.checks]}  # fmt: skip


def file_weights(path: str | Any, config: AttentionConfig) -> dict[str, np.ndarray]:
    """The weights a model file holds as themselves, by their names (docs/reference/onnx-graph.md, "Names"): `<name>` as
    stored, `<name>.T` transposed for MatMul (`<name>_t` in a file written before the names), the packed
    `qkv_proj.weight.T` / `qkv_proj.bias` split into q, k and v; float32. A weight held in another form
    (quantized, packed with an unknown split) is absent."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(path) if isinstance(path, (str, os.PathLike)) else path  # a path, or a loaded ModelProto
    inits = {t.name: t for t in proto.graph.initializer}
    shapes = weight_shapes(config)
    out: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        for stored, transposed in ((name, False), (f"{name}.T", True), (f"{name}_t", True)):
            if stored in inits:
                array = numpy_helper.to_array(inits[stored])
                array = array.T if transposed else array
                if tuple(array.shape) == shape:
                    out[name] = np.ascontiguousarray(array, np.float32)
                break
    widths = [shapes[f"{n}_proj.weight"][0] for n in "qkv"]  # the packed projection's split, [q | k | v]
    for packed, axis in (("qkv_proj.weight.T", 1), ("qkv_proj.bias", 0)):
        if packed in inits:
            array = numpy_helper.to_array(inits[packed])
            if array.shape[axis] == sum(widths):
                parts = np.split(array, np.cumsum(widths)[:-1], axis=axis)
                kind = "weight" if axis else "bias"
                for n, part in zip("qkv", parts):
                    out.setdefault(f"{n}_proj.{kind}", np.ascontiguousarray(part.T if axis else part, np.float32))
    return out


def _weights_differ(path: str | Any, config: AttentionConfig, weights: Mapping[str, np.ndarray]) -> list[str]:
    """The weights the model file holds that are not `weights` (held in half precision: not its rounding)."""
    differ = []
    for name, own in file_weights(path, config).items():
        want = np.asarray(weights[name], np.float32)
        if not (np.array_equal(own, want) or np.array_equal(own, want.astype(np.float16).astype(np.float32))):
            differ.append(name)
    return differ


def set_decomposed_writer(writer: DecomposedWriter | None) -> None:
    """Register what writes a model's decomposed form for a look inside a fused operator: the exporter,
    a layer above this one (attnx.workflows registers write_decomposed_form when it is imported; the
    commands register it lazily, so a deployment machine without torch imports nothing until a look
    inside is needed). None: no look inside (its verdict says why)."""
    global _decomposed_writer
    _decomposed_writer = writer


def _decomposed_model(source: ModelSource, directory: str) -> str:
    if _decomposed_writer is None:
        raise UsageError("no exporter is loaded to write the decomposed form (import attnx.workflows)")
    return _decomposed_writer(source, directory)
