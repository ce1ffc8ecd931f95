"""How far each request got, told by the engine to the router in front of it (the ``--workers``
front, the Ray ingress), and what the router does with a request whose engine process died.

A request's states as the router sees them (``STATES``, in order):

- ``queued``: sent to an engine process, which has not started it;
- ``prefilling``: the engine is running its prompt;
- ``generating``: its first token is sampled; nothing of the answer has reached the client;
- ``answering``: its first byte went to the client.

The router gives each request an id (``TAG_HEADER`` on the way to a worker); the engine process sets
it as :data:`deltazip.runtime.serve.engine.REQUEST_TAG` around the request's handler
(:func:`tag_requests`), and the engine reports ``prefilling`` / ``generating`` under it, each before the
forward or the token it announces, through :class:`EngineReports`. A worker writes the reports to a
pipe its supervisor reads (``report_line`` / ``read_report``): a pipe keeps what a process wrote
before it was killed, so once the process is gone the router knows exactly which of its requests had
started. The router holds a streamed answer back until the engine reported its first token (a chat
stream's role chunk comes before any token), and a non-streamed one until it has it whole.

When the engine process dies (:func:`after_death`): a request nothing of which reached the client is
sent to another engine once (a non-streamed one that had started only if its output is reproducible:
greedy or seeded; otherwise 503 with ``Retry-After``); a stream that had started ends with an error
event and ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

log = logging.getLogger("deltazip.cluster")
STATES = ("queued", "prefilling", "generating", "answering")
RANK = {s: i for i, s in enumerate(STATES)}
TAG_HEADER = "x-deltazip-flight"
_TAG = re.compile(r"[0-9A-Za-z_-]{1,64}")


def traits(body: bytes) -> tuple[bool, bool]:
    """``(stream, replayable)`` of a generation request's body: whether it asked for SSE, and whether
    its output does not depend on the run (greedy: ``temperature`` 0; or seeded: ``seed`` set; unset
    temperature is the server's default, 1). A body that is not a JSON object: ``(False, True)`` (the
    engine refuses it before generating anything)."""
    try:
        req = json.loads(body)
    except ValueError:
        return False, True
    if not isinstance(req, dict):
        return False, True
    return req.get("stream") is True, req.get("seed") is not None or req.get("temperature") == 0


def after_death(stream: bool, state: str, replayable: bool, resubmitted: bool) -> str:
    """What a request gets when the engine process it was on dies:

    - ``"error_event"``: a stream the client has bytes of: ``data: {"error": ...}``, then ``[DONE]``;
    - ``"resubmit"``: nothing reached the client and it was not resubmitted before: sent to another
      engine (a non-streamed request that had started only when ``replayable``: the client gets the
      answer it would have got);
    - ``"refuse"``: 503 with ``Retry-After``.
    """
    if state == "answering":
        return "error_event"
    if resubmitted:
        return "refuse"
    if stream or state == "queued" or replayable:
        return "resubmit"
    return "refuse"


def stream_error(message: str) -> bytes:
    """The end of an SSE stream whose engine died: an OpenAI-shaped error event, then ``[DONE]``."""
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": "worker_failed"}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


def closing_stream(body, on_close: Callable[[], Any], **kw):
    """A Starlette ``StreamingResponse`` of ``body`` that awaits ``on_close()`` once it is done, also
    when the client went away before the body started (then the body's own ``finally`` never runs)."""
    from starlette.responses import StreamingResponse

    class Closing(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await on_close()

    return Closing(body, **kw)


class SseEvents:
    """Cuts relayed SSE bytes at event boundaries, so an error event never lands inside a half-sent one;
    ``done`` once the stream's ``[DONE]`` event went out (the answer is whole: an engine dying after it
    must not add an error event and a second ``[DONE]``)."""

    def __init__(self):
        self.tail = b""
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        """The complete events so far (the rest is kept for the next chunk)."""
        data = self.tail + chunk
        cut = data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0
        self.tail = data[cut:]
        out = data[:cut]
        self.done = self.done or b"data: [DONE]\n\n" in out
        return out


# --------------------------------------------------------------------------------------------------
# Engine-process side
# --------------------------------------------------------------------------------------------------


class EngineReports:
    """An engine observer: ``request_state(tag, state)`` goes to ``emit``; every other call (``ttft``,
    ``finished``, ...) to ``metrics``. A failing ``emit`` is logged, never raised into the engine."""

    def __init__(self, metrics: Any, emit: Callable[[str, str], None]):
        self.metrics, self.emit = metrics, emit

    def request_state(self, tag: str, state: str) -> None:
        try:
            self.emit(tag, state)
        except Exception as e:  # the router went away: it no longer needs the news
            log.debug("progress report of %s lost: %r", tag, e)

    def __getattr__(self, name: str):
        return getattr(self.metrics, name)


class Listeners:
    """``emit`` for :class:`EngineReports` that hands each request's reports to the callback
    registered for its tag (an in-process router: the Ray replica)."""

    def __init__(self):
        self.by_tag: dict[str, Callable[[str], None]] = {}

    def __call__(self, tag: str, state: str) -> None:
        fn = self.by_tag.get(tag)
        if fn is not None:
            fn(state)


def tag_requests(app, header: str = TAG_HEADER):
    """ASGI wrapper: a request carrying ``header`` runs with ``REQUEST_TAG`` set to its value."""
    from deltazip.runtime.serve.engine import REQUEST_TAG

    key = header.encode()

    async def tagged(scope, receive, send):
        tag = None
        if scope["type"] == "http":
            tag = next((v.decode("latin-1") for k, v in scope["headers"] if k == key), None)
        if tag is None or not _TAG.fullmatch(tag):
            return await app(scope, receive, send)
        token = REQUEST_TAG.set(tag)
        try:
            return await app(scope, receive, send)
        finally:
            REQUEST_TAG.reset(token)

    return tagged


def report_line(tag: str, state: str) -> bytes:
    """One report on the worker's pipe (shorter than PIPE_BUF: written atomically)."""
    return f"{state} {tag}\n".encode()


def read_report(line: bytes) -> tuple[str, str] | None:
    """``(tag, state)`` of a report line, None for anything else."""
    parts = line.decode("latin-1").split()
    if len(parts) != 2 or parts[0] not in RANK or not _TAG.fullmatch(parts[1]):
        return None
    return parts[1], parts[0]
