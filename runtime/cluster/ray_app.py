"""``deltazip serve --ray``: the OpenAI-compatible server as a Ray Serve application.

Two deployments behind Ray Serve's HTTP proxy (one endpoint, ``--host``/``--port``):

- ``Ingress`` (one replica, no CPU reserved) reads each request's body (a body over
  ``--max-request-bytes`` gets a 413 from its Content-Length, or as soon as it streams past the
  limit, and never reaches a replica), and forwards the raw HTTP
  request to an engine replica through a deployment handle. Generation requests for a variant carry
  the variant name as the multiplexed model id (what the ``serve_multiplexed_model_id`` header sets),
  so Ray Serve routes them to a replica that already holds the variant; base-model and other requests
  go to any replica. A replica dying costs no request that had not started answering: Serve's router
  already re-routes a request the replica had not accepted; for the accepted ones, the replica streams
  the engine's progress reports with the answer (``("state", ...)`` items), the ingress holds the answer
  back until it may go to the client and applies :func:`~deltazip.runtime.cluster.progress.after_death`
  (resubmit once, a 503 with ``Retry-After``, or an error event ending a started stream).
- ``Engine`` (``--replicas N``, or autoscaled between ``--min-replicas`` and ``--max-replicas``): each
  replica is today's server, ``build_runtime`` + ``create_app`` (base + tiered delta cache, API key
  check, SSE, OpenAI error shapes), called in-process as an ASGI app. Responses carry
  ``x-deltazip-replica`` (the replica's id), which makes routing observable.

``POST /v1/variants`` and ``DELETE /v1/variants/{name}`` run on one replica; when it succeeds, the
ingress appends the change to a named Ray actor (``VariantLog``). Every forwarded request carries the
log's version, and a replica behind it replays the missing changes (through its own app, so the
route's checks are the same) before serving the request; health checks replay them too, so an idle
replica catches up within ``HEALTH_PERIOD_S``; a new replica (scale-up, restart) replays the whole log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deltazip.formats.errors import InputError
from deltazip.runtime.cluster.progress import (
    RANK,
    TAG_HEADER,
    EngineReports,
    Listeners,
    SseEvents,
    after_death,
    closing_stream,
    stream_error,
    tag_requests,
    traits,
)
from deltazip.runtime.serve.assembly import ServeConfig
from deltazip.runtime.serve.openai_schema import (
    DEFAULT_MAX_REQUEST_BYTES,
    ApiError,
    error_body,
    generation_model,
    read_body,
)

log = logging.getLogger("deltazip.cluster")
APP_NAME = "deltazip"
REPLICA_HEADER = b"x-deltazip-replica"
HEALTH_PERIOD_S = 2.0
INSTALL_HINT = "pip install 'deltazip[cluster]'"


@dataclass
class RayOptions:
    """How many engine replicas, and which Ray cluster (validated on construction).

    Args:
        address: an existing cluster (``host:port``, ``ray://host:port`` or ``auto``); None starts a
            local one on this machine.
        replicas: a fixed count; or ``min_replicas``/``max_replicas`` for autoscaling (default: 1 fixed).
    """

    address: str | None = None
    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None

    def __post_init__(self) -> None:
        scaled = self.min_replicas is not None or self.max_replicas is not None
        if self.replicas is not None and scaled:
            raise InputError("--replicas is a fixed count; drop it or drop --min-replicas/--max-replicas")
        if self.replicas is not None and self.replicas < 1:
            raise InputError(f"--replicas must be >= 1, got {self.replicas}")
        if scaled:
            self.min_replicas = 1 if self.min_replicas is None else self.min_replicas
            if self.max_replicas is None:
                raise InputError("--min-replicas needs --max-replicas (the autoscaling range)")
            if self.min_replicas < 0 or self.max_replicas < 1:
                raise InputError(f"replica range {self.min_replicas}..{self.max_replicas}: need --min-replicas >= 0 "
                                 f"and --max-replicas >= 1")
            if self.min_replicas > self.max_replicas:
                raise InputError(f"--min-replicas {self.min_replicas} is above --max-replicas {self.max_replicas}")
        if self.address is not None and not self.address.strip():
            raise InputError("--ray-address is empty; give host:port of the head node, or drop it for a local cluster")

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else (self.replicas or 1)

    def describe(self) -> str:
        if self.max_replicas is None:
            return f"{self.replicas or 1} engine replica(s)"
        return f"{self.min_replicas} to {self.max_replicas} engine replicas (autoscaled)"

    def scaling(self, cfg: ServeConfig) -> dict[str, Any]:
        """Ray Serve deployment options: a fixed count, or an autoscaling range that adds a replica
        when replicas average more than half a batch (``max_num_seqs``) of ongoing requests."""
        if self.max_replicas is None:
            return {"num_replicas": self.replicas or 1}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                       "initial_replicas": max(1, self.min_replicas),
                                       "target_ongoing_requests": max(1, cfg.max_num_seqs // 2)}}


def require_ray():
    """``(ray, ray.serve)``, or a one-line InputError saying how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise InputError(f"--ray needs Ray Serve, which is not installed ({e}); {INSTALL_HINT}") from None
    return ray, serve


# --------------------------------------------------------------------------------------------------
# The variant change log (one named actor per application)
# --------------------------------------------------------------------------------------------------


class VariantLog:
    """Ordered ``/v1/variants`` changes that succeeded: ``{"method", "path", "body"}`` each."""

    def __init__(self):
        self.ops: list[dict] = []

    def append(self, op: dict) -> int:
        self.ops.append(op)
        return len(self.ops)

    def since(self, n: int) -> list[dict]:
        return self.ops[n:]

    def version(self) -> int:
        return len(self.ops)


def variant_log(app_name: str = APP_NAME):
    """The application's log actor (created by whoever asks first; detached: it outlives a replica)."""
    import ray

    return ray.remote(VariantLog).options(name=f"deltazip-variant-log-{app_name}", namespace="serve",
                                          get_if_exists=True, lifetime="detached", num_cpus=0).remote()


# --------------------------------------------------------------------------------------------------
# Engine replicas
# --------------------------------------------------------------------------------------------------


async def call_asgi(app, req: dict, extra_headers: list, listeners: Listeners | None = None) -> AsyncIterator[tuple]:
    """Run one HTTP request through an ASGI app in this process.

    Args:
        req: ``{"method", "path", "query", "headers": [(bytes, bytes)], "body": bytes}``.
        listeners: the engine's progress reports (:class:`~deltazip.runtime.cluster.progress.Listeners`;
            the app must be wrapped in ``tag_requests``): the request is tagged, and its reports come
            out in order with the rest.
    Yields:
        ``("start", status, headers)`` once (``extra_headers`` appended), then ``("body", bytes)``;
        with ``listeners``, ``("state", "prefilling" | "generating")`` too, each before the chunk
        that follows what it announces. Closing the generator early (the client went away) tells the
        app the client disconnected.
    """
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    state = {"sent": False}
    headers, tag = req["headers"], None
    if listeners is not None:
        loop, tag = asyncio.get_running_loop(), uuid.uuid4().hex
        # Called on the engine thread before the token it announces is handed to the loop: the
        # report lands in ``out`` first.
        listeners.by_tag[tag] = lambda s: loop.call_soon_threadsafe(out.put_nowait, ("state", s))
        headers = [*headers, (TAG_HEADER.encode(), tag.encode())]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": req["method"], "scheme": "http", "path": req["path"], "raw_path": req["path"].encode(),
             "query_string": req["query"], "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}

    async def receive() -> dict:
        if not state["sent"]:
            state["sent"] = True
            return {"type": "http.request", "body": req["body"], "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        if msg["type"] == "http.response.start":
            await out.put(("start", msg["status"], [*msg.get("headers", []), *extra_headers]))
        elif msg["type"] == "http.response.body" and msg.get("body"):
            await out.put(("body", bytes(msg["body"])))

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _t: out.put_nowait(None))
    started = False
    try:
        while (item := await out.get()) is not None:
            started = True
            yield item
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            log.error("request %s %s failed: %r", req["method"], req["path"], failure)
        if not started:  # the app raised before answering: the server's 500 shape
            yield ("start", 500, [(b"content-type", b"application/json"), *extra_headers])
            yield ("body", _error_json(500, f"internal server error: {type(failure).__name__}"))
    finally:
        gone.set()  # the app's disconnect checks see it, and cancel the engine's work
        if listeners is not None:
            listeners.by_tag.pop(tag, None)


def _engine_class(max_models: int):
    """The engine deployment's class; ``max_models``: variants a replica reports as held (its
    device slots), the set Ray Serve routes a variant's requests by."""
    from ray import serve

    class Engine:
        async def __init__(self, cfg: ServeConfig, app_name: str = APP_NAME):
            from deltazip.runtime.serve.assembly import build_runtime
            from deltazip.runtime.serve.server import Metrics, create_app

            metrics, self.listeners = Metrics(), Listeners()
            self.rt = await asyncio.to_thread(build_runtime, cfg, EngineReports(metrics, self.listeners))
            self.app = tag_requests(create_app(self.rt, metrics))
            self.rt.engine.start()  # create_app's lifespan is not run: no uvicorn here
            ctx = serve.get_replica_context()
            self.replica = ctx.replica_id.unique_id
            self.log = variant_log(app_name)
            self.applied, self.sync_lock, self.syncing = 0, asyncio.Lock(), None
            await self.sync(None)

        async def info(self) -> dict:
            """The base's name, this replica's id and process, and how many log changes it has applied."""
            return {"base": self.rt.base_name, "replica": self.replica, "applied": self.applied, "pid": os.getpid()}

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def hold(self, name: str) -> str:
            """Multiplexed "model load": start the variant's host load (no-op for unknown names,
            which the app answers with a 404)."""
            if name in self.rt.engine.served:
                self.rt.engine.cache.prefetch([name])
            return name

        async def forward(self, req: dict) -> AsyncIterator[tuple]:
            await self.sync(req.get("version"))
            name = serve.get_multiplexed_model_id()
            if name:
                await self.hold(name)
            async for item in call_asgi(self.app, req, [(REPLICA_HEADER, self.replica.encode())], self.listeners):
                yield item

        async def sync(self, upto: int | None) -> None:
            """Replay the log's changes this replica has not applied (all of them when ``upto`` is
            None, else only if it is behind ``upto``)."""
            if upto is not None and upto <= self.applied:
                return
            async with self.sync_lock:
                for op in await self.log.since.remote(self.applied):
                    await self.replay(op)
                    self.applied += 1

        async def replay(self, op: dict) -> None:
            key = self.rt.config.api_key
            headers = [(b"content-type", b"application/json")]
            if key:
                headers.append((b"authorization", f"Bearer {key}".encode()))
            req = {"method": op["method"], "path": op["path"], "query": b"", "headers": headers,
                   "body": json.dumps(op["body"]).encode() if op["body"] is not None else b""}
            status = None
            async for item in call_asgi(self.app, req, []):
                status = item[1] if item[0] == "start" else status
            # 409/404: this replica made the change itself (it answered the original request).
            log.info("replica %s replayed %s %s: %s", self.replica, op["method"], op["path"], status)

        async def check_health(self) -> None:
            eng = self.rt.engine
            if eng._thread is None or not eng._thread.is_alive():
                raise RuntimeError("the engine thread is not running")
            if self.syncing is None or self.syncing.done():  # an idle replica catches up here
                self.syncing = asyncio.create_task(self.sync(None))

        def __del__(self):
            rt = getattr(self, "rt", None)
            if rt is not None:
                rt.engine.shutdown()

    return Engine


# --------------------------------------------------------------------------------------------------
# Ingress
# --------------------------------------------------------------------------------------------------


def _error_json(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}}).encode()


def admin_op(method: str, path: str, body: bytes, status: int, answer: bytes) -> dict | None:
    """The log entry of a ``/v1/variants`` change that succeeded, else None."""
    if not 200 <= status < 300:
        return None
    if method == "POST" and path.rstrip("/") == "/v1/variants":
        sent = json.loads(body)
        return {"method": "POST", "path": "/v1/variants",
                "body": {"path": sent["path"], "name": json.loads(answer).get("id", sent.get("name"))}}
    if method == "DELETE" and path.startswith("/v1/variants/"):
        return {"method": "DELETE", "path": path, "body": None}
    return None


class Ingress:
    """Forwards every HTTP request to an engine replica (see the module docstring)."""

    def __init__(self, engine, app_name: str = APP_NAME, max_body: int = DEFAULT_MAX_REQUEST_BYTES):
        self.engine = engine
        self.max_body = max_body  # --max-request-bytes: larger bodies get a 413 here, never reach a replica
        self.log = variant_log(app_name)
        self.version: int | None = None
        self.base: str | None = None
        self.admin_lock = asyncio.Lock()
        self.faults = {"resubmitted": 0, "refused": 0, "stream_errors": 0}  # what replica deaths did to requests

    async def fault_counts(self) -> dict:
        """``{"resubmitted", "refused", "stream_errors"}``: requests whose replica died, by outcome."""
        return dict(self.faults)

    async def __call__(self, request):
        from ray.exceptions import RayActorError
        from starlette.responses import Response

        if self.version is None:  # first request (or a restarted ingress): where the log stands
            version = await self.log.version.remote()
            base = (await self.engine.info.remote())["base"]
            # both at once: a request arriving during the awaits must not see a version without its base
            self.base, self.version = base, version
        try:
            body = await read_body(request, self.max_body)
        except ApiError as e:
            return Response(json.dumps(error_body(e.status, e.message, e.type, e.param, e.code)).encode(),
                            status_code=e.status, media_type="application/json")
        method, path = request.method, request.url.path
        req = {"method": method, "path": path, "query": request.url.query.encode(), "body": body,
               "headers": [(k.encode(), v.encode()) for k, v in request.headers.items()], "version": self.version}
        model = generation_model(method, path, body)
        variant = model if model and model != self.base else ""  # base requests: any replica
        admin = path.startswith("/v1/variants") and method in ("POST", "DELETE")
        stream, replay = traits(body) if model else (False, True)  # other routes: idempotent, never streamed
        try:
            async with self.admin_lock if admin else contextlib.nullcontext():  # changes: one at a time, in order
                opened = await self._open(req, variant, stream, replay)
                if isinstance(opened, Response):
                    return opened  # its replica died, and it is not resubmitted
                start, chunks, gen = opened
                answer = b"".join(chunks)
                if admin and (op := admin_op(method, path, body, start[1], answer)) is not None:
                    self.version = await self.log.append.remote(op)
        except RayActorError as e:
            return Response(_error_json(503, f"no engine replica could take the request ({type(e).__name__}); "
                                             "retry later"), status_code=503, media_type="application/json")
        if gen is None:
            return self._response(start, Response(answer, status_code=start[1]))

        async def close():  # the client went away (or we are done): the replica's app sees a disconnect
            gen.cancel()

        return self._response(start, closing_stream(self._relay(gen, chunks), close, status_code=start[1]))

    @staticmethod
    def _response(start: tuple, resp):
        resp.raw_headers = [(k, v) for k, v in start[2] if k.lower() != b"content-length"] + \
            [(k, v) for k, v in resp.raw_headers if k.lower() == b"content-length"]
        return resp

    async def _open(self, req: dict, variant: str, stream: bool, replay: bool):
        """Send ``req`` to a replica and read its answer up to where it may go to the client:
        ``(start, chunks, None)``, the whole answer; ``(start, chunks, rest)`` for a stream whose
        first token has come; or, when its replica died and ``after_death`` says so, a 503 with
        ``Retry-After``. Otherwise a request whose replica died is sent to another one, once."""
        from ray.exceptions import RayActorError

        resubmitted = False
        while True:
            gen = self.engine.options(stream=True, multiplexed_model_id=variant).forward.remote(req)
            state, start, chunks = "queued", None, []
            try:
                async for item in gen:
                    if item[0] == "state":
                        state = max(state, item[1], key=RANK.__getitem__)
                    elif item[0] == "start":
                        start = item
                    else:
                        chunks.append(item[1])
                        if RANK[state] >= RANK["generating"] and _is_sse(start):
                            return start, chunks, gen
                return start, chunks, None
            except RayActorError as e:
                gen.cancel()
                if after_death(stream, state, replay, resubmitted) != "resubmit":
                    self.faults["refused"] += 1
                    return _refusal(resubmitted)
                log.warning("an engine replica died before answering %s %s (%s, %s); resubmitted", req["method"],
                            req["path"], state, type(e).__name__)
                resubmitted = True
                self.faults["resubmitted"] += 1

    async def _relay(self, gen, chunks: list[bytes]) -> AsyncIterator[bytes]:
        """A stream's held-back chunks, then the rest; its replica dying now ends it with an error
        event and ``[DONE]``."""
        from ray.exceptions import RayActorError

        events = SseEvents()
        try:
            for chunk in chunks:
                if out := events.feed(chunk):
                    yield out
            async for item in gen:
                if item[0] == "body" and (out := events.feed(item[1])):
                    yield out
            if events.tail:
                yield events.tail
        except RayActorError as e:
            if events.done:  # the whole answer went out; the replica died after it
                return
            log.warning("an engine replica died while streaming an answer: %s", type(e).__name__)
            self.faults["stream_errors"] += 1
            yield stream_error("the engine replica serving this request died mid-stream; the answer is incomplete")


def _is_sse(start: tuple | None) -> bool:
    return start is not None and any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                     for k, v in start[2])


def _refusal(resubmitted: bool):
    from starlette.responses import Response

    why = ("its second replica died too" if resubmitted else
           "it had started generating, and a sampled request (temperature > 0, no seed) is not rerun")
    body = json.dumps({"error": {"message": f"the engine replica handling this request died; {why}; retry it",
                                 "type": "server_error", "param": None, "code": "worker_failed"}}).encode()
    return Response(body, status_code=503, media_type="application/json", headers={"Retry-After": "1"})


# --------------------------------------------------------------------------------------------------
# The application and the command
# --------------------------------------------------------------------------------------------------


def build_app(cfg: ServeConfig, opts: RayOptions, num_gpus: float = 0.0, app_name: str = APP_NAME):
    """The Ray Serve application (``serve.run(build_app(...), route_prefix="/")``)."""
    from ray import serve

    engine = serve.deployment(
        _engine_class(cfg.max_deltas), name="Engine", **opts.scaling(cfg),
        # The engine queues and batches; Serve only bounds what it sends one replica (queue + batch).
        max_ongoing_requests=cfg.max_queue + cfg.max_num_seqs, health_check_period_s=HEALTH_PERIOD_S,
        ray_actor_options={"num_cpus": 1, "num_gpus": num_gpus},
    ).bind(cfg, app_name)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, app_name, cfg.max_request_bytes)


def app_builder(args: dict):
    """``serve run deltazip.runtime.cluster.ray_app:app_builder artifacts=DIR [replicas=N | min_replicas=A
    max_replicas=B] [KEY=VALUE of ServeConfig...]`` (and a KubeRay RayService's ``import_path``)."""
    args = dict(args)
    opts = RayOptions(**{k: int(args.pop(k)) for k in ("replicas", "min_replicas", "max_replicas") if k in args})
    fields = ServeConfig.__dataclass_fields__
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise InputError(f"unknown application args {unknown}; use ServeConfig's fields (artifacts, base, max_deltas...)")

    def typed(k: str, v):  # args from a YAML config arrive as strings (or YAML scalars)
        kind = fields[k].type
        if kind == "bool":
            return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
        return int(v) if kind in ("int", "int | None") and v is not None else v

    cfg = ServeConfig(**{k: typed(k, v) for k, v in args.items()})
    return build_app(cfg, opts, num_gpus=1.0 if cfg.device.startswith("cuda") else 0.0)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A one-line InputError when ``host:port`` (or ``ray://host:port``) does not accept connections."""
    hostport = address.removeprefix("ray://")
    if address == "auto" or ":" not in hostport:
        return
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as e:
        raise InputError(f"--ray-address {address} cannot be reached ({e}); start the head with `ray start --head` "
                         f"and pass its address, or drop --ray-address for a local cluster") from None


def connect(opts: RayOptions) -> bool:
    """Join the cluster at ``opts.address``, or start a local one; True when one was started here."""
    import ray

    if opts.address is None:
        # Logical CPUs: one per engine replica; the ingress and the log actor take none.
        ray.init(num_cpus=opts.most_replicas + 1, include_dashboard=False, namespace="deltazip",
                 logging_level=logging.WARNING)
        return True
    check_reachable(opts.address)
    try:
        ray.init(address=opts.address, namespace="deltazip", logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise InputError(f"--ray-address {opts.address}: cannot join the Ray cluster ({str(e).splitlines()[0]}); "
                         f"check the head's address (`ray status` on it)") from None
    return False


def replica_gpus(cfg: ServeConfig) -> float:
    """One GPU per replica when the replicas compute on CUDA (``--device cuda``, or ``auto`` on a
    cluster that has GPUs)."""
    import ray

    if cfg.device.startswith("cuda"):
        return 1.0
    return 1.0 if cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def deploy(cfg: ServeConfig, opts: RayOptions, app_name: str = APP_NAME) -> None:
    """Start Serve's HTTP proxy on ``cfg.host:cfg.port`` and run the application (returns when every
    replica is up). Needs a connected Ray (``connect``)."""
    from ray import serve

    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    try:
        serve.run(build_app(cfg, opts, replica_gpus(cfg), app_name), name=app_name, route_prefix="/")
    except RuntimeError as e:  # a replica that cannot start (its error is in the message)
        raise InputError(f"the Ray Serve application did not start: {str(e).strip().splitlines()[-1]}") from None


def serve_forever(cfg: ServeConfig, opts: RayOptions, on_ready=None) -> None:
    """``deltazip serve --ray``: check the input, connect (or start a local cluster), deploy, and
    serve until SIGINT/SIGTERM, then delete the application and stop a cluster started here.

    Args:
        on_ready: ``(cfg) -> None``, called once every replica is up (``cfg.port``: the bound port).
    """
    import signal
    import threading

    from deltazip.runtime.serve.assembly import startup_variants
    from deltazip.runtime.serve.listen import bind_listen_socket
    from deltazip.runtime.serve.model import open_served_base

    require_ray()
    # Bad artifacts (among those read at start-up) and a busy port are one line now, not a replica's
    # traceback once Ray is up. On a remote cluster the proxy binds on the head node, whose ports this
    # machine cannot check.
    open_served_base(startup_variants(cfg)[0], cfg.base)
    if opts.address is None:
        with bind_listen_socket(cfg.host, cfg.port) as sock:
            cfg.port = sock.getsockname()[1]  # --port 0: a free one (Serve's proxy needs a number)
    started = connect(opts)  # raises (one line) before anything needs undoing
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        deploy(cfg, opts)
        if on_ready is not None:
            on_ready(cfg)
        while not stop.wait(0.5):
            pass
    finally:
        shutdown(started)
        for s, handler in previous.items():
            signal.signal(s, handler)


def shutdown(started_here: bool, app_name: str = APP_NAME) -> None:
    """Delete the application (and its log actor); stop the local cluster if this process started it."""
    import ray
    from ray import serve

    try:
        if started_here:
            serve.shutdown()
        else:  # a shared cluster: remove only what this command deployed
            serve.delete(app_name)
        ray.kill(ray.get_actor(f"deltazip-variant-log-{app_name}", namespace="serve"))
    except (ValueError, RuntimeError):
        pass  # never deployed, or already gone
    finally:
        ray.shutdown()
