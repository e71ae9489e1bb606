"""Generation from a whole model: requests of any length served together, a row leaving the batch when it ends and a
waiting request joining between steps (continuous batching).

    ModelIO     what the model's I/O is: input_ids, attention_mask, position_ids where it has them, its cache
                (past_key_values.N.key/value in, present.N.key/value out), its logits; its form: the buffer form
                where it takes seqlens_k and total_sequence_length (attnx.workflows.rewrite.serve), else growing
    Request     one request's state: its prompt, its limits, its sampling's generator, its new tokens
    Sampling    how a token is chosen (attnx.runtimes.sampling): greedy (argmax) without a temperature, else
                transformers' processors in order and a draw from the request's own seeded generator
    Engine      schedule (admit waiting requests: each prompt prefilled alone into the batch's cache), run one step
                for every row, update (each row's token, rows that end leave); Engine.run serves a fixed list
    EngineLoop  the same step loop, long-lived, on a thread of its own that owns the session (attnx serve;
                attnx.runtimes.engine_loop)

The cache, by the model's form:

    _SharedCache   the buffer form: one buffer a cache input, allocated once for the run ([rows, heads, the
                   longest request, head_dim]; rows: max_batch, or every request within half the memory available;
                   an EngineLoop's: [max_batch, heads, its capacity, head_dim], fixed when it starts, a request past
                   the capacity refused when it is submitted) and bound through ONNX Runtime's IOBinding as both past
                   and present;
                   each row is a slot with its own length, its positions its token indices; a call writes only its new
                   keys and values, in place
    _GrowingCache  the model's own I/O: the batch left-aligned as transformers pads, a row's cache, mask and positions
                   its own prompt's shifted right by the padding its batch needs (its keys at padded slots hidden by
                   attention_mask, its positions counted from its own first token); each step copies the cache from
                   past into present, and a row joining or leaving concatenates or trims it

In both, a row's tokens do not depend on which requests share its batch (the tests hold a batch's tokens to each
request's alone). A model of the growing form whose blocks read right padding (lengths from attention_mask: ONNX
Runtime GenAI's GroupQueryAttention) is served one request at a time (Engine.max_batch 1).

No torch here: this runs on the deployment machine with the runner registry's backends.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from attnx.errors import InputError, UsageError
from attnx.model.config import CacheSpec
from attnx.model.contract import ROPE_POSITIONS_KEY
from attnx.model.resources import available_memory_bytes
from attnx.runtimes.base import Runner
from attnx.runtimes.sampling import Sampling

__all__ = ["Engine", "GenerateStats", "ModelIO", "Request", "check_prompts"]

_GREEDY = Sampling()  # the default: argmax

_CACHE_IN = "past_key_values"
_CACHE_OUT = "present"
_SEQLENS, _TOTAL = "seqlens_k", "total_sequence_length"  # the buffer form's (attnx.workflows.rewrite.serve)
_NP = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}


@dataclasses.dataclass(frozen=True)
class ModelIO:
    """A whole model's own inputs and outputs, as generation feeds them (ModelIO.of)."""

    logits: str
    caches: tuple[CacheSpec, ...]  # each cache's layout (past input, present output, sizes), in the model's order
    cache_dtype: Any
    positions: bool  # the model takes position_ids
    mask: bool  # the model takes attention_mask
    vocab: int | None  # the logits' last dim, where the model fixes it
    batch: int | None  # a batch the model's dims fix
    form: str = "growing"  # "buffer": the buffer form (seqlens_k and total_sequence_length in, the cache in place)
    logits_dtype: Any = np.float32  # the logits' numpy type (an fp16 model's are float16)

    @classmethod
    def of(cls, runner: Runner, cache_dims: Mapping[str, Sequence[int]] | None = None) -> ModelIO:
        """Read from a loaded runner's input and output specs; one UsageError for a model generation cannot feed.
        cache_dims: a cache input's [heads, head_dim] where its dims name them rather than fix them (the GenAI
        builder's kv_cache_dim), as its blocks read them (a package's manifest)."""
        inputs = {s.name: s for s in runner.inputs}
        outputs = {s.name: s for s in runner.outputs}
        if "input_ids" not in inputs:
            raise UsageError("the model takes no input_ids: attnx generate feeds token ids")
        logits = "logits" if "logits" in outputs else runner.outputs[0].name
        caches = []
        for name, spec in inputs.items():
            if not name.startswith(_CACHE_IN):
                continue
            present = _CACHE_OUT + name[len(_CACHE_IN):]
            if present not in outputs:
                raise UsageError(f"the model's cache input {name} has no output {present}")
            said = (cache_dims or {}).get(name)
            heads, size = (spec.shape[1], spec.shape[3]) if len(spec.shape) == 4 else (None, None)
            heads, size = (heads if isinstance(heads, int) else said and said[0],
                           size if isinstance(size, int) else said and said[-1])  # fmt: skip
            if len(spec.shape) != 4 or not isinstance(heads, int) or not isinstance(size, int):
                raise UsageError(f"the model's cache input {name} is {list(spec.shape)}: not [batch, heads, past, "
                                 "head_dim] with its heads and head_dim fixed, or said by its blocks")  # fmt: skip
            caches.append(CacheSpec(name, spec.dtype, ("batch", heads, spec.shape[2], size), pair=(name, present)))
        form = "buffer" if _SEQLENS in inputs else "growing"
        known = {"input_ids", "attention_mask", "position_ids"} | {s.past for s in caches}
        if form == "buffer":
            known |= {_SEQLENS, _TOTAL}
        other = sorted(set(inputs) - known)
        if other:
            raise UsageError(f"the model takes {', '.join(other)}, which attnx generate does not feed (it feeds "
                             "input_ids, attention_mask, position_ids, its cache and, in the buffer form, seqlens_k "
                             "and total_sequence_length)")  # fmt: skip
        if form == "buffer" and not caches:
            raise UsageError(f"the model takes {_SEQLENS} but no cache: not attnx's buffer form")
        vocab = outputs[logits].shape[-1] if outputs[logits].shape else None
        batch = inputs["input_ids"].shape[0] if inputs["input_ids"].shape else None
        dtype = _NP.get(caches[0].dtype, np.float32) if caches else np.float32
        return cls(logits, tuple(caches), dtype, "position_ids" in inputs, "attention_mask" in inputs,
                   vocab if isinstance(vocab, int) else None, batch if isinstance(batch, int) else None,
                   form, _NP.get(outputs[logits].dtype, np.float32))  # fmt: skip


@dataclasses.dataclass
class Request:
    """One request's state (ONNX Runtime GenAI's Request, vLLM's Sequence): apart from the engine that batches it."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int] = frozenset()
    rng: np.random.Generator | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    # "eos", "length" (max_new_tokens), "context" (the model's positions); served (EngineLoop): "stop" (its listener
    # ended it), "cancelled" (its client left), "abort" (the loop closed first), "error" (the model's run failed)
    finish: str | None = None
    forced: Sequence[int] | None = None  # replay: these tokens are fed, whatever the logits choose
    logits: list[np.ndarray] | None = None  # recorded: the prompt's [L, V], then each step's [V]
    first_token_s: float | None = None  # seconds from the engine's start to its first new token
    sampling: Sampling | None = None  # its own sampling (served requests); None: the run's
    # served: called on the engine's thread with each new token (request.tokens[-1]; finish already set where the
    # token ends it: the listener may end it too, stop()), and once it ends (on_finish)
    on_token: Callable[[Request], None] | None = dataclasses.field(default=None, repr=False, compare=False)
    on_finish: Callable[[Request], None] | None = dataclasses.field(default=None, repr=False, compare=False)
    cancelled: bool = False  # set from any thread (EngineLoop.cancel): the row leaves at the next step
    error: str | None = None  # finish "error": what failed

    @property
    def done(self) -> bool:
        return self.finish is not None

    def stop(self, reason: str = "stop") -> None:
        """End it after the token just made (from its listener, on the engine's thread): its row leaves this step."""
        if self.finish is None:
            self.finish = reason


@dataclasses.dataclass
class GenerateStats:
    """What a run did: requests, new tokens, prefills, steps, the largest batch, seconds."""

    requests: int = 0
    new_tokens: int = 0
    prefills: int = 0
    steps: int = 0
    largest_batch: int = 0
    seconds: float = 0.0
    form: str = ""  # the model's form: "buffer" (the cache in place) or "growing" (the model's own I/O)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class _GrowingCache:
    """The model's own I/O: the rows' cache as the model returns it (one array per cache input, [B, heads, T,
    head_dim]), the mask [B, T] (1: a key of the row's own), each row's next position. A joining row's prompt runs
    alone (batch 1); its cache and the batch's are left-padded to the longer of the two, and columns no row uses any
    more are trimmed when rows leave: every step copies the whole cache (past in, present out)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.io = engine, engine.io
        self.rows: list[Request] = []
        self.caches: list[np.ndarray] = [np.zeros(s.sized(0, 0), self.io.cache_dtype) for s in self.io.caches]
        self.mask = np.zeros((0, 0), np.int64)
        self.positions = np.zeros(0, np.int64)
        self._joining: list[np.ndarray] | None = None

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def prefill(self, request: Request, start: int = 0, end: int | None = None) -> np.ndarray:
        """The prompt's logits [L, V]; its cache kept for join(). The whole prompt at once (no chunks: start 0)."""
        if start or end not in (None, len(request.prompt)):
            raise UsageError("the model's own I/O prefills a prompt whole: chunks need the buffer form")
        n = len(request.prompt)
        empty = [np.zeros(s.sized(1, 0), self.io.cache_dtype) for s in self.io.caches]
        logits, self._joining = self._run(np.asarray([request.prompt], np.int64), np.ones((1, n), np.int64),
                                          np.arange(n, dtype=np.int64)[None], empty)  # fmt: skip
        return logits[0]

    def join(self, request: Request) -> None:
        """The row just prefilled joins: its cache [1, h, L, d] and the batch's left-padded to the longer of the two."""
        length = len(request.prompt)
        total = max(self.length, length)
        self.caches = [np.concatenate([_left_pad(c, total, s.grows), _left_pad(new, total, s.grows)], axis=0)
                       for s, c, new in zip(self.io.caches, self.caches, self._joining)]  # fmt: skip
        own = np.concatenate([np.zeros((1, total - length), np.int64), np.ones((1, length), np.int64)], axis=1)
        self.mask = np.concatenate([_left_pad(self.mask, total, axis=1), own], axis=0)
        self.positions = np.append(self.positions, length)
        self.rows.append(request)
        self._joining = None

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """One token a row (tokens [B]): its logits [B, V]."""
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), np.int64)], axis=1)
        logits, self.caches = self._run(tokens[:, None], mask, self.positions[:, None], self.caches)
        self.mask = mask
        return logits[:, -1]

    def fed_positions(self) -> np.ndarray:
        """Each row's position of the token the next step feeds."""
        return self.positions

    def advance(self) -> None:
        self.positions = self.positions + 1

    def drop_done(self) -> None:
        """Rows that ended leave; columns no row uses any more (padding of rows that left) are trimmed."""
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.mask, self.positions = self.mask[keep], self.positions[keep]
        used = np.flatnonzero(self.mask.any(axis=0))
        start = int(used[0]) if used.size else self.length
        self.mask = self.mask[:, start:]
        self.caches = [np.take(c[keep], range(start, c.shape[s.grows]), axis=s.grows)
                       for s, c in zip(self.io.caches, self.caches)]  # fmt: skip

    def _run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
             caches: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        feeds = {"input_ids": ids}
        if self.io.mask:
            feeds["attention_mask"] = mask
        if self.io.positions:
            feeds["position_ids"] = positions
        feeds.update({s.past: c for s, c in zip(self.io.caches, caches)})
        out = self.engine.runner.run(feeds)
        return out[self.io.logits], [out[s.present] for s in self.io.caches]


def _left_pad(a: np.ndarray, total: int, axis: int) -> np.ndarray:
    """`a` with zeros before it along `axis` to `total` entries."""
    missing = total - a.shape[axis]
    if missing <= 0:
        return a
    shape = list(a.shape)
    shape[axis] = missing
    return np.concatenate([np.zeros(shape, a.dtype), a], axis=axis)


class _SharedCache:
    """The buffer form (attnx.workflows.rewrite.serve): one buffer a cache input, [max_batch, heads, capacity,
    head_dim], allocated once for the run and bound through ONNX Runtime's IOBinding as both the past input and the
    present output, so that a call writes only its new tokens' keys and values, in place. Row b of the batch is slot
    b: its keys are its first lengths[b] positions, its new token lands at its own length (seqlens_k), its positions
    are its token indices. A joining row's prompt runs alone into the next free slot (the slot's own [1, heads,
    capacity, head_dim], bound by address); a row that leaves is replaced by the last row (its filled positions
    copied), so the rows decoded are always slots 0..B-1, bound as one [B, ...] buffer. Nothing is concatenated, and
    the cache is never copied through a step.

    A step's binding is kept while the rows stay the same: its inputs (tokens, positions, lengths) and its logits
    are arrays of the run bound by address and written in place, so a step rebinds nothing (rebinding every tensor
    cost ~0.5 ms a step, 5% of a one-row step on the Llama-shaped model)."""

    def __init__(self, engine: Engine, capacity: int, rows: int) -> None:
        session = getattr(engine.runner, "session", None)
        if session is None:  # never reached through a package: engine_for serves this form on ONNX Runtime's CPU
            raise UsageError(f"the buffer form runs on ONNX Runtime (IOBinding), not on backend {engine.runner.name!r}")
        self.engine, self.io, self.capacity = engine, engine.io, capacity
        self.session = session
        table = session.get_modelmeta().custom_metadata_map.get(ROPE_POSITIONS_KEY)
        if table is not None and capacity > int(table):  # the op's rotation reads a table of so many rows
            raise InputError(f"a request reaches position {capacity - 1}, past the model's rope table (positions 0 to "
                             f"{int(table) - 1}): shorten its prompt or --max-new-tokens")  # fmt: skip
        self.buffers = [np.zeros(s.sized(rows, capacity), self.io.cache_dtype) for s in self.io.caches]
        self.rows: list[Request] = []
        self.lengths = np.zeros(rows, np.int64)  # positions filled, per slot
        # a step's inputs and logits, bound by address: [:B] of each is the step of B rows
        self.step_ids, self.step_positions = np.zeros((rows, 1), np.int64), np.zeros((rows, 1), np.int64)
        self.step_seqlens, self.step_total = np.zeros(rows, np.int32), np.zeros((), np.int32)
        self.step_logits = np.zeros((rows, 1, self.io.vocab), self.io.logits_dtype) if self.io.vocab else None
        self._step: tuple[Any, int] | None = None  # (the binding, its rows)
        self.partial = 0  # positions of a prompt prefilled in chunks so far, in the next free slot

    def _binding(self, first: int, rows: int) -> Any:
        """A binding of every cache input and its present to slots first..first+rows-1 of its buffer, by address."""
        b = self.session.io_binding()
        for spec, buffer in zip(self.io.caches, self.buffers):
            view = buffer[first:first + rows]
            for name, bind in ((spec.past, b.bind_input), (spec.present, b.bind_output)):
                bind(name, "cpu", 0, buffer.dtype.type, view.shape, view.ctypes.data)
        return b

    def prefill(self, request: Request, start: int = 0, end: int | None = None) -> np.ndarray:
        """The logits [L, V] of prompt[start:end] (or [1, V]: a model that computes the last position's alone), its
        keys and values written into the next free slot, whose first `start` positions hold the prompt's start
        already (a chunk of a long prompt; joined by join() once the whole prompt is in)."""
        end = len(request.prompt) if end is None else end
        slot = len(self.rows)
        b = self._binding(slot, 1)
        b.bind_cpu_input("input_ids", np.asarray([request.prompt[start:end]], np.int64))
        if self.io.positions:
            b.bind_cpu_input("position_ids", np.arange(start, end, dtype=np.int64)[None])
        b.bind_cpu_input("seqlens_k", np.asarray([end - 1], np.int32))
        b.bind_cpu_input("total_sequence_length", np.asarray(end, np.int32))
        b.bind_output(self.io.logits, "cpu")
        self.session.run_with_iobinding(b)
        self.lengths[slot] = end
        self.partial = end if end < len(request.prompt) else 0
        return b.get_outputs()[-1].numpy()[0]  # the logits: the output bound last

    def abandon(self) -> None:
        """A prompt prefilled in part leaves (its request cancelled): the free slot is free again."""
        self.partial = 0

    def join(self, request: Request) -> None:
        self.rows.append(request)

    def _step_binding(self, rows: int) -> Any:
        """The binding of a step of `rows` rows (kept until the rows change)."""
        if self._step is not None and self._step[1] == rows:
            return self._step[0]
        b = self._binding(0, rows)
        inputs = [("input_ids", self.step_ids), ("seqlens_k", self.step_seqlens)]
        inputs += [("position_ids", self.step_positions)] if self.io.positions else []
        for name, array in inputs:
            b.bind_input(name, "cpu", 0, array.dtype.type, array[:rows].shape, array.ctypes.data)
        b.bind_input("total_sequence_length", "cpu", 0, np.int32, (), self.step_total.ctypes.data)
        if self.step_logits is not None:
            b.bind_output(self.io.logits, "cpu", 0, self.step_logits.dtype.type, self.step_logits[:rows].shape,
                          self.step_logits.ctypes.data)  # fmt: skip
        else:  # a vocabulary the model's dims do not fix: ONNX Runtime allocates the logits
            b.bind_output(self.io.logits, "cpu")
        self._step = (b, rows)
        return b

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """One token a row (tokens [B], slots 0..B-1): its logits [B, V]."""
        rows = len(self.rows)
        lengths = self.lengths[:rows]
        b = self._step_binding(rows)
        self.step_ids[:rows, 0] = tokens
        self.step_positions[:rows, 0] = lengths
        self.step_seqlens[:rows] = lengths  # positions filled after the step, minus 1
        self.step_total[...] = lengths.max() + 1
        self.session.run_with_iobinding(b)
        if self.step_logits is not None:
            return self.step_logits[:rows, -1].copy()
        return b.get_outputs()[-1].numpy()[:, -1]

    def fed_positions(self) -> np.ndarray:
        return self.lengths[: len(self.rows)]

    def advance(self) -> None:
        self.lengths[: len(self.rows)] += 1

    def drop_done(self) -> None:
        """Rows that ended leave: each one's slot taken by the last row still decoding (its filled positions copied);
        a prompt prefilled in part moves to the next free slot."""
        free = len(self.rows)
        slot = 0
        while slot < len(self.rows):
            if not self.rows[slot].done:
                slot += 1
                continue
            last = len(self.rows) - 1
            if slot != last:
                self._move(last, slot, int(self.lengths[last]))
                self.rows[slot] = self.rows[last]
            self.rows.pop()
        if self.partial and len(self.rows) != free:
            self._move(free, len(self.rows), self.partial)

    def _move(self, source: int, slot: int, n: int) -> None:
        for spec, buffer in zip(self.io.caches, self.buffers):  # its first n positions, along the growing dim
            at = [slice(None)] * buffer.ndim
            at[spec.grows] = slice(0, n)
            buffer[slot][tuple(at[1:])] = buffer[source][tuple(at[1:])]
        self.lengths[slot] = n


class Engine:
    """Continuous batching over a loaded whole model (the module doc): at most `max_batch` rows at once (None: every
    request, within memory: batch_rows); `context` the model's positions (a row ends there); `record`: each
    request's logits kept (golden generations). The model's form says how its cache is held: the buffer form (a
    seqlens_k input: _SharedCache), else its own I/O (_GrowingCache)."""

    def __init__(self, runner: Runner, *, max_batch: int | None = None, context: int | None = None,
                 record: bool = False, right_padded: bool = False,
                 cache_dims: Mapping[str, Sequence[int]] | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.io = ModelIO.of(runner, cache_dims)
        if max_batch is not None and max_batch < 1:
            raise UsageError(f"--max-batch {max_batch}: must be 1 or more")
        if self.io.form == "growing" and (not self.io.mask or right_padded):
            max_batch = 1  # a batch of rows of other lengths needs left padding the model reads
        if self.io.batch is not None:
            max_batch = min(max_batch or self.io.batch, self.io.batch)
        self.max_batch = max_batch
        self.context = context
        self.record = record
        self.sampling = _GREEDY  # a request's own (Request.sampling) replaces it
        self.stats = GenerateStats()

    def _capacity(self, requests: Sequence[Request]) -> int:
        """The positions the longest row fills: its prompt and every new token but the last (never fed), within the
        context."""
        capacity = max((len(r.prompt) + r.max_new_tokens for r in requests), default=1)
        return min(capacity, self.context) if self.context is not None else capacity

    def row_bytes(self, capacity: int) -> int:
        """The bytes of one row's cache of `capacity` positions."""
        return capacity * np.dtype(self.io.cache_dtype).itemsize * sum(s.token_values for s in self.io.caches)

    def batch_rows(self, requests: Sequence[Request]) -> int:
        """The rows decoded at once: max_batch where it was given (or the model fixes it), else every request,
        within half the memory available now for their caches (each row's cache as long as the longest request).
        A package's recorded batch is never a cap: it is the batch its golden generations were recorded at."""
        if self.max_batch is not None:
            return self.max_batch
        rows = max(1, len(requests))
        row_bytes = self.row_bytes(self._capacity(requests))
        available = available_memory_bytes()
        if available is not None and row_bytes > 0:
            rows = min(rows, max(1, available // 2 // row_bytes))
        return rows

    def _cache(self, requests: Sequence[Request], rows: int | None = None) -> _GrowingCache | _SharedCache:
        """The run's cache, for `rows` rows at once (None: batch_rows)."""
        if self.io.form == "growing":
            return _GrowingCache(self)
        rows = self.batch_rows(requests) if rows is None else rows
        return _SharedCache(self, self._capacity(requests), min(rows, max(1, len(requests))))

    def _take(self, request: Request, logits: np.ndarray, position: int) -> None:
        """The request's next token from its logits [V] at `position` (the token's own), and whether it ends; its
        listener told (Request.on_token)."""
        token = request.forced[len(request.tokens)] if request.forced is not None else None
        if token is None:
            token = (request.sampling or self.sampling).choose(logits, request.rng)
        request.tokens.append(int(token))
        self.stats.new_tokens += 1
        if int(token) in request.eos:
            request.finish = "eos"
        elif len(request.tokens) >= request.max_new_tokens:
            request.finish = "length"
        elif self.context is not None and position + 1 >= self.context:
            request.finish = "context"
        if request.on_token is not None:
            try:
                request.on_token(request)
            except Exception as e:  # noqa: BLE001 - a listener's failure ends its own request, never the batch
                request.finish, request.error = "error", f"its listener failed: {type(e).__name__}: {e}"

    def run(self, requests: Iterable[Request], sampling: Sampling = _GREEDY,
            on_finish: Callable[[Request], None] | None = None) -> GenerateStats:  # fmt: skip
        """Serve every request (the module doc); on_finish(request) as each ends, in the order they end."""
        self.sampling = sampling
        waiting = list(requests)
        rows = self.batch_rows(waiting)  # once: the memory available moves
        self.stats = GenerateStats(requests=len(waiting), form=self.io.form)
        batch = _Batch(self, self._cache(waiting, rows), on_finish)
        waiting.reverse()  # popped from the end: the first request first
        while waiting or batch.rows:
            while waiting and len(batch.rows) < rows:  # schedule: waiting requests join between steps
                batch.admit(waiting.pop())
            batch.step()
        self.stats.seconds = time.perf_counter() - batch.start
        return self.stats


class _Batch:
    """The step loop of Engine.run and EngineLoop over one cache: admit() a request (its prompt prefilled alone into
    the cache, its first token taken: it joins the rows, or it has ended), step() (rows cancelled leave, then one
    token for every row, and rows that end leave).

    With `chunk` (the buffer form alone), admitted prompts wait in `pending` instead, and each step first prefills
    at most `chunk` of their tokens, in order (a long prompt across several steps, each chunk's keys written where
    the last one's ended): a prompt joining never stalls the rows decoding for longer than one chunk (chunked
    prefill, as vLLM's). Where no row decodes, the pending prompts go in whole: nobody waits. A chunk computes what
    the whole prompt would: each position's attention over the keys before it, the same kernels."""

    def __init__(self, engine: Engine, cache: _GrowingCache | _SharedCache,
                 on_finish: Callable[[Request], None] | None = None, chunk: int | None = None) -> None:  # fmt: skip
        self.engine, self.cache, self.on_finish = engine, cache, on_finish
        self.chunk = chunk
        self.pending: collections.deque[Request] = collections.deque()
        self.filled = 0  # the first pending prompt's tokens in the cache
        self.start = time.perf_counter()

    @property
    def rows(self) -> list[Request]:
        return self.cache.rows

    def finished(self, request: Request) -> None:
        for call in (request.on_finish, self.on_finish):
            if call is not None:
                call(request)

    def admit(self, request: Request) -> None:
        if request.cancelled:
            request.stop("cancelled")
            self.finished(request)
            return
        if self.chunk is not None:
            self.pending.append(request)
            return
        if self.engine.record:
            request.logits = []
        self._prefilled(request, self.cache.prefill(request))  # the prompt alone (batch 1)

    def _prefilled(self, request: Request, logits: np.ndarray) -> None:
        """The whole prompt is in the cache: its first token from its last position's logits; it joins the rows."""
        engine = self.engine
        engine.stats.prefills += 1
        if request.logits is not None:
            request.logits.append(np.array(logits, np.float32))
        request.first_token_s = time.perf_counter() - self.start
        engine._take(request, logits[-1], len(request.prompt))
        if request.done:
            self.finished(request)
            return
        self.cache.join(request)

    def _prefill_chunks(self) -> None:
        """At most `chunk` tokens of the pending prompts, the first one first; every pending prompt whole where no
        row decodes (no one waits on it)."""
        budget = (self.chunk or 0) if self.rows else sum(len(r.prompt) for r in self.pending)
        while self.pending and budget > 0:
            request = self.pending[0]
            if request.cancelled:
                self.pending.popleft()
                if self.filled:
                    self.cache.abandon()
                self.filled = 0
                request.stop("cancelled")
                self.finished(request)
                continue
            end = min(len(request.prompt), self.filled + budget)
            logits = self.cache.prefill(request, self.filled, end)
            budget -= end - self.filled
            self.filled = end
            if end == len(request.prompt):
                self.pending.popleft()
                self.filled = 0
                self._prefilled(request, logits)

    def step(self) -> None:
        if self.pending:
            self._prefill_chunks()
        cancelled = [r for r in self.rows if r.cancelled and not r.done]
        for request in cancelled:  # a client that left: its row is freed before the step
            request.stop("cancelled")
            self.finished(request)
        if cancelled:
            self.cache.drop_done()
        if not self.rows:
            return
        engine = self.engine
        engine.stats.largest_batch = max(engine.stats.largest_batch, len(self.rows))
        tokens = np.asarray([r.tokens[-1] for r in self.rows], np.int64)  # run: one step for every row
        logits = self.cache.step(tokens)
        engine.stats.steps += 1
        for request, row, position in zip(self.rows, logits, self.cache.fed_positions()):  # update: each row's token
            if request.logits is not None:
                request.logits.append(np.array(row, np.float32))
            engine._take(request, row, int(position))
            if request.done:
                self.finished(request)
        self.cache.advance()
        self.cache.drop_done()  # rows that end leave


def check_prompts(prompts: Sequence[Any], vocab: int | None, context: int | None, what: str = "prompt") -> None:
    """Each prompt a non-empty list of token ids inside the vocabulary and shorter than the context; one InputError
    naming the first that is not (its line, counted from 1)."""
    for i, prompt in enumerate(prompts, 1):
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
            raise InputError(f"{what} {i}: not a non-empty JSON list of token ids (integers)")
        bad = next((t for t in prompt if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise InputError(f"{what} {i}: token id {bad} is outside the vocabulary (0 to {vocab - 1})"
                             if vocab is not None else f"{what} {i}: token id {bad} is negative")  # fmt: skip
        if context is not None and len(prompt) >= context:
            raise InputError(f"{what} {i}: {len(prompt)} tokens, the model's context is {context}: no room for a new "
                             "token")  # fmt: skip
