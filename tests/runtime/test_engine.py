"""The continuous-batching engine and the tiered cache, without HTTP."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _serving import PROMPTS, VARIANTS, served_set, single_thread

from deltazip.runtime.delta_cache import SlotsExhausted, TieredCache
from deltazip.runtime.engine import (
    Engine,
    EngineConfig,
    EngineError,
    FinishEvent,
    IncrementalDetokenizer,
    PromptTooLong,
    QueueFull,
    SamplingParams,
    ServedVariant,
    TokenEvent,
    UnknownModel,
)

MODELS = ["base", *sorted(VARIANTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


def make_engine(served, mode="delta", **cfg) -> Engine:
    from deltazip.compress.checkpoint import Checkpoint
    from deltazip.runtime.model import DeltaModel, SwapModels, discover_artifacts, eos_token_ids

    variants = discover_artifacts(served.artifacts)
    base = Checkpoint(served.base_dir)
    ec = EngineConfig(**cfg)
    if mode == "delta":
        backend = DeltaModel(base, variants, ec.max_deltas, torch.device("cpu"), torch.float32)
    else:
        backend = SwapModels(base, variants, ec.max_deltas, torch.device("cpu"), torch.float32, "base")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served.base_dir)  # the engine thread's own instance
    eos = eos_token_ids(served.base_dir, tok, backend.config)
    table = {"base": ServedVariant("base", tok, eos, None)}
    table.update({v.name: ServedVariant(v.name, tok, eos, "base") for v in variants})
    return Engine(backend, table, "base", ec)


class Collector:
    """Collects events of many requests; ``wait`` blocks until all have finished."""

    def __init__(self):
        self.events: dict[object, list] = {}
        self.cond = threading.Condition()
        self.open = 0

    def sink(self, key):
        with self.cond:
            self.events[key] = []
            self.open += 1

        def fn(ev):
            with self.cond:
                self.events[key].append(ev)
                if isinstance(ev, FinishEvent):
                    self.open -= 1
                    self.cond.notify_all()
        return fn

    def wait(self, timeout=120):
        with self.cond:
            assert self.cond.wait_for(lambda: self.open == 0, timeout), "requests did not finish in time"

    def final(self, key) -> FinishEvent:
        return self.events[key][-1]

    def streamed(self, key) -> str:
        return "".join(e.text for e in self.events[key] if isinstance(e, TokenEvent))


def test_greedy_outputs_equal_the_merged_models_with_slot_and_host_churn(served):
    """All models at once through 2 device slots and a 1-entry host cache: variants are evicted and
    reloaded from disk while others run; every output equals its merged model's greedy generate."""
    with single_thread():
        eng = make_engine(served, max_deltas=2, max_cpu_deltas=1, max_num_seqs=8)
        tok = served.tokenizer()
        col = Collector()
        eng.start()
        try:
            for rep in range(2):
                for m in MODELS:
                    for p in PROMPTS:
                        eng.submit(m, tok(p)["input_ids"], SamplingParams(max_tokens=10, temperature=0.0),
                                   col.sink((m, p, rep)))
            col.wait()
            st = eng.stats()
        finally:
            eng.shutdown()
        for (m, p, _rep), evs in col.events.items():
            fin = evs[-1]
            assert fin.reason in ("stop", "length"), fin
            assert fin.text == served.expected(m, p, 10), (m, p)
            assert col.streamed((m, p, _rep)) == fin.text  # the streamed pieces add up to the text
        assert st["running_seqs"] == 0 and st["queue_length"] == 0
        loads = st["load_stats"]
        assert set(loads) == set(VARIANTS)
        assert sum(v["device_loads"] for v in loads.values()) > len(VARIANTS)  # slots were reused
        assert all(v["disk_seconds_last"] > 0 for v in loads.values())


def test_preempted_line_skippers_resume_with_identical_output(served):
    """One slot: alpha's short request is the parent, alpha's long ones skip the line past beta;
    when the parent ends they are preempted (KV to host), beta runs, then they resume."""
    with single_thread():
        eng = make_engine(served, max_deltas=1, max_cpu_deltas=4)
        tok = served.tokenizer()
        col = Collector()
        jobs = [("alpha", PROMPTS[0], 4), ("beta", PROMPTS[1], 6), ("alpha", PROMPTS[2], 30), ("alpha", PROMPTS[3], 30)]
        for i, (m, p, n) in enumerate(jobs):  # queued before the engine starts: one FCFS walk sees them all
            eng.submit(m, tok(p)["input_ids"], SamplingParams(max_tokens=n, temperature=0.0), col.sink(i))
        eng.start()
        try:
            col.wait()
            st = eng.stats()
        finally:
            eng.shutdown()
        assert st["preempted"] == 2
        for i, (m, p, n) in enumerate(jobs):
            assert col.final(i).text == served.expected(m, p, n), (m, p)


def test_swap_mode_serves_the_same_outputs(served):
    with single_thread():
        eng = make_engine(served, mode="swap", max_deltas=2, max_cpu_deltas=2)
        tok = served.tokenizer()
        col = Collector()
        eng.start()
        try:
            for m in MODELS:
                for p in PROMPTS[:3]:
                    eng.submit(m, tok(p)["input_ids"], SamplingParams(max_tokens=8, temperature=0.0), col.sink((m, p)))
            col.wait()
        finally:
            eng.shutdown()
        for (m, p), _ in col.events.items():
            assert col.final((m, p)).text == served.expected(m, p, 8), (m, p)


def test_cancel_frees_the_sequence_and_sampling_options(served):
    with single_thread():
        eng = make_engine(served, max_deltas=2)
        tok = served.tokenizer()
        ids = tok(PROMPTS[0])["input_ids"]
        eng.start()
        try:
            col = Collector()
            rid = eng.submit("alpha", ids, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                             col.sink("long"))
            deadline = time.time() + 60
            while not any(isinstance(e, TokenEvent) for e in col.events["long"]) and time.time() < deadline:
                time.sleep(0.01)
            eng.cancel(rid)
            col.wait()
            assert col.final("long").reason == "cancelled"
            assert eng.stats()["running_seqs"] == 0 and eng.stats()["cancelled"] == 1

            # seeded sampling is reproducible; top_p works; stop strings cut the text
            col = Collector()
            for key, seed in (("s1", 7), ("s2", 7), ("s3", 8)):
                eng.submit("beta", ids, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=seed),
                           col.sink(key))
            want = served.expected("gamma", PROMPTS[1], 12)
            stop = want[3:5]
            eng.submit("gamma", tok(PROMPTS[1])["input_ids"], SamplingParams(max_tokens=12, temperature=0.0,
                                                                             stop=[stop]), col.sink("stop"))
            col.wait()
        finally:
            eng.shutdown()
        assert col.final("s1").text == col.final("s2").text
        assert col.final("stop").text == want[:want.find(stop)] and col.final("stop").reason == "stop"
        assert col.streamed("stop") == col.final("stop").text


def test_requests_are_validated_before_queueing(served):
    with single_thread():
        eng = make_engine(served, max_deltas=1, max_queue=2, max_batch_tokens=64)
        ok = SamplingParams(max_tokens=4, temperature=0.0)
        with pytest.raises(UnknownModel):
            eng.submit("nope", [1, 2], ok, lambda e: None)
        with pytest.raises(PromptTooLong, match="maximum context length"):
            eng.submit("alpha", [5] * 100, SamplingParams(max_tokens=40), lambda e: None)
        with pytest.raises(PromptTooLong, match="max-batch-tokens"):
            eng.submit("alpha", [5] * 70, SamplingParams(max_tokens=4), lambda e: None)
        with pytest.raises(EngineError, match="token ids"):
            eng.submit("alpha", [5, 999], ok, lambda e: None)
        with pytest.raises(EngineError, match="temperature"):
            SamplingParams(temperature=3.0)
        # The engine is not started, so nothing drains the queue: the third request is refused.
        eng.submit("alpha", [5, 6], ok, lambda e: None)
        eng.submit("beta", [5, 6], ok, lambda e: None)
        with pytest.raises(QueueFull):
            eng.submit("alpha", [5, 6], ok, lambda e: None)
        eng.shutdown()


def test_incremental_detokenizer_holds_back_possible_stop_prefixes(served):
    tok = served.tokenizer()
    ids = tok("abcdefgh", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, [0], ["efx"])
    pieces = []
    for t in ids:
        d.add(t)
        assert not d.find_stop()
        pieces.append(d.take(final=False))
    pieces.append(d.take(final=True))
    assert "".join(pieces) == "abcdefgh"
    assert pieces[-1] == "gh"  # the last len(stop) - 1 characters wait until the text is final


# ------------------------------------------------------------------------------------------------
# Tiered cache on its own
# ------------------------------------------------------------------------------------------------


class FakeVariant:
    def __init__(self, name):
        self.name = name

    def nbytes(self):
        return 10


def test_tiered_cache_slots_host_lru_and_prefetch():
    loads, device = [], {}
    gate = threading.Event()

    def load(name):
        if name == "slow":
            gate.wait(10)
        loads.append(name)
        return FakeVariant(name)

    cache = TieredCache(load, lambda s, n, obj: device.__setitem__(s, n), lambda s: device.pop(s, None),
                        num_slots=2, max_cpu=2)
    try:
        assert cache.ensure(["a", "b"]) == {"a": 0, "b": 1}
        assert cache.ensure(["a"]) == {"a": 0}  # device hit: nothing loaded
        assert loads == ["a", "b"]
        # "c" evicts the least recently used slot not asked for ("b").
        assert cache.ensure(["c"], keep=["a"]) == {"c": 1}
        assert device == {0: "a", 1: "c"} and cache.resident() == ["a", "c"]
        assert cache.on_host() == ["b", "c"]  # host LRU of 2: "a" fell out
        with pytest.raises(SlotsExhausted):
            cache.ensure(["x", "y", "z"])
        # prefetch loads in the background; host_get of a prefetched variant is a host hit
        cache.prefetch(["slow"])
        time.sleep(0.05)
        assert "slow" not in cache.on_host()
        gate.set()
        obj = cache.host_get("slow")
        assert obj.name == "slow" and loads.count("slow") == 1
        st = cache.stats
        assert st["c"].disk_loads == 1 and st["a"].device_hits == 1 and st["slow"].host_bytes == 10
    finally:
        cache.shutdown()


def test_a_variant_that_fails_to_load_fails_only_its_requests(served, tmp_path):
    """Corrupt bytes in one artifact: its requests end with an error naming it, the others are served."""
    import shutil

    from deltazip.compress.checkpoint import Checkpoint
    from deltazip.runtime.model import DeltaModel, discover_artifacts, eos_token_ids

    arts = tmp_path / "arts"
    shutil.copytree(served.artifacts, arts)
    container = next((arts / "beta").glob("*.safetensors"))
    raw = bytearray(container.read_bytes())
    raw[-64:] = bytes(64)  # tensor data, past the header: only the checksum can notice
    container.write_bytes(bytes(raw))
    with single_thread():
        variants = discover_artifacts(arts)
        backend = DeltaModel(Checkpoint(served.base_dir), variants, 2, torch.device("cpu"), torch.float32)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(served.base_dir)
        eos = eos_token_ids(served.base_dir, tok, backend.config)
        table = {"base": ServedVariant("base", tok, eos, None)}
        table.update({v.name: ServedVariant(v.name, tok, eos, "base") for v in variants})
        eng = Engine(backend, table, "base", EngineConfig(max_deltas=2, max_cpu_deltas=0))
        col = Collector()
        enc = served.tokenizer()
        for m in ("alpha", "beta", "gamma"):
            eng.submit(m, enc(PROMPTS[0])["input_ids"], SamplingParams(max_tokens=5, temperature=0.0), col.sink(m))
        eng.start()
        try:
            col.wait()
            with pytest.raises(EngineError, match="beta cannot be loaded"):
                eng.submit("beta", [0, 5], SamplingParams(max_tokens=2), lambda e: None)
        finally:
            eng.shutdown()
    assert col.final("beta").reason == "error" and "corrupt" in col.final("beta").error
    for m in ("alpha", "gamma"):
        assert col.final(m).text == served.expected(m, PROMPTS[0], 5)
