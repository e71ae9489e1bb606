"""Which core each block of a whole model becomes, measured on the provider: every core of the ort-fused lowering that
computes the block's formula (attnx.model.cores: why_not) built for the block's config and timed, and the block as
the graph has it (cut out at its own tensors, as the audit cuts it) timed the same way; the fastest is written, and
where the graph's own block is the fastest it is kept, with the numbers that say so.

    A block's time      a prompt of TIME_SHAPE["prefill"] tokens, and one decode step after TIME_SHAPE["past"] (a model
                        with a cache), batch 1, each the median of `repeat` runs after a warm-up, on the provider
    Its cost            the prompt plus TIME_SHAPE["steps"] steps: a request's work (issue 41 serves 128 new tokens a
                        request); a model without a cache costs its prompt
    Shapes              within the positions the model has (the checkpoint's max_position_embeddings, the rows of the
                        block's rotary table): a table read past its end is not a time
    Per block shape     blocks of one config and one source core are measured once (a model's layers mostly are)
    What blocks share   what a block computes from the model's inputs alone (its rotary table, its token grid) is
                        computed once for the whole model (the splice's attnx.export.passes.share; the graph's own
                        mask and tables, as exporters write them): timed apart and counted once for the model's
                        blocks, each block its own part and its share (time_block)

Times are measured, never assumed: the same choice can differ between an Intel Xeon and an AMD EPYC
(docs/concepts/step-forms.md; DESIGN's measured facts). `pick` is the rule alone, so it is tested on given numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.errors import ProviderUnavailable, UsageError
from attnx.export import GRAPH_CORES, build_model
from attnx.model.config import AttentionConfig, TensorSpec
from attnx.model.contract import LOWERINGS, PROVIDERS
from attnx.model.cores import CORES, MEASURE, why_not
from attnx.runtimes.base import Runner, time_runner
from attnx.workflows.audit.cut import NP_DTYPES, AuditGraph, cut_block, cut_file, graph_feeds, runner_for
from attnx.workflows.audit.run import first_line

__all__ = ["AUTO_CORE", "TIME_SHAPE", "CoreChoice", "Timing", "candidates", "choose_core", "own_is_fastest", "pick",
           "time_runner", "time_whole"]

AUTO_CORE = MEASURE  # measure the candidates (optimize_model's core=)
# a request, as a block is timed and costed: a prompt of `prefill` tokens, then `steps` single steps, each timed at a
# cache of `past` (the middle of a long generation)
TIME_SHAPE = {"prefill": 512, "past": 2048, "steps": 128}
REPEAT = 5


@dataclasses.dataclass
class Timing:
    """A block's (or a whole model's) median times on the provider, ms: the prompt, one step (None: no cache, or not
    run, with `error` saying why)."""

    prefill_ms: float | None = None
    step_ms: float | None = None
    error: str | None = None

    def cost(self, steps: int = TIME_SHAPE["steps"]) -> float | None:
        """A request's time: the prompt plus `steps` steps (the prompt alone for a model without a cache)."""
        if self.error is not None or self.prefill_ms is None:
            return None
        return self.prefill_ms + (steps * self.step_ms if self.step_ms is not None else 0.0)

    def said(self) -> str:
        if self.error is not None:
            return f"not timed: {self.error}"
        step = f", step {self.step_ms:.3g} ms" if self.step_ms is not None else ""
        return f"prefill {self.prefill_ms:.3g} ms{step}"


@dataclasses.dataclass
class CoreChoice:
    """What was measured for one block shape: the shapes, the graph's own block's times, each candidate's, and the
    core chosen (None: the graph's block kept, `reason` says why)."""

    core: str | None
    reason: str
    shape: dict[str, int]
    before: Timing | None = None
    times: dict[str, Timing] = dataclasses.field(default_factory=dict)
    # kept because the graph's own block is already the fastest core for its I/O (own_is_fastest, or its core the
    # only one that computes it there): a pass, never a failure to rewrite
    fastest: bool = False
    # the rule that chose in a few words, as the report heads the block's times ("the fastest", "asked (--core gqa)");
    # `reason` says it with its numbers. Both are for people: code branches on core and fastest
    head: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"core": self.core, "reason": self.reason, "shape": self.shape, "fastest": self.fastest,
                "before": dataclasses.asdict(self.before) if self.before is not None else None,
                "times": {k: dataclasses.asdict(t) for k, t in self.times.items()}}  # fmt: skip


def candidates(config: AttentionConfig, form: str, lowering: str, dtype: str = "fp32",
               within: tuple[str, ...] | None = None) -> list[str]:  # fmt: skip
    """The cores of `lowering` that compute `config` in `form` and `dtype`, in the registry's order (`within`: of
    those alone, the cores that compute it under the block's I/O), and that the audit reads back (a written block is
    proven by auditing the written model: a core with no block reader could not be)."""
    return [name for name in LOWERINGS[lowering].cores.get(form, ())
            if (within is None or name in within) and not why_not(name, config, dtype, form)
            and GRAPH_CORES[name].read_block is not None]  # fmt: skip


def pick(before: Timing | None, times: Mapping[str, Timing], steps: int = TIME_SHAPE["steps"],
         own: bool = True) -> tuple[str | None, str]:  # fmt: skip
    """The rule (the module doc): the candidate of the lowest cost, unless the graph's own block costs less (then
    None: kept); (core or None, the reason in words). Candidates not timed are passed over; none timed: kept.
    own=False: the graph's block computes another formula (a repaired one): timed for the report, never kept."""
    core, _, reason = _pick_rule(before, times, steps, own)
    return core, reason


def _pick_rule(before: Timing | None, times: Mapping[str, Timing], steps: int = TIME_SHAPE["steps"],
              own: bool = True) -> tuple[str | None, str, str]:  # fmt: skip
    """pick's (core or None, the rule that chose in a few words: CoreChoice.head, the reason)."""
    timed = {name: t.cost(steps) for name, t in times.items() if t.cost(steps) is not None}
    if not timed:
        errors = "; ".join(f"{n}: {t.error}" for n, t in times.items()) or "no core computes it"
        return None, "no core was timed", f"no core was timed ({errors})"
    best = min(timed, key=timed.__getitem__)
    others = ", ".join(f"{n} {c:.4g}" for n, c in timed.items() if n != best)
    own_cost = before.cost(steps) if before is not None else None
    if not own and own_cost is not None:
        head = "the fastest that computes the repaired formula"
        return best, head, (f"{head}: {timed[best]:.4g} ms a request (the graph's own {own_cost:.4g} ms computes "
                            "another)" + (f"; {others}" if others else ""))  # fmt: skip
    own = own_cost
    if own_is_fastest(before, times, steps):
        return None, "none is faster", (f"none is faster: the graph's own block costs {own:.4g} ms a request, the "
                                        f"fastest core ({best}) {timed[best]:.4g} ms")  # fmt: skip
    versus = f" (the graph's own {own:.4g} ms)" if own is not None else ""
    return best, "the fastest", f"the fastest: {timed[best]:.4g} ms a request{versus}" + (f"; {others}" if others else "")


def own_is_fastest(before: Timing | None, times: Mapping[str, Timing], steps: int = TIME_SHAPE["steps"]) -> bool:
    """pick's rule for keeping the graph's own block: it was timed, and costs no more than every candidate timed."""
    own = before.cost(steps) if before is not None else None
    timed = [c for c in (t.cost(steps) for t in times.values()) if c is not None]
    return own is not None and bool(timed) and own <= min(timed)


def time_shape(limit: int | None) -> dict[str, int]:
    """TIME_SHAPE within a model of `limit` positions (None: no limit known): a prompt of at most half of them, a
    step's cache one short of them."""
    shape = dict(TIME_SHAPE)
    if limit is not None:
        shape["prefill"] = max(1, min(shape["prefill"], limit // 2))
        shape["past"] = max(1, min(shape["past"], limit - 1))
    return shape


def positions_limit(block: Any, checkpoint_limit: int | None) -> int | None:
    """The positions a block can be fed: the checkpoint's, and its own rotary table's rows where the graph holds one."""
    limits = [n for n in (checkpoint_limit,) if n]
    tables = block.reading.rope.tables
    if tables is not None and block.reading.rope.tables_at is None:  # a constant table (not one computed, then probed)
        limits.append(int(np.asarray(tables[0]).shape[0]))
    return min(limits) if limits else None


@contextlib.contextmanager
def _loaded(path: str, provider: str) -> Iterator[Runner]:
    runner = runner_for(PROVIDERS[provider].backend, path)
    if isinstance(runner, str):
        raise ProviderUnavailable(f"--provider {provider}: {PROVIDERS[provider].backend} is unavailable here: {runner}")
    with runner:
        yield runner


def _block_feeds(specs: Sequence[Any], config: AttentionConfig, tokens: int, past: int | None, dtype: Any,
                 names: Mapping[str, str]) -> dict[str, np.ndarray]:  # fmt: skip
    """Feeds of one call of a block (batch 1, `tokens` tokens after `past` cached; None: no cache): its hidden state
    and cache under their names in `names` (role -> input), GroupQueryAttention's lengths (the row whole), every
    other input as transformers makes it."""
    rng = np.random.default_rng(0)
    taken = {s.name for s in specs}
    lengths = names.get("seqlens_k") in taken  # one buffer written in place: room for this call's tokens too
    cache = np.zeros((1, config.n_kv_heads, (past or 0) + (tokens if lengths else 0), config.head_dim), dtype)
    widths = {"x": config.d_model, "q": config.q_dim, "k": config.kv_q_dim, "v": config.kv_v_dim,
              "qkv": config.q_dim + config.kv_q_dim + config.kv_v_dim}  # a core alone is fed its projections
    feeds: dict[str, np.ndarray] = {names[role]: rng.standard_normal((1, tokens, width)).astype(dtype)
                                    for role, width in widths.items() if names.get(role) in taken}  # fmt: skip
    for role, name in names.items():  # each cache input zeros of `past` positions, its other dims as it declares
        if role.startswith(_CACHE_ROLE) and name in taken:  # them (a latent's one "head" of its own width)
            dims = next(s.shape for s in specs if s.name == name)
            fixed = [d if isinstance(d, int) else None for d in dims] if len(dims) == cache.ndim else [None] * 4
            feeds[name] = np.zeros([cache.shape[0], fixed[1] or cache.shape[1], cache.shape[2],
                                    fixed[3] or cache.shape[3]], dtype)  # fmt: skip
    if lengths:
        feeds[names["seqlens_k"]] = np.array([(past or 0) + tokens - 1], np.int32)
        feeds[names["total_sequence_length"]] = np.array((past or 0) + tokens, np.int32)
    rest = [s.name for s in specs if s.name not in feeds]
    feeds.update(graph_feeds(rest, np.ones((1, (past or 0) + tokens), np.int64), past or 0, cache, specs))
    return feeds


# a block's own inputs, by role: what one block reads that another does not (the rest, position_ids, the padding
# mask, GroupQueryAttention's lengths, is the model's, read alike by every block)
_OWN_ROLES = ("x", "q", "k", "v", "qkv")
_CACHE_ROLE = "past_"  # and its cache: each input whose role starts so (past_key, past_value; a latent's past_latent)


def split_shared(model: Any, own: set[str]) -> tuple[Any, Any] | None:
    """(shared, own part) of a block model (a ModelProto): the nodes that read none of the block's `own` inputs, nor
    anything made from them (its rotary tables from position_ids, its token grid from the padding mask), cut out as a
    model of their own whose outputs the rest reads as inputs; None where it has no such node, or where they cannot
    be cut apart (a graph output among them, a value between them that shape inference leaves untyped). In a whole
    model every block computes that part alike and the splice makes it once (attnx.export.passes.share)."""
    import onnx

    from attnx.workflows.audit.cut import cut_extractor, free_symbolic_dims, outer_names

    typed = onnx.shape_inference.infer_shapes(model)
    made_from_own, shared_reads, read, made = set(own), set(), set(), set()
    for node in typed.graph.node:  # in the order each comes after what it reads
        reads = (set(node.input) | outer_names(node)) - {""}
        if reads & made_from_own:
            made_from_own |= set(node.output)
            read |= reads
        else:
            made |= set(node.output) - {""}
            shared_reads |= reads
    boundary = sorted(made & read)
    types = {v.name for v in typed.graph.value_info if v.type.HasField("tensor_type")}
    if not boundary or made & {o.name for o in typed.graph.output} or not set(boundary) <= types:
        return None
    inputs = [i.name for i in typed.graph.input]
    shared = cut_extractor(typed).extract_model([i for i in inputs if i in shared_reads], boundary)
    rest = cut_extractor(typed).extract_model([i for i in inputs if i in read or i in own] + boundary,
                                              [o.name for o in typed.graph.output])  # fmt: skip
    for part in (shared, rest):
        free_symbolic_dims(part)
    return shared, rest


def _split_files(path: str, folder: str, own: set[str]) -> tuple[list[str], list[Any]] | None:
    """The block model at `path` cut by split_shared, its two parts written in `folder`: (their paths, the inputs of
    the whole block that feeds are made for), or None where it has no shared part or cannot be cut apart (a graph
    the extractor or shape inference cannot take: timed whole, its shared part in every block's time, more than
    the model spends on it, never less)."""
    import onnx

    try:
        model = onnx.load(path)
        parts = split_shared(model, own)
        if parts is None:
            return None
        paths = [os.path.join(folder, f"{part}.onnx") for part in ("shared", "own")]
        for part, at in zip(parts, paths):
            onnx.save(part, at)
    except Exception:  # noqa: BLE001 - the docstring's fallback
        return None
    initializers = {t.name for t in model.graph.initializer}
    return paths, [TensorSpec(i.name, "", tuple(d.dim_value if d.HasField("dim_value") else d.dim_param
                                              for d in i.type.tensor_type.shape.dim))
                   for i in model.graph.input if i.name not in initializers]  # fmt: skip


def time_block(path: str, config: AttentionConfig, names: Mapping[str, str], provider: str, shape: Mapping[str, int],
               cached: bool, dtype: Any = np.float32, repeat: int = REPEAT, shared_by: int = 1) -> Timing:  # fmt: skip
    """The prompt's and a step's times of the block model at `path` (names: role -> its input's name); a run that
    fails is said (Timing.error), never raised: a table read past its end, a shape the graph's block cannot take.
    What the block computes from the model's inputs alone (split_shared) is timed apart and counted once for the
    `shared_by` blocks that compute it alike, as the written model computes it: a block's time is its own part's and
    its share of that."""
    own = {name for role, name in names.items() if role in _OWN_ROLES or role.startswith(_CACHE_ROLE)}
    with tempfile.TemporaryDirectory(prefix="attnx-block-") as folder:
        split = _split_files(path, folder, own) if shared_by > 1 else None
        try:
            if split is None:
                with _loaded(path, provider) as runner:
                    feeds = _block_feeds(runner.inputs, config, shape["prefill"], 0 if cached else None, dtype, names)
                    prefill = time_runner(runner, feeds, repeat)
                    # a step is a millisecond or less, and a request weighs it 128 times: 4x the runs of a prompt
                    step = time_runner(runner, _block_feeds(runner.inputs, config, 1, shape["past"], dtype, names),
                                       4 * repeat) if cached else None  # fmt: skip
                return Timing(prefill, step)
            (shared_path, own_path), specs = split
            with _loaded(shared_path, provider) as shared, _loaded(own_path, provider) as rest:

                def timed(feeds: dict[str, np.ndarray], runs: int) -> float:
                    ins = {s.name for s in shared.inputs}
                    made = shared.run({k: v for k, v in feeds.items() if k in ins})
                    mine = {s.name for s in rest.inputs}
                    return time_runner(rest, {k: v for k, v in {**feeds, **made}.items() if k in mine}, runs) + \
                        time_runner(shared, {k: v for k, v in feeds.items() if k in ins}, runs) / shared_by  # fmt: skip

                prefill = timed(_block_feeds(specs, config, shape["prefill"], 0 if cached else None, dtype, names),
                                repeat)  # fmt: skip
                step = timed(_block_feeds(specs, config, 1, shape["past"], dtype, names), 4 * repeat) if cached \
                    else None  # fmt: skip
                return Timing(prefill, step)
        except ProviderUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - an untrusted graph's own failure at this shape: said in the report
            return Timing(error=first_line(e))


# what attnx's block models call their inputs (build_model), by role
_CORE_INPUTS = {role: role for role in ("x", "q", "k", "v", "qkv", "past_key", "past_value", "seqlens_k",
                                        "total_sequence_length")}  # fmt: skip


def choose_core(plan: Any, graph: AuditGraph, provider: str, lowering: str, *, core: str = AUTO_CORE,
                limit: int | None = None, repaired: bool = False, repeat: int = REPEAT, shared_by: int = 1,
                memo: dict[str, CoreChoice] | None = None,
                say: Callable[[str], None] = lambda _m: None) -> CoreChoice:  # fmt: skip
    """The core a planned block (attnx.workflows.rewrite.plan.Plan, read from `graph`) is written as (the module
    doc): with core MEASURE ("measure") the fastest of every core of `lowering` that computes its config under its I/O
    (Plan.cores), or the graph's own block where it is faster and computes the same formula (not `repaired`); a core
    named: that one wherever it computes the block, timed for the report. Each is timed as it would be written
    (Plan.bound): the whole block, against the graph's block as the audit cuts it; or the core alone, against the
    graph's own cut at its projections' outputs and the output projection's input (the projections, kept, are the
    same on both sides). The graph's own core alone, with nothing repaired, is timed alone and kept as the fastest:
    the rewrite would be the block itself. Blocks of one shape are measured once (memo). shared_by: the blocks of the model, which compute
    alike what a block computes from the model's inputs alone (time_block)."""
    block, config, form = plan.block, plan.config, plan.form
    written = LOWERINGS[lowering].cores.get(form, ())
    if core != AUTO_CORE and core not in written:
        raise UsageError(f"--core {core}: the {lowering} lowering writes no {core} core in the {form} form "
                         f"(it writes: {', '.join(written)})")  # fmt: skip
    asked = [core] if core != AUTO_CORE else None
    names = candidates(config, form, lowering, plan.dtype, plan.cores if asked is None else tuple(
        c for c in asked if plan.cores is None or c in plan.cores))  # fmt: skip
    shape = time_shape(positions_limit(block, limit))
    quant = block.quantization
    key = json.dumps([config.to_dict(), block.core, block.dtype, form, plan.bound, quant, shape, names, core,
                      repaired, shared_by], sort_keys=True, default=str)  # fmt: skip
    if memo is not None and key in memo:
        return memo[key]
    if not names:
        pool = list(asked or written)
        why = [r for c in pool for r in why_not(c, config, plan.dtype, form)]
        if plan.cores is not None:
            why += [f"{c} does not read each row's length (seqlens_k), which this model's GroupQueryAttention takes"
                    for c in pool if c not in plan.cores]  # fmt: skip
        return CoreChoice(None, f"no core of the {lowering} lowering computes it: {'; '.join(dict.fromkeys(why))}",
                          shape, head=f"no core of the {lowering} lowering computes it")  # fmt: skip
    # the rewrite would be the block itself: the same fused node (standard ops, the fallback core's, are the graph's
    # own structure, which attnx's emitter writes otherwise: multi-head latent attention's absorbed step)
    itself = names == [block.core] and not CORES[block.core].fallback and not repaired and asked is None
    if itself:
        names = []  # the graph's own block alone is timed, for the report
    choice = CoreChoice(None, "", shape)
    cached = config.kv_cache
    dtype = NP_DTYPES.get(block.dtype, np.float32)
    core_inputs = {**_CORE_INPUTS, **{spec.name: spec.name for spec in config.cache_specs()}}  # its cache's own names
    with tempfile.TemporaryDirectory(prefix="attnx-optimize-") as folder:
        say(f"timing block {block.index} as the graph has it, on {provider}")
        if plan.bound == "x":
            cut, roles = cut_block(graph, block), block.inputs
        else:  # the core alone, as it would be written: the graph's own cut at its projections' outputs and z
            at = {role: plan.binds[role] for role in ("q", "k", "v", "qkv") if role in plan.binds}
            outs = [plan.binds["z"]] + [block.outputs[r] for r in ("present_key", "present_value") if r in block.outputs]
            cut, roles = cut_block(graph, block, outs, boundary=True, inputs=list(at.values())), {**block.inputs, **at}
        with cut_file(cut) as path:
            choice.before = time_block(path, config, roles, provider, shape, cached, dtype, repeat, shared_by)
        for name in names:
            say(f"timing the {name} core for block {block.index} on {provider}")
            path = os.path.join(folder, f"{name}.onnx")
            model = build_model(config, plan.weights, lowering, form, plan.dtype, core=name, bound=plan.bound,
                                ring_cache=plan.ring_cache,
                                rope_positions=max(shape["prefill"], shape["past"] + 1))  # fmt: skip
            with open(path, "wb") as f:
                f.write(model.SerializeToString())
            choice.times[name] = time_block(path, config, core_inputs, provider, shape, cached, dtype, repeat=repeat,
                                            shared_by=shared_by)  # fmt: skip
    if itself:
        choice.fastest, choice.head = True, f"its own core ({block.core})"
        choice.reason = (f"{choice.head} is the one that computes it under its inputs: the rewrite would be the block "
                         "itself")  # fmt: skip
    elif core == AUTO_CORE:
        choice.core, choice.head, choice.reason = _pick_rule(choice.before, choice.times, shape["steps"],
                                                            own=not repaired)  # fmt: skip
        choice.fastest = choice.core is None and not repaired and own_is_fastest(choice.before, choice.times,
                                                                                 shape["steps"])  # fmt: skip
    else:
        choice.core, choice.head = core, f"asked (--core {core})"
        choice.reason = choice.head
    if memo is not None:
        memo[key] = choice
    return choice


def time_whole(path: str, provider: str, shape: Mapping[str, int], repeat: int = REPEAT,
               caches: Mapping[str, tuple[int, int, int]] | None = None) -> Timing:  # fmt: skip
    """A whole model's prompt and step times through its own inputs and outputs (batch 1: input_ids, attention_mask,
    position_ids where it has them, its cache past_key_values.* of `past` positions: its heads and head size from its
    dims, else as its block reads them, `caches`), as time_block times a block; a run that fails is said."""
    with _loaded(path, provider) as runner:
        specs = {s.name: s for s in runner.inputs}
        cached = [n for n in specs if n.startswith("past_key_values")]

        def feeds(tokens: int, past: int) -> dict[str, np.ndarray]:
            out = graph_feeds([n for n in specs if n not in cached and n != "input_ids"],
                              np.ones((1, past + tokens), np.int64), past, None)  # fmt: skip
            out["input_ids"] = np.random.default_rng(0).integers(1, 32, (1, tokens))
            for name in cached:
                dims, read = specs[name].shape, (caches or {}).get(name, (None, 0, None))
                heads, size = (d if isinstance(d, int) else r for d, r in ((dims[1], read[0]), (dims[3], read[2])))
                length = read[1] or past  # a ring buffer holds its window whatever the step
                out[name] = np.zeros((1, heads, length, size), NP_DTYPES.get(specs[name].dtype, np.float32))
            return out

        try:
            prefill = time_runner(runner, feeds(shape["prefill"], 0), repeat)
            step = time_runner(runner, feeds(1, shape["past"]), repeat) if cached else None
        except Exception as e:  # noqa: BLE001 - the model's own failure at this shape: said in the report
            return Timing(error=first_line(e))
    return Timing(prefill, step)
