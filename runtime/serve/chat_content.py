"""A chat message's text in the form its chat template reads.

OpenAI clients send a message's ``content`` as a string, and most chat templates print it as one.
Image-text checkpoints often ship their processor's template, which reads content only as a list of
typed parts (LLaVA's ``message['content'] | selectattr('type', 'equalto', 'text')``): handed a string,
it renders nothing for the message and raises no error, so the model would answer an empty turn.

Which form a template reads is decided once per template, on the first conversation whose user turns
hold text: it is rendered with string content and, when a user turn's text is missing from the
result (or the render fails), with each text as one ``{"type": "text", "text": ...}`` part.
"""

from __future__ import annotations

from typing import Any

_READS_PARTS: dict[str, bool] = {}  # template source -> whether it reads content as typed parts only


def as_template_reads(tok, template: str, messages: list[dict], **kw: Any) -> list[dict]:
    """``messages`` (string contents, as ``tool_calls.template_messages`` gives them) with each
    string content as a one-part list when ``template`` reads content as parts only. ``kw``: what
    ``apply_chat_template`` is called with besides the messages (``add_generation_prompt``, ``tools``)."""
    reads_parts = _READS_PARTS.get(template)
    if reads_parts is None:
        texts = [m["content"].strip() for m in messages
                 if m.get("role") == "user" and isinstance(m.get("content"), str) and m["content"].strip()]
        if not texts:  # nothing to tell the forms apart by: decide on a later conversation
            return messages
        reads_parts = _READS_PARTS[template] = (not _renders(tok, template, messages, texts, kw)
                                                and _renders(tok, template, _parts(messages), texts, kw))
    return _parts(messages) if reads_parts else messages


def _renders(tok, template: str, messages: list[dict], texts: list[str], kw: dict) -> bool:
    """Whether rendering ``messages`` with ``template`` shows every one of ``texts``."""
    try:
        out = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
    except Exception:  # the caller's own render reports a template that rejects the conversation
        return False
    return isinstance(out, str) and all(t in out for t in texts)


def _parts(messages: list[dict]) -> list[dict]:
    return [dict(m, content=[{"type": "text", "text": m["content"]}]) if isinstance(m.get("content"), str) else m
            for m in messages]
