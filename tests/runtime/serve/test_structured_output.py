"""``response_format`` on a real server (loopback port, the official ``openai`` client, CPU fp32) serving
the ΔCompress variant ``alpha``: a random tiny model writes garbage, so only the grammar makes its
answers valid JSON."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from _serving import running_server, served_set, single_thread

from deltazip.runtime.serve.grammar import GrammarCompilers

openai = pytest.importorskip("openai")
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

# Bounded strings, numbers and arrays: a random model inside an unbounded string never closes it.
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "status": {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"enum": [200, 404, 500]}},
               "required": ["ok", "code"]},
    "temps": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                               "temps": {"type": "array", "maxItems": 3,
                                                         "items": {"type": "integer", "minimum": -50, "maximum": 50}}},
              "required": ["unit", "temps"]},
    "tagged": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
                                                "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]},
                                                         "minItems": 1, "maxItems": 2}},
               "required": ["id", "tags"]},
    "pairs": {"type": "array", "minItems": 1, "maxItems": 2,
              "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3},
                                                         "v": {"type": ["integer", "null"], "minimum": 0, "maximum": 99}},
                        "required": ["k", "v"]}},
}
PROMPTS = ["give json", "a record please", "zip 12", "delta gamma"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


@pytest.fixture(scope="module")
def server(served):
    with running_server(served, max_deltas=2, max_num_seqs=16) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _fmt(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def test_100_json_schema_requests_parse_and_validate(client, served):
    """100 requests over 5 schemas, greedy and sampled, at once beside unconstrained requests: every
    constrained answer parses and validates, every unconstrained one equals the merged model's greedy
    text (the masks touch only their own rows)."""
    jobs = [(name, PROMPTS[i % len(PROMPTS)], 0.0 if i % 2 else 1.0, i) for i, name in
            enumerate(n for _ in range(20) for n in SCHEMAS)]

    def constrained(job):
        name, prompt, temperature, seed = job
        r = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": prompt}],
                                           response_format=_fmt(name), temperature=temperature, seed=seed)
        return name, r.choices[0]

    def free(prompt):
        return client.completions.create(model="alpha", prompt=prompt, max_tokens=10, temperature=0).choices[0].text

    with single_thread(), ThreadPoolExecutor(16) as pool:
        free_runs = [pool.submit(free, p) for p in PROMPTS]
        results = list(pool.map(constrained, jobs))
        free_texts = [f.result() for f in free_runs]
    assert len(results) == 100
    for name, choice in results:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    assert free_texts == [served.expected("alpha", p, 10) for p in PROMPTS]
    assert len({c.message.content for _, c in results}) > 20  # sampled rows differ: the model writes, not a template


def _reference(served, prompt_ids: list[int], schema: dict, max_new: int) -> str:
    """Greedy decoding of the merged model under the schema (:func:`_reference_ids`), as text."""
    ids = _reference_ids(served, prompt_ids, schema, max_new)
    return served.tokenizer().decode(ids, skip_special_tokens=True)


def _reference_ids(served, prompt_ids: list[int], schema: dict, max_new: int) -> list[int]:
    """Greedy decoding of the merged model under the schema, one token at a time: the matcher's mask
    unpacked with plain torch (not the server's code path) before each argmax. The drawn ids, an
    ending EOS included."""
    tok = served.tokenizer()
    model = served.model("alpha")
    comp = GrammarCompilers(model.config.vocab_size)
    matcher = comp.json_schema(tok, [tok.eos_token_id], schema, "schema").matcher().state
    v = model.config.vocab_size

    bits = xgr.allocate_token_bitmask(1, v)
    ids = list(prompt_ids)
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        matcher.fill_next_token_bitmask(bits)
        allowed = ((bits[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:v].bool()
        t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert matcher.accept_token(t)
        ids.append(t)
        if t == tok.eos_token_id:
            break
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("name", ["person", "pairs"])
def test_greedy_constrained_answer_equals_the_masked_merged_model(client, served, name):
    tok = served.tokenizer()
    messages = [{"role": "user", "content": "zip 12"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    want = _reference(served, list(ids), SCHEMAS[name], 100)
    r = client.chat.completions.create(model="alpha", messages=messages, response_format=_fmt(name), temperature=0)
    assert r.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="alpha", messages=messages, response_format=_fmt(name),
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_json_object_answers_parse(client):
    """Any object (keys and values free): the ones that end are objects; one the context cut is
    ``length`` (with 128 positions, a random model's free keys can run out of room)."""
    reasons = []
    for i, prompt in enumerate(PROMPTS):
        r = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": prompt}],
                                           response_format={"type": "json_object"}, temperature=0.7, seed=i)
        reasons.append(r.choices[0].finish_reason)
        if reasons[-1] == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert reasons[-1] == "length" and r.choices[0].message.content.startswith("{")
    assert reasons.count("stop") >= 2, reasons
    # /v1/completions takes response_format too (as vLLM's does)
    r = client.completions.create(model="alpha", prompt="zip", max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": SCHEMAS["status"]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["status"])


def test_max_tokens_cut_is_length_and_text_is_a_prefix(client, served):
    full = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "zip 12"}],
                                          response_format=_fmt("person"), temperature=0).choices[0].message.content
    r = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "zip 12"}],
                                       response_format=_fmt("person"), temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == full[:5]


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "minimum greater than maximum"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}, "pattern"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "yaml"}, "'yaml' is not supported"),
    ("json", "response_format"),
])
def test_invalid_response_format_is_a_400_naming_it(server, fmt, needle):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and needle in err["message"], err


def _chat_ids(served, messages) -> list[int]:
    ids = served.tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_constrained_logprobs_are_the_merged_models_raw_log_softmax(client, served):
    """The grammar's mask does not reach log probabilities: each token of a greedy constrained answer
    (its ending EOS included) reports a finite logprob equal to the merged model's unmasked
    ``log_softmax`` for it, and usage counts those tokens."""
    tok, messages = served.tokenizer(), [{"role": "user", "content": "zip 12"}]
    prompt = _chat_ids(served, messages)
    want = _reference_ids(served, prompt, SCHEMAS["person"], 100)
    assert want[-1] == tok.eos_token_id
    with torch.no_grad():
        logits = served.model("alpha")(torch.tensor([prompt + want[:-1]])).logits[0, len(prompt) - 1:].double()
    ref = torch.log_softmax(logits, -1)[torch.arange(len(want)), torch.tensor(want)]
    r = client.chat.completions.create(model="alpha", messages=messages, response_format=_fmt("person"),
                                       temperature=0, logprobs=True, top_logprobs=2)
    got = r.choices[0].logprobs.content
    assert [e.token for e in got] == [tok.decode([t]) for t in want]
    lps = torch.tensor([e.logprob for e in got], dtype=torch.float64)
    assert torch.isfinite(lps).all() and (lps > -9999).all()
    torch.testing.assert_close(lps, ref, atol=1e-4, rtol=0)
    assert r.usage.completion_tokens == len(want)
    assert (ref < torch.log_softmax(logits, -1).max(-1).values - 1e-6).any()  # the mask changed a choice


def test_n_samples_each_follow_the_schema_with_their_own_matcher(client):
    """n=3 samples forked from one prefilled prompt, seeded: each is valid, they differ, and the same
    request gives the same three (each sample keeps its own place in the grammar)."""
    def ask():
        r = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "a record please"}],
                                           response_format=_fmt("person"), temperature=1.0, seed=21, n=3)
        return [(c.finish_reason, c.message.content) for c in sorted(r.choices, key=lambda c: c.index)]

    first = ask()
    for reason, content in first:
        assert reason == "stop", content
        jsonschema.validate(json.loads(content), SCHEMAS["person"])
    assert len({c for _, c in first}) >= 2
    assert ask() == first
    best = client.completions.create(model="alpha", prompt="zip", max_tokens=60, temperature=1.0, seed=3, n=2, best_of=4,
                                     extra_body={"response_format": _fmt("status")})
    for c in best.choices:
        jsonschema.validate(json.loads(c.text), SCHEMAS["status"])


def test_a_complete_answer_ends_before_min_tokens(client):
    """min_tokens bans EOS, but a complete JSON answer allows nothing else: the grammar wins, the
    answer ends there (valid, ``stop``) instead of every token being masked."""
    r = client.completions.create(model="alpha", prompt="zip", max_tokens=100, temperature=0,
                                  extra_body={"response_format": _fmt("status"), "min_tokens": 90})
    c = r.choices[0]
    assert c.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), SCHEMAS["status"])
    assert r.usage.completion_tokens < 90
