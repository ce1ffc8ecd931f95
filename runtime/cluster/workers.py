"""``deltazip serve --workers K``: one weight owner, K engine workers, one HTTP front.

Processes (all on one machine, all started by the supervisor):

- **supervisor** — the ``deltazip serve`` process (in tests, the test process through
  :class:`WorkerPool`). It starts the owner and the workers, restarts a worker that dies, and runs
  the front. It holds no model weights.
- **owner** — ``python -m deltazip.runtime.share.weight_share``: exports the base weights once into a
  sealed memfd (CPU) or one CUDA slab (see :mod:`deltazip.runtime.share.weight_share`) and hands them to
  every worker that attaches. It imports no torch on CPU, so it costs ~30 MiB besides the weights.
- **worker i** — ``python -m deltazip.runtime.cluster.workers``: attaches to the owner, builds the usual
  runtime (:func:`deltazip.runtime.serve.assembly.build_runtime`: engine, tokenizers, variants) over the
  mapped weights, and serves the usual app (:func:`deltazip.runtime.serve.server.create_app`) on a
  loopback port of its own, which it reports to the supervisor on a pipe; the same pipe then carries
  its engine's progress reports (:mod:`deltazip.runtime.cluster.progress`).
- **standby** — the same command with ``--standby``: it does a worker's imports (torch, transformers,
  the base's model class: most of a worker's start-up), then waits on stdin for the slot of a worker
  that died, and is ready about a second later instead of several. A new standby is started once no
  worker is starting.

Every child reads a pipe from the supervisor on stdin; when the supervisor goes away (even
SIGKILLed) the pipe closes and the child shuts down, so no orphan keeps running. Children run in
their own session, so a Ctrl-C in the terminal reaches only the supervisor, which then stops the
workers first (they may still be using the owner's CUDA slab) and the owner last.

**Front: one HTTP port, a small reverse proxy in the supervisor** (``--host``/``--port``), not one
public port per worker. Why: clients get one OpenAI ``base_url``; the proxy knows how many requests
each worker has open and which variants it sent where — kernel balancing (``SO_REUSEPORT``) hashes
connections and pins a keep-alive client to one worker; and only the proxy can turn a worker's death
into an OpenAI-shaped error for exactly the requests that were on it.

**Routing: variant affinity, then least busy.** Every worker loads a variant into its own device
slots, so spreading one variant's requests over K workers pays its load K times and holds it K
times. A generation request for a variant goes to a worker that got that variant's earlier requests
(its *home*: the variant is likely still in its slots or host tier) while the home has fewer than
``--max-num-seqs`` requests open (capacity); otherwise to the least busy worker (ties round-robin),
which becomes a home too. In delta mode the base model needs no slot, so its requests always go to
the least busy worker (in swap mode it is routed like a variant). A worker that dies loses its homes. The response header
``x-deltazip-worker`` names the worker; ``deltazip_front_routed_total{how="affinity"|"least_busy"}``
counts the choices.

Failures (:mod:`deltazip.runtime.cluster.failover`): the front holds each answer back until it may go
to the client (a non-streamed one whole, a stream from its first token). A request that cannot
connect to its worker is sent to another one. When a worker dies, each of its requests that sent
nothing to the client is resubmitted once to a live worker (a non-streamed one that had started
generating only if greedy or seeded, else ``503`` with ``Retry-After``); a stream that had started
ends with ``data: {"error": ...}`` and ``data: [DONE]``. No worker ready: ``503`` (``code:
"no_worker"``). The supervisor restarts a dead worker after ``restart_backoff``, doubled for each
death in a row within ``QUICK_DEATH_S`` of a start (capped at ``BACKOFF_CAP_S``), and logs its exit
code or signal and the last line of its stderr (which it copies to its own).

The cost is one local hop per request (well under a millisecond, next to tens of milliseconds per
generated token). SSE passes through chunk by chunk; a client that disconnects closes the
upstream connection, which cancels the request in the worker.

Endpoints on the front: ``/v1/*`` is proxied (auth is checked by the workers, which all have the
key); ``/v1/models`` answers from any worker (all serve the same models). ``POST/DELETE
/v1/variants...`` (live variant management) is sent to every ready worker and replayed on a worker
that restarts, so all workers keep the same set. ``/health`` is the front's own: ``200`` with
per-worker state and faults while at least one worker is ready (``status: degraded`` when not all
are), ``503`` otherwise. ``/metrics`` is **per worker**: every worker's series with a
``worker="i"`` label added (sum them in PromQL for totals; summing here would hide a slow or
restarting worker), plus the front's own ``deltazip_worker_up``, ``deltazip_worker_restarts_total``,
``deltazip_worker_deaths_total``, ``deltazip_worker_outstanding``, ``deltazip_front_requests{state}``,
``deltazip_front_resubmitted_total`` and ``deltazip_front_errors_total``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from deltazip.formats.errors import DeltazipError, InputError
from deltazip.runtime.cluster.failover import HOP_HEADERS as _HOP_HEADERS
from deltazip.runtime.cluster.failover import FailoverProxy, Flights
from deltazip.runtime.cluster.progress import RANK, TAG_HEADER, read_report

log = logging.getLogger("deltazip.workers")
QUICK_DEATH_S = 60.0  # a worker dying within this long of its start is in a crash loop: back off
BACKOFF_CAP_S = 30.0  # the longest wait before restarting a worker


class WorkerStartError(DeltazipError, RuntimeError):
    """The owner or a worker did not come up."""


def _config_json(cfg) -> str:
    d = asdict(cfg)
    d["artifacts"] = str(d["artifacts"])
    d["chat_template"] = None if d["chat_template"] is None else str(d["chat_template"])
    # Workers listen on loopback only (the front is the public side) and are single-process.
    d.update(host="127.0.0.1", port=0, workers=1)
    return json.dumps(d)


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Children import deltazip the way this process does (an editable install or a checkout on sys.path).
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
    env.update(extra or {})
    return env


# --------------------------------------------------------------------------------------------------
# Supervisor
# --------------------------------------------------------------------------------------------------


@dataclass
class WorkerState:
    """One worker slot as the supervisor and the front see it.

    state: ``starting`` | ``ready`` | ``dead`` | ``stopped``; outstanding: requests the front has
    open on it; restarts: times this slot was restarted after a death; deaths: times its process
    died; streak: deaths in a row that came within ``QUICK_DEATH_S`` of a start (the backoff's
    exponent); last_death: ``{"code", "signal", "stderr", "at"}`` of the latest.
    """

    index: int
    state: str = "stopped"
    proc: subprocess.Popen | None = None
    pid: int | None = None
    port: int | None = None
    outstanding: int = 0
    restarts: int = 0
    started_at: float = 0.0
    ready_seconds: float | None = None
    report: dict[str, Any] = field(default_factory=dict)
    restart_at: float = 0.0
    deaths: int = 0
    streak: int = 0
    last_death: dict[str, Any] | None = None
    _ready_r: int | None = None  # the worker's pipe: its ready line, then its progress reports
    _buf: bytes = b""
    _stderr_pump: threading.Thread | None = None
    _tail: dict[str, str] = field(default_factory=lambda: {"line": ""})  # its stderr's last line (the pump's)

    @property
    def last_stderr(self) -> str:
        return self._tail["line"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class WorkerPool:
    """The owner + K workers + the front, as one context manager.

    Args:
        cfg: a :class:`deltazip.runtime.serve.assembly.ServeConfig`; ``cfg.workers`` workers are started
            (overridden by ``workers``); the front binds ``cfg.host:cfg.port`` (port 0: any free).
        workers: number of workers (default ``cfg.workers``).
        share: False starts each worker loading its own weights (no owner) — the "K independent
            servers" baseline of the tests and bench/share.py, same code otherwise.
        front: run the front in a background thread on enter (tests); ``deltazip serve`` runs it in
            the foreground instead (:func:`serve_workers`).
        start_timeout: seconds for the owner and each worker to become ready.
        restart_backoff: delay before restarting a dead worker; it doubles with each death in a row
            that came within ``QUICK_DEATH_S`` of the worker's start, up to ``BACKOFF_CAP_S``.
        env: extra environment for the children (e.g. ``OMP_NUM_THREADS``).
        standby: keep one spare process that has done a worker's imports (torch, transformers, the
            base's model class: most of a worker's start-up) and waits for a slot; a dead worker is
            replaced by it, ready in about a second instead of several.
    """

    def __init__(self, cfg, workers: int | None = None, *, share: bool = True, front: bool = True,
                 start_timeout: float = 300.0, restart_backoff: float = 0.5, env: dict[str, str] | None = None,
                 standby: bool = True):
        self.cfg = cfg
        self.k = workers if workers is not None else cfg.workers
        if self.k < 1:
            raise InputError(f"--workers must be >= 1, got {self.k}")
        self.share, self.front_enabled = share, front
        self.start_timeout, self.restart_backoff = start_timeout, restart_backoff
        self.env = env or {}
        self.address = f"deltazip-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.workers = [WorkerState(i) for i in range(self.k)]
        self.owner: subprocess.Popen | None = None
        self.owner_report: dict[str, Any] = {}
        self.lock = threading.RLock()
        self.closing = threading.Event()
        self.replay: list[dict[str, Any]] = []  # successful variant registrations, for restarted workers
        self._monitor: threading.Thread | None = None
        self._front = None
        self._rr = 0
        self.errors: dict[str, int] = {}
        self.homes: dict[str, list[int]] = {}  # variant -> workers that served it (affinity routing)
        self.capacity = cfg.max_num_seqs  # open requests a home takes before others are considered
        self.routed = {"affinity": 0, "least_busy": 0}
        self.flights = Flights()  # requests in flight through the front, and what deaths did to them
        self.use_standby = standby
        self._standby: WorkerState | None = None  # the spare process (index -1), when up
        self._standby_failures = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> WorkerPool:
        """Validate the inputs here (one-line errors before any process starts), start the owner,
        then the workers; return when all are ready."""
        from deltazip.runtime.serve.assembly import startup_variants
        from deltazip.runtime.serve.model import open_served_base, served_dtype
        from deltazip.runtime.share.weight_share import st_dtype

        # As build_runtime does: the variants read at start-up, corrupt ones refused here in one line
        # (the others are read by each worker on first use).
        variants, _ = startup_variants(self.cfg)
        base = open_served_base(variants, self.cfg.base)
        self.base_dir = base.path
        self.device = self.cfg.torch_device()
        self.dtype = served_dtype(self.cfg.dtype, self.device, base)
        self._config = _config_json(self.cfg)
        try:
            if self.share:
                self._start_owner(st_dtype(self.dtype))
            for w in self.workers:
                self._spawn(w)
            deadline = time.time() + self.start_timeout
            while any(w.state == "starting" for w in self.workers):
                for w in self.workers:
                    self._poll_start(w, initial=True)
                if time.time() > deadline:
                    raise WorkerStartError(f"workers did not become ready within {self.start_timeout:.0f} s")
                time.sleep(0.02)
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="deltazip-supervisor")
        self._monitor.start()
        return self

    def __enter__(self) -> WorkerPool:
        self.start()
        if self.front_enabled:
            from deltazip.runtime.serve.server import ServerThread

            try:
                self._front = ServerThread(self.front_app(), host=self.cfg.host, port=self.cfg.port)
                self._front.__enter__()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def url(self) -> str:
        if self._front is None:
            raise RuntimeError("the front is not running in this pool")
        return self._front.url

    def close(self) -> None:
        """Stop the front, the workers (SIGTERM, then SIGKILL after 10 s), then the owner."""
        self.closing.set()
        if self._front is not None:
            with contextlib.suppress(Exception):
                self._front.__exit__(None, None, None)
            self._front = None
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        spare, self._standby = self._standby, None
        procs = [w.proc for w in [*self.workers, *([spare] if spare else [])] if w.proc is not None]
        for p in procs:
            _terminate(p)
        _reap(procs, 10.0)
        for w in [*self.workers, *([spare] if spare else [])]:
            self._close_pipes(w)
            w.state, w.proc = "stopped", None
        if self.owner is not None:
            _terminate(self.owner)
            _reap([self.owner], 5.0)
            with contextlib.suppress(OSError):
                self.owner.stdout.close()
            self.owner = None

    def pids(self) -> dict[str, Any]:
        """Process ids: ``{"owner": pid | None, "workers": [pid | None, ...], "standby": pid | None}``."""
        spare = self._standby
        return {"owner": self.owner.pid if self.owner else None, "workers": [w.pid for w in self.workers],
                "standby": spare.pid if spare is not None else None}

    # -- owner ----------------------------------------------------------------------------------
    def _start_owner(self, dtype: str) -> None:
        from deltazip.runtime.share.weight_share import fused_runs, strip_expandable_segments

        cmd = [sys.executable, "-m", "deltazip.runtime.share.weight_share", "--base", str(self.base_dir), "--dtype", dtype,
               "--device", str(self.device), "--address", self.address, "--runs-on-stdin"]
        env = _child_env(self.env)
        if self.device.type == "cuda":
            env = strip_expandable_segments(env)
        t0 = time.perf_counter()
        # the tensors transformers fuses on load (MoE experts), each parameter's laid out back to back
        runs = fused_runs(self.base_dir)
        self.owner = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                      start_new_session=True)
        self.owner.stdin.write(json.dumps(runs).encode() + b"\n")
        self.owner.stdin.flush()
        line = _read_line(self.owner.stdout, self.start_timeout)
        try:
            rep = json.loads(line) if line else {}
        except json.JSONDecodeError:
            rep = {}
        if not rep.get("ready"):
            err = rep.get("error") or f"the weight owner exited with code {self.owner.poll()} (see its log above)"
            raise WorkerStartError(f"weight owner: {err}")
        rep["startup_seconds"] = time.perf_counter() - t0
        self.owner_report = rep
        log.info("weight owner pid %s: %d tensors, %.1f MiB shared (%s) in %.2f s", rep["pid"], rep["tensors"],
                 rep["nbytes"] / 2**20, rep["kind"], rep["startup_seconds"])

    # -- workers --------------------------------------------------------------------------------
    def _launch(self, index: int | None) -> WorkerState:
        """A new worker process for slot ``index``, or the standby (None: it does the imports, then
        waits on stdin for its slot). Its stderr is copied to ours by a thread that keeps the last line."""
        child = WorkerState(-1 if index is None else index)
        r, wfd = os.pipe()
        cmd = [sys.executable, "-m", "deltazip.runtime.cluster.workers", "--config", self._config, "--ready-fd", str(wfd),
               "--warm", str(self.base_dir), *(["--index", str(index)] if index is not None else ["--standby"])]
        if self.share:
            cmd += ["--owner", self.address]
        try:
            child.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(wfd,),
                                          env=_child_env(self.env), start_new_session=True)
        finally:
            os.close(wfd)
        os.set_blocking(r, False)
        child._ready_r, child.pid, child.started_at, child.state = r, child.proc.pid, time.perf_counter(), "warming"
        child._stderr_pump = threading.Thread(target=_pump_stderr, args=(child._tail, child.proc.stderr), daemon=True,
                                              name=f"deltazip-worker{child.index}-stderr")
        child._stderr_pump.start()
        return child

    def _spawn(self, w: WorkerState) -> None:
        """Start slot ``w``'s process: the standby when one is up, else a new process."""
        child, self._standby = self._standby, None
        if child is not None and not self._activate(child, w.index):
            child = None
        if child is None:
            child = self._launch(w.index)
        w.proc, w.pid, w._ready_r, w._stderr_pump, w._tail = child.proc, child.pid, child._ready_r, child._stderr_pump, \
            child._tail
        w._buf, w.port, w.state, w.started_at, w.report = b"", None, "starting", time.perf_counter(), {}

    def _activate(self, child: WorkerState, index: int) -> bool:
        """Give the standby slot ``index`` (a line on its stdin); False if it is gone."""
        try:
            if child.alive():
                child.proc.stdin.write(json.dumps({"index": index}).encode() + b"\n")
                child.proc.stdin.flush()
                log.info("worker %d: the standby (pid %s) takes its place", index, child.pid)
                return True
        except OSError:
            pass
        _terminate(child.proc, signal.SIGKILL)
        self._close_pipes(child)
        return False

    def _keep_standby(self) -> None:
        """Start a standby when none is up and no worker is starting (they would share the CPUs);
        after three standbys died unasked, stop (their stderr says why)."""
        spare = self._standby
        if spare is not None and spare.state != "warm":
            _read_pipe(spare)
            if b"\n" in spare._buf:  # its imports are done: it would be ready in about a second
                spare.state = "warm"
        if spare is not None and not spare.alive():
            self._standby, self._standby_failures = None, self._standby_failures + 1
            self._close_pipes(spare)
            log.warning("the standby worker (pid %s) died with code %s; last stderr line: %r", spare.pid,
                        spare.proc.returncode, spare.last_stderr)
        if (self.use_standby and self._standby is None and self._standby_failures < 3 and not self.closing.is_set()
                and not any(w.state == "starting" for w in self.workers)):
            self._standby = self._launch(None)

    def _poll_start(self, w: WorkerState, initial: bool = False) -> None:
        """Advance a starting worker: read its ready line, or notice it died."""
        if w.state != "starting":
            return
        _read_pipe(w)
        while b"\n" in w._buf:
            line, w._buf = w._buf.split(b"\n", 1)
            rep = json.loads(line)  # the rest of the pipe carries its progress reports
            if "port" not in rep:  # a standby's "warm" line, from before it took this slot
                continue
            if self.replay and not initial:
                self._replay_to(w, rep["port"])
            with self.lock:
                w.port, w.report, w.state = rep["port"], rep, "ready"
                w.ready_seconds = time.perf_counter() - w.started_at
            log.info("worker %d ready: pid %s port %s (%.2f s%s, weights %s)", w.index, w.pid, w.port, w.ready_seconds,
                     ", from the standby" if rep.get("standby") else "", rep.get("weights"))
            return
        code = w.proc.poll() if w.proc else None
        if code is not None:
            if initial:
                raise WorkerStartError(f"worker {w.index} exited with code {code} during start-up: "
                                       f"{w.last_stderr or '(see its log above)'}")
            self._mark_dead(w, code)
        elif time.perf_counter() - w.started_at > self.start_timeout:
            if initial:
                raise WorkerStartError(f"worker {w.index} did not become ready within {self.start_timeout:.0f} s")
            log.warning("worker %d did not become ready in time; killing it", w.index)
            _terminate(w.proc, signal.SIGKILL)

    def _mark_dead(self, w: WorkerState, code: int | None) -> None:
        if w._stderr_pump is not None:  # its last words: the pipe is closed, the pump ends soon
            w._stderr_pump.join(timeout=1)
        now = time.perf_counter()
        with self.lock:
            self._drain(w)  # every report it wrote before dying, before its pipe is closed
            self._close_pipes(w)
            # A worker dying soon after its start is likely to die again: back off exponentially.
            w.streak = w.streak + 1 if now - w.started_at < QUICK_DEATH_S else 0
            delay = min(BACKOFF_CAP_S, self.restart_backoff * 2 ** max(0, w.streak - 1))
            w.state, w.port, w.restart_at = "dead", None, now + delay
            w.deaths += 1
            w.last_death = {"code": code, "signal": _signal_name(code), "stderr": w.last_stderr, "at": time.time()}
            for homes in self.homes.values():  # its slots and host tier are gone with it
                if w.index in homes:
                    homes.remove(w.index)
        if w.proc is not None:
            with contextlib.suppress(Exception):
                w.proc.wait(timeout=1)
        how = f"killed by {w.last_death['signal']}" if w.last_death["signal"] else f"exit code {code}"
        loop = f" ({w.streak} deaths in a row within {QUICK_DEATH_S:.0f} s of a start)" if w.streak > 1 else ""
        log.warning("worker %d (pid %s) died: %s; last stderr line: %r; restarting in %.1f s%s", w.index, w.pid, how,
                    w.last_stderr, delay, loop)

    def _close_pipes(self, w: WorkerState, stdin: bool = True) -> None:
        if w._ready_r is not None:
            with contextlib.suppress(OSError):
                os.close(w._ready_r)
            w._ready_r = None
        if stdin and w.proc is not None and w.proc.stdin is not None:
            with contextlib.suppress(OSError):
                w.proc.stdin.close()

    def _watch(self) -> None:
        """Supervisor loop: notice deaths, restart after the backoff, advance starting workers."""
        while not self.closing.wait(0.05):
            if self.share and self.owner is not None and self.owner.poll() is not None:
                # Running workers keep their mapping (the memfd lives while mapped); new ones need an owner.
                log.warning("the weight owner died (code %s); starting a new one", self.owner.returncode)
                with contextlib.suppress(Exception):
                    from deltazip.runtime.share.weight_share import st_dtype

                    self._start_owner(st_dtype(self.dtype))
            for w in self.workers:
                if self.closing.is_set():
                    return
                if w.state == "ready":
                    with self.lock:
                        self._drain(w)
                if w.state == "ready" and not w.alive():
                    self._mark_dead(w, w.proc.returncode if w.proc else None)
                elif w.state == "starting":
                    with contextlib.suppress(Exception):
                        self._poll_start(w)
                elif w.state == "dead" and time.perf_counter() >= w.restart_at:
                    w.restarts += 1
                    self._spawn(w)
            self._keep_standby()

    # -- routing ----------------------------------------------------------------------------------
    def pick(self, exclude: set[int], model: str | None = None) -> WorkerState | None:
        """The worker for a request for ``model`` (see "Routing" in the module docstring): a home of
        the variant with capacity, else the ready worker with the fewest open requests (ties:
        round-robin); None if no worker is ready. ``exclude``: process ids the request already
        failed on (a restarted worker is a new process, and may take it)."""
        with self.lock:
            ready = [w for w in self.workers if w.state == "ready" and w.pid not in exclude]
            # A SIGKILLed worker is a zombie until the supervisor notices; waitpid here catches it now.
            ready = [w for w in ready if w.alive()]
            if not ready:
                return None
            self._rr += 1
            n = len(self.workers)

            def load(w: WorkerState) -> tuple[int, int]:
                return w.outstanding, (w.index - self._rr) % n

            affine = model is not None and (model != self.base_name_seen(ready) or self.cfg.mode == "swap")
            homes = self.homes.setdefault(model, []) if affine else []
            at_home = [w for w in ready if w.index in homes and w.outstanding < self.capacity]
            best = min(at_home or ready, key=load)
            self.routed["affinity" if at_home else "least_busy"] += 1
            if affine and best.index not in homes:
                homes.append(best.index)
            best.outstanding += 1
            return best

    @staticmethod
    def base_name_seen(ready: list[WorkerState]) -> str | None:
        """The base model's served name, as the workers report it (None before any did)."""
        return next((w.report["base"] for w in ready if w.report.get("base")), None)

    def release(self, w: WorkerState) -> None:
        with self.lock:
            w.outstanding -= 1

    def count_error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    # -- progress reports ---------------------------------------------------------------------------
    def _drain(self, w: WorkerState) -> None:
        """Apply the progress reports waiting in ``w``'s pipe (call with ``self.lock`` held)."""
        if not w.report:  # still starting: its first line is the ready line
            return
        _read_pipe(w)
        *lines, w._buf = w._buf.split(b"\n")
        for line in lines:
            if (r := read_report(line)) is not None:
                self.flights.advance(*r, pid=w.pid)

    def read_reports(self, pid: int | None) -> None:
        """Apply what worker process ``pid`` has reported so far (all of it once the process is dead:
        the pipe keeps it; a worker already marked dead was drained then)."""
        with self.lock:
            for w in self.workers:
                if w.pid == pid:
                    self._drain(w)

    def reported(self, flight, state: str) -> bool:
        """Whether ``flight``'s worker has reported it at ``state`` or later."""
        self.read_reports(flight.pid)
        return RANK[flight.state] >= RANK[state]

    def retry_after(self) -> int:
        """Seconds until a worker is likely ready again (a ``Retry-After``): at least 1."""
        now = time.perf_counter()
        with self.lock:
            waits = [max(0.0, w.restart_at - now) + (w.ready_seconds or 5.0) for w in self.workers if w.state == "dead"]
            waits += [max(0.0, (w.ready_seconds or 5.0) - (now - w.started_at)) for w in self.workers
                      if w.state == "starting"]
        return max(1, round(min(waits))) if waits else 1

    def _replay_to(self, w: WorkerState, port: int) -> None:
        import httpx

        for r in list(self.replay):
            with contextlib.suppress(httpx.HTTPError):
                httpx.request(r["method"], f"http://127.0.0.1:{port}{r['path']}", headers=r["headers"],
                              content=r["body"], timeout=120)

    def health(self) -> dict[str, Any]:
        """``/health``: ``status`` ok | degraded (some worker is not ready) | down (none is), per-worker
        state and faults (deaths, restarts, the last death's code/signal/stderr line, seconds to its
        restart), the front's open requests by state and what deaths did to requests."""
        now, wall = time.perf_counter(), time.time()
        with self.lock:
            ws = [{"index": w.index, "state": w.state, "pid": w.pid, "port": w.port, "outstanding": w.outstanding,
                   "restarts": w.restarts, "deaths": w.deaths,
                   "ready_seconds": None if w.ready_seconds is None else round(w.ready_seconds, 3),
                   "weights": w.report.get("weights"),
                   "variants": sorted(m for m, homes in self.homes.items() if w.index in homes),
                   "last_death": None if w.last_death is None else {
                       **{k: v for k, v in w.last_death.items() if k != "at"},
                       "seconds_ago": round(wall - w.last_death["at"], 1)},
                   "restart_in": round(max(0.0, w.restart_at - now), 1) if w.state == "dead" else None}
                  for w in self.workers]
        n = sum(w["state"] == "ready" for w in ws)
        spare = self._standby
        return {"status": "ok" if n == len(ws) else ("degraded" if n else "down"), "workers_ready": n,
                "workers": ws, "standby": None if spare is None else {"pid": spare.pid, "state": spare.state},
                "worker_deaths": sum(w["deaths"] for w in ws),
                "worker_restarts": sum(w["restarts"] for w in ws), **self.flights.snapshot(),
                "owner": {"pid": self.owner.pid if self.owner else None,
                          "shared_bytes": self.owner_report.get("nbytes")} if self.share else None}

    def front_app(self):
        return create_front(self, self.cfg.max_request_bytes)


def _terminate(p: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
    if p.stdin is not None:
        with contextlib.suppress(OSError):
            p.stdin.close()


def _reap(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _read_pipe(w: WorkerState) -> None:
    """Append what ``w``'s pipe holds now to ``w._buf`` (non-blocking)."""
    if w._ready_r is None:
        return
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(w._ready_r, 65536):
            w._buf += chunk


def _pump_stderr(tail: dict[str, str], stream) -> None:
    """Copy a worker's stderr to ours line by line, keeping its last line in ``tail["line"]`` (for
    the log of its death)."""
    with contextlib.suppress(OSError, ValueError):
        for line in stream:
            with contextlib.suppress(OSError):
                os.write(2, line)
            if text := line.decode("utf-8", "replace").strip():
                tail["line"] = text[-500:]
    with contextlib.suppress(OSError):
        stream.close()


def _signal_name(code: int | None) -> str | None:
    """``"SIGKILL"`` for a process killed by a signal (Popen's code ``-9``), else None."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _read_line(stream, timeout: float) -> bytes:
    """One line from a child's stdout, or b"" on timeout / EOF."""
    deadline, buf = time.time() + timeout, b""
    fd = stream.fileno()
    while time.time() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                return buf
            buf += chunk
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0]
    return buf


# --------------------------------------------------------------------------------------------------
# Front
# --------------------------------------------------------------------------------------------------


def _error(status: int, message: str, type_: str = "server_error", code: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}},
                        status_code=status)


def create_front(pool: WorkerPool, max_body: int | None = None):
    """The front's Starlette app: proxy ``/v1/*`` to the workers, answer ``/health`` and ``/metrics``;
    request bodies over ``max_body`` bytes (default: ``--max-request-bytes``'s) get a 413 here."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    front = _Front(pool, max_body)
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/health", front.health), Route("/metrics", front.metrics),
                             Route("/{path:path}", front.proxy, methods=methods)], lifespan=front.lifespan)


class _Front:
    """The front's handlers over one pool and one pooled HTTP client (created by the lifespan)."""

    def __init__(self, pool: WorkerPool, max_body: int | None = None):
        from deltazip.runtime.serve.openai_schema import DEFAULT_MAX_REQUEST_BYTES

        self.pool = pool
        self.max_body = DEFAULT_MAX_REQUEST_BYTES if max_body is None else max_body
        self.client = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        import httpx

        # No read timeout: a long generation may take minutes; connects are local and quick. Idle
        # connections are dropped well before the workers' uvicorn closes them (5 s), so a request
        # never races a worker closing the connection it is sent on.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                            keepalive_expiry=2.0))
        try:
            yield
        finally:
            await self.client.aclose()

    async def health(self, _request):
        from starlette.responses import JSONResponse

        h = self.pool.health()
        return JSONResponse(h, status_code=200 if h["workers_ready"] else 503)

    async def metrics(self, _request):
        from starlette.responses import Response

        body = await _gather_metrics(self.pool, self.client)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def proxy(self, request):
        from deltazip.runtime.serve.openai_schema import TOKENIZER_PATHS, ApiError, read_body

        path = request.url.path
        if not path.startswith("/v1") and path not in TOKENIZER_PATHS:
            return _error(404, f"no route {path}; the API is under /v1", "invalid_request_error", "not_found")

        try:  # the front refuses an oversized body too, before reading it whole (issue 25)
            body = await read_body(request, self.max_body)
        except ApiError as e:
            return _error(e.status, e.message, e.type, e.code)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS | {TAG_HEADER}]
        target = path + (f"?{request.url.query}" if request.url.query else "")
        if path.startswith("/v1/variants") and request.method in ("POST", "PUT", "DELETE", "PATCH"):
            return await _broadcast(self.pool, self.client, request.method, target, headers, body)
        return await FailoverProxy(self.pool, self.client).forward(request.method, target, headers, body,
                                                                   _model_of(request.method, path, body))


def _model_of(method: str, path: str, body: bytes) -> str | None:
    from deltazip.runtime.serve.openai_schema import generation_model

    return generation_model(method, path, body)


async def _broadcast(pool: WorkerPool, client, method: str, target: str, headers, body: bytes):
    """Send a variant-management call to every ready worker; remember it for restarted workers."""
    from starlette.responses import Response

    with pool.lock:
        ready = [w for w in pool.workers if w.state == "ready" and w.alive()]
    if not ready:
        return _error(503, "no server worker is ready (restarting); retry shortly", code="no_worker")
    results = await asyncio.gather(*(client.request(method, w.url + target, headers=headers, content=body)
                                     for w in ready), return_exceptions=True)
    statuses = {r.status_code if not isinstance(r, Exception) else None for r in results}
    if len(statuses) != 1 or None in statuses:
        return _error(502, f"the server workers disagreed on {method} {target} (statuses "
                           f"{sorted(str(s) for s in statuses)}); check GET /v1/variants", code="workers_disagree")
    first = results[0]
    if 200 <= first.status_code < 300:
        with pool.lock:
            pool.replay.append({"method": method, "path": target, "headers": dict(headers), "body": body})
    keep = {k: v for k, v in first.headers.items() if k.lower() not in _HOP_HEADERS}
    return Response(first.content, status_code=first.status_code, headers=keep)


async def _gather_metrics(pool: WorkerPool, client) -> bytes:
    """Every ready worker's Prometheus series with ``worker="i"`` added, plus the front's own."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.parser import text_string_to_metric_families

    with pool.lock:
        ready = [w for w in pool.workers if w.state == "ready"]

    async def one(w):
        try:
            r = await client.get(w.url + "/metrics", timeout=10)
            return w.index, r.text if r.status_code == 200 else ""
        except Exception:  # a worker dying while scraped: it is simply absent from this scrape
            return w.index, ""

    texts = await asyncio.gather(*(one(w) for w in ready))
    families: dict[str, Metric] = {}
    for index, text in texts:
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                merged.samples.append(s._replace(labels={"worker": str(index), **s.labels}))
    health = pool.health()
    up = GaugeMetricFamily("deltazip_worker_up", "1 when the worker serves requests", labels=["worker"])
    out = GaugeMetricFamily("deltazip_worker_outstanding", "Requests the front has open on a worker",
                            labels=["worker"])
    restarts = CounterMetricFamily("deltazip_worker_restarts", "Worker restarts after a death", labels=["worker"])
    deaths = CounterMetricFamily("deltazip_worker_deaths", "Worker processes that died", labels=["worker"])
    for w in health["workers"]:
        up.add_metric([str(w["index"])], 1.0 if w["state"] == "ready" else 0.0)
        out.add_metric([str(w["index"])], w["outstanding"])
        restarts.add_metric([str(w["index"])], w["restarts"])
        deaths.add_metric([str(w["index"])], w["deaths"])
    states = GaugeMetricFamily("deltazip_front_requests", "Requests open at the front, by state (queued, "
                               "prefilling, generating: nothing sent yet; answering)", labels=["state"])
    for state, n in health["requests"].items():
        states.add_metric([state], n)
    resubmitted = CounterMetricFamily("deltazip_front_resubmitted", "Requests sent to another worker after "
                                      "theirs died before answering", value=health["resubmitted"])
    errors = CounterMetricFamily("deltazip_front_errors", "Requests the front failed, by cause", labels=["cause"])
    routed = CounterMetricFamily("deltazip_front_routed", "Requests routed to a worker, by how it was chosen "
                                 "(affinity: a home of the variant; least_busy)", labels=["how"])
    with pool.lock:
        for cause, n in sorted(pool.errors.items()):
            errors.add_metric([cause], n)
        for how, n in sorted(pool.routed.items()):
            routed.add_metric([how], n)

    class _Collector:
        def collect(self):
            yield from families.values()
            yield from (up, out, restarts, deaths, states, resubmitted, errors, routed)

    reg = CollectorRegistry()
    reg.register(_Collector())
    return generate_latest(reg)


def serve_workers(cfg, on_ready=None, sock=None) -> None:
    """``deltazip serve --workers K`` in the foreground: pool + front until SIGINT/SIGTERM.

    ``on_ready(pool)`` runs once the owner and every worker are up, before the front serves.
    ``sock``: the front's socket, already bound and listening (default: uvicorn binds the port).
    """
    import uvicorn

    pool = WorkerPool(cfg, front=False)
    pool.start()
    try:
        if on_ready is not None:
            on_ready(pool)
        config = uvicorn.Config(pool.front_app(), host=cfg.host, port=cfg.port, lifespan="on",
                                timeout_graceful_shutdown=5,
                                log_level=os.environ.get("DELTAZIP_LOG_LEVEL", "info").lower())
        uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)
    finally:
        pool.close()


# --------------------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------------------


def worker_main(argv: list[str] | None = None) -> int:
    """``python -m deltazip.runtime.cluster.workers --config JSON (--index I | --standby) --ready-fd N
    [--owner ADDRESS] [--warm BASE_DIR]``

    ``--standby``: do the imports (and the base's model class, from ``--warm``), then wait for
    ``{"index": I}`` on stdin and become worker I (EOF first: exit).
    """
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description="deltazip serve worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--index", type=int, default=None)
    ap.add_argument("--standby", action="store_true")
    ap.add_argument("--ready-fd", type=int, required=True)
    ap.add_argument("--owner", default=None)
    ap.add_argument("--warm", default=None)
    a = ap.parse_args(argv)
    if (a.index is None) != a.standby:
        ap.error("give exactly one of --index and --standby")
    _warm_up(a.warm)
    t_imported = time.perf_counter()
    if a.standby:
        os.write(a.ready_fd, b'{"standby": "warm"}\n')
        line = sys.stdin.buffer.readline()
        if not line:
            return 0
        a.index = int(json.loads(line)["index"])
        t_start = time.perf_counter()  # its start-up, as a worker, begins now
    logging.basicConfig(level=os.environ.get("DELTAZIP_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(asctime)s worker{a.index} %(name)s %(levelname)s %(message)s")
    _serve_worker(a, {"standby": a.standby, "import_s": round(max(0.0, t_imported - t_start), 3)}, t_start)
    return 0


def _warm_up(base_dir: str | None) -> None:
    """The imports a worker needs, and transformers' lazy ones for the base's model class (most of
    a worker's start-up: seconds, against well under one to build the runtime after them)."""
    import uvicorn  # noqa: F401

    from deltazip.runtime.cluster import progress  # noqa: F401
    from deltazip.runtime.serve import assembly, server  # noqa: F401
    from deltazip.runtime.share import weight_share  # noqa: F401

    if base_dir:
        with contextlib.suppress(Exception):  # only a warm-up: build_runtime reports any real problem
            from transformers import AutoConfig

            from deltazip.models.loader import causal_lm_class

            causal_lm_class(AutoConfig.from_pretrained(base_dir))


def _serve_worker(a, rep: dict[str, Any], t_start: float) -> None:
    """Attach to the owner, build the runtime, serve on a loopback port; the ready line (with
    ``rep``'s timings) goes to the supervisor's pipe, then the engine's progress reports."""
    import socket

    import uvicorn

    from deltazip.runtime.cluster.progress import EngineReports, report_line, tag_requests
    from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
    from deltazip.runtime.serve.server import Metrics, create_app
    from deltazip.runtime.share import weight_share

    cfg = ServeConfig(**json.loads(a.config))
    rep["attach_s"] = None
    if a.owner:
        shared = weight_share.attach(a.owner)
        weight_share.install(shared)
        rep["attach_s"] = shared.attach_seconds
    metrics = Metrics()
    t0 = time.perf_counter()
    # After the ready line the pipe carries the engine's progress reports (blocking writes of a few
    # bytes: the supervisor reads it continually, and a report must be in the pipe before the
    # forward or token it announces).
    rt = build_runtime(cfg, observer=EngineReports(metrics, lambda tag, state: os.write(a.ready_fd,
                                                                                         report_line(tag, state))))
    rep["build_runtime_s"] = round(time.perf_counter() - t0, 3)
    app = tag_requests(create_app(rt, metrics))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=os.environ.get("DELTAZIP_LOG_LEVEL", "warning").lower(),
                                           lifespan="on", timeout_graceful_shutdown=5))

    def announce():
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.01)
        rep.update(port=sock.getsockname()[1], pid=os.getpid(), weights="mapped" if a.owner else "loaded",
                   base=rt.base_name, ready_s=round(time.perf_counter() - t_start, 3))
        os.write(a.ready_fd, (json.dumps(rep) + "\n").encode())

    def watch_supervisor():
        # stdin is a pipe from the supervisor: EOF means it is gone (or wants us gone).
        with contextlib.suppress(Exception):
            while sys.stdin.buffer.read(4096):
                pass
        server.should_exit = True

    threading.Thread(target=announce, daemon=True, name="worker-announce").start()
    threading.Thread(target=watch_supervisor, daemon=True, name="worker-stdin").start()
    server.run(sockets=[sock])  # main thread: uvicorn turns SIGTERM/SIGINT into a graceful exit


if __name__ == "__main__":
    sys.exit(worker_main())
