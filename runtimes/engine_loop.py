"""The engine's step loop, long-lived (attnx serve): EngineLoop, on a thread of its own that owns the session;
requests join from a thread-safe queue between steps, leave when they end or are cancelled (a cancelled row is freed
at the next step), and each request's tokens reach its listener as they are made. The step itself (schedule, run,
update) and the cache are Engine.run's (attnx.runtimes.generate); the errors a submit can meet are here (QueueFull,
EngineClosed, ContextTooLong), for a server to answer each with its status.

No torch here: this runs on the deployment machine with the runner registry's backends.
"""

from __future__ import annotations

import collections
import threading
import time

from attnx.errors import AttnxError, InputError, UsageError
from attnx.model.resources import available_memory_bytes
from attnx.runtimes.generate import (
    Engine,
    GenerateStats,
    Request,
    _Batch,
    _GrowingCache,
    _SharedCache,
    check_prompts,
)

__all__ = ["PREFILL_CHUNK", "ContextTooLong", "EngineClosed", "EngineLoop", "QueueFull"]

PREFILL_CHUNK = 256  # EngineLoop's prompt tokens a step, at most (attnx serve --prefill-chunk)


class QueueFull(AttnxError):
    """EngineLoop.submit: the queue of waiting requests is full (a server answers 429)."""

    exit_code = 1


class EngineClosed(AttnxError):
    """EngineLoop.submit once the loop closes (a server draining answers 503), or after the model's run failed."""

    exit_code = 1


class ContextTooLong(InputError):
    """EngineLoop.check: a request's prompt and max_new_tokens pass the loop's bound, max_len (a server's
    context_length_exceeded)."""


class EngineLoop:
    """The engine's step loop, long-lived (attnx serve): a thread of its own owns the session and runs the steps;
    submit() puts a request in the queue from any thread, and it joins the batch between steps; cancel() frees its
    row at the next step; its listener (Request.on_token, on_finish) is called on the loop's thread with each token
    as it is made. At most `engine.max_batch` rows (None: DEFAULT_ROWS) and `max_queue` requests waiting.

    The cache is allocated once, when the loop starts: the buffer form's capacity is the model's context, or
    `max_len` below it (its rows' memory within half the memory available), and a request whose prompt and
    max_new_tokens pass it is refused when submitted (InputError). A request's greedy tokens never depend on which
    requests share its batch (each row its own cache, lengths and positions; its own sampling and generator).
    close(grace_s) stops accepting, serves what was accepted for up to grace_s seconds, ends the rest ("abort")
    and joins the thread.

    Prompts are prefilled in chunks of at most `prefill_chunk` tokens a step (the buffer form; None: each prompt
    whole when it joins; _Batch): a 512-token prompt joining 31 rows that decode delays their next token by one
    chunk's time, not the whole prompt's."""

    DEFAULT_ROWS = 16

    def __init__(self, engine: Engine, *, max_queue: int = 64, max_len: int | None = None,
                 prefill_chunk: int | None = PREFILL_CHUNK) -> None:  # fmt: skip
        if max_queue < 1:
            raise UsageError(f"--max-queue {max_queue}: must be 1 or more")
        if max_len is not None and max_len < 2:
            raise UsageError(f"--max-model-len {max_len}: must be 2 or more (a prompt token and a new one)")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise UsageError(f"--prefill-chunk {prefill_chunk}: must be 1 or more (or none: whole prompts)")
        self.engine = engine
        self.max_queue = max_queue
        bounds = [b for b in (engine.context, max_len) if b is not None]
        self.max_len = min(bounds) if bounds else None
        self.rows = engine.max_batch or self.DEFAULT_ROWS
        if engine.io.form == "buffer":
            if self.max_len is None:
                raise UsageError("the model says no context: give --max-model-len, the positions its cache holds")
            available = available_memory_bytes()
            if engine.max_batch is None and available is not None:  # the default: as many rows as half holds
                self.rows = max(1, min(self.rows, available // 2 // max(1, engine.row_bytes(self.max_len))))
            need = self.rows * engine.row_bytes(self.max_len)
            if available is not None and need > available // 2:
                raise UsageError(f"the cache of {self.rows} rows of {self.max_len} positions needs {need / 2**30:.2f} "
                                 f"GiB, over half the memory available ({available / 2**30:.2f} GiB): lower "
                                 "--max-batch or --max-model-len")  # fmt: skip
            cache: _GrowingCache | _SharedCache = _SharedCache(engine, self.max_len, self.rows)
        else:
            cache = _GrowingCache(engine)
        engine.stats = GenerateStats(form=engine.io.form)
        self.prefill_chunk = prefill_chunk if engine.io.form == "buffer" else None  # the growing form: whole prompts
        self._batch = _Batch(engine, cache, chunk=self.prefill_chunk)
        self._waiting: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._deadline = 0.0
        self.failure: str | None = None  # why the loop stopped, where the model's run failed
        self._thread = threading.Thread(target=self._loop, name="attnx-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def __enter__(self) -> EngineLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def waiting(self) -> int:
        """Requests in the queue, not yet in the batch."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Rows in the batch."""
        return len(self._batch.rows)

    @property
    def accepting(self) -> bool:
        return not self._closing and self.failure is None and self._thread.is_alive()

    def check(self, request: Request) -> None:
        """InputError where the request cannot be served: its prompt not token ids of the vocabulary, or its prompt
        and max_new_tokens past the loop's bound (max_len)."""
        check_prompts([request.prompt], self.engine.io.vocab, self.max_len)
        if request.max_new_tokens < 1:
            raise InputError(f"max_new_tokens {request.max_new_tokens}: must be 1 or more")
        total = len(request.prompt) + request.max_new_tokens
        if self.max_len is not None and total > self.max_len:
            raise ContextTooLong(f"the model's maximum context length is {self.max_len} tokens; this request asks "
                                 f"{total} ({len(request.prompt)} in the prompt, {request.max_new_tokens} new)")  # fmt: skip

    def submit(self, request: Request) -> None:
        """Queue the request (check first): EngineClosed once the loop closes or failed, QueueFull where max_queue
        requests wait already."""
        self.check(request)
        with self._cond:
            if self.failure is not None:
                raise EngineClosed(f"the engine stopped: {self.failure}")
            if self._closing or not self._thread.is_alive():
                raise EngineClosed("the engine is shutting down: it takes no new request")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests wait already (the queue holds {self.max_queue})")
            self._waiting.append(request)
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        """From any thread: a waiting request leaves the queue now (its on_finish called here), a running one frees
        its row at the next step (on_finish on the loop's thread); one that ended is left as it is."""
        request.cancelled = True
        with self._cond:
            index = next((i for i, r in enumerate(self._waiting) if r is request), None)
            if index is not None:
                del self._waiting[index]
        if index is not None:
            request.stop("cancelled")
            self._batch.finished(request)

    def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting; serve the requests accepted (waiting or running) for up to grace_s seconds, then end the
        rest ("abort"); the thread joined."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._deadline = time.monotonic() + grace_s
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        batch = self._batch
        reason = "abort"
        try:
            while True:
                with self._cond:
                    while not self._waiting and not batch.rows and not batch.pending and not self._closing:
                        self._cond.wait()
                    busy = self._waiting or batch.rows or batch.pending
                    if self._closing and (not busy or time.monotonic() >= self._deadline):
                        break
                    joining = []  # schedule: waiting requests join between steps
                    while self._waiting and len(batch.rows) + len(batch.pending) + len(joining) < self.rows:
                        joining.append(self._waiting.popleft())
                for request in joining:
                    self.engine.stats.requests += 1
                    try:
                        batch.admit(request)
                    except Exception as e:  # noqa: BLE001 - its prompt failed alone: it ends, the batch goes on
                        request.finish, request.error = "error", f"{type(e).__name__}: {e}"
                        batch.finished(request)
                batch.step()
        except BaseException as e:  # noqa: BLE001 - a step failed: every request ends, and says why
            reason, self.failure = "error", f"{type(e).__name__}: {e}"
        finally:
            with self._cond:
                rest = [*batch.rows, *batch.pending, *self._waiting]
                self._waiting.clear()
                batch.pending.clear()
                self._closing = True
            for request in rest:
                if not request.done:
                    request.finish, request.error = reason, self.failure
                    batch.finished(request)
            batch.rows.clear()
