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

Times are measured, never assumed: the same choice can differ between an Intel Xeon and an AMD EPYC
(docs/concepts/step-forms.md; DESIGN's measured facts). `pick` is the rule alone, so it is tested on given numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from attnx.errors import ProviderUnavailable, UsageError
from attnx.export import build_model
from attnx.model.config import AttentionConfig
from attnx.model.contract import LOWERINGS, PROVIDERS
from attnx.model.cores import why_not
from attnx.runtimes.base import Runner, time_runner
from attnx.workflows.audit.cut import NP_DTYPES, AuditGraph, cut_block, cut_file, graph_feeds, runner_for
from attnx.workflows.audit.run import first_line

__all__ = ["AUTO_CORE", "TIME_SHAPE", "CoreChoice", "Timing", "candidates", "choose_core", "pick", "time_runner",
           "time_whole"]

AUTO_CORE = "auto"  # measure the candidates (optimize_model's core=)
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

    def to_dict(self) -> dict[str, Any]:
        return {"core": self.core, "reason": self.reason, "shape": self.shape,
                "before": dataclasses.asdict(self.before) if self.before is not None else None,
                "times": {k: dataclasses.asdict(t) for k, t in self.times.items()}}  # fmt: skip


def candidates(config: AttentionConfig, form: str, lowering: str) -> list[str]:
    """The cores of `lowering` that compute `config` in `form` (fp32), in the registry's order."""
    return [name for name in LOWERINGS[lowering].cores.get(form, ()) if not why_not(name, config, "fp32", form)]


def pick(before: Timing | None, times: Mapping[str, Timing], steps: int = TIME_SHAPE["steps"]) -> tuple[str | None, str]:
    """The rule (the module doc): the candidate of the lowest cost, unless the graph's own block costs less (then
    None: kept); (core or None, the reason in words). Candidates not timed are passed over; none timed: kept."""
    timed = {name: t.cost(steps) for name, t in times.items() if t.cost(steps) is not None}
    if not timed:
        errors = "; ".join(f"{n}: {t.error}" for n, t in times.items()) or "no core computes it"
        return None, f"no core was timed ({errors})"
    best = min(timed, key=timed.__getitem__)
    others = ", ".join(f"{n} {c:.4g}" for n, c in timed.items() if n != best)
    own = before.cost(steps) if before is not None else None
    if own is not None and own <= timed[best]:
        return None, (f"none is faster: the graph's own block costs {own:.4g} ms a request, the fastest core "
                      f"({best}) {timed[best]:.4g} ms")  # fmt: skip
    versus = f" (the graph's own {own:.4g} ms)" if own is not None else ""
    return best, f"the fastest: {timed[best]:.4g} ms a request{versus}" + (f"; {others}" if others else "")


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
    tables = block.facts.get("rope_tables")
    if tables is not None and "rope_tables_at" not in block.facts:  # a constant table (not one computed, then probed)
        limits.append(int(np.asarray(tables[0]).shape[0]))
    return min(limits) if limits else None


@contextlib.contextmanager
def _loaded(path: str, provider: str) -> Iterator[Runner]:
    runner = runner_for(PROVIDERS[provider].backend, path)
    if isinstance(runner, str):
        raise ProviderUnavailable(f"--provider {provider}: {PROVIDERS[provider].backend} is unavailable here: {runner}")
    with runner:
        yield runner


def _block_feeds(runner: Runner, config: AttentionConfig, tokens: int, past: int | None, dtype: Any,
                 names: Mapping[str, str]) -> dict[str, np.ndarray]:  # fmt: skip
    """Feeds of one call of a block (batch 1, `tokens` tokens after `past` cached; None: no cache): its hidden state
    and cache under their names in `names` (role -> input), every other input as transformers makes it."""
    rng = np.random.default_rng(0)
    cache = np.zeros((1, config.n_kv_heads, past or 0, config.head_dim), dtype)
    feeds: dict[str, np.ndarray] = {names["x"]: rng.standard_normal((1, tokens, config.d_model)).astype(dtype)}
    for role in ("past_key", "past_value"):
        if role in names:
            feeds[names[role]] = cache
    rest = [s.name for s in runner.inputs if s.name not in feeds]
    feeds.update(graph_feeds(rest, np.ones((1, (past or 0) + tokens), np.int64), past or 0, cache))
    return feeds


def time_block(path: str, config: AttentionConfig, names: Mapping[str, str], provider: str, shape: Mapping[str, int],
               cached: bool, dtype: Any = np.float32, repeat: int = REPEAT) -> Timing:  # fmt: skip
    """The prompt's and a step's times of the block model at `path` (names: role -> its input's name); a run that
    fails is said (Timing.error), never raised: a table read past its end, a shape the graph's block cannot take."""
    with _loaded(path, provider) as runner:
        try:
            prefill = time_runner(runner, _block_feeds(runner, config, shape["prefill"], 0 if cached else None,
                                                       dtype, names), repeat)  # fmt: skip
            step = time_runner(runner, _block_feeds(runner, config, 1, shape["past"], dtype, names), repeat) \
                if cached else None  # fmt: skip
        except Exception as e:  # noqa: BLE001 - an untrusted graph's own failure at this shape: said in the report
            return Timing(error=first_line(e))
    return Timing(prefill, step)


_CORE_INPUTS = {"x": "x", "past_key": "past_key", "past_value": "past_value"}  # what attnx's block models call them


def choose_core(block: Any, config: AttentionConfig, weights: Mapping[str, np.ndarray], graph: AuditGraph,
                provider: str, lowering: str, *, core: str = AUTO_CORE, limit: int | None = None,
                repeat: int = REPEAT, memo: dict[str, CoreChoice] | None = None,
                say: Callable[[str], None] = lambda _m: None) -> CoreChoice:  # fmt: skip
    """The core `block` (read from `graph`) is written as, for `config` and `weights` (the module doc): with core
    "auto" the fastest of every core of `lowering` that computes the config, or the graph's own block where it is
    faster; a core named: that one wherever it computes the block, timed for the report. Blocks of one shape are
    measured once (memo)."""
    form = "growing" if config.kv_cache else "full"
    written = LOWERINGS[lowering].cores.get(form, ())
    if core != AUTO_CORE and core not in written:
        raise UsageError(f"--core {core}: the {lowering} lowering writes no {core} core in the {form} form "
                         f"(it writes: {', '.join(written)})")  # fmt: skip
    names = candidates(config, form, lowering) if core == AUTO_CORE else [core] * (not why_not(core, config, "fp32", form))
    shape = time_shape(positions_limit(block, limit))
    key = json.dumps([config.to_dict(), block.core, block.dtype, shape, names, core], sort_keys=True, default=str)
    if memo is not None and key in memo:
        return memo[key]
    if not names:
        why = "; ".join(dict.fromkeys(r for c in (written if core == AUTO_CORE else [core])
                                      for r in why_not(c, config, "fp32", form)))  # fmt: skip
        return CoreChoice(None, f"no core of the {lowering} lowering computes it: {why}", shape)
    choice = CoreChoice(None, "", shape)
    cached = config.kv_cache
    with tempfile.TemporaryDirectory(prefix="attnx-optimize-") as folder:
        say(f"timing block {block.index} as the graph has it, on {provider}")
        with cut_file(cut_block(graph, block)) as path:
            choice.before = time_block(path, config, block.inputs, provider, shape, cached,
                                       NP_DTYPES.get(block.dtype, np.float32), repeat)  # fmt: skip
        for name in names:
            say(f"timing the {name} core for block {block.index} on {provider}")
            path = os.path.join(folder, f"{name}.onnx")
            with open(path, "wb") as f:
                f.write(build_model(config, weights, lowering, form, core=name).SerializeToString())
            choice.times[name] = time_block(path, config, _CORE_INPUTS, provider, shape, cached, repeat=repeat)
    if core == AUTO_CORE:
        choice.core, choice.reason = pick(choice.before, choice.times, shape["steps"])
    else:
        choice.core, choice.reason = core, f"asked (--core {core})"
    if memo is not None:
        memo[key] = choice
    return choice


def time_whole(path: str, provider: str, shape: Mapping[str, int], repeat: int = REPEAT) -> Timing:
    """A whole model's prompt and step times through its own inputs and outputs (batch 1: input_ids, attention_mask,
    position_ids where it has them, its cache past_key_values.* of `past` positions), as time_block times a block; a
    run that fails is said."""
    with _loaded(path, provider) as runner:
        specs = {s.name: s for s in runner.inputs}
        caches = [n for n in specs if n.startswith("past_key_values")]

        def feeds(tokens: int, past: int) -> dict[str, np.ndarray]:
            out = graph_feeds([n for n in specs if n not in caches and n != "input_ids"],
                              np.ones((1, past + tokens), np.int64), past, None)  # fmt: skip
            out["input_ids"] = np.random.default_rng(0).integers(1, 32, (1, tokens))
            for name in caches:
                dims = specs[name].shape
                out[name] = np.zeros((1, dims[1], past, dims[3]), NP_DTYPES.get(specs[name].dtype, np.float32))
            return out

        try:
            prefill = time_runner(runner, feeds(shape["prefill"], 0), repeat)
            step = time_runner(runner, feeds(1, shape["past"]), repeat) if caches else None
        except Exception as e:  # noqa: BLE001 - the model's own failure at this shape: said in the report
            return Timing(error=first_line(e))
    return Timing(prefill, step)
