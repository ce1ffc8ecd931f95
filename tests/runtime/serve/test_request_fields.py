"""Every field of OpenAI's reference request bodies (``POST /v1/completions`` and ``POST
/v1/chat/completions``), sent one at a time with a value that means something: each is honoured
(200, and what it asks for is visible in the answer) or refused with a 400 whose ``param`` names it.
None is dropped in silence. docs/serve.md's "Request fields" table lists every one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from _serving import running_server, served_set, single_thread

# Field -> (a value to send, what the server does: "honoured" or "refused"). The lists follow
# OpenAI's API reference (legacy completions; chat completions).
COMPLETION_FIELDS = {
    "model": ("alpha", "honoured"), "prompt": ("zip", "honoured"),
    "best_of": (3, "honoured"), "echo": (True, "honoured"), "frequency_penalty": (0.7, "honoured"),
    "logit_bias": ({"40": 3.0}, "honoured"), "logprobs": (2, "honoured"), "max_tokens": (3, "honoured"),
    "n": (2, "honoured"), "presence_penalty": (0.7, "honoured"), "seed": (5, "honoured"), "stop": (["x"], "honoured"),
    "stream": (True, "honoured"), "stream_options": ({"include_usage": True}, "honoured"),
    "suffix": (" end", "refused"), "temperature": (0.5, "honoured"), "top_p": (0.9, "honoured"),
    "user": ("user-1", "honoured"),
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]
CHAT_FIELDS = {
    "model": ("alpha", "honoured"), "messages": ([{"role": "user", "content": "hi"}], "honoured"),
    "audio": ({"voice": "alloy", "format": "wav"}, "refused"), "frequency_penalty": (0.7, "honoured"),
    "function_call": ("auto", "refused"), "functions": ([{"name": "f", "parameters": {}}], "refused"),
    "logit_bias": ({"40": 3.0}, "honoured"), "logprobs": (True, "honoured"), "max_completion_tokens": (3, "honoured"),
    "max_tokens": (3, "honoured"), "metadata": ({"team": "eval"}, "honoured"), "modalities": (["text", "audio"], "refused"),
    "n": (2, "honoured"), "parallel_tool_calls": (False, "honoured"),
    "prediction": ({"type": "content", "content": "hi"}, "refused"), "presence_penalty": (0.7, "honoured"),
    "prompt_cache_key": ("k1", "honoured"), "reasoning_effort": ("low", "refused"),
    "response_format": ({"type": "json_object"}, "honoured"), "safety_identifier": ("s1", "honoured"),
    "seed": (5, "honoured"), "service_tier": ("flex", "refused"), "stop": (["x"], "honoured"), "store": (True, "refused"),
    "stream": (True, "honoured"), "stream_options": ({"include_usage": True}, "honoured"), "temperature": (0.5, "honoured"),
    "tool_choice": ({"type": "function", "function": {"name": "f"}}, "honoured"), "tools": (TOOLS, "honoured"),
    "top_logprobs": (2, "honoured"), "top_p": (0.9, "honoured"), "user": ("user-1", "honoured"),
    "verbosity": ("low", "refused"), "web_search_options": ({}, "refused"),
}
# What a request with the field honoured shows (beyond a 200); fields not listed show it in the
# sampling tests (penalties, bias, seed, top_p, temperature...) or have no visible effect by design
# (user, metadata, prompt_cache_key, safety_identifier: accepted, nothing is stored).
NEEDS = {"logprobs": {"top_logprobs": 2}, "top_logprobs": {"logprobs": True}, "stream_options": {"stream": True},
         "tool_choice": {"tools": TOOLS, "max_tokens": 60},
         "parallel_tool_calls": {"tools": TOOLS, "tool_choice": "required", "max_tokens": 60}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with single_thread():
        served = served_set(tmp_path_factory.getbasetemp() / "serving")
    with running_server(served, max_num_seqs=8) as srv:
        yield srv


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _choices(r: httpx.Response, stream: bool) -> tuple[list[dict], dict | None]:
    if not stream:
        return r.json()["choices"], r.json()["usage"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return [c for ch in chunks for c in ch["choices"]], next((ch["usage"] for ch in chunks if ch.get("usage")), None)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_reference_field_is_honoured_or_refused_by_name(server, chat):
    path, fields = ("/v1/chat/completions", CHAT_FIELDS) if chat else ("/v1/completions", COMPLETION_FIELDS)
    base = {"model": "alpha", "max_tokens": 4, "temperature": 0}
    base |= {"messages": CHAT_FIELDS["messages"][0]} if chat else {"prompt": "zip"}
    for name, (value, does) in fields.items():
        body = base | NEEDS.get(name, {}) | {name: value}
        r = _post(server, path, body)
        if does == "refused":
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == name, (name, r.text)
            continue
        assert r.status_code == 200, (name, r.text)
        choices, used = _choices(r, bool(body.get("stream")))
        if name in ("n", "best_of"):
            assert len({c["index"] for c in choices}) == body.get("n", 1), name
        if name == "echo":
            assert choices[0]["text"].startswith("zip")
        if name in ("logprobs", "top_logprobs"):
            lp = choices[0]["logprobs"]
            assert (len(lp["content"][0]["top_logprobs"]) == 2) if chat else (len(lp["tokens"]) == len(
                lp["token_logprobs"]) >= 1)
        if name == "stream_options":
            assert used is not None and used["completion_tokens"] >= 1
        if name == "response_format":  # cut at 4 tokens: the start of a JSON object
            assert choices[0]["message"]["content"].startswith("{"), choices
        if name == "tools":  # rendered into the prompt by the chat template
            assert used["prompt_tokens"] > _post(server, path, base).json()["usage"]["prompt_tokens"]
        if name in ("tool_choice", "parallel_tool_calls"):  # forced: exactly one call of f
            calls = choices[0]["message"]["tool_calls"]
            assert choices[0]["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["f"]
            assert json.loads(calls[0]["function"]["arguments"]) == {}


def test_the_docs_list_every_request_field():
    """docs/serve.md holds one table row per field (of either endpoint), so the page stays complete."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "serve.md").read_text()
    section = text[text.index("### Request fields"):]
    section = section[:section.index("\n## ")]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    listed = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)`", cell)}
    missing = (set(COMPLETION_FIELDS) | set(CHAT_FIELDS)) - listed
    assert not missing, f"docs/serve.md lacks rows for {sorted(missing)}"
