"""The JSON of ``/v1/completions`` and ``/v1/chat/completions`` answers, whole or as SSE chunks.

:class:`CompletionShape` and :class:`ChatShape` turn the engine's events into OpenAI's objects:
choices (``n`` per prompt, in prompt order), the echoed prompt, and log probabilities in the legacy
completions form (``tokens``, ``token_logprobs``, ``top_logprobs`` of ``{token: logprob}``,
``text_offset``; with ``echo`` the prompt's tokens come first, the first with ``null``) or the chat
form (``content[]`` of ``{token, logprob, bytes, top_logprobs}``). As vLLM does, a completions
``top_logprobs`` entry holds the chosen token and the ``k`` most likely ones (so up to ``k + 1``),
a chat entry exactly the ``k`` most likely, and offsets count characters of the choice's text.
Log probabilities are clamped at -9999 (JSON has no ``-inf``).
"""

from __future__ import annotations

import time
import uuid

from deltazip.runtime.serve.engine import FinishEvent, LogprobEntry, TokenEvent

_FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, _FLOOR)


class TokenTexts:
    """A token id's text (``decode([id])``), cached: the strings log probabilities are keyed by."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tok.decode([token_id])
        return s


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class CompletionShape:
    """JSON of one ``/v1/completions`` answer (``text_completion``), whole or as SSE chunks.

    Args:
        model: the served name.
        texts: the model's :class:`TokenTexts` (needed for log probabilities).
        echo: per prompt, ``(text, token ids)`` when the prompt is echoed, else None.
        samples: choices per prompt: choice ``i`` answers prompt ``i // samples``.
    """

    object = "text_completion"
    prefix = "cmpl"

    def __init__(self, model: str, texts: TokenTexts | None = None, echo: list[tuple[str, list[int]]] | None = None,
                 samples: int = 1):
        self.id, self.created, self.model = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time()), model
        self.texts, self.echo, self.samples = texts, echo, samples
        self._offset: dict[int, int] = {}  # streamed choice -> characters of text sent so far

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    # -- log probabilities ----------------------------------------------------------------------
    def _logprobs(self, ids: list[int], entries: list[LogprobEntry | None], offset: int) -> tuple[dict, int]:
        """The legacy object of tokens ``ids`` (their ``entries``; None: no log probability, the
        first prompt token), offsets from ``offset``; and the offset after them."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e in zip(ids, entries):
            s = self.texts(tid)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {s: _lp(e[1])}
            for alt, lp in e[2]:
                top.setdefault(self.texts(alt), _lp(lp))
            out["token_logprobs"].append(_lp(e[1]))
            out["top_logprobs"].append(top)
        return out, offset

    def _generated(self, entries: list[LogprobEntry] | None, offset: int) -> tuple[dict | None, int]:
        if entries is None:
            return None, offset
        return self._logprobs([e[0] for e in entries], list(entries), offset)

    @staticmethod
    def _join(a: dict | None, b: dict | None) -> dict | None:
        if a is None or b is None:
            return a or b
        return {k: a[k] + b[k] for k in a}

    # -- streamed -------------------------------------------------------------------------------
    def head(self) -> list[dict]:
        """Chunks sent before any text."""
        return []

    def echo_chunk(self, i: int, ev: TokenEvent | FinishEvent) -> dict | None:
        """The first chunk of choice ``i`` when the prompt is echoed: the prompt's text (and its log
        probabilities, which ``ev``, the choice's first event, carries)."""
        if self.echo is None:
            return None
        text, ids = self.echo[i // self.samples]
        lps, self._offset[i] = None, len(text)
        if ev.prompt_logprobs is not None:  # offsets count the tokens' texts, as in the whole answer
            lps, self._offset[i] = self._logprobs(ids, ev.prompt_logprobs, 0)
        return self._choice_chunk(i, text, lps)

    def chunk(self, i: int, ev: TokenEvent) -> dict | None:
        """The chunk of choice ``i`` for ``ev`` (None when it carries neither text nor log probabilities)."""
        if not ev.text and not ev.logprobs:
            return None
        lps, self._offset[i] = self._generated(ev.logprobs, self._offset.get(i, 0))
        return self._choice_chunk(i, ev.text, lps)

    def _choice_chunk(self, i: int, text: str, lps) -> dict:
        return self._envelope(self.object, [{"index": i, "text": text, "logprobs": lps, "finish_reason": None}])

    def final(self, i: int | None, reason: str | None) -> dict:
        """The chunk that ends choice ``i`` (``None``: the envelope of the usage chunk)."""
        choices = [] if i is None else [{"index": i, "text": "", "logprobs": None, "finish_reason": reason}]
        return self._envelope(self.object, choices)

    # -- whole ----------------------------------------------------------------------------------
    def response(self, evs: list[FinishEvent], use: dict) -> dict:
        """The answer of finished choices ``evs`` (choice ``i`` is ``evs[i]``) with usage ``use``."""
        choices = []
        for i, e in enumerate(evs):
            text, lps, offset = e.text, None, 0
            if self.echo is not None:
                ptext, ids = self.echo[i // self.samples]
                text = ptext + e.text
                if e.prompt_logprobs is not None:
                    lps, offset = self._logprobs(ids, e.prompt_logprobs, 0)
                else:
                    offset = len(ptext)
            lps = self._join(lps, self._generated(e.logprobs, offset)[0])
            choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": e.reason})
        return self._envelope(self.object, choices) | {"usage": use}


class ChatShape(CompletionShape):
    """JSON of one ``/v1/chat/completions`` answer (``chat.completion``, chunks ``chat.completion.chunk``)."""

    object = "chat.completion.chunk"
    prefix = "chatcmpl"

    def _content(self, entries: list[LogprobEntry] | None) -> dict | None:
        if entries is None:
            return None

        def item(tid: int, lp: float) -> dict:
            s = self.texts(tid)
            return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}

        return {"content": [item(t, lp) | {"top_logprobs": [item(a, alp) for a, alp in top]} for t, lp, top in entries]}

    def echo_chunk(self, i: int, ev) -> dict | None:
        return None

    def chunk(self, i: int, ev: TokenEvent) -> dict | None:
        if not ev.text and not ev.logprobs:
            return None
        return self._envelope(self.object, [{"index": i, "delta": {"content": ev.text},
                                             "logprobs": self._content(ev.logprobs), "finish_reason": None}])

    def final(self, i: int | None, reason: str | None) -> dict:
        choices = [] if i is None else [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]
        return self._envelope(self.object, choices)

    def head(self) -> list[dict]:
        return [self._envelope(self.object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]) for i in range(self.samples)]

    def response(self, evs: list[FinishEvent], use: dict) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": e.text}, "logprobs": self._content(e.logprobs),
                    "finish_reason": e.reason} for i, e in enumerate(evs)]
        return self._envelope("chat.completion", choices) | {"usage": use}
