"""The OpenAI wire format of ``deltazip serve``: request bodies, errors, response and chunk shapes.

Request bodies are pydantic models (built lazily so importing this module does not need pydantic).
Errors are answered as ``{"error": {"message", "type", "param", "code"}}`` (:class:`ApiError`).
:class:`CompletionShape` and :class:`ChatShape` build the JSON of ``/v1/completions`` and
``/v1/chat/completions`` answers, whole or as SSE chunks, from the engine's finish events.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from deltazip.runtime.serve.engine import EngineError, FinishEvent, SamplingParams

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
"""The routes that generate for one ``model``: what a front routes on (workers, Ray ingress)."""


def generation_model(method: str, path: str, body: bytes) -> str | None:
    """The ``model`` a generation request names; None for any other route or a body that is not a
    JSON object (the server behind answers that one with its own 400)."""
    if method != "POST" or path.rstrip("/") not in GENERATE_PATHS:
        return None
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(status: int, message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def not_found(name: str, param: str = "model") -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist.", param=param, code="model_not_found")


def request_models():
    """``(CompletionRequest, ChatRequest)`` pydantic models."""
    from pydantic import BaseModel, ConfigDict, Field

    class _Common(BaseModel):
        # Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras).
        model_config = ConfigDict(extra="ignore")
        # Optional fields accept an explicit null (some clients send one) and mean the default then.
        model: str
        max_tokens: int | None = Field(default=None, ge=1)
        temperature: float | None = Field(default=None, ge=0.0, le=2.0)
        top_p: float | None = Field(default=None, gt=0.0, le=1.0)
        n: int | None = None
        stop: str | list[str] | None = None
        seed: int | None = None
        stream: bool | None = None
        stream_options: dict[str, Any] | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        logprobs: Any = None
        logit_bias: dict[str, float] | None = None
        user: str | None = None
        response_format: dict[str, Any] | None = None  # grammar.response_format_grammar reads it

    class CompletionRequest(_Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        echo: bool | None = None
        best_of: int | None = None
        suffix: str | None = None

    class ChatMessage(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: Literal["system", "user", "assistant", "developer", "tool"]
        content: str | list[dict[str, Any]] | None = None

    class ChatRequest(_Common):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = Field(default=None, ge=1)
        tools: list[Any] | None = None  # tool_calls.tool_plan checks these three
        tool_choice: str | dict[str, Any] | None = None
        parallel_tool_calls: bool | None = None

    return CompletionRequest, ChatRequest


DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
"""``--max-request-bytes``: the largest request body read (a prompt of 128k tokens is ~0.5 MB of text)."""


async def read_body(request, limit: int | None) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed ``limit`` bytes (from its
    Content-Length before reading anything, else while it streams in)."""
    if limit is None:
        return await request.body()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_large(n, limit, more=True)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(n: int, limit: int, more: bool = False) -> ApiError:
    return ApiError(413, f"the request body has {'more than ' if more else ''}{n} bytes; this server accepts at most "
                    f"{limit} (--max-request-bytes)", code="request_too_large")


def parse_json(raw: bytes) -> dict:
    """A request body's JSON object, or a 400 naming what is wrong with it."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def json_body(request, limit: int | None = DEFAULT_MAX_REQUEST_BYTES) -> Any:
    """The request's JSON object (at most ``limit`` bytes: else 413), or a 400 naming what is wrong."""
    return parse_json(await read_body(request, limit))


def parse_body(model_cls, body: dict):
    """Validate a request body; pydantic's complaint becomes a 400 naming the parameter."""
    from pydantic import ValidationError

    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise ApiError(400, f"{first.get('msg', 'invalid value')} (param: {param})", param=param) from e


def check_unsupported(req, *, chat: bool) -> None:
    """400 for OpenAI features this server does not implement (rather than silently ignoring them)."""
    checks = [
        (req.n not in (None, 1), "n", "only n=1 is supported"),
        (bool(req.presence_penalty) or bool(req.frequency_penalty), "presence_penalty",
         "presence_penalty and frequency_penalty are not supported (use 0)"),
        (req.logprobs not in (None, False, 0), "logprobs", "logprobs are not supported"),
        (bool(req.logit_bias), "logit_bias", "logit_bias is not supported"),
    ]
    if not chat:
        checks += [(bool(req.echo), "echo", "echo is not supported"),
                   (req.best_of not in (None, 1), "best_of", "best_of is not supported"),
                   (req.suffix is not None, "suffix", "suffix is not supported")]
    for bad, param, msg in checks:
        if bad:
            raise ApiError(400, msg, param=param)


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sampling_params(req, max_tokens: int, grammar=None) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop_list(req.stop),
                              grammar=grammar)
    except EngineError as e:
        raise ApiError(400, str(e), param=e.param) from e


def usage(evs: list[FinishEvent]) -> dict:
    p = sum(e.prompt_tokens for e in evs)
    c = sum(e.completion_tokens for e in evs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class CompletionShape:
    """JSON of one ``/v1/completions`` answer (``text_completion``), whole or as SSE chunks."""

    object = "text_completion"
    prefix = "cmpl"

    def __init__(self, model: str):
        self.id, self.created, self.model = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time()), model

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, i: int, text: str) -> dict:
        return self._envelope(self.object, [{"index": i, "text": text, "logprobs": None, "finish_reason": None}])

    def final(self, i: int | None, reason: str | None) -> dict:
        """The chunk that ends choice ``i`` (``None``: the envelope of the usage chunk)."""
        choices = [] if i is None else [{"index": i, "text": "", "logprobs": None, "finish_reason": reason}]
        return self._envelope(self.object, choices)

    def head(self) -> list[dict]:
        """Chunks sent before any text."""
        return []

    def response(self, evs: list[FinishEvent]) -> dict:
        choices = [{"index": i, "text": e.text, "logprobs": None, "finish_reason": e.reason} for i, e in enumerate(evs)]
        return self._envelope(self.object, choices) | {"usage": usage(evs)}


class ChatShape(CompletionShape):
    """JSON of one ``/v1/chat/completions`` answer (``chat.completion``, chunks ``chat.completion.chunk``)."""

    object = "chat.completion.chunk"
    prefix = "chatcmpl"

    def chunk(self, i: int, text: str) -> dict:
        return self._envelope(self.object, [{"index": i, "delta": {"content": text}, "logprobs": None,
                                             "finish_reason": None}])

    def final(self, i: int | None, reason: str | None) -> dict:
        choices = [] if i is None else [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]
        return self._envelope(self.object, choices)

    def head(self) -> list[dict]:
        return [self._envelope(self.object, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}])]

    def response(self, evs: list[FinishEvent]) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": e.text}, "logprobs": None,
                    "finish_reason": e.reason} for i, e in enumerate(evs)]
        return self._envelope("chat.completion", choices) | {"usage": usage(evs)}
