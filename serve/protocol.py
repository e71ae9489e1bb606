"""The OpenAI API's requests as attnx serve reads them (pydantic models, validated before any work), its responses
and its error object. A request's fields are the OpenAI ones attnx serves; a field it does not serve (logprobs,
tools, n above 1...) or does not know is refused, named, with a 400: never silently ignored."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import pydantic

__all__ = ["ChatRequest", "CompletionRequest", "ServeError", "error_body", "parse"]


class ServeError(Exception):
    """An answer that is an OpenAI error object: status, message, type, param, code; headers (Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Fields of the OpenAI API that attnx serve does not serve, and the values it takes as "not asked" (the client's
# defaults): any other value is refused with a 400 naming the field.
_OFF: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,), "suffix": ("",),
    "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,), "tools": ([],), "functions": ([],),
    "tool_choice": ("none",), "parallel_tool_calls": (), "response_format": ({"type": "text"},), "audio": (),
    "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "web_search_options": (), "store": (False,),
    "metadata": (), "service_tier": ("auto", "default"), "function_call": ("none",), "verbosity": (),
}  # fmt: skip
_IGNORED = {"user"}  # said to be the end user's id: it changes nothing a server computes


class StreamOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampled(pydantic.BaseModel):
    """The fields completions and chat share."""

    model_config = pydantic.ConfigDict(extra="forbid")

    model: str | None = None  # None: the one model served
    max_tokens: int | None = pydantic.Field(default=None, ge=1)
    temperature: float = pydantic.Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default, 1 (0: greedy)
    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = pydantic.Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = pydantic.Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice's (and each chunk's) new token ids

    @pydantic.field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("a stop string is empty")
        return stops

    @pydantic.model_validator(mode="after")
    def _options_with_stream(self) -> _Sampled:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def new_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Sampled):
    """POST /v1/completions: one prompt, a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]

    @pydantic.field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"{len(value)} prompts: attnx serve takes one prompt a request")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is an empty list of token ids")
        if isinstance(value, str) and not value:
            raise ValueError("the prompt is empty")
        return value


class ChatMessage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")  # the template reads what it reads (name, reasoning...)
    role: str
    content: str | list[dict[str, Any]] | None = None

    @pydantic.field_validator("content")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else []:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"a content part of type {part.get('type')!r}: attnx serve takes text parts alone")
        return value


class ChatRequest(_Sampled):
    """POST /v1/chat/completions: messages rendered through the package's chat template."""

    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)

    def new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:  # fmt: skip
            raise ServeError(400, f"max_tokens {self.max_tokens} and max_completion_tokens "
                             f"{self.max_completion_tokens} disagree: give one", param="max_tokens")  # fmt: skip
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(body: Any, model: type[_Sampled]) -> Any:
    """The request `body` (parsed JSON) as `model`, or ServeError 400: unsupported fields named (and their values),
    then pydantic's first complaints, each with the field it is about."""
    if not isinstance(body, dict):
        raise ServeError(400, f"the request body is a JSON {type(body).__name__}, not an object")
    known = set(model.model_fields)
    refused = []
    for key, value in body.items():
        if key in known or key in _IGNORED:
            continue
        if key in _OFF:
            if value is None or any(_same(value, off) for off in _OFF[key]):
                continue
            refused.append(f"{key}={_short(value)}")
        else:
            refused.append(key)
    if refused:
        raise ServeError(400, f"unsupported field{'s' * (len(refused) > 1)}: {', '.join(refused)} (attnx serve "
                         "takes one choice, no logprobs, no tools, no penalties)", param=refused[0].split("=")[0],
                         code="unsupported_field")  # fmt: skip
    try:
        return model.model_validate({k: v for k, v in body.items() if k in known})
    except pydantic.ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        said = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in errors[:3])
        raise ServeError(400, said, param=param.split(".")[0] if param else None) from None


def _same(value: Any, off: Any) -> bool:
    """Whether `value` is the "not asked" value `off` (true is not 1, 0.0 is 0)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return value is off
    return bool(value == off)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "abort"]
