"""Tools in chat requests: checking ``tools`` / ``tool_choice``, the messages a chat template renders,
forcing a call with a grammar, and reading the calls out of an answer, whole or streamed.

Two output formats, picked from the variant's chat template:

- ``hermes`` (a template that mentions ``<tool_call>``: Qwen 2.5/3, Hermes, SmolLM3...): each call
  is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``llama3_json`` (any other template that renders ``tools``, e.g. Llama 3.1/3.2): the answer is
  ``{"name": ..., "parameters": {...}}`` (several joined by ``; ``), optionally after ``<|python_tag|>``.

``tool_choice`` ``auto`` leaves the model free and reads whatever calls it makes; ``none`` renders no
tools and reads none; ``required`` and a named function compile an xgrammar structural tag of the
format (one or more calls, or exactly that one) whose arguments follow each tool's ``parameters``
schema. ``parallel_tool_calls: false`` allows one call (grammar) or keeps the first (``auto``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from deltazip.runtime.serve.engine import FinishEvent, TokenEvent
from deltazip.runtime.serve.openai_schema import ApiError
from deltazip.runtime.serve.openai_shapes import ChatShape, TokenTexts

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools, checked."""

    tools: list[dict]  # OpenAI function tools, as given
    choice: str  # "auto", "none", "required" or "function" (``name``)
    name: str | None
    parallel: bool
    fmt: str  # "hermes" or "llama3_json"

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template gets as ``tools`` (none for ``tool_choice: none``)."""
        return None if self.choice == "none" else self.tools

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def structural_tag(self):
        """The xgrammar structural tag that forces the call(s), or None (``auto``, ``none``).

        The library's tag of the format (``qwen_3``: Hermes blocks, ``llama``: JSON) with two changes:
        each call's arguments follow the grammar of :func:`~deltazip.runtime.serve.grammar.json_schema_ebnf`
        (the fixed JSON layout; the tag's own JSON allows free whitespace), and ``required`` with
        parallel calls is calls only (the library's form lets free text follow the first call).
        """
        if self.choice not in ("required", "function"):
            return None
        import xgrammar as xgr

        choice = "required" if self.choice == "required" else {"type": "function", "function": {"name": self.name}}
        tag = xgr.get_model_structural_tag("qwen_3" if self.fmt == "hermes" else "llama", tools=self.tools,
                                           tool_choice=choice, reasoning=False, parallel_tool_calls=self.parallel)
        fmt = _fixed_layout(tag.model_dump()["format"])
        if self.choice == "required" and self.parallel:
            fmt = {"type": "tags_with_separator", "tags": fmt["tags"], "separator": "\n" if self.fmt == "hermes" else "; ",
                   "at_least_one": True, "stop_after_first": False}
        return xgr.StructuralTag.model_validate({"type": "structural_tag", "format": fmt})


def _fixed_layout(fmt: Any) -> Any:
    """A structural tag's format with every JSON-schema content replaced by its fixed-layout grammar."""
    from deltazip.runtime.serve.grammar import json_schema_ebnf

    if isinstance(fmt, list):
        return [_fixed_layout(f) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    if fmt.get("type") == "json_schema" and "json_schema" in fmt:
        return {"type": "grammar", "grammar": json_schema_ebnf(fmt["json_schema"], "tools")}
    return {k: _fixed_layout(v) for k, v in fmt.items()}


def tool_format(template: str) -> str:
    return "hermes" if HERMES_OPEN in template else "llama3_json"


def _check_tools(tools: Any) -> list[dict]:
    from deltazip.runtime.serve.grammar import GrammarError, check_schema

    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                       param="tools")
    seen = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in seen:
            raise ApiError(400, f"tools[{i}].function.name must be a non-empty string unique among the tools",
                           param="tools")
        seen.add(name)
        try:
            check_schema(fn.get("parameters", {"type": "object"}), f"tools[{i}].function.parameters")
        except GrammarError as e:
            raise ApiError(400, str(e), param="tools") from e
    return tools


def tool_plan(req, template: str) -> ToolPlan | None:
    """The request's tools checked against ``tool_choice`` (400s name the field), or None without tools."""
    choice, parallel = req.tool_choice, req.parallel_tool_calls is not False
    if not req.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    tools = _check_tools(req.tools)
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"tool_choice names the function `{name}`, which is not among the tools",
                           param="tool_choice")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise ApiError(400, f"tool_choice {choice!r} is not one of 'auto', 'none', 'required' or a named function",
                       param="tool_choice")
    if choice != "none" and "tools" not in template:
        raise ApiError(400, "this model's chat template does not render tools", param="tools")
    return ToolPlan(tools, choice, name, parallel, tool_format(template))


def template_messages(messages) -> list[dict]:
    """OpenAI chat messages as chat templates read them: text content, an assistant's ``tool_calls``
    with their ``arguments`` as objects (what templates serialize with ``tojson``), a tool answer's
    ``tool_call_id`` and ``name``."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: text, and images where the model reads them
            if any(p.get("type") not in ("text", "image_url") for p in content):
                raise ApiError(400, "only text and image_url content parts are supported", param="messages")
            if any(p.get("type") == "image_url" for p in content):  # typed parts, as processors' templates read
                content = [{"type": "image"} if p["type"] == "image_url" else {"type": "text", "text": str(p.get("text", ""))}
                           for p in content]
            else:
                content = "".join(str(p.get("text", "")) for p in content)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        extra = m.model_extra or {}
        if m.role == "assistant" and extra.get("tool_calls"):
            msg["tool_calls"] = [_template_call(c) for c in extra["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if isinstance(extra.get(key), str):
                msg[key] = extra[key]
        out.append(msg)
    return out


def _template_call(call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, "an assistant message's tool_calls[].function must have a name", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise ApiError(400, f"tool_calls[].function.arguments is not JSON: {e}", param="messages") from e
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# --------------------------------------------------------------------------------------------------
# Reading calls out of an answer
# --------------------------------------------------------------------------------------------------


def _call(obj: Any) -> dict | None:
    """An OpenAI tool call from a parsed ``{"name", "arguments" | "parameters"}`` object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


def _hermes_block(block: str) -> dict | None:
    try:
        return _call(json.loads(block))
    except ValueError:
        return None


def _llama_calls(text: str) -> list[dict] | None:
    """``{...}; {...}`` (after an optional python tag) as calls; None unless all of it is calls."""
    s = text.strip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG):].lstrip()
    dec, calls, i = json.JSONDecoder(), [], 0
    while i < len(s):
        try:
            obj, i = dec.raw_decode(s, i)
        except ValueError:
            return None
        call = _call(obj)
        if call is None:
            return None
        calls.append(call)
        while i < len(s) and s[i] in " \t\n;":
            i += 1
    return calls or None


class ToolCallReader:
    """Splits one choice's answer into content and tool calls as its text streams in.

    :meth:`feed` and :meth:`finish` return ``(content, calls)``: text safe to show now (nothing
    that could still turn out to be part of a call) and the calls completed since the last call.
    """

    def __init__(self, fmt: str, parallel: bool):
        self.fmt, self.parallel = fmt, parallel
        self.buf = ""
        self.ws = ""  # whitespace held back: shown only when text follows it, dropped around calls
        self.mode = "start" if fmt == "llama3_json" else "text"
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        if self.mode == "start":  # llama3_json: is the answer a call? decided at its first visible characters
            head = self.buf.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.mode = "json"
            elif head and not PYTHON_TAG.startswith(head):
                self.mode = "text"
        if self.mode != "text":
            return "", []  # a call is read whole at the end
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode in ("json", "start"):
            calls = _llama_calls(self.buf)
            if calls is None:
                self.mode = "text"
                return self._scan(final=True)
            self.buf = ""
            return "", self._keep(calls)
        return self._scan(final=True)

    def _keep(self, calls: list[dict]) -> list[dict]:
        room = len(calls) if self.parallel else max(0, 1 - len(self.calls))
        calls = calls[:room]
        self.calls += calls
        return calls

    def _scan(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = "", []
        while True:
            if self.fmt == "hermes" and self.mode == "call":
                end = self.buf.find(HERMES_CLOSE)
                if end < 0 and not final:
                    break
                block = self.buf[len(HERMES_OPEN):end if end >= 0 else len(self.buf)]
                call = _hermes_block(block)
                raw = self.buf[:end + len(HERMES_CLOSE)] if end >= 0 else self.buf
                self.buf = self.buf[len(raw):]
                self.mode = "text"
                if call is not None:
                    calls += self._keep([call])
                    self.ws = ""
                else:  # not a call after all: its text is content
                    content += self._show(raw)
                if end < 0:
                    break
                continue
            start = self.buf.find(HERMES_OPEN) if self.fmt == "hermes" else -1
            if start >= 0:
                content += self._show(self.buf[:start])
                self.buf, self.mode = self.buf[start:], "call"
                continue
            keep = 0 if final or self.fmt != "hermes" else _partial_suffix(self.buf, HERMES_OPEN)
            content += self._show(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        if final and self.ws and not self.calls:
            content, self.ws = content + self.ws, ""
        return content, calls

    def _show(self, text: str) -> str:
        """Content to send: held-back whitespace goes out in front of visible text, trailing stays back."""
        visible = text.rstrip()
        if not visible:
            self.ws += text
            return ""
        out, self.ws = self.ws + visible, text[len(visible):]
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: a marker may follow)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def finish_reason(reason: str, calls: list[dict]) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


class ToolChatShape(ChatShape):
    """:class:`ChatShape` of a request with tools: ``message.tool_calls`` / ``delta.tool_calls``,
    ``finish_reason: "tool_calls"`` when the model called. Log probabilities go out with the tokens
    they belong to, whether their text is shown now, held back or read as a call."""

    def __init__(self, model: str, plan: ToolPlan, texts: TokenTexts | None = None, samples: int = 1):
        super().__init__(model, texts, samples=samples)
        self.plan = plan
        self.readers: dict[int, ToolCallReader] = {}

    def _reader(self, i: int) -> ToolCallReader:
        if i not in self.readers:
            self.readers[i] = ToolCallReader(self.plan.fmt, self.plan.parallel)
        return self.readers[i]

    def _delta(self, i: int, content: str, calls: list[dict]) -> dict:
        r = self._reader(i)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            first = len(r.calls) - len(calls)
            delta["tool_calls"] = [{"index": first + k, **c} for k, c in enumerate(calls)]
        return delta

    def chunk(self, i: int, ev: TokenEvent) -> dict | None:
        delta = self._delta(i, *self._reader(i).feed(ev.text))
        lps = self._content(ev.logprobs) if ev.logprobs else None
        if not delta and lps is None:
            return None
        return self._envelope(self.object, [{"index": i, "delta": delta, "logprobs": lps, "finish_reason": None}])

    def final(self, i: int | None, reason: str | None) -> dict:
        if i is None:
            return super().final(i, reason)
        r = self._reader(i)
        delta = self._delta(i, *r.finish())
        return self._envelope(self.object, [{"index": i, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason(reason or "stop", r.calls)}])

    def response(self, evs: list[FinishEvent], use: dict) -> dict:
        body = super().response(evs, use)
        for choice, ev in zip(body["choices"], evs):
            r = ToolCallReader(self.plan.fmt, self.plan.parallel)
            parts = [r.feed(ev.text), r.finish()]
            if r.calls:
                text = "".join(c for c, _ in parts).strip()
                choice["message"] = {"role": "assistant", "content": text or None, "tool_calls": r.calls}
                choice["finish_reason"] = finish_reason(ev.reason, r.calls)
        return body
