"""Iteration-level scheduling with a bound on resident deltas (paper §5.4).

Every engine step calls :meth:`Scheduler.schedule`, which walks the waiting queue first come first
served and admits requests while the step has room (``max_num_seqs`` sequences, ``max_batch_tokens``
tokens: a prompt costs its length, a running or resumed sequence one token):

- the requests of a step belong to at most ``max_deltas`` variants ("selected" deltas, those of the
  running sequences). A request for a variant that is not selected while ``max_deltas`` are is
  *blocked by the delta limit* and the walk goes on past it;
- a request behind a blocked one may **skip the line** only if its variant is already selected. It
  is marked a *line-skipper*, and its *parent* is the earliest-admitted running request of that
  variant that did not skip the line;
- capacity is strict FCFS: the walk stops at the first request that does not fit, so nobody passes
  a request for lack of room;
- **chunked prefill** (``chunked_prefill=True``): a running sequence still in its prompt costs the
  prompt tokens it has left (the engine feeds them in chunks of what the step's budget leaves after
  the decodes), and a request is admitted while at least one token of budget is left, so a prompt
  longer than ``max_batch_tokens`` is served and never stalls the sequences already decoding;
- **preemption**: when a parent finishes (or is cancelled) and its variant would then hold only
  line-skippers while some waiting request is blocked by the delta limit, those line-skippers are
  preempted: back into the queue at their original place (arrival order), keeping their state (the
  engine moves their KV cache to host memory) so they resume without recomputation. Their variant
  leaves the selected set and the oldest blocked request takes its slot. When nobody is blocked,
  or the variant stays selected anyway (other non-skippers still run), the line-skippers are
  re-attached to the next parent instead: preempting them would not free a slot.

Bounded wait: once a request H is blocked, no request behind it can extend a selected variant's
life except as a line-skipper, and line-skippers go when the last non-skipper of their variant
does. So H waits at most for the requests ahead of it plus the non-skippers that were running when
it arrived (``tests/runtime/serve/test_scheduler.py`` checks this on a crafted arrival pattern, and that
without preemption the same pattern starves H).

The base model is served without a delta: its requests need no slot in ``delta`` mode. In ``swap``
mode (``base_needs_slot=True``, ``max_deltas=1``) the base is one more whole model and every step
serves one model only — the baseline's "batch only requests of the same model".

**Loads in flight** (``ready`` hook): a waiting request whose variant is not resident yet is not
admitted; its variant is *reserved* (it counts towards ``max_deltas``, so a slot is free for it when
its load lands) and listed in ``ScheduleOutput.loading``, and the walk goes on past it, so sequences
of resident variants keep running and later requests of them keep being admitted meanwhile. The step
after the load completes (``ready`` turns True) admits it in its FCFS place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

BASE_KEY = "\x00base"  # the base model's variant key (cannot collide with a directory name)


@dataclass
class SchedRequest:
    """What the scheduler knows about a request.

    Attributes:
        rid: unique id.
        variant: variant name, or :data:`BASE_KEY` for the base model.
        prompt_len: prompt tokens (the cost of admitting it fresh).
        arrival: position in the arrival order (assigned by :meth:`Scheduler.add`).
        has_state: it ran before and was preempted: resuming costs one token, no prefill.
        skipper: admitted by skipping the line (see module docstring).
        parent: rid of the request whose completion preempts this line-skipper.
    """

    rid: str
    variant: str
    prompt_len: int
    arrival: int = -1
    status: str = "new"
    has_state: bool = False
    skipper: bool = False
    parent: str | None = None
    admitted_step: int = -1
    first_admitted_step: int = -1
    preemptions: int = 0
    prefill_left: int = -1  # prompt tokens not yet in the KV cache (-1: the whole prompt)
    width: int = 1  # sequences it occupies: n for a request of n samples, until they are forked


@dataclass
class ScheduleOutput:
    """One step's decision.

    Attributes:
        prefill: newly admitted requests whose prompt runs this step.
        resumed: preempted requests admitted again (state to restore; they decode this step).
        running: every running request after admission (decoders, resumed and prefill ones).
        selected: variants of the running requests (needing a device slot), at most ``max_deltas``.
        blocked: waiting requests blocked by the delta limit, oldest first (prefetch candidates).
        waiting: waiting requests after this step's admissions, oldest first.
        loading: variants with waiting requests whose load is in flight (``ready`` was False);
            each holds a reserved place among the ``max_deltas``.
    """

    prefill: list[SchedRequest] = field(default_factory=list)
    resumed: list[SchedRequest] = field(default_factory=list)
    running: list[SchedRequest] = field(default_factory=list)
    selected: list[str] = field(default_factory=list)
    blocked: list[SchedRequest] = field(default_factory=list)
    waiting: list[SchedRequest] = field(default_factory=list)
    loading: list[str] = field(default_factory=list)


class Scheduler:
    """FCFS with at most ``max_deltas`` selected variants, line-skipping and preemption.

    Args:
        max_deltas: ``N``, variants whose requests may run in one step (device slots).
        max_num_seqs: sequences per step.
        max_batch_tokens: tokens per step (prompt tokens of admissions + one per running sequence).
        preemption: preempt line-skippers when their parent finishes (paper §5.4); False only to
            demonstrate starvation in tests and benchmarks.
        base_needs_slot: the base model occupies a slot like a variant (swap mode).
        ready: ``variant -> bool``, asked (at most once per variant per step) before admitting a
            request of a variant no running request uses: False while its load is in flight (see
            module docstring). None: every variant is ready (it is loaded when selected).
    """

    def __init__(self, max_deltas: int, max_num_seqs: int, max_batch_tokens: int, preemption: bool = True,
                 base_needs_slot: bool = False, chunked_prefill: bool = False,
                 ready: Callable[[str], bool] | None = None):
        if max_deltas < 1 or max_num_seqs < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_deltas ({max_deltas}), max_num_seqs ({max_num_seqs}) and max_batch_tokens "
                             f"({max_batch_tokens}) must be >= 1")
        self.max_deltas, self.max_num_seqs, self.max_batch_tokens = max_deltas, max_num_seqs, max_batch_tokens
        self.preemption, self.base_needs_slot = preemption, base_needs_slot
        self.chunked_prefill = chunked_prefill
        self.ready = ready
        self.waiting: list[SchedRequest] = []  # kept sorted by arrival
        self.running: dict[str, SchedRequest] = {}  # insertion order = admission order
        self._arrivals = 0
        self.step = 0
        self.preempted_total = 0

    # -- bookkeeping ----------------------------------------------------------------------------
    def _needs_slot(self, r: SchedRequest) -> bool:
        return r.variant != BASE_KEY or self.base_needs_slot

    def selected(self) -> list[str]:
        """Variants (needing a slot) of the running requests, in admission order."""
        return list(dict.fromkeys(r.variant for r in self.running.values() if self._needs_slot(r)))

    def add(self, r: SchedRequest) -> None:
        """Queue a new request (FCFS position = now)."""
        if r.rid in self.running or any(w.rid == r.rid for w in self.waiting):
            raise ValueError(f"request {r.rid} is already scheduled")
        if not r.has_state and r.prompt_len > self.max_batch_tokens and not self.chunked_prefill:
            raise ValueError(f"request {r.rid} needs {r.prompt_len} tokens, more than max_batch_tokens "
                             f"({self.max_batch_tokens}) allows in one step")
        r.arrival = self._arrivals
        self._arrivals += 1
        r.status = "waiting"
        self.waiting.append(r)

    def _requeue(self, r: SchedRequest) -> None:
        r.status, r.skipper, r.parent = "waiting", False, None
        r.has_state = True
        r.preemptions += 1
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < r.arrival:
            i += 1
        self.waiting.insert(i, r)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduleOutput:
        """Admit waiting requests for this step (see module docstring)."""
        self.step += 1
        out = ScheduleOutput()
        selected = self.selected()
        sel_set = set(selected)
        seqs_left = self.max_num_seqs - sum(r.width for r in self.running.values())
        tokens_left = self.max_batch_tokens - sum(self._cost(r, True) for r in self.running.values())
        blocked_seen = False
        admitted: list[SchedRequest] = []
        readiness = {v: True for v in selected}  # running variants are resident
        for r in self.waiting:
            if self._needs_slot(r) and r.variant not in sel_set and len(sel_set) >= self.max_deltas:
                blocked_seen = True
                out.blocked.append(r)
                continue
            if self._needs_slot(r) and not self._is_ready(r.variant, readiness):
                if r.variant not in sel_set:  # reserve its place among the max_deltas
                    sel_set.add(r.variant)
                    out.loading.append(r.variant)
                continue
            cost = self._cost(r, False)
            if seqs_left < r.width or cost > tokens_left and not (self.chunked_prefill and tokens_left >= 1):
                break  # strict FCFS on capacity: nobody passes a request for lack of room
            seqs_left -= r.width
            tokens_left -= cost
            if self._needs_slot(r) and r.variant not in sel_set:
                sel_set.add(r.variant)
                selected.append(r.variant)
                r.skipper, r.parent = False, None
            elif blocked_seen and self._needs_slot(r):
                r.skipper, r.parent = True, self._parent_for(r.variant, admitted)
            else:
                r.skipper, r.parent = False, None
            r.status = "running"
            r.admitted_step = self.step
            if r.first_admitted_step < 0:
                r.first_admitted_step = self.step
            admitted.append(r)
            self.running[r.rid] = r
            (out.resumed if r.has_state else out.prefill).append(r)
        if admitted:
            ids = {r.rid for r in admitted}
            self.waiting = [w for w in self.waiting if w.rid not in ids]
        out.running = list(self.running.values())
        out.selected = selected
        out.waiting = list(self.waiting)
        return out

    def _cost(self, r: SchedRequest, running: bool) -> int:
        """Tokens ``r`` needs in a step: what is left of its prompt, else one to decode. Without
        chunking a prompt runs whole in the step that admits it, so a running request costs one."""
        if self.chunked_prefill:
            return max(1, r.prompt_len if r.prefill_left < 0 else r.prefill_left)
        return 1 if running or r.has_state else r.prompt_len

    def _is_ready(self, variant: str, readiness: dict[str, bool]) -> bool:
        if self.ready is None:
            return True
        if variant not in readiness:
            readiness[variant] = bool(self.ready(variant))
        return readiness[variant]

    def _parent_for(self, variant: str, admitted: list[SchedRequest]) -> str:
        for r in self.running.values():  # admission order: the earliest non-skipper of the variant
            if r.variant == variant and not r.skipper:
                return r.rid
        raise AssertionError(f"variant {variant} is selected but has no running non-skipper")  # invariant

    def fork(self, rid: str, child_rids: list[str]) -> None:
        """Running request ``rid`` (``width`` samples) read its prompt: its other samples run from now
        on as requests of their own, with its variant, line-skipping status and place in the order."""
        r = self.running[rid]
        r.width = 1
        for c in child_rids:
            self.running[c] = SchedRequest(c, r.variant, r.prompt_len, arrival=r.arrival, status="running",
                                           has_state=True, skipper=r.skipper, parent=r.parent,
                                           admitted_step=r.admitted_step, first_admitted_step=r.first_admitted_step,
                                           prefill_left=0)

    def shrink(self, rid: str, by: int) -> None:
        """``by`` samples of request ``rid``, not forked yet, were cancelled: it occupies fewer sequences."""
        r = self.running.get(rid) or next((w for w in self.waiting if w.rid == rid), None)
        if r is not None:
            r.width = max(1, r.width - by)

    def finish(self, rid: str) -> list[SchedRequest]:
        """A running request completed (or was cancelled); returns the requests preempted because of it."""
        r = self.running.pop(rid, None)
        if r is None:
            self.waiting = [w for w in self.waiting if w.rid != rid]
            return []
        r.status = "finished"
        children = [c for c in self.running.values() if c.parent == rid]
        if not children:
            return []
        heirs = [c for c in self.running.values() if c.variant == r.variant and not c.skipper]
        if heirs:  # the variant stays selected: preempting would not free its slot
            for c in children:
                c.parent = heirs[0].rid
            return []
        if self.preemption and self._someone_blocked():
            for c in children:
                del self.running[c.rid]
                self._requeue(c)
            self.preempted_total += len(children)
            return children
        # Nobody waits for a slot: the oldest child becomes the variant's parent, the rest attach to it.
        children[0].skipper, children[0].parent = False, None
        for c in children[1:]:
            c.parent = children[0].rid
        return []

    def _someone_blocked(self) -> bool:
        sel = set(self.selected())
        if len(sel) < self.max_deltas:
            return False
        return any(self._needs_slot(w) and w.variant not in sel for w in self.waiting)

    def cancel(self, rid: str) -> list[SchedRequest]:
        """Remove a request wherever it is; returns line-skippers preempted as a consequence."""
        return self.finish(rid)
