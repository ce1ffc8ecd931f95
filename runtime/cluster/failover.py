"""The ``--workers`` front's requests in flight, and the proxying that keeps a request alive when its
worker dies (the states and the rules are in :mod:`deltazip.runtime.cluster.progress`).

Per request, :meth:`FailoverProxy.forward`:

1. picks a worker (:meth:`WorkerPool.pick`) and sends the request with its id in ``TAG_HEADER``;
2. reads the answer without passing anything on: a non-streamed answer whole, a stream up to the
   first chunk that follows the worker's ``generating`` report (what came before, such as a chat
   stream's role chunk, is held back with it);
3. then answers the client: the whole body, or the stream (cut at event boundaries, so an error
   event never lands inside a half-sent one).

If the worker cannot be connected to, the request goes to another worker (it never reached one). If
the connection breaks during 1-2, the front waits for the worker's death to be certain (its pipe then
holds every report it wrote), reads its reports, and follows :func:`~deltazip.runtime.cluster.progress.after_death`:
resubmit to another live worker (excluding the dead process; waiting up to ``RESUBMIT_WAIT_S`` for
one to be ready), or 503 with ``Retry-After``. During 3, a stream ends with an error event and
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from deltazip.runtime.cluster.progress import (
    RANK,
    STATES,
    TAG_HEADER,
    SseEvents,
    after_death,
    closing_stream,
    stream_error,
    traits,
)

log = logging.getLogger("deltazip.workers")
SETTLE_S = 2.0  # how long a request whose connection broke waits for its worker's death to be certain
RESUBMIT_WAIT_S = 30.0  # how long a resubmitted request waits for a ready worker (all may be restarting)
HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "host", "content-length"}


@dataclass(eq=False)
class Flight:
    """One request through the front. ``pid``/``proc``: the worker process it is on now."""

    id: str
    stream: bool
    replayable: bool
    state: str = "queued"
    pid: int | None = None
    proc: Any = None
    worker: int | None = None
    resubmitted: bool = False


@dataclass
class Flights:
    """The front's requests in flight by id, and counts of what worker deaths did to them (thread-safe:
    the supervisor thread applies the workers' reports)."""

    open: dict[str, Flight] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("resubmitted", "refused", "stream_errors"), 0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, stream: bool, replayable: bool) -> Flight:
        f = Flight(uuid.uuid4().hex, stream, replayable)
        with self.lock:
            self.open[f.id] = f
        return f

    def on_worker(self, f: Flight, w) -> None:
        with self.lock:
            f.pid, f.proc, f.worker, f.state = w.pid, w.proc, w.index, "queued"

    def advance(self, tag: str, state: str, pid: int | None = None) -> None:
        """Move a request forward to ``state`` (reports from a process it is no longer on are ignored)."""
        with self.lock:
            f = self.open.get(tag)
            if f is not None and (pid is None or f.pid == pid) and RANK[state] > RANK[f.state]:
                f.state = state

    def end(self, f: Flight) -> None:
        with self.lock:
            self.open.pop(f.id, None)

    def count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def snapshot(self) -> dict[str, Any]:
        """``{"requests": {state: open requests in it}, "resubmitted": n, "refused": n, "stream_errors": n}``."""
        with self.lock:
            states = dict.fromkeys(STATES, 0)
            for f in self.open.values():
                states[f.state] += 1
            return {"requests": states, **self.outcomes}


@dataclass
class _Opened:
    """An answer read up to where it may go to the client; ``rest`` None: ``chunks`` is all of it."""

    worker: Any
    resp: Any
    chunks: list[bytes]
    rest: Any = None


def error_response(status: int, message: str, code: str | None, retry_after: int | None = None):
    from starlette.responses import JSONResponse

    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status, headers=headers)


class FailoverProxy:
    """Forwards requests to the pool's workers (see the module docstring).

    Args:
        pool: a :class:`~deltazip.runtime.cluster.workers.WorkerPool` (``pick``, ``release``,
            ``read_reports``, ``flights``, ``count_error``, ``retry_after``).
        client: an ``httpx.AsyncClient``.
    """

    def __init__(self, pool, client):
        self.pool, self.client = pool, client

    async def forward(self, method: str, target: str, headers: list, body: bytes, model: str | None):
        """The client's response to ``method target``; ``model``: the generation request's model
        (None for other routes, which are idempotent and never streamed)."""
        stream, replay = traits(body) if model is not None else (False, True)
        flights = self.pool.flights
        f = flights.begin(stream, replay)
        handed_off = False
        try:
            tried: set[int] = set()
            while True:
                w = await self._pick(f, tried, model)
                if w is None:
                    self.pool.count_error("no_worker")
                    return error_response(503, "no server worker is ready (restarting); retry shortly", "no_worker",
                                          self.pool.retry_after())
                opened = await self._open(f, w, method, target, headers, body)
                if isinstance(opened, _Opened):
                    handed_off = opened.rest is not None
                    return self._respond(f, opened)
                tried.add(w.pid)  # unreached: never got there; lost: it died (or broke the connection)
                if opened == "lost":
                    if await self._after_loss(f) != "resubmit":
                        return self._refuse(f, w)
                    log.warning("request %s: worker %d failed before answering it (%s); resubmitted", f.id, w.index,
                                f.state)
                    f.resubmitted = True
                    flights.count("resubmitted")
        finally:
            if not handed_off:
                flights.end(f)

    async def _pick(self, f: Flight, tried: set[int], model: str | None):
        """A ready worker not among ``tried`` (pids); a resubmitted request waits for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (RESUBMIT_WAIT_S if f.resubmitted else 0.0)
        while (w := self.pool.pick(tried, model)) is None and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if w is not None:
            self.pool.flights.on_worker(f, w)
        return w

    async def _open(self, f: Flight, w, method: str, target: str, headers: list, body: bytes):
        """Send the request to ``w`` and read its answer up to where it may go to the client: an
        :class:`_Opened`, ``"unreached"`` (no connection) or ``"lost"`` (the connection broke).
        Holds ``w``'s open-request count while a stream is handed off, else releases it."""
        import httpx

        resp, opened = None, None
        try:
            req = self.client.build_request(method, w.url + target, headers=[*headers, (TAG_HEADER, f.id)],
                                            content=body)
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.ConnectError:
                return "unreached"
            sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            rest, chunks = resp.aiter_raw(), []
            async for chunk in rest:
                chunks.append(chunk)
                if sse and self.pool.reported(f, "generating"):
                    opened = _Opened(w, resp, chunks, rest)
                    return opened
            return _Opened(w, resp, chunks)
        except httpx.HTTPError:
            return "lost"
        finally:
            if opened is None:
                self.pool.release(w)
                if resp is not None:
                    await resp.aclose()

    async def _after_loss(self, f: Flight) -> str:
        """Wait (up to ``SETTLE_S``) for the worker's death to be certain, read its last reports, and
        decide (``after_death``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_S
        while f.proc is not None and f.proc.poll() is None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        self.pool.read_reports(f.pid)
        return after_death(f.stream, f.state, f.replayable, f.resubmitted)

    def _refuse(self, f: Flight, w):
        self.pool.flights.count("refused")
        self.pool.count_error("worker_failed")
        why = ("its second worker failed too" if f.resubmitted else
               "it had started generating, and a sampled request (temperature > 0, no seed) is not rerun")
        return error_response(503, f"server worker {w.index} failed while handling this request; {why}; "
                                   "retry it", "worker_failed", 1)

    def _respond(self, f: Flight, o: _Opened):
        from starlette.responses import Response

        self.pool.flights.advance(f.id, "answering")
        headers = {k: v for k, v in o.resp.headers.items() if k.lower() not in HOP_HEADERS}
        headers["x-deltazip-worker"] = str(o.worker.index)
        if o.rest is None:
            return Response(b"".join(o.chunks), status_code=o.resp.status_code, headers=headers)

        async def close():
            self.pool.release(o.worker)
            self.pool.flights.end(f)
            await o.resp.aclose()

        return closing_stream(self._relay(o), close, status_code=o.resp.status_code, headers=headers)

    async def _relay(self, o: _Opened):
        """The held-back chunks, then the rest of the stream; a worker dying now ends the stream with
        an error event and ``[DONE]``."""
        import httpx

        events = SseEvents()
        try:
            for chunk in o.chunks:
                if out := events.feed(chunk):
                    yield out
            async for chunk in o.rest:
                if out := events.feed(chunk):
                    yield out
            if events.tail:
                yield events.tail
        except httpx.HTTPError as e:
            if events.done:  # the whole answer went out; the connection broke after it
                return
            self.pool.flights.count("stream_errors")
            self.pool.count_error("worker_failed")
            yield stream_error(f"server worker {o.worker.index} failed mid-stream ({type(e).__name__}); "
                               "the answer is incomplete")
