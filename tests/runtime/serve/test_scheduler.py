"""The delta-aware scheduler (paper §5.4): FCFS, N-delta limit, line-skipping, preemption, bounds."""

from __future__ import annotations

import pytest

from deltazip.runtime.serve.scheduler import BASE_KEY, SchedRequest, Scheduler


class Sim:
    """Drives a Scheduler like the engine does: every running request makes one token per step and
    finishes after ``length`` tokens (kept across preemptions: state is swapped, not recomputed)."""

    def __init__(self, sched: Scheduler):
        self.s = sched
        self.length: dict[str, int] = {}
        self.done_tokens: dict[str, int] = {}
        self.finished_at: dict[str, int] = {}
        self.reqs: dict[str, SchedRequest] = {}
        self.prefills: dict[str, int] = {}

    def add(self, rid: str, variant: str, length: int, prompt: int = 4) -> None:
        r = SchedRequest(rid, variant, prompt)
        self.reqs[rid] = r
        self.length[rid] = length
        self.done_tokens[rid] = 0
        self.s.add(r)

    def step(self) -> None:
        s = self.s
        out = s.schedule()
        assert len(set(out.selected)) <= s.max_deltas
        assert len({r.variant for r in out.running if r.variant != BASE_KEY or s.base_needs_slot}) <= s.max_deltas
        assert len(out.running) <= s.max_num_seqs
        decoding = len(out.running) - len(out.prefill)
        assert sum(r.prompt_len for r in out.prefill) + decoding <= s.max_batch_tokens
        for r in out.prefill:
            self.prefills[r.rid] = self.prefills.get(r.rid, 0) + 1
        for r in out.running:
            assert r.status == "running"
            if r.skipper:  # a line-skipper always hangs off a running non-skipper of its variant
                parent = s.running[r.parent]
                assert parent.variant == r.variant and not parent.skipper
        for r in list(out.running):
            self.done_tokens[r.rid] += 1
            if self.done_tokens[r.rid] >= self.length[r.rid]:
                self.finished_at[r.rid] = s.step
                s.finish(r.rid)

    def run(self, steps: int, arrivals=None) -> None:
        arrivals = arrivals or {}
        for t in range(steps):
            for rid, variant, length in arrivals.get(t, []):
                self.add(rid, variant, length)
            self.step()


def test_fcfs_all_admitted_when_deltas_fit():
    sim = Sim(Scheduler(max_deltas=4, max_num_seqs=8, max_batch_tokens=100))
    for i, v in enumerate("abcab"):
        sim.add(f"r{i}", v, 3)
    out = sim.s.schedule()
    assert [r.rid for r in out.prefill] == ["r0", "r1", "r2", "r3", "r4"]
    assert out.selected == ["a", "b", "c"]
    assert not any(r.skipper for r in out.running)


def test_at_most_n_deltas_and_line_skipping_marks_parent():
    s = Scheduler(max_deltas=1, max_num_seqs=8, max_batch_tokens=100)
    sim = Sim(s)
    sim.add("a1", "a", 5)
    sim.step()
    sim.add("b1", "b", 5)
    sim.add("a2", "a", 5)
    out = s.schedule()
    assert [r.rid for r in out.prefill] == ["a2"]  # a2 skipped the line past blocked b1
    assert [r.rid for r in out.blocked] == ["b1"]
    a2 = s.running["a2"]
    assert a2.skipper and a2.parent == "a1"
    assert out.selected == ["a"]


def test_preemption_bounds_the_wait_of_a_blocked_request():
    """Crafted pattern: one slot; a long request for `a`, then one for `b`, then a steady stream of
    `a` requests, each arriving while the previous ones run. Without preemption the stream keeps `a`
    selected and `b1` starves; with it, `b1` starts as soon as `a1` (its blocker) finishes."""
    steps, a_len = 80, 10
    arrivals = {0: [("a1", "a", a_len)], 1: [("b1", "b", 5)]}
    for t in range(2, 60):
        arrivals.setdefault(t, []).append((f"a{t}", "a", a_len))

    sim = Sim(Scheduler(max_deltas=1, max_num_seqs=64, max_batch_tokens=1000, preemption=True))
    sim.run(steps + 700, arrivals)
    b1 = sim.reqs["b1"]
    wait = b1.first_admitted_step - 2  # arrived before step 2's schedule
    assert wait <= a_len, f"b1 waited {wait} steps; the bound is a1's length {a_len}"
    assert sim.s.preempted_total > 0
    # Everyone finishes; preempted requests resumed from their state (one prefill each).
    assert set(sim.finished_at) == set(sim.reqs)
    assert all(n == 1 for n in sim.prefills.values())
    assert any(r.preemptions for r in sim.reqs.values())

    starve = Sim(Scheduler(max_deltas=1, max_num_seqs=64, max_batch_tokens=1000, preemption=False))
    starve.run(steps + 700, arrivals)
    assert starve.reqs["b1"].first_admitted_step - 2 > 50  # stuck behind the whole `a` stream


def test_bounded_wait_holds_for_every_request_under_a_mixed_stream():
    """Many variants, few slots: every request starts within a bound of its arrival."""
    import random

    rnd = random.Random(0)
    arrivals: dict[int, list] = {}
    for i in range(300):
        t = rnd.randrange(0, 200)
        v = rnd.choice("aaaaabbbcde")  # skewed popularity, like zipf traces
        arrivals.setdefault(t, []).append((f"q{i}", v, rnd.randint(2, 12)))
    sim = Sim(Scheduler(max_deltas=2, max_num_seqs=16, max_batch_tokens=200))
    sim.run(2000, arrivals)
    assert set(sim.finished_at) == set(sim.reqs)
    waits = [r.first_admitted_step - r.arrival for r in sim.reqs.values()]
    assert max(waits) < 400


def test_capacity_is_strict_fcfs():
    s = Scheduler(max_deltas=4, max_num_seqs=2, max_batch_tokens=10)
    sim = Sim(s)
    sim.add("big", "a", 3, prompt=8)
    sim.add("small1", "b", 3, prompt=2)
    sim.add("small2", "c", 3, prompt=2)
    sim.add("small3", "c", 3, prompt=1)
    out = s.schedule()
    assert [r.rid for r in out.prefill] == ["big", "small1"]  # 8 + 2 tokens, 2 sequences
    out = s.schedule()
    assert out.prefill == []  # two sequences already running: nobody passes the head for lack of room


def test_prompt_over_the_step_budget_is_rejected():
    s = Scheduler(max_deltas=1, max_num_seqs=2, max_batch_tokens=10)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        s.add(SchedRequest("r", "a", 11))


def test_base_requests_need_no_slot_in_delta_mode_but_one_in_swap_mode():
    s = Scheduler(max_deltas=1, max_num_seqs=8, max_batch_tokens=100)
    s.add(SchedRequest("a1", "a", 2))
    s.add(SchedRequest("base1", BASE_KEY, 2))
    out = s.schedule()
    assert {r.rid for r in out.prefill} == {"a1", "base1"}

    swap = Scheduler(max_deltas=1, max_num_seqs=8, max_batch_tokens=100, base_needs_slot=True)
    swap.add(SchedRequest("a1", "a", 2))
    swap.add(SchedRequest("base1", BASE_KEY, 2))
    out = swap.schedule()
    assert [r.rid for r in out.prefill] == ["a1"] and [r.rid for r in out.blocked] == ["base1"]


def test_line_skippers_are_adopted_not_preempted_when_nobody_waits():
    s = Scheduler(max_deltas=1, max_num_seqs=8, max_batch_tokens=100)
    s.add(SchedRequest("a1", "a", 2))
    s.schedule()
    s.add(SchedRequest("b1", "b", 2))
    s.add(SchedRequest("a2", "a", 2))
    s.add(SchedRequest("a3", "a", 2))
    s.schedule()
    assert s.running["a2"].skipper and s.running["a3"].parent == "a1"
    s.cancel("b1")  # the blocked request goes away
    assert s.finish("a1") == []
    assert not s.running["a2"].skipper and s.running["a3"].parent == "a2"


def test_skippers_reattach_when_their_variant_stays_selected():
    s = Scheduler(max_deltas=1, max_num_seqs=8, max_batch_tokens=100)
    s.add(SchedRequest("a1", "a", 2))
    s.add(SchedRequest("a2", "a", 2))  # non-skipper: nothing blocked when it was admitted
    s.schedule()
    s.add(SchedRequest("b1", "b", 2))
    s.add(SchedRequest("a3", "a", 2))
    s.schedule()
    assert s.running["a3"].parent == "a1"
    assert s.finish("a1") == []  # a2 keeps `a` selected: preempting a3 would free nothing
    assert s.running["a3"].parent == "a2"
    preempted = s.finish("a2")
    assert [r.rid for r in preempted] == ["a3"]
    assert [w.rid for w in s.waiting] == ["b1", "a3"]  # back at its original place, behind b1
    out = s.schedule()
    assert [r.rid for r in out.prefill] == ["b1"] and out.resumed == []


def test_cancel_removes_waiting_and_running_requests():
    s = Scheduler(max_deltas=1, max_num_seqs=8, max_batch_tokens=100)
    s.add(SchedRequest("a1", "a", 2))
    s.add(SchedRequest("b1", "b", 2))
    s.schedule()
    s.cancel("b1")
    assert s.num_waiting() == 0
    s.cancel("a1")
    assert not s.has_work()


def test_rejects_bad_limits():
    with pytest.raises(ValueError):
        Scheduler(max_deltas=0, max_num_seqs=1, max_batch_tokens=1)


def test_chunked_prefill_admits_long_prompts_and_charges_what_is_left_of_them():
    """With chunked prefill a prompt longer than the budget is accepted; a running request costs the
    prompt tokens it has left (the engine updates ``prefill_left``) or one when decoding, and a new
    request is admitted while at least one token of budget is left (strictly FCFS)."""
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Scheduler(2, 8, 10).add(SchedRequest("big", "a", 25))
    s = Scheduler(2, 8, 10, chunked_prefill=True)
    s.add(SchedRequest("d", BASE_KEY, 3))
    assert [r.rid for r in s.schedule().prefill] == ["d"]
    s.running["d"].prefill_left = 0  # read whole: it decodes from now on (cost 1)
    s.add(SchedRequest("big", "a", 25))
    s.add(SchedRequest("next", "a", 2))
    out = s.schedule()
    assert [r.rid for r in out.prefill] == ["big"]  # 9 tokens left: big takes them all, next waits
    s.running["big"].prefill_left = 25 - 9
    assert s.schedule().prefill == []  # 1 (decode) + 16 (big's rest) > 10: nobody new
    s.running["big"].prefill_left = 0
    assert [r.rid for r in s.schedule().prefill] == ["next"]  # 10 - 2 decodes = 8 left


def test_a_request_of_n_samples_holds_n_sequences_and_forks_into_them():
    """``width`` n: admitted only while n sequences are free; forked, its samples run as requests of
    their own with its variant and line-skipping status; cancelled samples give their place back."""
    s = Scheduler(max_deltas=2, max_num_seqs=4, max_batch_tokens=100)
    s.add(SchedRequest("a", "v1", 5, width=3))
    s.add(SchedRequest("b", "v1", 5, width=2))  # 3 + 2 > 4: waits, and FCFS stops the walk there
    s.add(SchedRequest("c", "v1", 5))
    out = s.schedule()
    assert [r.rid for r in out.prefill] == ["a"]
    s.shrink("b", 1)  # one of b's samples was cancelled before it was forked: b needs one sequence
    s.fork("a", ["a.1", "a.2"])
    assert {r.rid: (r.variant, r.has_state, r.skipper) for r in s.running.values() if r.rid != "a"} == \
        {"a.1": ("v1", True, False), "a.2": ("v1", True, False)}
    out = s.schedule()  # 3 sequences run, one is free: b (now width 1) is admitted, c is not
    assert [r.rid for r in out.prefill] == ["b"] and [r.rid for r in out.waiting] == ["c"]
    s.finish("a.1")
    assert [r.rid for r in s.schedule().prefill] == ["c"]
