"""Tools on a real server (loopback port, the official ``openai`` client, CPU fp32): two RTN-compressed
variants of a tiny Llama, one whose chat template writes Hermes ``<tool_call>`` blocks, one Llama-3 JSON
calls. A random model never calls a tool by itself, so forced calls (``required``, a named function)
show the grammar at work and ``auto`` shows the template and the untouched model."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from _factories import perturb, tiny_model
from _serving import single_thread

from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

CALLS = ("{% for c in m['tool_calls'] %}{{ '<tool_call>' if hermes else '' }}"
         "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
         "{{ '</tool_call>' if hermes else '' }}{% endfor %}")
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'assistant' and m['tool_calls'] is defined %}assistant: "
            + CALLS + "\n{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TEMPLATES = {"hermes": "{% set hermes = true %}" + TEMPLATE, "llama3": "{% set hermes = false %}" + TEMPLATE}
assert "<tool_call>" in TEMPLATES["hermes"] and "<tool_call>" not in TEMPLATES["llama3"].replace("'<tool_call>'", "")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "weather in oslo?"}]


@pytest.fixture(scope="module")
def tools_set(tmp_path_factory):
    """A tiny Llama base (512 positions: templates and calls are characters here) and two RTN variants."""
    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.demo.pair import build_char_tokenizer
    from deltazip.kernels.scheme import DeltaScheme

    root = tmp_path_factory.mktemp("tools")
    ids = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2, max_position_embeddings=512)
    base_dir = root / "base"
    tiny_model("llama", **ids).save_pretrained(base_dir)
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATES["hermes"]
    tok.save_pretrained(base_dir)
    with single_thread():
        for i, name in enumerate(TEMPLATES):
            ft = root / f"ft-{name}"
            perturb(tiny_model("llama", **ids), scale=0.3, seed=31 + i).save_pretrained(ft)
            tok.chat_template = TEMPLATES[name]
            tok.save_pretrained(ft)
            compress_delta(base_dir, ft, None, root / "arts" / name,
                           CompressConfig(scheme=DeltaScheme(group_size=32), method="rtn", device="cpu"))
    return root


@pytest.fixture(scope="module")
def server(tools_set):
    with single_thread():
        rt = build_runtime(ServeConfig(artifacts=tools_set / "arts", base=str(tools_set / "base"), max_num_seqs=8),
                           observer=Metrics())
        with ServerThread(create_app(rt, Metrics())) as srv:
            yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _calls(message_or_calls) -> list[tuple[str, dict]]:
    calls = getattr(message_or_calls, "tool_calls", message_or_calls) or []
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def _streamed(client, **kw) -> tuple[str, list[tuple[str, dict]], str]:
    """Content, calls (deltas joined by index, as clients do) and finish reason of a streamed answer."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        reason = ch.finish_reason or reason
    assert all(c["id"] for c in calls.values())
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], reason


def _template_ids(tools_set, name: str, messages: list[dict], tools=None) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tools_set / "base")
    ids = tok.apply_chat_template(messages, chat_template=TEMPLATES[name], tools=tools, add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_named_function_round_trips_through_tool_calls(client, tools_set):
    """A named function is called (grammar), whole and streamed alike; the client sends the call and
    its result back and the template renders them (the prompt's length says how: arguments as an object)."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    [(name, args)] = _calls(msg)
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER)
    assert r.usage.prompt_tokens == len(_template_ids(tools_set, "hermes", ASK, TOOLS))
    assert _streamed(client, model="hermes", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0) == \
        ("", [(name, args)], "tool_calls")

    call = msg.tool_calls[0]
    back = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model="hermes", messages=back, tools=TOOLS, max_tokens=4, temperature=0)
    rendered = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": call.id}]
    ids = _template_ids(tools_set, "hermes", rendered, TOOLS)
    assert json.dumps(args) in _decode(tools_set, ids)
    assert r2.usage.prompt_tokens == len(ids) and r2.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _decode(tools_set, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_set / "base").decode(ids)


@pytest.mark.parametrize("model", ["hermes", "llama3"])
def test_required_calls_validate_whole_and_streamed(client, model):
    counts = []
    for parallel in (False, True):
        for seed in range(3):
            kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                      temperature=1.0, seed=seed)
            r = client.chat.completions.create(**kw)
            calls = _calls(r.choices[0].message)
            assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
            assert len(calls) == 1 or parallel
            counts.append(len(calls))
            for name, args in calls:
                jsonschema.validate(args, SCHEMAS[name])
            assert _streamed(client, **kw) == ("", calls, "tool_calls")
    if model == "hermes":  # parallel calls, one block after another
        assert max(counts) > 1, counts


def test_auto_leaves_the_model_free(client, tools_set):
    """``auto``: no grammar, the tools in the prompt; the random model answers text, equal to the merged
    model's greedy continuation of the same prompt. ``none``: the template gets no tools."""
    from deltazip.compress.merge import load_merged_model
    from deltazip.formats.artifact import Artifact
    from deltazip.models.checkpoint import Checkpoint

    ids = _template_ids(tools_set, "llama3", ASK, TOOLS)
    model = load_merged_model(Artifact(tools_set / "arts" / "llama3"), Checkpoint(tools_set / "base"))
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, pad_token_id=2)
    want = _decode(tools_set, out[0, len(ids):].tolist()).replace("</s>", "")
    r = client.chat.completions.create(model="llama3", messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == want and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model="llama3", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == len(_template_ids(tools_set, "llama3", ASK))


@pytest.mark.parametrize("body, param, needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "`get_time`"),
    ({"tool_choice": "always"}, "tool_choice", "'always'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "city"}}}]}, "tools",
     "not a valid JSON schema"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param, needle):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "hermes", "messages": ASK, "tools": TOOLS, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
