"""``deltazip serve --ray``: a local Ray cluster running the Serve application with 2 engine replicas
over the tiny model pair, driven by the official ``openai`` client and raw HTTP. One cluster for the
module (starting Ray is most of the cost); the last test shuts it down and checks nothing is left."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import time

import httpx
import pytest
from _cli import run_cli
from _serving import PROMPTS, send_completion, served_set, single_thread, stream_outcome

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from deltazip.formats.errors import InputError  # noqa: E402
from deltazip.runtime.cluster import ray_app  # noqa: E402
from deltazip.runtime.serve.assembly import ServeConfig  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "sk-ray-key"
BASE = "tiny-base"
SERVED = ["alpha", "beta", "gamma"]
# Copies of beta and gamma that only the routing test sends requests for: the earlier tests' requests
# may have left a variant on both replicas (a request that arrives before the router has heard that a
# replica loaded it falls back to the replica with the fewest variants), and Ray Serve then spreads
# that variant by load, which is right but is not the affinity under test.
FRESH = {"solo-1": "beta", "solo-2": "gamma"}
LIMIT = 64 * 1024  # --max-request-bytes of the app under test
HEADER = "x-deltazip-replica"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


@pytest.fixture(scope="module")
def cluster(served, tmp_path_factory):
    """The application on a local cluster; yields (url, artifacts dir, the cluster's process ids)."""
    import psutil
    import ray

    arts = tmp_path_factory.mktemp("ray-arts")
    for name in SERVED:
        shutil.copytree(served.artifacts / name, arts / name)
    for name, src in FRESH.items():
        shutil.copytree(served.artifacts / src, arts / name)
    cfg = ServeConfig(artifacts=arts, base=str(served.base_dir), api_key=KEY, port=0, max_deltas=2,
                      max_cpu_deltas=4, max_num_seqs=8, cpu_threads=1, max_request_bytes=LIMIT)
    opts = ray_app.RayOptions(replicas=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        cfg.port = s.getsockname()[1]
    started = ray_app.connect(opts)
    assert started
    procs = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        ray_app.deploy(cfg, opts)
        yield {"url": f"http://127.0.0.1:{cfg.port}", "arts": arts, "procs": procs}
    finally:
        if ray.is_initialized():
            ray_app.shutdown(started)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def expected(served, model, prompt, n):
    return served.expected("base" if model == BASE else model, prompt, n)


def completion(cluster, model, prompt, n=8, **kw):
    r = httpx.post(cluster["url"] + "/v1/completions", headers=auth(), timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, **kw})
    return r


def _engine_deployment(app):
    return app._bound_deployment.init_args[0]._bound_deployment  # Ingress.bind(Engine.bind(...))


def test_app_builder_scaling_and_typed_args(served):
    """The KubeRay / ``serve run`` entry: string args become ServeConfig's types; fixed or autoscaled."""
    app = ray_app.app_builder({"artifacts": str(served.artifacts), "replicas": "3", "max_deltas": "5",
                               "preemption": "false"})
    eng = _engine_deployment(app)
    cfg = eng.init_args[0]
    assert eng.num_replicas == 3 and eng._deployment_config.autoscaling_config is None
    assert cfg.max_deltas == 5 and cfg.preemption is False
    assert eng.max_ongoing_requests == cfg.max_queue + cfg.max_num_seqs
    auto = _engine_deployment(ray_app.app_builder({"artifacts": str(served.artifacts), "min_replicas": "0",
                                                   "max_replicas": "4", "max_num_seqs": "8"}))
    sc = auto._deployment_config.autoscaling_config
    assert (sc.min_replicas, sc.max_replicas, sc.initial_replicas, sc.target_ongoing_requests) == (0, 4, 1, 4)
    with pytest.raises(InputError, match="unknown application args"):
        ray_app.app_builder({"artifacts": str(served.artifacts), "replica": "2"})


@pytest.mark.parametrize("args, match", [
    (["--replicas", "2"], "go with --ray"),
    (["--ray", "--replicas", "2", "--max-replicas", "3"], "--replicas is a fixed count"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is above --max-replicas 2"),
    (["--ray", "--min-replicas", "1"], "--min-replicas needs --max-replicas"),
    (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
    (["--ray", "--workers", "2"], "--workers is for a single machine"),
])
def test_bad_options_are_one_line(capsys, monkeypatch, served, args, match):
    code, out, err = run_cli(capsys, monkeypatch, "serve", served.artifacts, *args)
    assert code == 1 and err.count("\n") == 1 and match in err, err


def test_unreachable_address_and_missing_ray_are_one_line(capsys, monkeypatch, served):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code, _, err = run_cli(capsys, monkeypatch, "serve", served.artifacts, "--ray", "--ray-address", f"127.0.0.1:{port}")
    assert code == 1 and err.count("\n") == 1 and f"--ray-address 127.0.0.1:{port} cannot be reached" in err, err
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # as if ray were not installed
    code, _, err = run_cli(capsys, monkeypatch, "serve", served.artifacts, "--ray")
    assert code == 1 and err.count("\n") == 1 and "pip install 'deltazip[cluster]'" in err, err


def test_outputs_equal_merged_greedy_generate_through_openai_client(client, served):
    for m in [BASE, *SERVED]:
        for p in PROMPTS[:2]:
            want = expected(served, m, p, 10)
            r = client.completions.create(model=m, prompt=p, max_tokens=10, temperature=0)
            assert r.choices[0].text == want, (m, p)
            chunks = list(client.completions.create(model=m, prompt=p, max_tokens=10, temperature=0, stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    messages = [{"role": "user", "content": "zip the model"}]
    ids = served.tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    chat = client.chat.completions.create(model="alpha", messages=messages, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == \
        served.expected_ids("alpha", tuple(ids), 6)


def test_errors_and_api_key_keep_the_single_server_shapes(cluster):
    url = cluster["url"]
    r = httpx.post(url + "/v1/completions", json={"model": "alpha", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = completion(cluster, "nope", "x")
    assert r.status_code == 404 and r.json() == {"error": {
        "message": "The model `nope` does not exist.", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}}
    r = httpx.post(url + "/v1/completions", headers=auth(), content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = completion(cluster, "beta", "x", logit_bias={"1": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_body_over_max_request_bytes_is_413_at_the_ingress(cluster):
    """--max-request-bytes holds behind Ray too: refused from Content-Length, and a chunked body (no
    Content-Length) as soon as it streams past the limit; the app keeps serving."""
    url = cluster["url"]
    big = json.dumps({"model": "alpha", "prompt": "x" * (2 * LIMIT), "max_tokens": 1}).encode()
    r = httpx.post(url + "/v1/completions", headers=auth(), content=big, timeout=60)
    assert r.status_code == 413 and HEADER not in r.headers, (r.text, r.headers)  # the ingress answered
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and f"at most {LIMIT}" in err["message"], err

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = httpx.post(url + "/v1/completions", headers=auth(), content=chunks(), timeout=60)
    assert r.status_code == 413 and "more than" in r.json()["error"]["message"] and HEADER not in r.headers, r.text
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert completion(cluster, "alpha", "hi", n=2).status_code == 200


def test_a_variants_requests_stay_on_one_replica(cluster, served):
    """A variant no request has named yet is loaded by one replica, which reports it to the router
    (every 0.1 s); from then on every request for it goes to that replica."""
    first = {}
    for m, src in FRESH.items():
        r = completion(cluster, m, "alpha")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == served.expected(src, "alpha", 8)
        first[m] = r.headers[HEADER]
    time.sleep(2.0)  # the report's round trip (replica -> controller -> router), with room for a loaded CI machine
    seen = {m: [completion(cluster, m, p).headers[HEADER] for p in PROMPTS for _ in range(2)] for m in FRESH}
    assert all(set(replicas) == {first[m]} for m, replicas in seen.items()), (first, seen)
    base = {completion(cluster, BASE, p).headers[HEADER] for p in PROMPTS * 2}
    assert base  # the base can go anywhere (no assertion on spreading: the router picks by load)


def test_variant_added_through_one_replica_reaches_every_replica(cluster, served):
    url = cluster["url"]
    shutil.copytree(served.artifacts / "alpha", cluster["arts"] / "alpha-live")
    r = httpx.post(url + "/v1/variants", headers=auth(), json={"path": "alpha-live"}, timeout=120)
    assert r.status_code == 201 and r.json()["id"] == "alpha-live"
    # Without any request, the health checks bring both replicas up to the log (``info`` does not sync).
    assert applied_by_replica(want=1) == 2
    r = httpx.post(url + "/v1/variants", headers=auth(), json={"path": "alpha-live"}, timeout=120)
    assert r.status_code == 409 and r.json()["error"]["code"] == "variant_exists"
    # Requests without a variant spread over the replicas: every replica lists the new variant...
    listed = models_by_replica(url)
    assert len(listed) == 2 and all("alpha-live" in ids for ids in listed.values()), listed
    want = served.expected("alpha", "zip model tune", 8)
    assert completion(cluster, "alpha-live", "zip model tune").json()["choices"][0]["text"] == want
    assert httpx.delete(url + "/v1/variants/alpha-live", headers=auth(), timeout=120).status_code == 200
    # ...and, once it is deleted through one of them, none does.
    listed = models_by_replica(url)
    assert len(listed) == 2 and all("alpha-live" not in ids and "alpha" in ids for ids in listed.values()), listed
    assert completion(cluster, "alpha-live", "x").status_code == 404


def applied_by_replica(want: int, timeout: float = 30) -> int:
    """Replicas that report at least ``want`` applied changes (polled through Serve's handle)."""
    import ray
    from ray import serve

    assert ray.get(ray_app.variant_log().version.remote()) == want
    handle = serve.get_deployment_handle("Engine", ray_app.APP_NAME)
    deadline, seen = time.time() + timeout, {}
    while time.time() < deadline:
        for _ in range(10):
            info = handle.info.remote().result()
            seen[info["replica"]] = info["applied"]
        if len(seen) == 2 and min(seen.values()) >= want:
            break
        time.sleep(0.5)
    return sum(v >= want for v in seen.values())


def models_by_replica(url: str) -> dict[str, set[str]]:
    """``GET /v1/models`` until both replicas answered: {replica: model ids}."""
    seen: dict[str, set[str]] = {}
    for _ in range(60):
        r = httpx.get(url + "/v1/models", headers=auth())
        seen[r.headers[HEADER]] = {m["id"] for m in r.json()["data"]}
        if len(seen) == 2:
            break
    return seen


def replica_pids(timeout: float = 60) -> dict[str, int]:
    """``{replica id: process id}`` of both engine replicas (asked through Serve's handle)."""
    from ray import serve

    handle = serve.get_deployment_handle("Engine", ray_app.APP_NAME)
    deadline, seen = time.time() + timeout, {}
    while len(seen) < 2:
        assert time.time() < deadline, seen
        info = handle.info.remote().result()
        seen[info["replica"]] = info["pid"]
    return seen


def test_a_replica_killed_under_load_loses_no_request_that_had_not_started_answering(cluster, served):
    """60 concurrent greedy requests (half streamed) over the base and a variant; the replica that sent
    the first streamed chunk is SIGKILLed. Every non-streamed request answers the merged model's text;
    every stream completes with it, or ends with an error event and [DONE] after having sent chunks;
    no connection is cut; Serve brings the replica count back to 2."""
    import ray
    from ray import serve

    n = 24
    jobs = [(BASE if i % 2 else "alpha", PROMPTS[i % 5], i % 4 < 2) for i in range(60)]
    with single_thread():
        want = [expected(served, m, p, n) for m, p, _ in jobs]
    pids = replica_pids()
    ingress = serve.get_deployment_handle("Ingress", ray_app.APP_NAME)
    before = ingress.fault_counts.remote().result()

    async def load():
        async with httpx.AsyncClient(base_url=cluster["url"], headers=auth(), timeout=120) as http:
            first = asyncio.get_running_loop().create_future()
            tasks = [asyncio.create_task(send_completion(http, {"model": m, "prompt": p, "max_tokens": n, "temperature": 0,
                                                                "stream": st}, HEADER, first)) for m, p, st in jobs]
            victim = await asyncio.wait_for(first, 120)
            os.kill(pids[victim], signal.SIGKILL)
            return victim, time.monotonic(), await asyncio.gather(*tasks, return_exceptions=True)

    victim, killed_at, outs = asyncio.run(load())
    cut = [(j, o) for j, o in zip(jobs, outs) if isinstance(o, BaseException)]
    assert not cut, f"connections cut without an answer: {cut[:3]}"
    errored = 0
    for (m, p, stream), out, w in zip(jobs, outs, want):
        if stream:
            errored += stream_outcome(out, w, victim)
        else:
            assert out["status"] == 200 and out["json"]["choices"][0]["text"] == w, (m, p, out)
    faults = {k: v - before[k] for k, v in ingress.fault_counts.remote().result().items()}
    assert faults["resubmitted"] >= 1 and faults["stream_errors"] == errored and faults["refused"] == 0, faults
    # The application recovers: every model answers, and Serve brings the replica count back to 2.
    for m in [BASE, *SERVED]:
        r = completion(cluster, m, "zip model tune")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(served, m, "zip model tune", 8)
    deadline = time.time() + 120
    while time.time() < deadline:
        st = serve.status().applications[ray_app.APP_NAME].deployments["Engine"]
        if st.replica_states.get("RUNNING", 0) == 2 and st.status == "HEALTHY":
            break
        time.sleep(0.2)
    assert st.replica_states.get("RUNNING", 0) == 2, st
    print(f"replica count back to 2 {time.monotonic() - killed_at:.1f} s after the kill; faults {faults}")
    assert victim not in replica_pids() and ray.is_initialized()


def test_shutdown_leaves_no_ray_process(cluster):
    """Last: stops the module's cluster, then no process it started may remain."""
    import psutil
    import ray

    procs = cluster["procs"] | {p.pid for p in psutil.Process().children(recursive=True)}
    assert any("raylet" in " ".join(_cmdline(pid)) for pid in procs)  # the check below sees the cluster
    ray_app.shutdown(True)
    assert not ray.is_initialized()
    deadline = time.time() + 60
    while time.time() < deadline and (alive := [p for p in procs if psutil.pid_exists(p) and _cmdline(p)]):
        time.sleep(0.5)
    assert not alive, [" ".join(_cmdline(p))[:120] for p in alive]
    with pytest.raises(httpx.HTTPError):
        httpx.get(cluster["url"] + "/health", timeout=5)


def _cmdline(pid: int) -> list[str]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [] if p.status() == psutil.STATUS_ZOMBIE else p.cmdline()
    except psutil.Error:
        return []
