"""The HTTP side of ``deltazip serve``: route handlers, streaming, auth, access log and error shaping.

:func:`install` puts everything on a FastAPI app: :class:`Routes` (one small method per endpoint,
over a shared :class:`AppState`), the auth/metrics/access-log middleware and the exception
handlers that turn every failure into OpenAI's error shape. The wire format itself (request models,
response and chunk JSON) is in :mod:`deltazip.runtime.serve.openai_schema`; the server's start-up
(building the runtime) in :mod:`deltazip.runtime.serve.assembly`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request  # at module level: FastAPI resolves endpoint annotations here

from deltazip.formats.errors import DeltazipError
from deltazip.runtime.serve.chat_content import as_template_reads
from deltazip.runtime.serve.engine import EngineError, FinishEvent, SamplingParams, ServedVariant, TokenEvent
from deltazip.runtime.serve.grammar import Grammar, GrammarError, response_format_grammar
from deltazip.runtime.serve.images import image_prompt, image_url, processor, read_image
from deltazip.runtime.serve.openai_schema import (
    DEFAULT_MAX_REQUEST_BYTES,
    TOKENIZER_PATHS,
    ApiError,
    check_unsupported,
    error_body,
    json_body,
    not_found,
    parse_body,
    parse_json,
    read_body,
    request_models,
    sampling_params,
)
from deltazip.runtime.serve.openai_shapes import ChatShape, CompletionShape, TokenTexts, usage
from deltazip.runtime.serve.prompt_media import PromptMedia
from deltazip.runtime.serve.tool_calls import ToolChatShape, ToolPlan, template_messages, tool_plan
from deltazip.runtime.serve.variant_catalog import VariantRefused

log = logging.getLogger("deltazip.serve")
# One line per request at INFO: method, route template, model, status, latency, tokens.
access_log = logging.getLogger("deltazip.access")


class EngineStream:
    """Bridges one engine request (engine thread) to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rid: str | None = None
        self.done = False

    def sink(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


@dataclass
class AppState:
    """What every handler shares: the runtime (engine, variants), metrics and the request models."""

    rt: Any  # deltazip.runtime.serve.assembly.Runtime
    metrics: Any  # deltazip.runtime.serve.server.Metrics
    models: tuple = field(default_factory=request_models)
    _texts: dict[int, TokenTexts] = field(default_factory=dict)

    def token_texts(self, name: str) -> TokenTexts:
        """The token strings of model ``name``'s tokenizer (cached per tokenizer)."""
        tok = self.served_entry(name).encoder
        if id(tok) not in self._texts:
            self._texts[id(tok)] = TokenTexts(tok)
        return self._texts[id(tok)]

    @property
    def engine(self):
        return self.rt.engine

    def served_entry(self, name: str) -> ServedVariant:
        # A variant can be deleted between check_model and here: still a 404, never a KeyError.
        sv = self.engine.served.get(name)
        if sv is None:
            raise not_found(name)
        return sv

    @property
    def max_body(self) -> int:
        """``--max-request-bytes`` (configs that predate it: the default)."""
        return getattr(self.rt.config, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)

    def model_card(self, name: str) -> dict:
        parent = None if name == self.rt.base_name else self.rt.base_name
        return {"id": name, "object": "model", "created": self.rt.created, "owned_by": "deltazip",
                "root": name, "parent": parent}


def error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(status, message, type_, param, code), status_code=status)


# --------------------------------------------------------------------------------------------------
# Prompts and engine requests
# --------------------------------------------------------------------------------------------------


def encode_prompts(state: AppState, name: str, prompt) -> list[list[int]]:
    tok = state.served_entry(name).encoder
    if isinstance(prompt, str):
        return [tok(prompt)["input_ids"]]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [tok(p)["input_ids"] for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")


def own_chat_template(state: AppState, name: str) -> str | None:
    """``--chat-template``'s, else the variant's own chat template, else the base's (a fine-tune that
    kept tokenizer files without one still chats as its base does); None if there is none."""
    given = getattr(state.rt.config, "chat_template_text", None)
    if given:
        return given
    tok = state.served_entry(name).encoder
    return getattr(tok, "chat_template", None) or getattr(state.engine.served[state.rt.base_name].encoder,
                                                          "chat_template", None)


def chat_template(state: AppState, name: str) -> str:
    """:func:`own_chat_template`, or a 400 that says what to do without one."""
    template = own_chat_template(state, name)
    if not template:
        raise ApiError(400, f"model `{name}` has no chat template (nor has the base); use /v1/completions, or "
                            "start the server with --chat-template FILE", param="messages")
    return template


def encode_chat(state: AppState, name: str, messages, template: str, tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> tuple[list[int], PromptMedia | None]:
    """The prompt's token ids, and its images as the model's processor gives them (None without)."""
    tok = state.served_entry(name).encoder
    msgs, kw = template_messages(messages), {"add_generation_prompt": add_generation_prompt, "tools": tools}
    urls = [u for m in messages if isinstance(m.content, list) for u in map(image_url, m.content) if u]
    if urls:
        refused = state.engine.images_refused()
        if refused:
            raise ApiError(400, refused, param="messages")
    try:
        ids = tok.apply_chat_template(as_template_reads(tok, template, msgs, **kw), chat_template=template,
                                      tokenize=not urls, **kw)
    except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from e
    if urls:
        images = [read_image(u, state.max_body or DEFAULT_MAX_REQUEST_BYTES) for u in urls]
        base = state.served_entry(state.rt.base_name)
        return image_prompt(processor(state.served_entry(name).files, base.files), ids, images)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids), None


def request_grammar(state: AppState, name: str, req, plan: ToolPlan | None = None) -> Grammar | None:
    """What constrains the request's tokens: a forced tool call, else its ``response_format`` (compiled
    here, in the request's thread; a schema the engine rejects is a 400 naming the field)."""
    sv = state.served_entry(name)
    tag = plan.structural_tag() if plan is not None else None
    try:
        if tag is None:
            return response_format_grammar(state.engine.grammars, sv.encoder, sv.eos_ids, req.response_format)
        if (req.response_format or {}).get("type", "text") != "text":
            raise ApiError(400, "response_format cannot be combined with tool_choice 'required' or a named function",
                           param="response_format")
        return state.engine.grammars.structural_tag(sv.encoder, sv.eos_ids, tag, "tools")
    except GrammarError as e:
        raise ApiError(400, str(e), param=e.param) from e


def submit_all(state: AppState, name: str, prompts: list[list[int]], params: SamplingParams,
               media: PromptMedia | None = None) -> list[EngineStream]:
    """Queue one engine request per prompt, each drawing ``params.samples`` samples (all validated
    first: all or none are queued); the streams come prompt by prompt, samples in order. ``media``:
    the images of a single prompt."""
    engine, loop = state.engine, asyncio.get_running_loop()
    try:
        for p in prompts:
            engine.validate(name, p, params, media)
    except EngineError as e:
        raise ApiError(e.status, str(e), param=e.param, code=e.code) from e
    streams: list[EngineStream] = []
    try:
        for p in prompts:
            group = [EngineStream(loop) for _ in range(params.samples)]
            for s, rid in zip(group, engine.submit_samples(name, p, params, [s.sink for s in group], media)):
                s.rid = rid
            streams += group
    except EngineError as e:
        for s in streams:
            engine.cancel(s.rid)
        type_ = "rate_limit_error" if e.status == 429 else "invalid_request_error"
        raise ApiError(e.status, str(e), type_, param=e.param, code=e.code) from e
    return streams


def usage_of(evs: list[FinishEvent], samples: int) -> dict:
    """Usage of finished streams (``samples`` per prompt): each prompt counted once, every drawn token."""
    return usage(sum(e.prompt_tokens for e in evs[::samples]), sum(e.completion_tokens for e in evs))


def best_of(evs: list[FinishEvent], samples: int, n: int) -> list[FinishEvent]:
    """Per prompt, its ``n`` samples of highest cumulative log probability, best first."""
    if samples == n:
        return evs
    out = []
    for i in range(0, len(evs), samples):
        out += sorted(evs[i:i + samples], key=lambda e: -e.cumulative_logprob)[:n]
    return out


async def collect(state: AppState, request: Request, s: EngineStream) -> FinishEvent | None:
    """Wait for a request's end; cancel it (and return None) if the client goes away."""
    while True:
        try:
            ev = await asyncio.wait_for(s.queue.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                state.engine.cancel(s.rid)
                return None
            continue
        if isinstance(ev, FinishEvent):
            s.done = True
            return ev


async def collect_all(state: AppState, request: Request, streams: list[EngineStream]) -> list[FinishEvent] | None:
    """Every stream's finish event (a failed generation is a 500); None when the client went away."""
    evs = []
    for s in streams:
        ev = await collect(state, request, s)
        if ev is None:
            for t in streams:
                state.engine.cancel(t.rid)
            return None
        if ev.reason == "error":
            raise ApiError(500, ev.error or "generation failed", "server_error")
        evs.append(ev)
    return evs


# --------------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------------


async def _pump(i: int, s: EngineStream, merged: asyncio.Queue) -> None:
    while True:
        ev = await s.queue.get()
        await merged.put((i, ev))
        if isinstance(ev, FinishEvent):
            s.done = True
            return


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse_events(state: AppState, request: Request, streams: list[EngineStream], shape: CompletionShape,
                     include_usage: bool) -> AsyncIterator[str]:
    """The SSE body of a streamed answer: text chunks of all choices as they come (the echoed prompt
    first), a final chunk per choice (an error event for a failed one), the usage chunk if asked,
    then ``[DONE]``."""
    finished: dict[int, FinishEvent] = {}
    merged: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, s, merged)) for i, s in enumerate(streams)]
    started: set[int] = set()
    try:
        for c in shape.head():
            yield _sse(c)
        left = len(streams)
        while left:
            i, ev = await merged.get()
            if i not in started and not (isinstance(ev, FinishEvent) and ev.reason == "error"):
                started.add(i)
                echo = shape.echo_chunk(i, ev)
                if echo is not None:
                    yield _sse(echo)
            if isinstance(ev, TokenEvent):
                c = shape.chunk(i, ev)  # None: nothing to send yet (text a tool call may hold back)
                if c is not None:
                    yield _sse(c)
                continue
            left -= 1
            finished[i] = ev
            if ev.reason == "error":
                yield _sse(error_body(500, ev.error or "generation failed", "server_error", None, None))
                continue
            yield _sse(shape.final(i, ev.reason))
        used = usage_of([finished[i] for i in range(len(streams))], shape.samples)
        request.state.usage = used
        if include_usage:
            yield _sse(shape.final(None, None) | {"choices": [], "usage": used})
        yield "data: [DONE]\n\n"
    finally:
        # Reached on normal completion and when the client disconnects (the response task is
        # cancelled): anything still running is cancelled so the engine frees its sequence.
        for t in tasks:
            t.cancel()
        for s in streams:
            if not s.done:
                state.engine.cancel(s.rid)


async def answer(state: AppState, request: Request, req, streams: list[EngineStream], shape: CompletionShape,
                 params: SamplingParams):
    """The response of a generation request: an SSE stream, or the whole JSON answer (499 if the
    client left before the end); with ``best_of > n`` the best ``n`` samples of each prompt."""
    from fastapi.responses import Response, StreamingResponse

    if req.stream:
        include = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(sse_events(state, request, streams, shape, include), media_type="text/event-stream")
    evs = await collect_all(state, request, streams)
    if evs is None:
        return Response(status_code=499)
    used = usage_of(evs, params.samples)
    request.state.usage = used
    return shape.response(best_of(evs, params.samples, params.n), used)


# --------------------------------------------------------------------------------------------------
# Endpoints
# --------------------------------------------------------------------------------------------------


class Routes:
    """One method per endpoint, over a shared :class:`AppState`."""

    def __init__(self, state: AppState):
        self.s = state

    async def health(self):
        eng, startup = self.s.engine, self.s.rt.startup
        if startup is not None and not startup.done.is_set():  # kernels still being tuned
            from fastapi.responses import JSONResponse

            return JSONResponse(startup.status(), status_code=503)
        if eng._thread is None or not eng._thread.is_alive():
            return error(503, "the engine is not running", "server_error")
        return {"status": "ok", "models": 1 + len(self.s.rt.catalog)}

    async def prom(self):
        from fastapi.responses import Response

        body, ctype = self.s.metrics.render()
        return Response(body, media_type=ctype)

    async def list_models(self):
        rt = self.s.rt
        return {"object": "list", "data": [self.s.model_card(n) for n in [rt.base_name, *rt.catalog.names()]]}

    async def get_model(self, model_id: str):
        if model_id != self.s.rt.base_name and model_id not in self.s.engine.served \
                and model_id not in self.s.rt.catalog:
            raise not_found(model_id)
        return self.s.model_card(model_id)

    async def list_variants(self):
        rows = await asyncio.wrap_future(self.s.engine.run_on_engine(lambda: variant_table(self.s.rt)))
        return {"object": "list", "data": rows + unread_rows(self.s.rt)}

    async def add_variant(self, request: Request):
        from fastapi.responses import JSONResponse

        from deltazip.runtime.serve.assembly import VariantConflict, register_variant

        body = await json_body(request, self.s.max_body)
        path, name = body.get("path"), body.get("name")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "path must be a non-empty string: a variant directory inside the served directory",
                           param="path")
        if name is not None and not isinstance(name, str):
            raise ApiError(400, "name must be a string", param="name")
        try:
            v = await asyncio.to_thread(register_variant, self.s.rt, path, name)
        except VariantConflict as e:
            raise ApiError(409, str(e), param="name", code="variant_exists") from e
        except DeltazipError as e:
            param = "name" if str(e).startswith("variant name") else "path"
            raise ApiError(400, str(e).splitlines()[0], param=param, code="invalid_variant") from e
        row = await asyncio.wrap_future(self.s.engine.run_on_engine(lambda: variant_table(self.s.rt, only=v.name)))
        return JSONResponse(row[0] if row else {"id": v.name, "object": "variant"}, status_code=201)

    async def delete_variant(self, name: str):
        rt = self.s.rt
        if name not in self.s.engine.served and (name in rt.catalog.found or name in rt.catalog.refused):
            # Never read (or refused on first use): nothing is loaded. On the engine thread, so that a
            # first use reading it meanwhile either commits before or not at all.
            await asyncio.wrap_future(self.s.engine.run_on_engine(lambda: rt.catalog.remove(name)))
            log.info("variant %s deleted (it had not been read)", name)
            return {"id": name, "object": "model", "deleted": True}

        def unload() -> None:  # engine thread, once the variant's requests are done
            rt.backend.remove_variant(name)
            rt.catalog.remove(name)

        try:
            fut = self.s.engine.remove_model(name, unload)
        except EngineError as e:
            raise ApiError(404, f"No variant named `{name}` is served (the base cannot be deleted).", param="name",
                           code="model_not_found") from e
        await asyncio.wrap_future(fut)
        log.info("variant %s deleted: its requests drained, unloaded from every tier", name)
        return {"id": name, "object": "model", "deleted": True}

    def _request(self, request: Request, cls, body: dict, chat: bool):
        req = parse_body(cls, body)
        request.state.model = req.model
        check_unsupported(req, chat=chat)
        from deltazip.runtime.serve.assembly import serve_on_first_use

        try:  # a variant found at start-up is read and checked by its first request (worker thread)
            served = serve_on_first_use(self.s.rt, req.model)
        except VariantRefused as e:
            raise ApiError(500, str(e), "server_error", param="model", code="invalid_variant") from e
        if not served:
            raise not_found(req.model)
        return req

    async def completions(self, request: Request):
        raw = await read_body(request, self.s.max_body)
        # Parsing and tokenizing take seconds for a large prompt: off the event loop, so that /health and
        # every other request go on meanwhile.
        req, prompts, grammar = await asyncio.to_thread(self._completion_prompts, request, raw)
        params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, grammar=grammar)
        streams = submit_all(self.s, req.model, prompts, params)
        echo = None
        if req.echo:
            texts = req.prompt if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) \
                else [req.prompt] if isinstance(req.prompt, str) else None
            decode = self.s.served_entry(req.model).encoder.decode
            echo = [(texts[i] if texts else decode(p), p) for i, p in enumerate(prompts)]
        # Choice i answers prompt i // n (streams are not ranked: best_of > n is refused with stream).
        shape = CompletionShape(req.model, self.s.token_texts(req.model), echo, params.n)
        return await answer(self.s, request, req, streams, shape, params)

    def _completion_prompts(self, request: Request, raw: bytes):
        req = self._request(request, self.s.models[0], parse_json(raw), chat=False)
        return req, encode_prompts(self.s, req.model, req.prompt), request_grammar(self.s, req.model, req)

    def _chat_prompt(self, request: Request, raw: bytes):
        req = self._request(request, self.s.models[1], parse_json(raw), chat=True)
        template = chat_template(self.s, req.model)
        plan = tool_plan(req, template)
        ids, media = encode_chat(self.s, req.model, req.messages, template, plan.template_tools if plan else None)
        return req, ids, media, plan, request_grammar(self.s, req.model, req, plan)

    async def chat(self, request: Request):
        raw = await read_body(request, self.s.max_body)
        req, ids, media, plan, grammar = await asyncio.to_thread(self._chat_prompt, request, raw)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, self.s.engine.max_len - len(ids))
        params = sampling_params(req, max_tokens, chat=True, grammar=grammar)
        streams = submit_all(self.s, req.model, [ids], params, media)
        texts = self.s.token_texts(req.model)
        shape = ToolChatShape(req.model, plan, texts, samples=params.n) if plan is not None and plan.parses \
            else ChatShape(req.model, texts, samples=params.n)
        return await answer(self.s, request, req, streams, shape, params)

    # -- vLLM's tokenizer routes ----------------------------------------------------------------
    def _served_model(self, name) -> str:
        """The model a tokenizer request names (the base when it names none), read if not yet."""
        from deltazip.runtime.serve.assembly import serve_on_first_use

        if name is None:
            return self.s.rt.base_name
        if not isinstance(name, str):
            raise ApiError(400, "model must be a string", param="model")
        try:
            if not serve_on_first_use(self.s.rt, name):
                raise not_found(name)
        except VariantRefused as e:
            raise ApiError(500, str(e), "server_error", param="model", code="invalid_variant") from e
        return name

    async def tokenize(self, request: Request):
        """vLLM's ``POST /tokenize``: ``prompt`` (``add_special_tokens``, default true) or ``messages``
        (rendered with the chat template, ``add_generation_prompt`` default true) -> ``{count,
        max_model_len, tokens, token_strs}``."""
        body = await json_body(request, self.s.max_body)
        return await asyncio.to_thread(self._tokenize, request, body)

    def _tokenize(self, request: Request, body: dict) -> dict:
        name = request.state.model = self._served_model(body.get("model"))
        if "messages" in body:
            req = parse_body(self.s.models[1], {"model": name, "messages": body["messages"]})
            gen = body.get("add_generation_prompt", True)
            if not isinstance(gen, bool):
                raise ApiError(400, "add_generation_prompt must be a boolean", param="add_generation_prompt")
            ids, _ = encode_chat(self.s, name, req.messages, chat_template(self.s, name), add_generation_prompt=gen)
        else:
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string (or send messages)", param="prompt")
            if not isinstance(special, bool):
                raise ApiError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
            ids = list(self.s.served_entry(name).encoder(prompt, add_special_tokens=special)["input_ids"])
        strs = None
        if body.get("return_token_strs"):
            strs = self.s.served_entry(name).encoder.convert_ids_to_tokens(ids)
        return {"count": len(ids), "max_model_len": self.s.engine.max_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request):
        """vLLM's ``POST /detokenize``: ``tokens`` -> ``{prompt}``."""
        body = await json_body(request, self.s.max_body)
        name = request.state.model = await asyncio.to_thread(self._served_model, body.get("model"))
        tokens = body.get("tokens")
        vocab = getattr(self.s.engine.backend.config, "vocab_size", None) or 2**31
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": self.s.served_entry(name).encoder.decode(tokens)}

    async def tokenizer_info(self, request: Request):
        """vLLM's ``GET /tokenizer_info`` (``?model=``, default the base): the tokenizer's class,
        special tokens, chat template and the served context length."""
        name = await asyncio.to_thread(self._served_model, request.query_params.get("model"))
        tok = self.s.served_entry(name).encoder
        special = {k: getattr(tok, k, None) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return {"tokenizer_class": type(tok).__name__, **{k: v if isinstance(v, str) else None for k, v in special.items()},
                "chat_template": own_chat_template(self.s, name),
                "model_max_length": self.s.engine.max_len}

    def add_to(self, app) -> None:
        for path, fn, method in (
            ("/health", self.health, "GET"), ("/metrics", self.prom, "GET"),
            ("/v1/models", self.list_models, "GET"), ("/v1/models/{model_id:path}", self.get_model, "GET"),
            ("/v1/variants", self.list_variants, "GET"), ("/v1/variants", self.add_variant, "POST"),
            ("/v1/variants/{name:path}", self.delete_variant, "DELETE"),
            ("/v1/completions", self.completions, "POST"), ("/v1/chat/completions", self.chat, "POST"),
            ("/tokenize", self.tokenize, "POST"), ("/detokenize", self.detokenize, "POST"),
            ("/tokenizer_info", self.tokenizer_info, "GET"),
        ):
            app.add_api_route(path, fn, methods=[method])


# --------------------------------------------------------------------------------------------------
# Errors, auth, access log
# --------------------------------------------------------------------------------------------------


def install_error_handlers(app) -> None:
    """Every failure answers in OpenAI's error shape; bad input never yields a 500."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def api_error(_request, exc: ApiError):
        return error(exc.status, exc.message, exc.type, exc.param, exc.code)

    async def validation(_request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return error(400, f"{msg}" + (f" (param: {param})" if param else ""), param=param)

    async def http(_request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), "invalid_request_error")

    async def internal(_request, exc: Exception):
        log.exception("internal error")
        return error(500, f"internal server error: {type(exc).__name__}", "server_error")

    for exc_type, handler in ((ApiError, api_error), (RequestValidationError, validation),
                              (StarletteHTTPException, http), (Exception, internal)):
        app.add_exception_handler(exc_type, handler)


def route_of(app, scope) -> str:
    """The route template a request matches (``/v1/models/{model_id:path}``), ``unmatched`` for
    any other path: metric labels and log lines never carry a raw path (unbounded cardinality)."""
    from starlette.routing import Match

    partial = None
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route.path
        if match == Match.PARTIAL and partial is None:
            partial = route.path  # the path matches, the method does not (405)
    return partial or "unmatched"


def log_access(request: Request, route: str, status: int, t0: float) -> None:
    st = request.state
    used = getattr(st, "usage", None) or {}
    access_log.info("%s %s model=%s status=%d latency=%.3fs prompt_tokens=%s completion_tokens=%s",
                    request.method, route, getattr(st, "model", "-"), status, time.perf_counter() - t0,
                    used.get("prompt_tokens", "-"), used.get("completion_tokens", "-"))


def _authorized(api_key: str | None, request: Request) -> bool:
    path = request.url.path
    if api_key is None or not (path.startswith("/v1") or path in TOKENIZER_PATHS):
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def install_middleware(app, state: AppState) -> None:
    """``/v1/*`` needs the API key (when one is set); every request is counted by route template and
    status, and logged once its body has been sent (streams: at their end)."""
    api_key, counter = state.rt.config.api_key, state.metrics.http_c

    async def auth_and_count(request: Request, call_next):
        t0 = time.perf_counter()
        route = route_of(app, request.scope)
        if not _authorized(api_key, request):
            counter.labels(route, "401").inc()
            log_access(request, route, 401, t0)
            return error(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY'.",
                         "invalid_request_error", code="invalid_api_key")
        response = await call_next(request)
        counter.labels(route, str(response.status_code)).inc()
        body = response.body_iterator

        async def logged_body():
            try:
                async for chunk in body:
                    yield chunk
            finally:
                log_access(request, route, response.status_code, t0)

        response.body_iterator = logged_body()
        return response

    app.middleware("http")(auth_and_count)


def engine_lifespan(engine, startup=None):
    """The app's lifespan: the engine thread runs while the server does; ``startup`` (the kernel tuning,
    ``kernel_warmup.Startup``) starts on its own thread once the server answers."""

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        if startup is not None:
            startup.start()
        try:
            yield
        finally:
            engine.shutdown()
            if hasattr(engine.backend, "close"):  # tensor parallel: stop the worker ranks
                engine.backend.close()

    return lifespan


def install(app, state: AppState) -> None:
    install_error_handlers(app)
    install_middleware(app, state)
    Routes(state).add_to(app)


# --------------------------------------------------------------------------------------------------
# GET /v1/variants
# --------------------------------------------------------------------------------------------------


def variant_table(rt, only: str | None = None) -> list[dict[str, Any]]:
    """``GET /v1/variants`` rows (run on the engine thread, so slots and tiers do not move meanwhile).

    Per variant: kind, tier (``device``/``host``/``loading``/``disk``, or ``draining`` while a delete
    waits for its requests), bytes on disk, in the host tier (tensors its host object references,
    shared ones included), in its device slot, bytes dedup saves it, last request (unix time) and
    the latest disk->host and host->device load times (seconds).
    """
    removing = rt.engine.removing()
    root = Path(rt.config.artifacts).resolve()
    chosen = rt.variants if only is None else [v for v in [rt.variant(only)] if v is not None]
    return [_variant_row(rt, v, root, removing) for v in chosen]


def unread_rows(rt) -> list[dict[str, Any]]:
    """``GET /v1/variants`` rows of the variants not read yet (``checked: false``, sizes null) and of
    those refused on first use (``state: refused`` with the reason); no file is touched."""
    root = os.path.abspath(rt.config.artifacts)  # where the walk found them, symlinks not followed
    empty = {"bytes_on_disk": None, "bytes_host": 0, "bytes_device": 0, "bytes_device_estimate": None,
             "bytes_dedup_saved": 0, "last_used": None, "load_seconds": {"disk": None, "device": None}}
    rows = [{"id": r.name, "object": "variant", "kind": r.kind, "path": _rel(r.where, root), "state": "disk",
             "checked": False, **empty} for r in rt.catalog.unread()]
    for ref, why in list(rt.catalog.refused.values()):
        rows.append({"id": ref.name, "object": "variant", "kind": ref.kind, "path": _rel(ref.where, root),
                     "state": "refused", "checked": True, "error": why, **empty})
    return rows


def _rel(where: str, root: str) -> str:
    rel = os.path.relpath(os.path.abspath(where), root)
    return where if rel.startswith("..") else rel


def _variant_row(rt, v, root: Path, removing: set[str]) -> dict[str, Any]:
    eng, be = rt.engine, rt.backend
    slot = eng.cache.slot_of(v.name)
    host = eng.cache.host_object(v.name)
    st = eng.cache.stats.get(v.name)
    try:
        rel = str(Path(v.path).resolve().relative_to(root))
    except ValueError:
        rel = str(v.path)
    return {
        "id": v.name, "object": "variant", "kind": v.kind, "path": rel,
        "state": "draining" if v.name in removing else eng.cache.state(v.name), "checked": True,
        "bytes_on_disk": v.disk_bytes,
        "bytes_host": host.nbytes() if host is not None and hasattr(host, "nbytes") else 0,
        "bytes_device": be.slot_bytes(slot) if slot is not None else 0,
        "bytes_device_estimate": be.resident_estimate(v.name),
        "bytes_dedup_saved": be.ledger.get(v.name).saved,
        "last_used": eng.last_used.get(v.name),
        "load_seconds": {"disk": st.disk_seconds_last if st and st.disk_loads else None,
                         "device": st.device_seconds_last if st and st.device_loads else None},
    }
