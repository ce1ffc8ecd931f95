"""Reading tool calls out of an answer (runtime/serve/tool_calls.py), whole and streamed in pieces."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from deltazip.runtime.serve.openai_schema import ApiError
from deltazip.runtime.serve.tool_calls import ToolCallReader, tool_format, tool_plan

CALL_A = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
CALL_B = {"name": "add", "arguments": {"a": 1, "b": 2}}
HERMES = f'Let me look.\n<tool_call>\n{json.dumps(CALL_A)}\n</tool_call>\n<tool_call>\n{json.dumps(CALL_B)}\n</tool_call>\n'
LLAMA = (f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(CALL_A["arguments"])}}}; '
         f'{{"name": "add", "parameters": {json.dumps(CALL_B["arguments"])}}}')


def read(fmt: str, text: str, parallel: bool = True, pieces: int | None = None, seed: int = 0):
    """``(content, calls)`` of ``text`` fed whole (``pieces=None``) or cut at random places."""
    r = ToolCallReader(fmt, parallel)
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), pieces - 1)) if pieces else []
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out = [r.feed(p) for p in parts] + [r.finish()]
    content = "".join(c for c, _ in out)
    calls = [c for _, cs in out for c in cs]
    assert calls == r.calls
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt, text", [("hermes", HERMES), ("llama3_json", LLAMA)])
def test_calls_are_read_alike_whole_and_streamed(fmt, text):
    want = [(CALL_A["name"], CALL_A["arguments"]), (CALL_B["name"], CALL_B["arguments"])]
    content, calls = read(fmt, text)
    assert calls == want
    assert content == ("Let me look." if fmt == "hermes" else "")
    for seed in range(20):
        assert read(fmt, text, pieces=1 + seed % 12, seed=seed) == (content, calls)


def test_parallel_false_keeps_the_first_call():
    assert read("hermes", HERMES, parallel=False)[1] == [(CALL_A["name"], CALL_A["arguments"])]
    assert read("llama3_json", LLAMA, parallel=False, pieces=5)[1] == [(CALL_A["name"], CALL_A["arguments"])]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "plain answer with <tool but no call"),
    ("hermes", "a <tool_call>{not json}</tool_call> b"),
    ("hermes", "cut short <tool_call>\n{\"name\": \"add\", \"argum"),
    ("llama3_json", "  {\"this\": \"is json but not a call\"}"),
    ("llama3_json", "{\"name\": \"add\", \"parameters\": {\"a\": 1}} and then text"),
    ("llama3_json", "just text {\"name\": \"add\", \"parameters\": {}}"),
])
def test_text_that_is_not_a_call_stays_content(fmt, text):
    for pieces in (None, 3, 7):
        content, calls = read(fmt, text, pieces=pieces)
        assert calls == [] and content == text


def _req(tools=None, tool_choice=None, parallel=None):
    return SimpleNamespace(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel)


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("req, param, needle", [
    (_req(TOOLS, {"type": "function", "function": {"name": "nope"}}), "tool_choice", "`nope`"),
    (_req(TOOLS, "sometimes"), "tool_choice", "'sometimes'"),
    (_req(None, "required"), "tool_choice", "needs tools"),
    (_req([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]), "tools",
     "not a valid JSON schema"),
    (_req([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
     "tools", "unique"),
    (_req([{"type": "retrieval"}]), "tools", "tools[0]"),
])
def test_bad_tools_and_tool_choice_are_400s_naming_the_field(req, param, needle):
    with pytest.raises(ApiError) as e:
        tool_plan(req, "{{ tools }} <tool_call>")
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message


def test_plan_reads_the_choice_and_the_template_format():
    plan = tool_plan(_req(TOOLS, {"type": "function", "function": {"name": "add"}}, False), "{{ tools }}")
    assert (plan.choice, plan.name, plan.parallel, plan.fmt) == ("function", "add", False, "llama3_json")
    assert tool_plan(_req(TOOLS, "none"), "no tools here").template_tools is None
    with pytest.raises(ApiError, match="does not render tools"):
        tool_plan(_req(TOOLS), "{{ messages }}")
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
