"""Overlapped variant loads: a slow load stalls only the requests that need it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _serving import PROMPTS, served_set, single_thread

from deltazip.runtime.serve.delta_cache import TieredCache
from deltazip.runtime.serve.engine import (
    Engine,
    FinishEvent,
    SamplingParams,
    TokenEvent,
)
from deltazip.runtime.serve.scheduler import BASE_KEY, SchedRequest, Scheduler

SLOW = 1.5  # seconds one variant's host load is made to take


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


def _engine(served, **cfg) -> Engine:
    from deltazip.runtime.serve.assembly import ServeConfig, build_engine

    return build_engine(ServeConfig(served.artifacts, base=str(served.base_dir), base_name="base", device="cpu",
                                    dtype="float32", **cfg))


class Timed:
    """Events of one request with their arrival times."""

    def __init__(self):
        self.events: list[tuple[float, object]] = []
        self.done = threading.Event()
        self.first = threading.Event()

    def __call__(self, ev) -> None:
        self.events.append((time.perf_counter(), ev))
        if isinstance(ev, TokenEvent):
            self.first.set()
        if isinstance(ev, FinishEvent):
            self.done.set()

    def token_times(self) -> list[float]:
        return [t for t, e in self.events if isinstance(e, TokenEvent) and e.token_id >= 0]

    @property
    def final(self) -> FinishEvent:
        return self.events[-1][1]


def test_a_slow_load_does_not_stall_running_variants_and_outputs_stay_exact(served, monkeypatch):
    """``beta``'s host load sleeps SLOW seconds; ``alpha``'s sequence, already decoding, keeps producing
    tokens all along (no gap near SLOW), ``beta`` starts once loaded, and both texts equal their merged
    models' greedy ``generate``."""
    from deltazip.runtime.serve.model import DeltaModel

    window: dict[str, float] = {}
    real = DeltaModel.load_host

    def slow_load(self, name):
        if name == "beta":
            window["start"] = time.perf_counter()
            time.sleep(SLOW)
            window["end"] = time.perf_counter()
        return real(self, name)

    monkeypatch.setattr(DeltaModel, "load_host", slow_load)
    tok = served.tokenizer()
    n_alpha = 100
    with single_thread():
        eng = _engine(served, max_deltas=2, max_cpu_deltas=2)
        eng.start()
        try:
            alpha, beta = Timed(), Timed()
            a_ids = tok(PROMPTS[0])["input_ids"]
            eng.submit("alpha", a_ids, SamplingParams(max_tokens=n_alpha, temperature=0.0, ignore_eos=True), alpha)
            assert alpha.first.wait(60)
            eng.submit("beta", tok(PROMPTS[1])["input_ids"], SamplingParams(max_tokens=8, temperature=0.0), beta)
            deadline = time.time() + 30
            while "start" not in window:
                assert time.time() < deadline
                time.sleep(0.005)
            mid = eng.stats()  # beta's load sleeps now
            assert mid["loading_deltas"] == ["beta"] and mid["queue_length"] == 1 and mid["running_seqs"] == 1
            assert alpha.done.wait(120) and beta.done.wait(120)
            loads = eng.stats()["load_stats"]
        finally:
            eng.shutdown()
    start, end = window["start"], window["end"]
    during = [t for t in alpha.token_times() if start <= t <= end]
    times = [t for t in alpha.token_times() if t >= start]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(during) >= 3, f"alpha produced {len(during)} tokens while beta loaded for {SLOW} s"
    assert max(gaps, default=0.0) < SLOW / 2, f"alpha stalled {max(gaps):.2f} s during beta's load"
    assert beta.token_times()[0] > end  # beta's first token needs its load
    assert alpha.final.reason == "length" and alpha.final.completion_tokens == n_alpha
    ref = served.model("alpha")
    ids = torch.tensor([a_ids])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_alpha, do_sample=False,
                           min_new_tokens=n_alpha, pad_token_id=tok.pad_token_id)
    assert alpha.final.text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert beta.final.text == served.expected("beta", PROMPTS[1], 8)
    assert loads["beta"]["device_loads"] == 1 and loads["beta"]["disk_seconds_last"] >= SLOW


def test_a_long_prompt_of_a_loading_variant_is_chunked_after_its_load(served, monkeypatch):
    """Background load, ``ready`` hook and chunked prefill together: ``beta``'s prompt is longer than
    the step's token budget and its load is held until ``alpha`` has decoded a while alone. Then the
    prompt is read in chunks of what the budget leaves after ``alpha``'s token, ``alpha`` decoding in
    every one of those steps; both texts equal the merged models' ``generate``."""
    from deltazip.runtime.serve.model import DeltaModel

    real, release = DeltaModel.load_host, threading.Event()

    def held_load(self, name):
        if name == "beta":
            assert release.wait(60)
        return real(self, name)

    monkeypatch.setattr(DeltaModel, "load_host", held_load)
    tok = served.tokenizer()
    long_ids = tok(" ".join(PROMPTS) + " zip")["input_ids"]
    budget, n_alpha = 12, 100
    assert len(long_ids) > 3 * budget
    with single_thread():
        eng = _engine(served, max_deltas=2, max_cpu_deltas=2, max_batch_tokens=budget)
        steps: list[dict[str, tuple[int, bool]]] = []
        forward = eng._forward

        def spy(group, row_slots, *more):  # engine thread: per forward, each row's model, new tokens, decoding?
            steps.append({s.model: (len(t), bool(s.output_ids)) for s, t in group})
            return forward(group, row_slots, *more)

        eng._forward = spy
        eng.start()
        try:
            alpha, beta = Timed(), Timed()
            a_ids = tok(PROMPTS[0])["input_ids"]
            eng.submit("alpha", a_ids, SamplingParams(max_tokens=n_alpha, temperature=0.0, ignore_eos=True), alpha)
            assert alpha.first.wait(60)
            eng.submit("beta", long_ids, SamplingParams(max_tokens=6, temperature=0.0), beta)
            deadline = time.time() + 60
            while len(alpha.token_times()) < 10:
                assert time.time() < deadline and not alpha.done.is_set()
                time.sleep(0.005)
            assert eng.stats()["loading_deltas"] == ["beta"] and not beta.first.is_set()
            release.set()
            assert alpha.done.wait(120) and beta.done.wait(120)
        finally:
            release.set()
            eng.shutdown()
    assert beta.final.text == served.expected_ids("beta", tuple(long_ids), 6)
    assert alpha.final.completion_tokens == n_alpha
    chunks = [i for i, st in enumerate(steps) if "beta" in st and not st["beta"][1]]
    assert len(chunks) >= 3 and sum(steps[i]["beta"][0] for i in chunks) == len(long_ids)
    for i in chunks:  # each chunk step: the budget minus alpha's decode (the decode forward follows it)
        assert steps[i]["beta"][0] <= budget - 1 and steps[i + 1].get("alpha") == (1, True)
    assert chunks == list(range(chunks[0], chunks[-1] + 1, 2))  # consecutive steps: prefill, decode, ...


def test_a_load_that_fails_in_the_background_fails_only_its_requests(served, monkeypatch):
    from deltazip.runtime.serve.model import DeltaModel

    real = DeltaModel.load_host

    def broken(self, name):
        if name == "gamma":
            raise OSError("disk went away")
        return real(self, name)

    monkeypatch.setattr(DeltaModel, "load_host", broken)
    tok = served.tokenizer()
    with single_thread():
        eng = _engine(served, max_deltas=2, max_cpu_deltas=0)
        eng.start()
        try:
            res = {m: Timed() for m in ("alpha", "gamma", "base")}
            for m, sink in res.items():
                eng.submit(m, tok(PROMPTS[2])["input_ids"], SamplingParams(max_tokens=4, temperature=0.0), sink)
            assert all(s.done.wait(60) for s in res.values())
        finally:
            eng.shutdown()
    assert res["gamma"].final.reason == "error" and "disk went away" in res["gamma"].final.error
    for m in ("alpha", "base"):
        assert res[m].final.text == served.expected(m, PROMPTS[2], 4)


def test_scheduler_holds_requests_of_loading_variants_and_reserves_their_slot():
    """While ``b`` loads, its requests wait, its place among max_deltas is held (``c`` is blocked), and
    ``a`` and base requests are admitted past it; once ready, ``b``'s requests go first (FCFS)."""
    ready = {"a": True, "b": False, "c": True}
    asked: list[str] = []

    def is_ready(v):
        asked.append(v)
        return ready[v]

    s = Scheduler(max_deltas=2, max_num_seqs=8, max_batch_tokens=100, ready=is_ready)
    s.add(SchedRequest("a1", "a", 3))
    out = s.schedule()
    assert [r.rid for r in out.prefill] == ["a1"] and out.loading == []
    for rid, v in [("b1", "b"), ("c1", "c"), ("b2", "b"), ("a2", "a"), ("z", BASE_KEY)]:
        s.add(SchedRequest(rid, v, 3))
    asked.clear()
    out = s.schedule()
    assert [r.rid for r in out.prefill] == ["a2", "z"]
    assert out.loading == ["b"] and [r.rid for r in out.blocked] == ["c1"]
    assert out.selected == ["a"] and asked == ["b"]  # asked once per step, running "a" not at all
    ready["b"] = True
    out = s.schedule()
    assert [r.rid for r in out.prefill] == ["b1", "b2"] and out.selected == ["a", "b"] and out.loading == []


def test_tiered_cache_install_never_evicts_a_protected_slot():
    device: dict[int, str] = {}
    cache = TieredCache(lambda n: n, lambda s, n, obj: device.__setitem__(s, obj), lambda s: device.pop(s, None),
                        num_slots=2, max_cpu=2)
    assert cache.install("a", "A") == 0 and cache.install("b", "B") == 1
    assert cache.install("c", "C", protect={"a", "b"}) is None and cache.slot_of("c") is None
    assert cache.install("c", "C", protect={"b"}) == 0  # "a" was not protected: its slot is reused
    assert device == {0: "C", 1: "B"} and cache.resident() == ["c", "b"]
    assert cache.install("b", "ignored") == 1 and device[1] == "B"  # already resident: no write
    assert cache.stats["c"].device_loads == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_staged_variant_fills_a_slot_exactly_like_a_direct_write(served, device):
    """The loader's staging (CPU: packed deltas dequantized off the engine thread; CUDA: copies to the
    device on a side stream) changes where the work happens, not the numbers: a slot written from the
    staged object gives bit-identical logits to one written from the host object.

    On CUDA the two slots' rows must agree within fp32 summation noise (1e-5 of the largest logit);
    on a CPU they are bit-identical."""
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.delta_loader import DeltaLoader, device_tensors
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.model_runner import prefill_logits
    from deltazip.runtime.serve.variant_sources import discover_variants

    dev = torch.device(device)
    with single_thread():
        dm = DeltaModel(Checkpoint(served.base_dir), discover_variants(served.artifacts), 2, dev, torch.float32)
        cache = TieredCache(dm.load_host, dm.write_slot, dm.clear_slot, num_slots=2, max_cpu=2)
        loader = DeltaLoader(cache, dm.stage_slot, dev)
        try:
            for name in ("alpha", "beta", "gamma"):
                host = dm.load_host(name)
                dm.write_slot(0, name, host)
                loader.start(name)
                while loader.state(name) == "loading":
                    time.sleep(0.01)
                staged = loader.peek(name)
                if dev.type == "cuda":
                    assert staged.event is not None and staged.event.query()
                    assert sum(1 for _ in device_tensors(staged.obj)) > 0
                else:  # dequantized in the loader: the slot write only copies
                    kinds = {k for kw in staged.obj.modules.values() for k in kw}
                    assert "dequantized" in kinds and "packed" not in kinds
                loader.adopt(staged)
                dm.write_slot(1, name, staged.obj)
                loader.drop(name)
                ids = served.tokenizer()(PROMPTS[3])["input_ids"]
                logits = prefill_logits(dm, [0, 1], [ids, ids])
                if dev.type == "cuda":  # split-K partials are summed in a fixed order: equal up to rounding at most
                    bound = 1e-5 * float(logits.abs().max())
                    assert float((logits[0] - logits[1]).abs().max()) <= bound, name
                else:
                    assert torch.equal(logits[0], logits[1]), name
                assert dm.slot_bytes(0) == dm.slot_bytes(1) > 0
        finally:
            loader.shutdown()
            cache.shutdown()


def test_load_stats_are_read_whole_while_the_loader_counts_a_new_variant():
    """``/metrics`` reads every variant's load counters while the loader thread may count a variant seen
    for the first time: the read iterates a copy of the map (here the first entry's read adds a variant,
    as the loader would in the middle of it), and each name has one entry however many threads count it."""
    device: dict[int, object] = {}
    cache = TieredCache(lambda n: n, lambda s, n, obj: device.__setitem__(s, obj), lambda s: device.pop(s, None),
                        num_slots=1, max_cpu=1)

    class CountedMeanwhile:  # its counters are read as another thread counts a new variant
        @property
        def __dict__(self):
            cache._stat("late").disk_loads += 1
            return {"disk_loads": 1}

    cache.stats["early"] = CountedMeanwhile()
    assert cache.load_stats() == {"early": {"disk_loads": 1}}
    assert cache.stats["late"].disk_loads == 1

    barrier, got = threading.Barrier(8), []

    def count():
        barrier.wait()
        got.append(cache._stat("new"))

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 1
