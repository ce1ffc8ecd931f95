"""The continuous-batching engine and the tiered cache, without HTTP."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _serving import PROMPTS, VARIANTS, served_set, single_thread

from deltazip.runtime.serve.delta_cache import SlotsExhausted, TieredCache
from deltazip.runtime.serve.engine import (
    Engine,
    EngineError,
    FinishEvent,
    IncrementalDetokenizer,
    PromptTooLong,
    QueueFull,
    SamplingParams,
    TokenEvent,
    UnknownModel,
)

MODELS = ["base", *sorted(VARIANTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


def serve_config(served, mode="delta", **cfg):
    from deltazip.runtime.serve.assembly import ServeConfig

    return ServeConfig(served.artifacts, base=str(served.base_dir), base_name="base", mode=mode, device="cpu",
                       dtype="float32", **cfg)


def make_engine(served, mode="delta", **cfg) -> Engine:
    from deltazip.runtime.serve.assembly import build_engine

    return build_engine(serve_config(served, mode, **cfg))


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
        # Memory gauges: the base plus the two filled slots; the KV pool is empty once all finished.
        be = eng.backend
        assert st["device_weight_bytes"] == be.base_bytes() + be.slot_bytes(0) + be.slot_bytes(1) > be.base_bytes()
        assert eng.paged and eng.kv_pool.nbytes() == 0 and eng.kv_pool.num_blocks == 0


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


def test_a_tagged_request_reports_its_progress_before_what_it_announces(served):
    """A request submitted under ``REQUEST_TAG`` is reported to the observer as ``prefilling`` once
    (its prompt read in several chunks) and ``generating`` once, both before its first token reaches
    its sink; an untagged request is not reported."""
    from deltazip.runtime.serve.assembly import build_engine
    from deltazip.runtime.serve.engine import REQUEST_TAG

    order: list[tuple] = []

    class Observer:
        def ttft(self, seconds): pass
        def e2e(self, seconds): pass
        def finished(self, reason): pass
        def request_state(self, tag, state): order.append((tag, state))

    with single_thread():
        eng = build_engine(serve_config(served, max_deltas=2, max_batch_tokens=4), observer=Observer())
        ids = served.tokenizer()(PROMPTS[3])["input_ids"]
        assert len(ids) > 8  # read in more than two chunks of 4
        eng.start()
        try:
            col = Collector()
            for key, tag in (("tagged", "t-1"), ("plain", None)):
                sink = col.sink(key)
                token = REQUEST_TAG.set(tag)
                try:
                    eng.submit("alpha", ids, SamplingParams(max_tokens=6, temperature=0.0),
                               lambda ev, key=key, sink=sink: (order.append((key, type(ev).__name__)), sink(ev)))
                finally:
                    REQUEST_TAG.reset(token)
            col.wait()
        finally:
            eng.shutdown()
    tagged = [e for e in order if e[0] in ("t-1", "tagged")]
    assert tagged[:3] == [("t-1", "prefilling"), ("t-1", "generating"), ("tagged", "TokenEvent")], tagged
    assert [e for e in order if e[0] == "t-1"] == [("t-1", "prefilling"), ("t-1", "generating")]
    assert all(e[0] != "plain" or e[1] in ("TokenEvent", "FinishEvent") for e in order)
    assert col.final("tagged").text == col.final("plain").text == served.expected("alpha", PROMPTS[3], 6)


def test_requests_are_validated_before_queueing(served):
    with single_thread():
        # Without chunked prefill a prompt must fit in one step's token budget.
        eng = make_engine(served, max_deltas=1, max_queue=2, max_batch_tokens=64, chunked_prefill=False)
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

    from deltazip.runtime.serve.assembly import build_engine
    from deltazip.runtime.serve.variant_sources import discover_variants

    arts = tmp_path / "arts"
    shutil.copytree(served.artifacts, arts)
    variants = discover_variants(arts)  # the files were sound when the server found them
    container = next((arts / "beta").glob("*.safetensors"))
    raw = bytearray(container.read_bytes())
    raw[-64:] = bytes(64)  # tensor data, past the header: only the checksum can notice
    container.write_bytes(bytes(raw))
    with single_thread():
        eng = build_engine(serve_config(served, max_deltas=2, max_cpu_deltas=0), variants)
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


def test_kv_pool_rows_grow_offload_restores_and_idle_pool_holds_nothing():
    from deltazip.runtime.serve.model_runner import KVPool, SeqKV, StepKV

    torch.manual_seed(0)
    pool = KVPool()
    seqs = [SeqKV() for _ in range(10)]  # more than the first allocation of 8 rows: the pool grows
    past, new = [0] * 10, [3, 5, 1, 2, 4, 3, 5, 1, 2, 4]
    step = StepKV(pool, seqs, past, new)
    k = torch.randn(10, 2, 5, 4)
    v = torch.randn(10, 2, 5, 4)
    keys, values = step.update(k, v, 0)
    assert keys.shape == (10, 2, 5, 4) and pool.rows >= 10 and pool.capacity >= 5
    for s, n in zip(seqs, new):
        s.length = n
    # Each row holds exactly its real (right-aligned) new tokens.
    for i, (s, n) in enumerate(zip(seqs, new)):
        torch.testing.assert_close(pool.k[0][s.row, :, :n], k[i, :, 5 - n:])
    # A decode step gathers every row's past right in front of its new token, right-aligned (rows in
    # any order); the slots before a shorter row's past hold no key of it (key position -1).
    order = [3, 0, 7]
    step2 = StepKV(pool, [seqs[i] for i in order], [new[i] for i in order], [1, 1, 1])
    k2 = torch.randn(3, 2, 1, 4)
    keys2, _ = step2.update(k2, k2, 0)
    length = max(new[i] for i in order) + 1
    assert keys2.shape == (3, 2, length, 4)
    key_pos, query_pos = step2.positions("cpu")
    for j, i in enumerate(order):
        torch.testing.assert_close(keys2[j, :, length - 1 - new[i]:-1], k[i, :, 5 - new[i]:])
        torch.testing.assert_close(keys2[j, :, -1], k2[j, :, 0])
        assert key_pos[j].tolist() == [-1] * (length - 1 - new[i]) + list(range(new[i] + 1))
        assert query_pos[j].tolist() == [new[i]]
        seqs[i].length += 1
    # Preemption: the cache goes to the host and comes back bit for bit into another row.
    before = pool.k[0][seqs[3].row, :, :seqs[3].length].clone()
    seqs[3].offload()
    assert seqs[3].row is None and seqs[3].nbytes() == before.numel() * 4 * 2
    seqs[3].attach(pool)
    assert torch.equal(pool.k[0][seqs[3].row, :, :seqs[3].length], before)
    for s in seqs:
        s.free()
    assert pool.rows == 0 and pool.k == []  # idle: no KV memory held


def test_kv_pool_against_per_sequence_lists_under_random_churn():
    """Sequences join, finish and are preempted (KV to host and back) at random while the pool
    grows in rows and length: every step's gathered past equals what each sequence wrote."""
    import random

    from deltazip.runtime.serve.model_runner import KVPool, SeqKV, StepKV

    rng = random.Random(0)
    torch.manual_seed(0)
    pool, ref, seqs = KVPool(), {}, {}
    for _ in range(300):
        if rng.random() < 0.3 or not seqs:
            sid = len(ref)
            seqs[sid], ref[sid] = SeqKV(), []
        if rng.random() < 0.15 and len(seqs) > 1:
            sid = rng.choice(list(seqs))
            seqs.pop(sid).free()
        if rng.random() < 0.1:
            seqs[rng.choice(list(seqs))].offload()
        batch = rng.sample(list(seqs), k=rng.randint(1, len(seqs)))
        past = [seqs[s].length for s in batch]
        new = [rng.randint(1, 3) if p == 0 else 1 for p in past]
        tm = max(new)
        step = StepKV(pool, [seqs[s] for s in batch], past, new)
        for layer in range(2):
            ks = torch.randn(len(batch), 2, tm, 4)
            keys, values = step.update(ks, -ks, layer)
            length = max(p + n for p, n in zip(past, new))
            for i, s in enumerate(batch):
                got = keys[i, :, length - new[i] - past[i]: length - new[i]].transpose(0, 1)
                want = torch.stack([t[layer] for t in ref[s]]) if past[i] else got
                got_v = values[i, :, length - new[i] - past[i]: length - new[i]].transpose(0, 1)
                assert torch.equal(got, want) and torch.equal(got_v, -want)
                assert torch.equal(keys[i, :, -new[i]:], ks[i, :, tm - new[i]:])
            if layer == 0:
                new_tokens = [[ks[i, :, tm - n + j].clone() for j in range(n)] for i, n in enumerate(new)]
            else:
                for i, s in enumerate(batch):
                    ref[s] += [(a, ks[i, :, tm - new[i] + j].clone()) for j, a in enumerate(new_tokens[i])]
        for s, n in zip(batch, new):
            seqs[s].length += n
    assert pool.rows >= 8 and pool.capacity >= max(s.length for s in seqs.values())


def test_chunked_prefill_keeps_decodes_going_and_outputs_equal_generate(served):
    """A prompt longer than the step's token budget arrives while two sequences decode: it is fed in
    chunks of what the budget leaves, the decoders get a token in every step meanwhile, and every
    output equals the merged model's ``generate``."""
    with single_thread():
        eng = make_engine(served, max_deltas=2, max_batch_tokens=12)
        assert eng.paged
        tok = served.tokenizer()
        rows_of_step: dict[int, dict[str, tuple[int, bool]]] = {}
        forward = eng._forward
        long_prompt = " ".join(PROMPTS) + " zip"
        long_ids = tok(long_prompt)["input_ids"]
        assert len(long_ids) > 3 * 12
        col = Collector()
        long_rid = []

        def spy(group, row_slots, *more):  # engine thread: which rows ran in which step, and how many tokens
            rows_of_step.setdefault(eng.counters["steps"], {}).update(
                {s.rid: (len(t), bool(s.output_ids)) for s, t in group})
            if not long_rid and len(group) == 2 and all(len(s.output_ids) >= 2 for s, _ in group):  # both decode
                long_rid.append(eng.submit("beta", long_ids, SamplingParams(max_tokens=6, temperature=0.0),
                                           col.sink("long")))
            return forward(group, row_slots, *more)

        eng._forward = spy
        # beta resident from the start: its background load would otherwise hold the long prompt back
        # while the decoders run towards their end. alpha too: when its background load landed a few
        # steps late, base (which stops at its EOS around step 16) was too far ahead to overlap the
        # long prefill (a race that failed about one run in ten).
        eng.cache.ensure(["alpha", "beta"])
        rids = {eng.submit(m, tok(PROMPTS[i])["input_ids"], SamplingParams(max_tokens=40, temperature=0.0),
                           col.sink(m)): m for i, m in enumerate(("alpha", "base"))}
        eng.start()
        try:
            col.wait()
        finally:
            eng.shutdown()
        assert col.final("long").text == served.expected_ids("beta", tuple(long_ids), 6)
        for i, m in enumerate(("alpha", "base")):
            assert col.final(m).text == served.expected(m, PROMPTS[i], 40)
        assert long_rid, "the decoders never ran together"
        long_rid = long_rid[0]
        chunks = {s: rows[long_rid][0] for s, rows in rows_of_step.items()
                  if long_rid in rows and not rows[long_rid][1]}
        assert len(chunks) >= 3 and sum(chunks.values()) == len(long_ids)
        overlapped = 0
        for s in chunks:
            decoding = [rid for rid, (n, dec) in rows_of_step[s].items() if dec and rid in rids]
            assert chunks[s] <= 12 - len(decoding)  # the budget is shared: decodes first
            overlapped += len(decoding)
            assert all(rows_of_step[s][rid] == (1, True) for rid in decoding)
        # Both decoders produced a token in every step of the long prefill they were alive for.
        for rid in rids:
            alive = [s for s, rows in rows_of_step.items() if rid in rows and rows[rid][1]]
            assert alive == list(range(alive[0], alive[-1] + 1))
        assert overlapped >= 2 * (len(chunks) - 1)


def test_models_without_the_attention_interface_use_the_contiguous_cache(served, monkeypatch):
    """A model class that takes no attention function (the ALiBi models) keeps SDPA and the
    contiguous ``StepKV`` pool, selected automatically; its outputs still equal ``generate``."""
    from transformers import LlamaForCausalLM

    from deltazip.runtime.serve.model_runner import KVPool

    monkeypatch.setattr(LlamaForCausalLM, "_supports_attention_backend", False)
    with single_thread():
        eng = make_engine(served, max_deltas=2)
        assert not eng.paged and isinstance(eng.kv_pool, KVPool)
        assert eng.backend.config._attn_implementation == "sdpa"
        tok = served.tokenizer()
        eng.start()
        try:
            col = Collector()
            for m in ("base", "alpha"):
                for p in PROMPTS[:2]:
                    eng.submit(m, tok(p)["input_ids"], SamplingParams(max_tokens=8, temperature=0.0), col.sink((m, p)))
            col.wait()
        finally:
            eng.shutdown()
        for (m, p) in col.events:
            assert col.final((m, p)).text == served.expected(m, p, 8), (m, p)


def test_samples_that_cannot_run_together_are_refused_before_queueing(served):
    """n (or best_of) samples decode side by side: more than --max-num-seqs, or a KV cache larger
    than the device's free memory (a model whose KV is 1 TiB per token, here), is a 400 naming it."""
    with single_thread():
        eng = make_engine(served, max_num_seqs=4)
        with pytest.raises(EngineError, match="max-num-seqs") as e:
            eng.submit_samples("alpha", [5, 6], SamplingParams(n=5), [lambda ev: None] * 5)
        assert e.value.param == "n"
        with pytest.raises(EngineError, match="max-num-seqs") as e:
            eng.submit_samples("alpha", [5, 6], SamplingParams(n=2, best_of=6), [lambda ev: None] * 6)
        assert e.value.param == "best_of"
        eng.kv_bytes_per_token = 2**40
        with pytest.raises(EngineError, match="KV cache") as e:
            eng.submit_samples("alpha", [5, 6], SamplingParams(n=2, max_tokens=4), [lambda ev: None] * 2)
        assert e.value.param == "n"
        eng.submit("alpha", [5, 6], SamplingParams(max_tokens=4), lambda ev: None)  # one sample is never refused so
        eng.shutdown()
