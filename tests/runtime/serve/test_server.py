"""The OpenAI-compatible server, started for real on a loopback port and driven by the official
``openai`` client (and raw HTTP for the error cases)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
import torch
from _serving import PROMPTS, VARIANTS, served_set, single_thread

from deltazip.formats.errors import InputError
from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

openai = pytest.importorskip("openai")

KEY = "sk-test-key"
BASE = "tiny-base"
MODELS = [BASE, *sorted(VARIANTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


def start(served, **cfg):
    metrics = Metrics()
    rt = build_runtime(ServeConfig(artifacts=served.artifacts, **cfg), observer=metrics)
    return ServerThread(create_app(rt, metrics)), rt


@pytest.fixture(scope="module")
def server(served):
    with single_thread():
        srv, rt = start(served, api_key=KEY, max_deltas=2, max_cpu_deltas=2, max_num_seqs=16)
        with srv:
            yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def expected(served, model, prompt, n):
    return served.expected("base" if model == BASE else model, prompt, n)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exported")


def test_models_are_listed_with_their_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert sorted(models) == sorted(MODELS)
    assert models[BASE].model_extra.get("parent") is None
    assert all(models[v].model_extra["parent"] == BASE for v in VARIANTS)
    assert client.models.retrieve("alpha").id == "alpha"


def test_completions_equal_merged_greedy_generate_streaming_and_not(client, served):
    for m in MODELS:
        for p in PROMPTS[:3]:
            want = expected(served, m, p, 12)
            r = client.completions.create(model=m, prompt=p, max_tokens=12, temperature=0)
            assert r.choices[0].text == want, (m, p)
            assert r.choices[0].finish_reason in ("stop", "length")
            assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens == len(served.tokenizer()(p)["input_ids"])
            chunks = list(client.completions.create(model=m, prompt=p, max_tokens=12, temperature=0, stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want
            assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_completions_use_the_chat_template(client, served):
    tok = served.tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "zip the model"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    for m in (BASE, "alpha", "gamma"):
        want = served.expected_ids("base" if m == BASE else m, tuple(ids), 10)
        r = client.chat.completions.create(model=m, messages=messages, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=m, messages=messages, max_tokens=10, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_multiple_prompts_stop_and_seed(client, served):
    r = client.completions.create(model="beta", prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [expected(served, "beta", p, 8)
                                                                          for p in PROMPTS[:3]]
    want = expected(served, "alpha", PROMPTS[1], 12)
    stop = want[4:6]
    r = client.completions.create(model="alpha", prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == want[:want.find(stop)] and r.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=10, temperature=0.9, top_p=0.95,
                                      seed=123).choices[0].text for _ in range(2))
    assert a == b


def test_many_concurrent_requests_match_sequential(server, served):
    """60 requests over all four models at once (the engine batches rows of different variants and
    swaps them through 2 device slots): every output equals the one-by-one output."""
    jobs = [(MODELS[i % 4], PROMPTS[(i // 4) % len(PROMPTS)], 6 + (i % 5)) for i in range(60)]
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(http, m, p, n):
        r = await http.post("/v1/completions", json={"model": m, "prompt": p, "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300) as http:
            return await asyncio.gather(*(one(http, *j) for j in jobs))

    with single_thread():
        got = asyncio.run(all_at_once())
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            one_by_one = []
            for m, p, n in jobs:
                r = http.post("/v1/completions", json={"model": m, "prompt": p, "max_tokens": n, "temperature": 0})
                one_by_one.append(r.json()["choices"][0]["text"])
    assert got == one_by_one
    assert got == [expected(served, m, p, n) for m, p, n in jobs]


def test_auth_is_required_on_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="alpha", prompt="x", max_tokens=1)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/metrics").status_code == 200


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "a"}, 404, "model"),
    ({"model": "alpha", "prompt": "a", "temperature": 5}, 400, "temperature"),
    ({"model": "alpha", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "alpha", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": "alpha", "prompt": "a", "n": 0}, 400, "n"),
    ({"model": "alpha", "prompt": "a", "n": 17}, 400, "n"),  # more samples than --max-num-seqs runs at once
    ({"model": "alpha", "prompt": "a", "n": 2, "best_of": 1}, 400, "best_of"),
    ({"model": "alpha", "prompt": "a", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    ({"model": "alpha", "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"model": "alpha", "prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": "alpha", "prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "alpha", "prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "alpha", "prompt": "a", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    ({"model": "alpha", "prompt": "a", "suffix": "b"}, 400, "suffix"),
    ({"model": "alpha", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "alpha"}, 400, "prompt"),
    ({"model": "alpha", "prompt": []}, 400, "prompt"),
    ({"model": "alpha", "prompt": [1, 5000]}, 400, "prompt"),
    ({"model": "alpha", "prompt": {"x": 1}}, 400, "prompt"),
    ({"model": 3, "prompt": "a"}, 400, "model"),
    ({"model": "alpha", "prompt": "a" * 200, "max_tokens": 4}, 400, "max_tokens"),
    ({"model": "alpha", "prompt": "abc", "max_tokens": 500}, 400, "max_tokens"),
])
def test_completion_errors_use_the_openai_shape(server, body, status, param):
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].startswith(param)
    if status == 400 and param == "max_tokens" and body["max_tokens"] > 1:
        assert err["code"] == "context_length_exceeded"


def test_other_bad_requests_never_yield_500(server):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", json.dumps({"model": "alpha", "prompt": "a", "max_tokens": "many"}).encode()),
        ("/v1/completions", json.dumps({"model": "alpha", "prompt": "a", "stream": "sometimes"}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "alpha", "messages": []}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "alpha", "messages": [{"role": "wizard", "content": "x"}]}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "alpha", "messages": "hi"}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "alpha", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode()),
    ]
    for path, raw in cases:
        r = httpx.post(server.url + path, content=raw, headers=h)
        assert r.status_code == 400, (raw, r.text)
        assert "error" in r.json()
    nulls = {"model": "alpha", "prompt": "a", "max_tokens": 2, "temperature": None, "top_p": None, "n": None,
             "stop": None, "seed": None, "stream": None, "presence_penalty": None}
    r = httpx.post(server.url + "/v1/completions", json=nulls, headers=h)
    assert r.status_code == 200, r.text  # explicit nulls mean "default", as in OpenAI's API
    r = httpx.get(server.url + "/v1/nothing-here", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/models/nope", headers=h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="alpha", prompt="x" * 300, max_tokens=5)


def test_disconnect_mid_stream_frees_the_sequence(server):
    h = {"Authorization": f"Bearer {KEY}"}

    def cancelled() -> float:  # the labelled series only exists after the first cancellation
        name = 'deltazip_requests_finished_total{reason="cancelled"}'
        return metric(server, name) if name in httpx.get(server.url + "/metrics").text else 0.0

    before = cancelled()
    body = {"model": "alpha", "prompt": "zip", "max_tokens": 110, "temperature": 0.7, "seed": 1, "stream": True}
    with httpx.Client(base_url=server.url, headers=h, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk seen: leave mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        if metric(server, "deltazip_running_seqs") == 0 and cancelled() > before:
            break
        time.sleep(0.05)
    assert metric(server, "deltazip_running_seqs") == 0
    assert cancelled() > before


def test_metrics_expose_queue_latency_and_load_times(server, client):
    client.completions.create(model="alpha", prompt="a", max_tokens=2, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("deltazip_queue_length", "deltazip_running_seqs", "deltazip_resident_deltas",
                 "deltazip_tokens_per_second", "deltazip_time_to_first_token_seconds_bucket",
                 "deltazip_e2e_request_latency_seconds_count", 'deltazip_delta_load_seconds{tier="disk",variant="alpha"}',
                 'deltazip_delta_loads_total{tier="device",variant="alpha"}'):
        assert name in text, name
    assert metric(server, "deltazip_time_to_first_token_seconds_count") > 0
    assert metric(server, "deltazip_device_weight_bytes") > 0  # exact figures: tests/runtime/serve/test_engine.py
    assert metric(server, "deltazip_kv_cache_bytes") >= 0


def test_queue_full_is_429_and_startup_logs_each_variant(served, caplog):
    with single_thread(), caplog.at_level(logging.INFO, logger="deltazip.serve"):
        srv, rt = start(served, max_queue=1, max_num_seqs=1, max_deltas=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("variant ")]
    assert len(lines) == len(VARIANTS) and all("on disk" in ln and "resident" in ln for ln in lines)
    assert all(r["bytes_resident"] > 0 for r in rt.report if r["role"] == "variant")

    async def burst():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            body = {"model": "alpha", "prompt": "zip", "max_tokens": 30, "temperature": 0}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))

    with single_thread(), srv:
        responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert 200 in codes and 429 in codes, codes
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert limited.json()["error"]["type"] == "rate_limit_error"


def test_artifacts_of_another_base_are_refused_by_name(served, tmp_path):
    import shutil

    from _factories import perturb, tiny_model

    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.kernels.scheme import DeltaScheme

    with single_thread():
        other = tiny_model("llama", seed=5, vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
        other.save_pretrained(tmp_path / "other-base")
        ft = perturb(tiny_model("llama", seed=5, vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2))
        ft.save_pretrained(tmp_path / "other-ft")
        arts = tmp_path / "arts"
        shutil.copytree(served.artifacts / "alpha", arts / "alpha")
        compress_delta(tmp_path / "other-base", tmp_path / "other-ft", None, arts / "stranger",
                       CompressConfig(scheme=DeltaScheme(group_size=32), method="rtn", device="cpu"))
        with pytest.raises(InputError, match="artifact stranger .*different base"):
            build_runtime(ServeConfig(artifacts=arts, base=str(served.base_dir)))
        with pytest.raises(InputError, match="different bases"):
            build_runtime(ServeConfig(artifacts=arts))


def test_cli_rejects_bad_options_in_one_line(served):
    from typer.testing import CliRunner

    from deltazip.deltacli.app import app

    # main() turns an InputError into one line on stderr and exit code 1
    r = CliRunner().invoke(app, ["serve", str(served.artifacts), "--mode", "nope"])
    assert isinstance(r.exception, InputError) and "--mode 'nope' is unknown" in str(r.exception)
    r = CliRunner().invoke(app, ["serve", str(served.artifacts), "--max-deltas", "0"])
    assert isinstance(r.exception, InputError) and "--max-deltas" in str(r.exception)


# --------------------------------------------------------------------------------------------------
# Issue 17: metrics cardinality, corrupt variants, chat template fallback, observability
# --------------------------------------------------------------------------------------------------


def _http_series(url: str) -> list[str]:
    return [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith("deltazip_http_requests_total{")]


def test_http_metric_labels_are_route_templates_not_raw_paths(server):
    """Keyless GETs to random /v1/<uuid> paths (401s) and unknown paths (404s) must not add series."""
    import uuid

    h = {"Authorization": f"Bearer {KEY}"}
    for _ in range(3):  # every kind of outcome once, so that their series exist
        httpx.get(server.url + f"/v1/{uuid.uuid4()}")
        httpx.get(server.url + f"/v1/models/{uuid.uuid4()}", headers=h)
        httpx.get(server.url + f"/nowhere/{uuid.uuid4()}")
        httpx.get(server.url + "/metrics")
    before = _http_series(server.url)
    for _ in range(40):
        assert httpx.get(server.url + f"/v1/{uuid.uuid4()}").status_code == 401
        assert httpx.get(server.url + f"/v1/{uuid.uuid4()}", headers=h).status_code == 404
        assert httpx.get(server.url + f"/v1/models/{uuid.uuid4()}", headers=h).status_code == 404
        assert httpx.get(server.url + f"/{uuid.uuid4()}").status_code == 404
    after = _http_series(server.url)
    assert len(after) == len(before), sorted(set(after) - set(before))[:5]
    labels = {ln.split("{", 1)[1].rsplit("} ", 1)[0] for ln in after}
    assert 'path="unmatched",status="401"' in labels and 'path="unmatched",status="404"' in labels
    assert 'path="/v1/models/{model_id:path}",status="404"' in labels
    assert not any(len(p) > 60 for p in labels)  # no uuid anywhere


def _corrupt_copy(src, dst):
    """A copy of artifact ``src`` with one byte flipped in the middle of its first container."""
    import shutil

    shutil.copytree(src, dst)
    f = sorted(dst.glob("deltas-*.safetensors"))[0]
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    return dst


def test_corrupt_artifact_is_refused_at_startup_in_one_line(served, tmp_path, capsys, monkeypatch):
    import shutil

    from _cli import run_cli

    from deltazip.formats.errors import ArtifactError

    arts = tmp_path / "arts"
    shutil.copytree(served.variant_dir("alpha"), arts / "alpha")
    _corrupt_copy(served.variant_dir("beta"), arts / "beta")
    with pytest.raises(ArtifactError, match=r"artifact .*beta: deltas-00001.safetensors sha256 differs"):
        build_runtime(ServeConfig(artifacts=arts, base=str(served.base_dir)))
    code, _, err = run_cli(capsys, monkeypatch, "serve", arts, "--base", served.base_dir, "--port", "0")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "beta: deltas-00001.safetensors sha256 differs from the manifest; the artifact is corrupt" in err
    assert "deltazip verify" in err


@pytest.fixture()
def live_server(served, tmp_path):
    """A server of its own over a directory the test can add variants to (base + alpha)."""
    import shutil

    arts = tmp_path / "arts"
    shutil.copytree(served.variant_dir("alpha"), arts / "alpha")
    with single_thread():
        srv, rt = start_with_base(served, arts, api_key=KEY, max_deltas=2)
        with srv:
            yield srv, rt, arts


def start_with_base(served, arts, **cfg):
    metrics = Metrics()
    rt = build_runtime(ServeConfig(artifacts=arts, base=str(served.base_dir), **cfg), observer=metrics)
    return ServerThread(create_app(rt, metrics)), rt


def test_post_of_a_corrupt_artifact_is_400_invalid_variant(served, live_server):
    srv, rt, arts = live_server
    h = {"Authorization": f"Bearer {KEY}"}
    _corrupt_copy(served.variant_dir("gamma"), arts / "gamma")
    r = httpx.post(srv.url + "/v1/variants", json={"path": "gamma"}, headers=h)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_variant" and err["param"] == "path"
    assert "corrupt" in err["message"] and "\n" not in err["message"]
    assert "gamma" not in {m["id"] for m in httpx.get(srv.url + "/v1/models", headers=h).json()["data"]}
    # a sound copy registers fine under another name
    import shutil

    shutil.copytree(served.variant_dir("gamma"), arts / "gamma-ok")
    r = httpx.post(srv.url + "/v1/variants", json={"path": "gamma-ok"}, headers=h)
    assert r.status_code == 201, r.text


def test_chat_falls_back_to_the_base_template(served, tmp_path):
    """Issue 17 #13: an artifact that kept tokenizer files without a chat template chats with the base's
    template (docs/serve.md), instead of a 400."""
    import shutil

    from _factories import perturb, tiny_model

    from deltazip.compress.config import CompressConfig
    from deltazip.compress.merge import load_merged_model
    from deltazip.compress.pipeline import compress_delta
    from deltazip.demo.pair import build_char_tokenizer
    from deltazip.formats.artifact import Artifact
    from deltazip.kernels.scheme import DeltaScheme
    from deltazip.models.checkpoint import Checkpoint

    ids = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    ft_dir = tmp_path / "ft-plain"
    perturb(tiny_model("llama", **ids), scale=0.3, seed=21).save_pretrained(ft_dir)
    build_char_tokenizer(ft_dir)  # no chat template
    arts = tmp_path / "arts"
    shutil.copytree(served.variant_dir("alpha"), arts / "alpha")
    with single_thread():
        compress_delta(served.base_dir, ft_dir, None, arts / "plain", CompressConfig(scheme=DeltaScheme(group_size=32),
                                                                                     method="rtn", device="cpu"))
        # the variant has tokenizer files of its own (here identical to the base's, so kept by reference)
        # but no chat template, which the base has
        side = Artifact(arts / "plain").side_files
        assert "tokenizer.json" in side and "chat_template.jinja" not in side
        assert (served.base_dir / "chat_template.jinja").is_file()
        messages = [{"role": "user", "content": "zip the model"}]
        tok = served.tokenizer()  # the base's tokenizer: same characters, with the template
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        model = load_merged_model(Artifact(arts / "plain"), Checkpoint(served.base_dir))
        x = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        want = tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)
        srv, _ = start_with_base(served, arts)
        with srv:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "model": "plain", "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


def test_access_log_deletion_log_and_idle_kv_cache(served, live_server, caplog):
    """Issue 17 #14: one access line per request (method, route, model, status, latency, tokens), a line
    per deleted variant, and ``deltazip_kv_cache_bytes`` back to 0 when idle."""
    srv, rt, arts = live_server
    h = {"Authorization": f"Bearer {KEY}"}
    with caplog.at_level(logging.INFO, logger="deltazip"):
        r = httpx.post(srv.url + "/v1/completions", headers=h, timeout=120,
                       json={"model": "alpha", "prompt": "zip", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200
        usage = r.json()["usage"]
        with httpx.stream("POST", srv.url + "/v1/completions", headers=h, timeout=120, json={
                "model": "alpha", "prompt": "zip", "max_tokens": 5, "temperature": 0, "stream": True}) as s:
            assert s.status_code == 200 and [ln for ln in s.iter_lines() if ln][-1] == "data: [DONE]"
        httpx.get(srv.url + "/v1/models")  # 401
        assert httpx.delete(srv.url + "/v1/variants/alpha", headers=h, timeout=120).status_code == 200
        deadline = time.time() + 10
        while metric(srv, "deltazip_kv_cache_bytes") != 0 and time.time() < deadline:
            time.sleep(0.05)
    access = [r.getMessage() for r in caplog.records if r.name == "deltazip.access"]
    done = ("POST /v1/completions model=alpha status=200 latency=", f"prompt_tokens={usage['prompt_tokens']} "
            f"completion_tokens={usage['completion_tokens']}")
    assert sum(m.startswith(done[0]) and m.endswith(done[1]) for m in access) == 2, access  # plain and streamed
    assert any(m.startswith("GET /v1/models model=- status=401 ") for m in access), access
    assert any(m.startswith("DELETE /v1/variants/{name:path} model=- status=200 ") for m in access), access
    assert any(r.getMessage().startswith("variant alpha deleted") for r in caplog.records if r.name == "deltazip.serve")
    assert metric(srv, "deltazip_kv_cache_bytes") == 0
