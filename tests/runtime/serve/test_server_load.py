"""Issue 25: one request must not stall the server. Prompts are tokenized off the event loop, request
bodies are capped (413) and prompts longer than the model's context refused (400), in OpenAI's error
shape, while /health and other requests go on; a slow soak of mixed valid and invalid requests from
32 concurrent clients checks that nothing is lost or answered wrong under load."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest
from _serving import PROMPTS, VARIANTS, served_set, single_thread

from deltazip.runtime.serve.openai_schema import DEFAULT_MAX_REQUEST_BYTES
from deltazip.runtime.serve.server import Metrics, ServeConfig, ServerThread, build_runtime, create_app

BASE = "tiny-base"
MODELS = [BASE, *sorted(VARIANTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


@pytest.fixture(scope="module")
def server(served):
    with single_thread():
        rt = build_runtime(ServeConfig(artifacts=served.artifacts, max_deltas=2), observer=Metrics())
        with ServerThread(create_app(rt)) as srv:
            yield srv


def _poll_health(url: str, busy: threading.Thread) -> list[float]:
    """Latencies of /health polled every 20 ms while ``busy`` runs."""
    lat = []
    with httpx.Client(base_url=url, timeout=30) as c:
        while busy.is_alive():
            t = time.perf_counter()
            r = c.get("/health")
            lat.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
            time.sleep(0.02)
    return lat


def assert_prompt_not_blocking(lat: list[float]) -> None:
    """The event loop was never held for the busy request's work (seconds of it): 95% of the polls
    answer within 100 ms and none takes a second (one slow poll on a loaded 2-core machine is a
    scheduling hiccup, not the loop blocked for the request)."""
    if not lat:
        return
    s = sorted(lat)
    assert s[int(0.95 * (len(s) - 1))] < 0.1 and s[-1] < 1.0, s[-5:]


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("r", fn()))
    th.start()
    return th, out


def test_health_answers_while_a_large_prompt_is_tokenized(server):
    big = "alpha beta gamma 123 " * 150_000  # 3.15 MB under the 4 MiB limit: ~3 s of tokenizing
    body = {"model": "alpha", "prompt": big, "max_tokens": 1}
    th, out = _in_thread(lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=120))
    time.sleep(0.3)  # the body is in: tokenizing now
    lat = _poll_health(server.url, th)
    r = out["r"]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert "maximum context length is 128 tokens" in err["message"]
    assert len(lat) >= 10, lat  # the tokenizing took a while, and /health was asked all along
    assert_prompt_not_blocking(lat)


def test_a_body_over_the_limit_is_413_while_health_answers(server):
    assert DEFAULT_MAX_REQUEST_BYTES == 4 * 2**20
    body = json.dumps({"model": "alpha", "prompt": "a" * (6 * 2**20)}).encode()
    th, out = _in_thread(lambda: httpx.post(server.url + "/v1/completions", content=body, timeout=120,
                                            headers={"content-type": "application/json"}))
    lat = _poll_health(server.url, th)
    r = out["r"]
    assert r.status_code == 413, r.text
    assert r.json()["error"] == {"message": f"the request body has {len(body)} bytes; this server accepts at most "
                                            f"{4 * 2**20} (--max-request-bytes)", "type": "invalid_request_error",
                                 "param": None, "code": "request_too_large"}
    assert_prompt_not_blocking(lat)

    def chunks():  # no Content-Length: counted while it streams in
        yield b'{"model": "alpha", "prompt": "'
        for _ in range(5):
            yield b"a" * 2**20
        yield b'"}'

    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=120)
    assert r.status_code == 413 and "more than" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": "alpha", "prompt": "zip", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text  # the server goes on


def test_max_request_bytes_is_validated():
    from deltazip.formats.errors import InputError

    with pytest.raises(InputError, match="--max-request-bytes must be >= 1024"):
        ServeConfig(artifacts=".", max_request_bytes=10)


def test_a_chat_template_file_is_checked_at_start_up(tmp_path):
    from deltazip.formats.errors import InputError

    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }}")
    (tmp_path / "empty.jinja").write_text(" \n")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe{{")
    for name, words in (("missing.jinja", "cannot read it"), ("bad.jinja", "line 1: "), ("empty.jinja", "is empty"),
                        ("binary.jinja", "UTF-8")):
        with pytest.raises(InputError, match=words) as e:
            ServeConfig(artifacts=".", chat_template=tmp_path / name)
        assert "\n" not in str(e.value) and "--chat-template" in str(e.value)
    (tmp_path / "ok.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ServeConfig(artifacts=".", chat_template=tmp_path / "ok.jinja").chat_template_text.startswith("{% for")


# --------------------------------------------------------------------------------------------------
# Soak: 32 concurrent clients for 60 s against a real `deltazip serve` process
# --------------------------------------------------------------------------------------------------

SOAK_S = float(os.environ.get("DELTAZIP_SOAK_SECONDS", "60"))
CLIENTS = 32
P99_BOUND_S = 5.0
"""Stated bound on the 99th percentile latency of every request (valid ones generate up to 12 tokens on a
2-layer model; invalid ones are refused before the engine); measured ~0.5 s on a shared 2-core CPU."""
SOAK_LIMIT = 256 * 1024  # the soak server's --max-request-bytes
CHAT = [[{"role": "user", "content": "zip model"}], [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "12 + 345 ="}]]


def _expectations(served) -> dict:
    """Every valid request's right answer: the merged model's greedy text."""
    tok = served.tokenizer()
    want = {}
    for m in MODELS:
        name = "base" if m == BASE else m
        for n in (4, 8, 12):
            for p in PROMPTS:
                want[("cmpl", m, p, n)] = served.expected(name, p, n)
            for i, msgs in enumerate(CHAT):
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
                want[("chat", m, i, n)] = served.expected_ids(name, tuple(ids), n)
    return want


def _request(rng: random.Random, want: dict) -> tuple[str, str, dict | bytes, int, str | None]:
    """(label, path, body, expected status, expected text or error code) of one random request."""
    m, n = rng.choice(MODELS), rng.choice((4, 8, 12))
    kind = rng.choices(["cmpl", "stream", "chat", "unknown", "json", "long", "big", "param"],
                       weights=[30, 15, 15, 8, 8, 8, 8, 8])[0]
    if kind in ("cmpl", "stream"):
        p = rng.choice(PROMPTS)
        body = {"model": m, "prompt": p, "max_tokens": n, "temperature": 0, "stream": kind == "stream"}
        return kind, "/v1/completions", body, 200, want[("cmpl", m, p, n)]
    if kind == "chat":
        i = rng.randrange(len(CHAT))
        return kind, "/v1/chat/completions", {"model": m, "messages": CHAT[i], "max_tokens": n,
                                              "temperature": 0}, 200, want[("chat", m, i, n)]
    return {
        "unknown": (kind, "/v1/completions", {"model": "nope", "prompt": "zip"}, 404, "model_not_found"),
        "json": (kind, "/v1/completions", b'{"model": "alpha", "prompt": ', 400, None),
        "long": (kind, "/v1/completions", {"model": m, "prompt": "zip " * 60, "max_tokens": n}, 400,
                 "context_length_exceeded"),
        "big": (kind, "/v1/completions", {"model": m, "prompt": "z" * (SOAK_LIMIT + 1)}, 413, "request_too_large"),
        "param": (kind, "/v1/completions", {"model": m, "prompt": "zip", "temperature": -1}, 400, None),
    }[kind]


def _check(kind: str, r: httpx.Response, status: int, expect) -> str | None:
    """Why the response is wrong, or None."""
    if r.status_code != status:
        return f"{kind}: status {r.status_code}, expected {status}: {r.text[:200]}"
    if status != 200:
        err = r.json().get("error", {})
        ok = set(err) == {"message", "type", "param", "code"} and (expect is None or err["code"] == expect)
        return None if ok else f"{kind}: error body {err}"
    if kind == "stream":
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        text = "".join(c["text"] for ln in lines[:-1] for c in json.loads(ln)["choices"])
        return None if lines[-1] == "[DONE]" and text == expect else f"stream: {text!r} != {expect!r}"
    doc = r.json()["choices"][0]
    text = doc["message"]["content"] if kind == "chat" else doc["text"]
    return None if text == expect else f"{kind}: {text!r} != {expect!r}"


async def _client(url: str, seed: int, want: dict, until: float, log: list) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while time.monotonic() < until:
            kind, path, body, status, expect = _request(rng, want)
            t = time.perf_counter()
            try:
                if isinstance(body, bytes):
                    r = await c.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    r = await c.post(path, json=body)
                log.append((kind, time.perf_counter() - t, _check(kind, r, status, expect)))
            except httpx.HTTPError as e:  # a lost request: no answer
                log.append((kind, time.perf_counter() - t, f"lost: {type(e).__name__}: {e}"))


async def _soak(url: str, want: dict) -> list:
    log: list = []
    until = time.monotonic() + SOAK_S
    await asyncio.gather(*(_client(url, i, want, until, log) for i in range(CLIENTS)))
    return log


@pytest.mark.slow
def test_soak_mixed_valid_and_invalid_requests_from_32_clients(served, tmp_path):
    from _cli import cli_command, read_json_document

    want = _expectations(served)
    err = open(tmp_path / "serve.err", "w+")
    proc = subprocess.Popen(cli_command("serve", served.artifacts, "--base", served.base_dir, "--port", "0", "--json",
                                        "--max-deltas", "2", "--cpu-threads", "1", "--max-request-bytes",
                                        str(SOAK_LIMIT)), stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = read_json_document(proc)["serving"]
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        log = asyncio.run(_soak(url, want))
        health = httpx.get(url + "/health", timeout=5)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    wrong = [w for _, _, w in log if w]
    lat = sorted(t for _, t, _ in log)
    p99 = lat[int(0.99 * (len(lat) - 1))]
    kinds = {k for k, _, _ in log}
    print(f"soak: {len(log)} requests in {SOAK_S:.0f} s from {CLIENTS} clients, p50 {lat[len(lat) // 2]:.3f} s, "
          f"p99 {p99:.3f} s, max {lat[-1]:.3f} s", file=sys.stderr)
    assert health.status_code == 200
    assert kinds == {"cmpl", "stream", "chat", "unknown", "json", "long", "big", "param"}
    assert len(log) >= 10 * CLIENTS
    assert wrong == [], wrong[:5]  # 0 lost, 0 wrong answers
    assert p99 < P99_BOUND_S, p99
