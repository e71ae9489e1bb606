"""The handlers of attnx serve: one package's engine loop (attnx.runtimes.engine_loop.EngineLoop) behind the OpenAI API.

A request is validated (protocol), its prompt tokenized (a chat rendered through the package's chat template
first), submitted to the loop; its listener (_Output) runs on the engine's thread as each token is made: the token
decoded incrementally, the stop strings looked for across tokens (text that could start one is held back), a stop
found ends the request at once (its row leaves at this step); its deltas reach the asyncio side through a queue.
The handler streams them as server-sent events, or waits for the whole answer; a client that leaves cancels its
request (its row freed at the next step). Nothing here runs the model or blocks the event loop."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from attnx.errors import InputError
from attnx.runtimes.engine_loop import ContextTooLong, EngineClosed, EngineLoop, QueueFull
from attnx.runtimes.generate import Request
from attnx.runtimes.sampling import Sampling
from attnx.serve.metrics import Metrics
from attnx.serve.protocol import ChatRequest, CompletionRequest, ServeError, error_body, new_id, now, parse

__all__ = ["Service"]

log = logging.getLogger(__name__)

# The engine's finish, as the OpenAI API says it: an eos token or a stop string is "stop", a limit "length"; a
# request ended by the server's shutdown is "abort", as vLLM says it
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "abort": "abort"}
DEFAULT_NEW_TOKENS = 16  # OpenAI's completions default, where the model says no context to fill
RETRY_AFTER_S = 1


class Service:
    """One package served: its engine loop, its text (PackageText, or None: token ids only), the name clients ask
    for, its metrics; `ready` once the loop runs, `draining` once shutdown began (new requests 503)."""

    def __init__(self, loop: EngineLoop, name: str, text: Any | None = None, *, model: Any | None = None) -> None:
        self.loop, self.name, self.text, self.model = loop, name, text, model
        self.eos = frozenset(text.eos_ids) if text is not None else frozenset()
        self.metrics = Metrics(lambda: loop.waiting, lambda: loop.running)
        self.ready = False
        self.draining = False
        self.answering = 0  # answers in progress (a drain waits for their last bytes)
        self.created = now()
        self.finished: collections.Counter[str] = collections.Counter()  # requests ended, by the engine's finish
        self._index = itertools.count()

    def start(self) -> Service:
        self.loop.start()
        self.ready = True
        return self

    def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting; the requests accepted served for up to grace_s seconds, the rest ended ("abort")."""
        self.draining = True
        self.loop.close(grace_s)
        if self.model is not None:  # the package's model, where the service loaded it (closed once the loop is)
            self.model.close()
            self.model = None

    @property
    def healthy(self) -> bool:
        return self.ready and not self.draining and self.loop.accepting

    def reject(self, error: ServeError) -> None:
        """Count a refused request by its status."""
        outcome = {400: "bad_request", 404: "not_found", 429: "queue_full", 503: "unavailable"}.get(error.status,
                                                                                                  "error")  # fmt: skip
        self.metrics.requests.labels(outcome).inc()

    # The request ------------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ServeError(404, f"The model `{model}` does not exist (this server serves `{self.name}`)",
                             param="model", code="model_not_found")  # fmt: skip

    def _prompt(self, req: CompletionRequest | ChatRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            if self.text is None:
                raise ServeError(400, "this package carries no tokenizer: it serves token-id prompts on "
                                 "/v1/completions alone", param="messages")  # fmt: skip
            if not self.text.has_chat_template:
                raise ServeError(400, "this package's tokenizer has no chat template: send the prompt to "
                                 "/v1/completions", param="messages")  # fmt: skip
            messages = [_message(m.model_dump(exclude_none=True)) for m in req.messages]
            try:  # the rendered chat holds its special tokens: none added (transformers' apply_chat_template)
                return self.text.encode(self.text.render_chat(messages, add_generation_prompt=True),
                                        add_special_tokens=False)  # fmt: skip
            except InputError as e:
                raise ServeError(400, str(e), param="messages") from None
        if isinstance(req.prompt, str):
            if self.text is None:
                raise ServeError(400, "this package carries no tokenizer: send the prompt as a list of token ids",
                                 param="prompt")  # fmt: skip
            ids = self.text.encode(req.prompt)
            if not ids:
                raise ServeError(400, "the prompt encodes to no token", param="prompt")
            return ids
        return list(req.prompt)

    def _request(self, req: CompletionRequest | ChatRequest, out: _Output, prompt: list[int]) -> Request:
        new = req.new_tokens()
        if new is None:  # as vLLM: what the context leaves
            new = self.loop.max_len - len(prompt) if self.loop.max_len is not None else DEFAULT_NEW_TOKENS
            new = max(new, 1)
        if req.temperature == 0:
            sampling, rng = Sampling(), None
        else:
            sampling = Sampling(req.temperature, None, req.top_p if req.top_p < 1 else None)
            rng = np.random.default_rng(req.seed)  # None: fresh entropy
        return Request(next(self._index), prompt, new, self.eos, rng, sampling=sampling, on_token=out.on_token,
                       on_finish=out.on_finish)  # fmt: skip

    async def answer(self, body: Any, chat: bool, receive: Any) -> Any:
        """The answer to a POST of `body` (parsed JSON): a dict (the whole answer) or an async iterator of
        server-sent events; ServeError for a request refused. `receive`: the ASGI receive (a disconnect)."""
        req = parse(body, ChatRequest if chat else CompletionRequest)
        self._check_model(req.model)
        if not self.healthy:
            raise ServeError(503, "the server is shutting down" if self.draining else "the server is not ready",
                             type="service_unavailable", code="unavailable")  # fmt: skip
        if req.stop and self.text is None:
            raise ServeError(400, "this package carries no tokenizer: stop strings cannot be matched", param="stop")
        prompt = self._prompt(req)
        want_ids = self.text is None or req.return_token_ids
        out = _Output(self, asyncio.get_running_loop(), req.stop, prompt, req.stream)
        request = self._request(req, out, prompt)
        try:
            self.loop.submit(request)
        except InputError as e:
            raise ServeError(400, str(e), param="messages" if chat else "prompt",
                             code="context_length_exceeded" if isinstance(e, ContextTooLong) else None) from None
        except QueueFull as e:
            raise ServeError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                             code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineClosed as e:
            raise ServeError(503, str(e), type="service_unavailable", code="unavailable") from None
        self.metrics.prompt_tokens.inc(len(prompt))
        head = {"id": new_id("chatcmpl" if chat else "cmpl"), "created": now(), "model": self.name}
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return self._events(request, out, head, chat, include_usage, want_ids)
        return await self._whole(request, out, head, chat, want_ids, receive)

    # The answer -------------------------------------------------------------------------------------
    def _ended(self, request: Request) -> None:
        self.finished[request.finish] += 1
        self.metrics.requests.labels(FINISH.get(request.finish, request.finish)).inc()
        self.metrics.new_tokens.inc(len(request.tokens))

    async def _whole(self, request: Request, out: _Output, head: dict[str, Any], chat: bool, want_ids: bool,
                     receive: Any) -> dict[str, Any] | None:  # fmt: skip
        self.answering += 1
        left = asyncio.ensure_future(_disconnect(receive))
        try:
            ended = asyncio.ensure_future(out.queue.get())
            await asyncio.wait({ended, left}, return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():  # the client left: its row is freed at the next step
                ended.cancel()
                self.loop.cancel(request)
                return None
            _error(request)
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": FINISH[request.finish]}
            if chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            if want_ids:
                choice["token_ids"] = list(request.tokens)
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    "usage": _usage(request)}  # fmt: skip
        finally:
            left.cancel()
            self.answering -= 1
            if not request.done:
                self.loop.cancel(request)

    async def _events(self, request: Request, out: _Output, head: dict[str, Any], chat: bool, include_usage: bool,
                      want_ids: bool) -> AsyncIterator[str]:  # fmt: skip
        """The server-sent events of a streamed answer (OpenAI's chunks), ending `data: [DONE]`."""
        self.answering += 1
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, ids: list[int] | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                choice["delta"] = {} if delta is None else {"content": delta}
            else:
                choice["text"] = delta or ""
            if want_ids:
                choice["token_ids"] = ids or []
            body = {**head, "object": kind, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return _sse(body)

        try:
            if chat:  # the role first, as OpenAI's stream does
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}  # fmt: skip
                yield _sse({**head, "object": kind, "choices": [first], **({"usage": None} if include_usage else {})})
            while True:
                kind_of, text, ids = await out.queue.get()
                if kind_of == "delta":
                    if text or (want_ids and ids):
                        yield chunk(text, None, ids)
                    continue
                if request.finish == "error":
                    yield _sse(error_body(f"the engine failed: {request.error}", "server_error"))
                else:
                    yield chunk(text if text else (None if chat else ""), FINISH[request.finish], ids)
                    if include_usage:
                        yield _sse({**head, "object": kind, "choices": [], "usage": _usage(request)})
                yield "data: [DONE]\n\n"
                return
        finally:  # also when the client left (the stream cancelled): its row is freed at the next step
            self.answering -= 1
            if not request.done:
                self.loop.cancel(request)


class _Output:
    """One request's text as it is made, on the engine's thread (its Request.on_token and on_finish): each token
    decoded incrementally, stop strings looked for in the text from the last emitted position on (the text that
    could start one held back), and the deltas put on `queue` for the asyncio side: ("delta", text, [ids]) as
    tokens come (streamed answers), then ("end", text, [ids]) once."""

    def __init__(self, service: Service, aio: asyncio.AbstractEventLoop, stops: list[str], prompt: list[int],
                 stream: bool) -> None:  # fmt: skip
        self.service, self.aio, self.stops, self.stream = service, aio, stops, stream
        self.queue: asyncio.Queue = asyncio.Queue()
        text = service.text
        # the new tokens alone: their deltas join to decode(new tokens), as transformers' users decode an answer
        self.decoder = text.detokenizer() if text is not None else None
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # the answer's text so far (cut at a stop string)
        self.sent = 0  # characters of it emitted
        self.ids: list[int] = []  # tokens not yet emitted
        self.cut = False
        self.arrived = time.perf_counter()
        self.last: float | None = None

    def _put(self, event: tuple[str, str, list[int]]) -> None:
        self.aio.call_soon_threadsafe(self.queue.put_nowait, event)

    def _look(self, final: bool) -> int:
        """How far the text may be emitted now; a stop string found cuts the text there and ends the request."""
        if not self.cut and self.stops:
            found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
            if found:
                self.text, self.cut = self.text[: min(found)], True
                return len(self.text)
        return len(self.text) if final or self.cut else max(self.sent, len(self.text) - self.hold)

    def on_token(self, request: Request) -> None:
        t = time.perf_counter()
        metrics = self.service.metrics
        if self.last is None:
            metrics.ttft.observe(t - self.arrived)
        else:
            metrics.tbt.observe(t - self.last)
        self.last = t
        if self.cut:
            return
        token = request.tokens[-1]
        self.ids.append(token)
        if self.decoder is not None and request.finish != "eos":  # the eos token is no text
            self.text += self.decoder.add(token)
        end = self._look(final=False)
        if self.cut:
            request.stop("stop")  # its row leaves at this step
        if self.stream and (end > self.sent or self.service.text is None):
            self._put(("delta", self.text[self.sent:end], self.ids))
            self.sent, self.ids = end, []

    def on_finish(self, request: Request) -> None:
        if self.decoder is not None and not self.cut:
            self.text += self.decoder.flush()
        end = self._look(final=True)
        self._put(("end", self.text[self.sent:end], self.ids) if self.stream else ("end", "", []))
        self.sent, self.ids = end, []
        self.service._ended(request)


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the template reads it: text parts joined into one string (as vLLM's "string" format)."""
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": "\n".join(part["text"] for part in content)}
    return message


def _usage(request: Request) -> dict[str, int]:
    new = len(request.tokens)
    return {"prompt_tokens": len(request.prompt), "completion_tokens": new, "total_tokens": len(request.prompt) + new}


def _error(request: Request) -> None:
    if request.finish == "error":
        raise ServeError(500, f"the engine failed: {request.error}", type="server_error")


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _disconnect(receive: Any) -> None:
    """Returns once the client has left (the ASGI receive's http.disconnect, after the body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
