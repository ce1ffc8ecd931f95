"""`deltazip serve --workers K`: a weight owner, worker processes mapping its weights, the HTTP front.

Real processes and real HTTP on loopback ports, tiny models from ``_serving`` / ``_factories``.
Memory is read from ``/proc/PID/smaps_rollup``: USS (Private_Clean + Private_Dirty, what a process
frees when it dies) shows that a worker holds no private copy of the weights; the sum of PSS over
all processes of a deployment (shared pages split between their users) is its physical footprint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from _factories import calib_file, perturb, tiny_model
from _serving import PROMPTS, send_completion, served_set, single_thread, stream_outcome

from deltazip.runtime.cluster.workers import WorkerPool
from deltazip.runtime.serve.assembly import ServeConfig
from deltazip.runtime.share import weight_share as ws
from deltazip.runtime.share.dedup_registry import SharedTensorWriteError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd, /proc and abstract sockets")

KEY = "sk-workers"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny-base"
MODELS = [BASE, "alpha", "beta", "gamma"]
ENV = {"OMP_NUM_THREADS": "1"}


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still in the table: only acceptable as a zombie nobody reaps (not ours: Popen reaps).
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def complete(url: str, model: str, prompt: str, n: int, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, **kw})


def ref(served, model: str, prompt: str, n: int) -> str:
    return served.expected("base" if model == BASE else model, prompt, n)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


@pytest.fixture(scope="module")
def pool(served):
    shm_before = shm_entries()
    cfg = ServeConfig(artifacts=served.artifacts, api_key=KEY, max_deltas=2, max_cpu_deltas=4, cpu_threads=1,
                      port=0)
    with WorkerPool(cfg, workers=2, env=ENV, restart_backoff=0.2) as p:
        p.shm_before = shm_before
        yield p


def test_two_workers_sharing_weights_match_the_merged_models(pool, served):
    """Every worker (asked directly on its own port) and the front give the merged model's greedy text."""
    h = pool.health()
    assert h["workers_ready"] == 2 and all(w["weights"] == "mapped" for w in h["workers"])
    jobs = [(m, p) for m in MODELS for p in PROMPTS[:2]]
    with single_thread():
        want = [ref(served, m, p, 10) for m, p in jobs]
    for w in pool.workers:
        got = [complete(w.url, m, p, 10).json()["choices"][0]["text"] for m, p in jobs]
        assert got == want, f"worker {w.index}"
    via_front = [complete(pool.url, m, p, 10) for m, p in jobs]
    assert [r.json()["choices"][0]["text"] for r in via_front] == want
    # Affinity: under light load every request for one variant lands on one worker (it loads the
    # variant once); the base's, which need no slot, spread least-busy with round-robin ties.
    where: dict[str, set[str]] = {}
    for (m, _), r in zip(jobs, via_front):
        where.setdefault(m, set()).add(r.headers["x-deltazip-worker"])
    assert all(len(where[m]) == 1 for m in MODELS if m != BASE), where
    assert where[BASE] == {"0", "1"}
    homes = {m: {w["index"] for w in pool.health()["workers"] if m in w["variants"]} for m in MODELS}
    assert all(homes[m] == {int(i) for i in where[m]} for m in MODELS if m != BASE) and not homes[BASE]
    # SSE passes through the front chunk by chunk.
    with httpx.stream("POST", pool.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "alpha", "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0,
                            "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(c["text"] for x in lines[:-1] for c in json.loads(x[6:])["choices"])
    assert text == ref(served, "alpha", PROMPTS[1], 10)


def test_front_models_auth_health_and_metrics(pool):
    r = httpx.get(pool.url + "/v1/models", headers=AUTH)
    assert sorted(m["id"] for m in r.json()["data"]) == sorted(MODELS)
    r = httpx.get(pool.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    h = httpx.get(pool.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json()["owner"]["shared_bytes"] > 0
    text = httpx.get(pool.url + "/metrics").text
    assert 'deltazip_worker_up{worker="0"} 1.0' in text and 'deltazip_worker_up{worker="1"} 1.0' in text
    gen = [line for line in text.splitlines() if line.startswith("deltazip_generated_tokens_total{")]
    routed = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("deltazip_front_routed_total{")}
    assert routed["affinity"] >= 3 and routed["least_busy"] >= 3  # 3 variants' repeats; first picks + base
    assert {line.split('worker="')[1][0] for line in gen} == {"0", "1"}  # per-worker series
    assert httpx.get(pool.url + "/nope").status_code == 404


def test_sampling_fields_and_tokenizer_routes_pass_through_the_front(pool, served):
    """Log probabilities, echo, n with a seed and vLLM's tokenizer routes work through the front."""
    tok = served.tokenizer()
    r = complete(pool.url, "beta", PROMPTS[0], 4, logprobs=1, echo=True).json()["choices"][0]
    assert r["text"].startswith(PROMPTS[0]) and r["logprobs"]["token_logprobs"][0] is None
    assert len(r["logprobs"]["tokens"]) == len(tok(PROMPTS[0])["input_ids"]) + 4
    seeded = {"model": "gamma", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3}
    a, b = (sorted((c["index"], c["text"]) for c in httpx.post(pool.url + "/v1/completions", headers=AUTH, json=seeded,
                                                               timeout=120).json()["choices"]) for _ in range(2))
    assert a == b and len({t for _, t in a}) == 3
    ids = httpx.post(pool.url + "/tokenize", headers=AUTH, json={"model": "alpha", "prompt": PROMPTS[2]}).json()["tokens"]
    assert ids == tok(PROMPTS[2])["input_ids"]
    assert httpx.post(pool.url + "/detokenize", headers=AUTH, json={"tokens": ids}).json()["prompt"] == tok.decode(ids)
    assert httpx.get(pool.url + "/tokenizer_info", headers=AUTH).json()["eos_token"] == tok.eos_token
    assert httpx.post(pool.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_front_refuses_an_oversized_body_before_reading_it(pool):
    """The front applies --max-request-bytes itself (413 in OpenAI's shape), from Content-Length, so a
    huge body never reaches a worker; a body under the limit still goes through."""
    limit = pool.cfg.max_request_bytes
    big = {"model": "alpha", "prompt": "z" * (limit + 1), "max_tokens": 1}
    r = httpx.post(pool.url + "/v1/completions", headers=AUTH, json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert "x-deltazip-worker" not in r.headers  # answered by the front
    ok = httpx.post(pool.url + "/v1/completions", headers=AUTH, json={"model": "alpha", "prompt": "zip",
                                                                      "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_mapped_weights_are_sealed_and_read_only(pool, tmp_path):
    meta, fd = ws.request_export(pool.address)
    try:
        assert ws.seals(fd) == {"F_SEAL_WRITE", "F_SEAL_GROW", "F_SEAL_SHRINK", "F_SEAL_SEAL"}
        with pytest.raises(PermissionError):  # the kernel refuses any writable shared mapping
            mmap.mmap(fd, meta.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    shared = ws.attach(pool.address)
    assert shared.meta.checksum == ws._hash(shared._keep[0], shared.meta.nbytes)
    w = shared.tensors["model.layers.0.mlp.up_proj.weight"]
    before = w.clone()
    for write in (lambda: w.add_(1), lambda: w.copy_(torch.zeros_like(w)), lambda: w[0].fill_(0),
                  lambda: torch.nn.init.normal_(w)):
        with pytest.raises(SharedTensorWriteError):
            write()
    assert torch.equal(w, before)
    # Going around the guard writes to a PROT_READ page: the process faults, the weights stay intact.
    code = ("import sys; from deltazip.runtime.share import weight_share as ws\n"
            f"s = ws.attach({pool.address!r})\n"
            "t = s.tensors['model.layers.0.mlp.up_proj.weight']\n"
            "t.untyped_storage().fill_(0)\nprint('wrote')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == -signal.SIGSEGV and "wrote" not in proc.stdout, proc.stderr[-2000:]
    assert torch.equal(w, before)
    model = shared.build_model(torch.float32, "cpu")
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() == w.data_ptr()


def test_a_workers_serving_model_holds_no_private_copy_of_a_weight(pool, served):
    """The decoupled model a worker serves, built here over the owner's mapping as a worker builds
    it: every base parameter, and every q/k/v and gate/up group's stacked weight (one GEMM each),
    lies inside the mapped buffer. The owner lays each group out back to back, so stacking is a view."""
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.delta_linear import DeltaLinear
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import discover_variants

    shared = ws.attach(pool.address)
    ws.install(shared)
    try:
        with single_thread():
            dm = DeltaModel(Checkpoint(served.base_dir), discover_variants(served.artifacts), num_slots=2,
                            device=torch.device("cpu"), dtype=torch.float32)
    finally:
        ws.install(None)
    lo, hi = shared.buffer.data_ptr(), shared.buffer.data_ptr() + shared.meta.nbytes

    def mapped(t: torch.Tensor) -> bool:
        return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi

    params = dict(dm.model.named_parameters())
    assert params and all(mapped(p) for p in params.values()), [n for n, p in params.items() if not mapped(p)]
    groups = {id(m.merged): m.merged for m in dm.modules.values() if isinstance(m, DeltaLinear) and m.merged}
    assert len(groups) == 2 * dm.config.num_hidden_layers  # q/k/v and gate/up of every layer
    assert all(mapped(g.weight) for g in groups.values())


def _long_job(served) -> tuple[str, str]:
    """A (model, prompt) whose greedy completion runs the full 100 tokens (no early end)."""
    with single_thread():
        return max(((m, p) for m in ("alpha", "gamma") for p in PROMPTS),
                   key=lambda j: len(ref(served, j[0], j[1], 100)))


def _wait_ready(pool, index: int, old_pid: int, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        w = pool.workers[index]
        if w.state == "ready" and w.pid != old_pid:
            return
        time.sleep(0.05)
    raise AssertionError(f"worker {index} did not come back: {pool.health()}")


def _other_worker_traffic(pool, served, index: int, results: list, stop: threading.Event) -> None:
    """Requests straight to worker ``index`` while its sibling is killed: all must succeed."""
    url = pool.workers[index].url
    i = 0
    while not stop.is_set():
        m, p = MODELS[i % 4], PROMPTS[i % 3]
        r = complete(url, m, p, 8)
        results.append(r.status_code == 200 and r.json()["choices"][0]["text"] == ref(served, m, p, 8))
        i += 1


def _pin_to(pool, busy):
    """Make the front prefer ``busy`` (the others look loaded); undo with ``_pin_to(pool, None)``."""
    for w in pool.workers:
        if w is not busy:
            w.outstanding += 1000 if busy is not None else -1000


def _wait_started(pool, pid: int, n: int, timeout: float = 60) -> None:
    """Until ``n`` requests on worker process ``pid`` have their first token sampled (as reported)."""
    deadline = time.time() + timeout
    while True:
        pool.read_reports(pid)
        with pool.flights.lock:
            started = sum(f.pid == pid and f.state == "generating" for f in pool.flights.open.values())
        if started >= n:
            return
        assert time.time() < deadline, f"{started} of {n} requests started: {pool.health()}"
        time.sleep(0.002)


def test_killed_worker_costs_only_what_it_had_sent_and_comes_back(pool, served):
    """A stream that had sent chunks ends with an error event and [DONE]; non-streamed requests that
    were generating are rerun elsewhere when greedy, refused with 503 + Retry-After when sampled; the
    other worker's requests are untouched; both workers come back."""
    model, prompt = _long_job(served)
    with single_thread():
        for m in MODELS:  # fill the reference cache before the timing-sensitive part
            for p in PROMPTS[:3]:
                ref(served, m, p, 8)
        want = ref(served, model, prompt, 100)
    restarts = sum(w.restarts for w in pool.workers)

    # 1) Streaming: killed after its first chunk -> the stream ends with an OpenAI-shaped error event.
    with httpx.stream("POST", pool.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": 100, "temperature": 0,
                            "stream": True}) as r:
        victim = int(r.headers["x-deltazip-worker"])
        pid = pool.workers[victim].pid
        ok, stop = [], threading.Event()
        t = threading.Thread(target=_other_worker_traffic, args=(pool, served, 1 - victim, ok, stop))
        t.start()
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        assert "choices" in first
        os.kill(pid, signal.SIGKILL)
        rest = [x for x in lines if x.startswith("data: ")]
    assert r.status_code == 200
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "worker_failed", rest[-2:]
    got = "".join(c["text"] for x in [first, *rest[:-2]] for c in json.loads(x[6:])["choices"])
    assert want.startswith(got)
    _wait_ready(pool, victim, pid)
    stop.set()
    t.join()
    assert ok and all(ok), "a request on the surviving worker failed"

    # 2) Non-streaming, both generating on one worker when it is killed: the greedy one is rerun on
    # the other worker (same text), the sampled one (temperature > 0, no seed) gets a 503.
    busy = pool.workers[1 - victim]
    old_pid, out = busy.pid, {}
    jobs = {"greedy": 0, "sampled": 0.01}  # 0.01: sampled by the rule, all but greedy in fact (runs 100 tokens)
    _pin_to(pool, busy)
    try:
        ths = [threading.Thread(target=lambda k=k, t=t: out.setdefault(k, complete(pool.url, model, prompt, 100,
                                                                                    temperature=t)))
               for k, t in jobs.items()]
        for th in ths:
            th.start()
        _wait_started(pool, old_pid, 2)
        os.kill(old_pid, signal.SIGKILL)
        for th in ths:
            th.join(60)
    finally:
        _pin_to(pool, None)
    assert out["greedy"].status_code == 200, out["greedy"].text
    assert out["greedy"].json()["choices"][0]["text"] == want
    assert out["greedy"].headers["x-deltazip-worker"] == str(victim)  # rerun on the other one
    r = out["sampled"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_failed", r.text
    assert int(r.headers["retry-after"]) >= 1 and "not rerun" in r.json()["error"]["message"]

    # Both restarted, with new processes, and serving correct outputs again (directly and via the front).
    _wait_ready(pool, busy.index, old_pid)
    assert sum(w.restarts for w in pool.workers) == restarts + 2
    for w in pool.workers:
        assert complete(w.url, "beta", PROMPTS[0], 8).json()["choices"][0]["text"] == ref(served, "beta", PROMPTS[0], 8)
    assert complete(pool.url, "gamma", PROMPTS[2], 8).json()["choices"][0]["text"] == ref(served, "gamma", PROMPTS[2], 8)
    assert pool.owner.poll() is None  # the owner outlived the workers
    h = pool.health()
    assert all(w["weights"] == "mapped" for w in h["workers"])
    assert h["resubmitted"] >= 1 and h["refused"] >= 1 and h["stream_errors"] >= 1, h
    assert all(w["last_death"]["signal"] == "SIGKILL" for w in h["workers"]), h["workers"]


def test_a_worker_killed_under_load_loses_no_request_that_had_not_started_answering(served):
    """60 concurrent greedy requests (half streamed) over the base and a variant on 2 workers taking 4
    sequences each, so most requests are queued; one worker is SIGKILLed as soon as a stream from it
    has a chunk. Every non-streamed request answers the merged model's text; every stream completes
    with it, or ends with an error event and [DONE] after having sent chunks; no connection is cut;
    /health stays 200 (``degraded``) meanwhile, and the worker is back within 10 s (the standby
    takes its place)."""
    n = 24
    jobs = [(BASE if i % 2 else "alpha", PROMPTS[i % 5], i % 4 < 2) for i in range(60)]
    with single_thread():
        want = [ref(served, m, p, n) for m, p, _ in jobs]
    cfg = ServeConfig(artifacts=served.artifacts, api_key=KEY, max_deltas=2, max_cpu_deltas=4, cpu_threads=1,
                      port=0, max_num_seqs=4)

    async def load(pool):
        async with httpx.AsyncClient(base_url=pool.url, headers=AUTH, timeout=120) as http:
            first = asyncio.get_running_loop().create_future()
            tasks = [asyncio.create_task(send_completion(http, {"model": m, "prompt": p, "max_tokens": n, "temperature": 0,
                                                                "stream": st}, "x-deltazip-worker", first))
                     for m, p, st in jobs]
            victim = int(await asyncio.wait_for(first, 120))
            pid = pool.workers[victim].pid
            os.kill(pid, signal.SIGKILL)
            killed_at, health = time.monotonic(), []
            while not health or health[-1][1]["workers"][victim]["pid"] == pid or \
                    health[-1][1]["workers"][victim]["state"] != "ready":  # until its new process is ready
                r = await http.get("/health")
                health.append((r.status_code, r.json()))
                assert time.monotonic() - killed_at < 60, health[-1]
                await asyncio.sleep(0.05)
            back_s = time.monotonic() - killed_at
            return victim, pid, await asyncio.gather(*tasks, return_exceptions=True), health, back_s

    with WorkerPool(cfg, workers=2, env=ENV, restart_backoff=0.2) as pool:
        deadline = time.time() + 120  # a server up for a while has its standby warm (imports done)
        while (pool.health()["standby"] or {}).get("state") != "warm":
            assert time.time() < deadline, pool.health()
            time.sleep(0.1)
        victim, pid, outs, health, back_s = asyncio.run(load(pool))
        deadline = time.time() + 30  # a client can read the end of an answer before the front closes it
        while any(pool.health()["requests"].values()) or any(w.outstanding for w in pool.workers):
            assert time.time() < deadline, f"requests left open at the front: {pool.health()}"
            time.sleep(0.05)
        h = pool.health()
        text = httpx.get(pool.url + "/metrics").text
        pool_report = [w.report for w in pool.workers]
    cut = [(j, o) for j, o in zip(jobs, outs) if isinstance(o, BaseException)]
    assert not cut, f"connections cut without an answer: {cut[:3]}"
    errored = 0
    for (m, p, stream), out, w in zip(jobs, outs, want):
        if stream:
            errored += stream_outcome(out, w, str(victim))
        else:
            assert out["status"] == 200 and out["json"]["choices"][0]["text"] == w, (m, p, out)
    # Requests queued on the dead worker were resubmitted; only streams that had sent chunks failed.
    assert h["resubmitted"] >= 1 and h["stream_errors"] == errored and h["refused"] == 0, h
    assert h["worker_deaths"] == 1 and h["worker_restarts"] == 1 and h["workers"][victim]["pid"] != pid
    assert pool_report[victim]["standby"] is True
    assert h["workers"][victim]["last_death"]["signal"] == "SIGKILL"
    assert all(code == 200 for code, _ in health), health  # one worker was ready all along
    assert any(js["status"] == "degraded" and js["workers_ready"] == 1 for _, js in health)
    assert back_s < 10, f"the worker took {back_s:.1f} s to come back"
    assert f'deltazip_worker_deaths_total{{worker="{victim}"}} 1.0' in text
    assert f"deltazip_front_resubmitted_total {float(h['resubmitted'])}" in text


def test_no_worker_ready_is_503(served):
    """A front whose workers are all gone answers 503 in OpenAI's shape, with Retry-After (no hang, no
    500); its /health is 503 too, status "down"."""
    from deltazip.runtime.cluster.workers import create_front
    from deltazip.runtime.serve.server import ServerThread

    never_started = WorkerPool(ServeConfig(artifacts=served.artifacts), workers=2)
    with ServerThread(create_front(never_started)) as srv:
        r = complete(srv.url, "alpha", "x", 1)
        h = httpx.get(srv.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker" and r.headers["retry-after"] == "1"
    assert h.status_code == 503 and h.json()["status"] == "down"


def test_a_mixture_of_experts_base_fused_on_load_is_shared_as_one_view_per_expert_tensor(tmp_path):
    """Mixtral's checkpoint holds one ``w1``/``w3``/``w2`` tensor per expert, which transformers fuses
    on load into ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. The owner lays each fused
    parameter's pieces out back to back in its row order, so a worker's fused experts are views of the
    shared buffer (no private copy), and two workers give the merged model's greedy text for the base
    and a compressed fine-tune."""
    from _images import generate

    from deltazip.compress.config import CompressConfig
    from deltazip.compress.merge import load_merged_model
    from deltazip.compress.pipeline import compress_delta
    from deltazip.demo.pair import build_char_tokenizer
    from deltazip.formats.artifact import Artifact
    from deltazip.kernels.scheme import DeltaScheme
    from deltazip.models.checkpoint import Checkpoint

    ids = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    tok = build_char_tokenizer()
    with single_thread():
        base = tiny_model("mixtral", **ids)
        base.save_pretrained(tmp_path / "base")
        perturb(tiny_model("mixtral", **ids), scale=0.2, seed=3).save_pretrained(tmp_path / "ft")
        for d in ("base", "ft"):
            tok.save_pretrained(tmp_path / d)
        cfg = CompressConfig(scheme=DeltaScheme(bits=4, sparsity="none", group_size=32), method="rtn", device="cpu")
        compress_delta(tmp_path / "base", tmp_path / "ft", None, tmp_path / "arts" / "ft", cfg)
        merged = load_merged_model(Artifact(tmp_path / "arts" / "ft"), Checkpoint(tmp_path / "base"))
        want = {m: generate(model, tok(PROMPTS[0])["input_ids"], None, n=8)[0]
                for m, model in (("base", base), ("ft", merged))}
    assert "w1" in ",".join(Checkpoint(tmp_path / "base").names)  # per-expert tensors on disk
    assert want["base"] != want["ft"] and all(want.values()), want  # the variant's experts change the text
    serve = ServeConfig(artifacts=tmp_path / "arts", api_key=KEY, max_deltas=1, max_cpu_deltas=1, cpu_threads=1,
                        port=0)
    with WorkerPool(serve, workers=2, env=ENV) as pool:
        assert all(w["weights"] == "mapped" for w in pool.health()["workers"])
        for w in pool.workers:
            got = {m: complete(w.url, m, PROMPTS[0], 8).json()["choices"][0]["text"] for m in want}
            assert got == want, f"worker {w.index}"
        shared = ws.attach(pool.address)
        model = shared.build_model(torch.float32, "cpu")
        lo, hi = shared.buffer.data_ptr(), shared.buffer.data_ptr() + shared.meta.nbytes
        experts = model.model.layers[0].mlp.experts
        for p in (experts.gate_up_proj, experts.down_proj):
            assert lo <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= hi
        assert torch.equal(experts.gate_up_proj, base.model.layers[0].mlp.experts.gate_up_proj)


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "kimi_linear"])
def test_converted_checkpoints_map_whole_in_process(tmp_path, arch):
    """Bases whose checkpoints transformers converts on load, mapped as a worker maps them: Qwen3-Next's
    per-expert tensors fused, Nemotron-H's ``backbone.`` names and Kimi Linear's router bias buffer
    (``e_score_correction_bias``) renamed into the module, its convolution pieces concatenated. Every
    parameter and buffer the checkpoint holds lies inside the owner's buffer, and the model's logits
    are the source model's."""
    model = tiny_model(arch)
    base = tmp_path / "base"
    model.save_pretrained(base)
    with _owner(base, ws.fused_runs(base), arch) as shared:
        built = shared.build_model(torch.float32, "cpu", attn_implementation="eager")
    lo, hi = shared.buffer.data_ptr(), shared.buffer.data_ptr() + shared.meta.nbytes
    outside = [n for n, t in list(built.named_parameters()) + list(built.named_buffers(remove_duplicate=False))
               if n in dict(model.state_dict()) and not lo <= t.data_ptr() < hi]
    assert not outside, outside
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        assert torch.allclose(built(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_fused_tensors_not_laid_out_as_one_run_are_refused_with_the_fix(tmp_path):
    """An owner export whose per-expert tensors are not back to back (no runs given) cannot give a
    worker its fused experts as a view: refused in one line pointing at ``--workers 1``, not copied
    privately. A run naming a tensor the checkpoint lacks is refused by the owner."""
    from deltazip.formats.errors import InputError

    base = tmp_path / "base"
    tiny_model("mixtral").save_pretrained(base)
    with pytest.raises(InputError, match=r"the layout names 'model\.layers\.0\.nope', which is not in the checkpoint"):
        ws.plan_layout(base, "F32", [["model.layers.0.nope"]])
    with _owner(base, None, "fused") as shared:
        with pytest.raises(ws.WeightShareError, match=r"is not laid out as a piece of one .*serve it with --workers 1") as e:
            shared.build_model(torch.float32, "cpu")
    assert "\n" not in str(e.value)


@contextlib.contextmanager
def _owner(base: Path, runs, tag: str):
    """A weight owner of ``base`` (fp32, ``runs`` laid out back to back) serving in a thread of this
    process; yields its weights as a worker attaches them."""
    fd, meta, view = ws.export_cpu(base, "F32", runs)
    owner = ws.WeightOwner(meta, f"dz-{tag}-{os.getpid()}", fd=fd, keep=view)
    threading.Thread(target=owner.serve_forever, daemon=True).start()
    try:
        yield ws.attach(owner.address)
    finally:
        owner.close()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A base large enough (31.6 M params, fp16 on disk, 126 MB served in fp32) that its weights
    dominate a worker's private memory, with one RTN variant."""
    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.demo.pair import build_char_tokenizer
    from deltazip.kernels.scheme import DeltaScheme

    root = tmp_path_factory.mktemp("big")
    ids = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    shape = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4)
    tok = build_char_tokenizer()
    with single_thread():
        m = tiny_model("llama", dtype=torch.float16, **ids, **shape)
        m.save_pretrained(root / "base")
        tok.save_pretrained(root / "base")
        perturb(m, scale=0.2, seed=3).save_pretrained(root / "ft")
        tok.save_pretrained(root / "ft")
        cfg = CompressConfig(scheme=DeltaScheme(bits=4, sparsity="none", group_size=128),
                             method="rtn", nsamples=4, seqlen=16, device="cpu")
        compress_delta(root / "base", root / "ft", str(calib_file(root / "calib", n=8)), root / "arts" / "v1", cfg)
    weights = sum(p.numel() for p in m.parameters()) * 4
    return root / "arts", weights


def test_sharing_workers_use_far_less_memory_than_independent_servers(big):
    arts, weights = big
    cfg = ServeConfig(artifacts=arts, max_deltas=1, max_cpu_deltas=1, cpu_threads=1)
    measured, texts = {}, {}
    for share in (True, False):
        # MEASURE_ENV: freed blocks go back to the kernel, so USS is what a worker holds, not what
        # glibc's arenas kept of its frees (which alone moved USS by +-60 MB per worker here).
        with WorkerPool(cfg, workers=2, share=share, front=False, env={**ENV, **ws.MEASURE_ENV},
                        standby=False) as p:  # as bench/share.py
            texts[share] = [complete(w.url, m, "alpha beta", 6).json()["choices"][0]["text"]
                            for w in p.workers for m in ("base", "v1")]
            pids = p.pids()
            procs = {f"worker{i}": ws.smaps_rollup(pid) for i, pid in enumerate(pids["workers"])}
            if share:
                procs["owner"] = ws.smaps_rollup(pids["owner"])
            measured[share] = procs
    assert texts[True] == texts[False]  # mapped fp32 (converted by the owner) == from_pretrained's
    uss = {s: sum(v["USS"] for k, v in m.items() if k != "owner") for s, m in measured.items()}
    pss = {s: sum(v["Pss"] for v in m.values()) for s, m in measured.items()}
    # Each independent worker holds a private fp32 copy (from_pretrained converts the fp16 file into
    # its own memory and unmaps the file); a sharing worker holds none, its q/k/v and gate/up stacks
    # included. Two copies saved; 0.4 of one left for whatever else differs (measured: 2.03).
    assert uss[False] - uss[True] > 1.6 * weights, (uss, weights)
    # Whole deployments (owner included): one copy of the weights instead of two, minus the owner's
    # own small overhead (no torch in it).
    assert pss[False] - pss[True] > 0.6 * weights, (pss, weights)
    assert measured[True]["owner"]["USS"] < 0.5 * weights
    # The weights are counted once: the shared pages' PSS over owner + workers adds up to their size.
    shmem = sum(v.get("Pss_Shmem", 0) for v in measured[True].values())
    assert abs(shmem - weights) < 0.05 * weights, (shmem, weights)


def test_shutdown_leaves_no_processes_or_shm(pool):
    """Closing the pool ends the owner, every worker (current and replaced ones) and the standby, and
    leaves /dev/shm as it was. Runs last: it closes the module's pool."""
    pids = [pool.owner.pid] + [w.pid for w in pool.workers] + [p for p in [pool.pids()["standby"]] if p]
    r = complete(pool.url, "alpha", PROMPTS[0], 4)
    assert r.status_code == 200
    pool.close()
    assert all(gone(pid) for pid in pids), pids
    assert shm_entries() <= pool.shm_before, shm_entries() - pool.shm_before
    with pytest.raises(ws.WeightShareError):
        ws.request_export(pool.address, timeout=2)


@pytest.mark.gpu
def test_cuda_ipc_workers_map_the_same_device_bytes(tmp_path):
    """The owner's CUDA slab opened in another process adds no device memory and reads the same bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = tmp_path / "base"
    m = tiny_model("llama", dtype=torch.float16, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=8, vocab_size=8192)
    m.save_pretrained(base)
    env = ws.strip_expandable_segments(dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    address = f"deltazip-test-{os.getpid()}"
    owner = subprocess.Popen([sys.executable, "-m", "deltazip.runtime.share.weight_share", "--base", str(base), "--dtype",
                              "F16", "--device", "cuda:0", "--address", address], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    try:
        ready = json.loads(owner.stdout.readline())
        assert ready["ready"] and ready["kind"] == "cuda_ipc"
        nbytes = ready["nbytes"]
        code = ("import json, torch; from deltazip.runtime.share import weight_share as ws\n"
                "torch.cuda.init(); torch.zeros(1, device='cuda')\n"
                "f0 = torch.cuda.mem_get_info()[0]\n"
                f"s = ws.attach({address!r})\n"
                "torch.cuda.synchronize(); f1 = torch.cuda.mem_get_info()[0]\n"
                "w = s.tensors['model.layers.0.mlp.up_proj.weight']\n"
                "print(json.dumps({'added': f0 - f1, 'sum': float(w.double().sum()), 'dev': str(w.device),"
                " 'ptr': s.buffer.data_ptr()}))\n")
        outs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                          timeout=300, check=True).stdout.strip().splitlines()[-1])
                for _ in range(2)]
        want = float(m.model.layers[0].mlp.up_proj.weight.double().sum())
        for o in outs:
            assert o["dev"].startswith("cuda") and abs(o["sum"] - want) < 1e-6 * max(1.0, abs(want))
            # Mapping the slab allocates nothing: device free memory does not drop by its size.
            assert o["added"] < 0.1 * nbytes, (o, nbytes)
    finally:
        owner.stdin.close()
        owner.terminate()
        owner.wait(30)


def test_affinity_routing_keeps_a_variant_on_its_home_until_it_is_full(monkeypatch, tmp_path):
    """No processes: the front's choice alone. A variant sticks to the worker that got it first while
    that one has capacity (--max-num-seqs open requests), then overflows to the least busy, which
    becomes a second home; the base goes least-busy; a dead worker loses its homes."""
    from deltazip.runtime.cluster.workers import WorkerState

    pool = WorkerPool(ServeConfig(artifacts=tmp_path, max_num_seqs=2), workers=2)
    monkeypatch.setattr(WorkerState, "alive", lambda self: True)
    for w in pool.workers:
        w.state, w.report = "ready", {"base": "tiny-base"}
    first = pool.pick(set(), "alpha")
    other = pool.workers[1 - first.index]
    assert pool.pick(set(), "alpha") is first  # home, though the other worker is idle
    assert pool.pick(set(), "beta") is other  # a new variant: least busy
    assert pool.pick(set(), "alpha") is other  # home full (2 open): overflow to the least busy
    assert pool.homes["alpha"] == [first.index, other.index]
    pool.release(first)
    assert pool.pick(set(), "alpha") is first  # back under capacity: its first home again
    busy = [w.outstanding for w in pool.workers]
    base = pool.pick(set(), "tiny-base")
    assert base.outstanding - 1 == min(busy) and "tiny-base" not in pool.homes
    pool._mark_dead(first, -9)
    assert pool.homes["alpha"] == [other.index] and pool.pick(set(), "alpha") is other
    assert pool.routed == {"affinity": 2, "least_busy": 5}


def test_a_worker_dying_soon_after_each_start_backs_off_and_says_why(tmp_path, caplog):
    """The supervisor's bookkeeping of a death, on real processes that die as a crashing worker would:
    one dying within a minute of each start is restarted after 0.5, 1, 2, ... s, up to 30 s (no tight
    loop); one that lived longer after 0.5 s again. Each death is logged with its exit code or signal
    and the last line of its stderr, and /health's ``last_death`` shows them."""
    from deltazip.runtime.cluster.workers import QUICK_DEATH_S, _pump_stderr

    pool = WorkerPool(ServeConfig(artifacts=tmp_path), workers=1, restart_backoff=0.5)
    w = pool.workers[0]
    crash = ("import sys; sys.stderr.write('loading\\nCUDA error: an illegal memory access was encountered\\n'); "
             "sys.exit(3)")
    killed = "import os, signal, sys; sys.stderr.write('step 7\\n'); sys.stderr.flush(); os.kill(os.getpid(), signal.SIGKILL)"
    caplog.set_level(logging.WARNING, "deltazip.workers")
    delays, deaths = [], []
    for lived, code in [(5, crash)] * 8 + [(QUICK_DEATH_S + 60, killed), (5, crash)]:
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        w.proc, w.pid, w.state, w.started_at = proc, proc.pid, "ready", time.perf_counter() - lived
        w._stderr_pump = threading.Thread(target=_pump_stderr, args=(w._tail, proc.stderr), daemon=True)
        w._stderr_pump.start()
        pool._mark_dead(w, proc.wait())
        delays.append(round(w.restart_at - time.perf_counter(), 1))
        deaths.append(pool.health()["workers"][0]["last_death"])
        w.restarts += 1
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 0.5, 0.5]
    crash_death = {"code": 3, "signal": None, "stderr": "CUDA error: an illegal memory access was encountered"}
    assert {k: deaths[0][k] for k in crash_death} == crash_death
    assert {k: deaths[8][k] for k in crash_death} == {"code": -9, "signal": "SIGKILL", "stderr": "step 7"}
    logged = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(logged) == 10 and pool.health()["worker_deaths"] == 10
    assert "exit code 3; last stderr line: 'CUDA error: an illegal memory access was encountered'; restarting in " \
           "30.0 s (8 deaths in a row within 60 s of a start)" in logged[7]
    assert "killed by SIGKILL; last stderr line: 'step 7'; restarting in 0.5 s" in logged[8]
