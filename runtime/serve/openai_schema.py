"""The OpenAI wire format of ``deltazip serve``: request bodies, errors, response and chunk shapes.

Request bodies are pydantic models (built lazily so importing this module does not need pydantic).
Errors are answered as ``{"error": {"message", "type", "param", "code"}}`` (:class:`ApiError`).
Every field of OpenAI's reference request bodies is honoured or refused with a 400 that names it
(:data:`REFUSED`, :func:`check_unsupported`). The answers' JSON is built in
:mod:`deltazip.runtime.serve.openai_shapes`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from deltazip.runtime.serve.engine import EngineError, SamplingParams
from deltazip.runtime.serve.sampling import MAX_TOP_LOGPROBS

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
"""The routes that generate for one ``model``: what a front routes on (workers, Ray ingress)."""
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
"""vLLM's tokenizer routes, beside ``/v1`` (where vLLM serves them): fronts forward them too."""


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
    """``(CompletionRequest, ChatRequest)`` pydantic models: every field of OpenAI's reference request
    bodies plus vLLM's sampling extras. What the server does with each is :data:`FIELDS`."""
    from pydantic import BaseModel, ConfigDict, Field

    class _Common(BaseModel):
        # Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras).
        model_config = ConfigDict(extra="ignore")
        # Optional fields accept an explicit null (some clients send one) and mean the default then.
        model: str
        max_tokens: int | None = Field(default=None, ge=0)
        temperature: float | None = Field(default=None, ge=0.0, le=2.0)
        top_p: float | None = Field(default=None, gt=0.0, le=1.0)
        n: int | None = Field(default=None, ge=1)
        stop: str | list[str] | None = None
        seed: int | None = None
        stream: bool | None = None
        stream_options: dict[str, Any] | None = None
        presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
        frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
        logit_bias: dict[str, float] | None = None
        user: str | None = None
        # vLLM's sampling extras
        top_k: int | None = Field(default=None, ge=-1)
        min_p: float | None = Field(default=None, ge=0.0, le=1.0)
        repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
        min_tokens: int | None = Field(default=None, ge=0)
        ignore_eos: bool | None = None
        stop_token_ids: list[int] | None = None
        # structured output (grammar.response_format_grammar reads it; /v1/completions takes it, as vLLM's does)
        response_format: Any = None

    class CompletionRequest(_Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        echo: bool | None = None
        best_of: int | None = Field(default=None, ge=1)
        suffix: str | None = None
        logprobs: int | None = None

    class ChatMessage(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: Literal["system", "user", "assistant", "developer", "tool"]
        content: str | list[dict[str, Any]] | None = None

    class ChatRequest(_Common):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = Field(default=None, ge=1)
        logprobs: bool | None = None
        top_logprobs: int | None = None
        tools: list[Any] | None = None  # tool_calls.tool_plan checks tools, tool_choice, parallel_tool_calls
        tool_choice: Any = None
        parallel_tool_calls: bool | None = None
        audio: Any = None
        modalities: list[str] | None = None
        function_call: Any = None
        functions: list[Any] | None = None
        metadata: dict[str, str] | None = None
        prediction: Any = None
        prompt_cache_key: str | None = None
        reasoning_effort: Any = None
        safety_identifier: str | None = None
        service_tier: str | None = None
        store: bool | None = None
        verbosity: Any = None
        web_search_options: Any = None

    return CompletionRequest, ChatRequest


# --------------------------------------------------------------------------------------------------
# Every request field and what the server does with it
# --------------------------------------------------------------------------------------------------


def _set(v) -> bool:
    return v is not None and v != [] and v != {}


def _given(v) -> bool:
    return v is not None


# (field, endpoints, refused when, why): the fields this server refuses, with the value that is
# refused. ``endpoints``: "completions", "chat" or "both". Every other field of the reference bodies
# is honoured (docs/serve.md, "Request fields", lists them all).
REFUSED: list[tuple[str, str, Any, str]] = [
    ("suffix", "completions", _set, "suffix (fill-in-the-middle) is not supported"),
    ("audio", "chat", _given, "audio output is not supported: the served models produce text"),
    ("modalities", "chat", lambda v: _set(v) and list(v) != ["text"], "only the text modality is served"),
    ("function_call", "chat", _given, "function_call is not supported (deprecated by OpenAI): use tool_choice"),
    ("functions", "chat", _set, "functions are not supported (deprecated by OpenAI): use tools"),
    ("prediction", "chat", _given, "predicted outputs are not supported"),
    ("reasoning_effort", "chat", _given, "reasoning_effort is not supported: the served models take no such setting"),
    ("verbosity", "chat", _given, "verbosity is not supported: the served models take no such setting"),
    ("web_search_options", "chat", _given, "web search is not supported"),
    ("service_tier", "chat", lambda v: _set(v) and v not in ("auto", "default"),
     "only service_tier 'auto' or 'default' is served (one tier)"),
    ("store", "chat", lambda v: bool(v), "this server stores no completions (store must be false)"),
]


def check_unsupported(req, *, chat: bool) -> None:
    """A 400 naming the field for every request field this server does not honour (:data:`REFUSED`)
    and for combinations that have no meaning, rather than ignoring any of them silently."""
    here = "chat" if chat else "completions"
    for name, where, bad, why in REFUSED:
        if where in (here, "both") and bad(getattr(req, name, None)):
            raise ApiError(400, why, param=name)
    for bad, param, msg in _combination_checks(req, chat):
        if bad:
            raise ApiError(400, msg, param=param)


def _combination_checks(req, chat: bool) -> list[tuple[bool, str, str]]:
    top = req.top_logprobs if chat else req.logprobs
    n = req.n or 1
    checks = [
        (top is not None and not 0 <= top <= MAX_TOP_LOGPROBS, "top_logprobs" if chat else "logprobs",
         f"{'top_logprobs' if chat else 'logprobs'} must lie in [0, {MAX_TOP_LOGPROBS}], got {top}"),
        (req.logit_bias is not None and not all(k.lstrip("-").isdigit() for k in req.logit_bias), "logit_bias",
         "logit_bias keys must be token ids (integers as strings)"),
        (req.max_tokens == 0 and not (not chat and req.echo), "max_tokens",
         "max_tokens must be >= 1 (0 only with echo, to score the prompt)"),
    ]
    if chat:
        checks.append((bool(req.top_logprobs) and not req.logprobs, "top_logprobs",
                       "top_logprobs needs logprobs: true"))
    else:
        best = req.best_of or n
        checks += [(best < n, "best_of", f"best_of ({best}) must be >= n ({n})"),
                   (bool(req.stream) and best > n, "best_of", "best_of > n cannot be streamed (the samples are "
                    "ranked once all have finished)")]
    return checks


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sampling_params(req, max_tokens: int, *, chat: bool = False, grammar=None) -> SamplingParams:
    """The engine's settings of a (checked) completion or chat request; ``grammar``: what constrains
    its tokens (``response_format`` or a forced tool call, compiled by the routes), or None."""
    if chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs, best_of = None, None
    else:
        logprobs, best_of = req.logprobs, req.best_of
        prompt_logprobs = logprobs if req.echo and logprobs is not None else None
    given = {k: getattr(req, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                                           "top_k", "min_p", "ignore_eos", "stop_token_ids") if getattr(req, k) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop_list(req.stop),
                              n=req.n or 1, best_of=best_of, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()}, grammar=grammar,
                              **given)
    except EngineError as e:
        raise ApiError(400, str(e), param=e.param) from e


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
