"""Structured output: grammars compiled by xgrammar, and the token masks of an engine step.

Two sides:

- request threads compile what a request asks for (``response_format`` ``json_object`` /
  ``json_schema``, a forced tool call) into a :class:`Grammar` with :class:`GrammarCompilers`: one
  xgrammar compiler per served tokenizer, built on first use, whose cache keeps compiled schemas;
  a schema xgrammar or ``jsonschema`` rejects is a :class:`GrammarError` naming the problem;
- the engine thread gives each sequence with a grammar its own matcher (:meth:`Grammar.matcher`;
  each of ``n`` samples its own) and, per step, :class:`MaskFiller` fills the bitmask of the rows
  that draw on a worker thread while the forward runs; the sampler's ``process_logits`` then masks
  the logits ``[B, V]`` of a forward's rows with :meth:`RowMasks.apply`, its last change, in one call
  over the constrained rows. A step without a constrained row does none of this.

Why xgrammar and not llguidance or outlines-core: see docs/serve.md ("Structured output and tools")
for the figures (``bench/structured_output.py``). xgrammar's masks are filled by a batched C++ call
and it reads the demo's character tokenizer as well as byte-level BPE ones; outlines-core has no
grammar for an arbitrary JSON object; llguidance needs its own tokenizer wrapper for the character one.

JSON is generated in one fixed layout (``", "`` and ``": "`` separators, no other whitespace): a
grammar with free whitespace lets a model emit blank lines until ``max_tokens``. A string bounded
by ``minLength``/``maxLength`` is compiled as the equivalent ``pattern``: xgrammar 0.2.8's rule for
bounded strings lets raw control characters through (``{"maxLength": 3}`` took a tab, which JSON
forbids; upstream issue mlc-ai/xgrammar#800), its ``pattern`` rule does not.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch


class GrammarError(ValueError):
    """What a request asked to constrain cannot be compiled; ``param`` is the request field."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # serving without the serve extra: everything but constrained output works
        raise GrammarError("structured output needs the xgrammar package: pip install 'deltazip[serve]'") from e
    return xgrammar


def _clean(e: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    return re.sub(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e)).strip() or type(e).__name__


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar; each sequence that follows it gets its own :meth:`matcher`."""

    compiled: Any  # xgrammar.CompiledGrammar
    kind: str  # "json_object", "json_schema" or "tool_call"

    def matcher(self) -> Matcher:
        return Matcher(_xgr().GrammarMatcher(self.compiled))


class Matcher:
    """One sequence's place in its grammar (engine thread; filled by :class:`MaskFiller`)."""

    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state  # xgrammar.GrammarMatcher

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it."""
        return self.state.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and took a stop token."""
        return self.state.is_terminated()


_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # values there are data, not schemas


def bounded_strings_as_patterns(schema: Any) -> Any:
    """A copy of ``schema`` in which every string subschema bounded by ``minLength``/``maxLength``
    (and without a ``pattern``) carries the bounds as ``pattern: ^[\\s\\S]{min,max}$`` instead."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYS else bounded_strings_as_patterns(v) for k, v in schema.items()}
    kind = out.get("type")
    if (kind == "string" or isinstance(kind, list) and "string" in kind) and "pattern" not in out \
            and ("minLength" in out or "maxLength" in out):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{lo},{'' if hi is None else int(hi)}}}$"
    return out


def json_schema_ebnf(schema: Any, param: str) -> str:
    """The EBNF of ``schema`` in the fixed JSON layout (for structural tags: forced tool calls)."""
    check_schema(schema, param)
    try:
        return str(_xgr().Grammar.from_json_schema(json.dumps(bounded_strings_as_patterns(schema)),
                                                   any_whitespace=False))
    except Exception as e:
        raise GrammarError(f"{param} cannot be compiled: {_clean(e)}", param) from e


class GrammarCompilers:
    """One xgrammar ``GrammarCompiler`` per tokenizer (its ``TokenizerInfo`` takes ~0.1 s for a 49k
    vocabulary, so it is built on first use), dropped with the tokenizer. Thread-safe."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size  # the model's logits width; tokens past the tokenizer's are never allowed
        self._by_tok: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def compiler(self, tokenizer, eos_ids: list[int]):
        xgr = _xgr()
        with self._lock:
            comp = self._by_tok.get(tokenizer)
            if comp is None:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(eos_ids))
                comp = xgr.GrammarCompiler(info, max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
                self._by_tok[tokenizer] = comp
        return comp

    def json_schema(self, tokenizer, eos_ids: list[int], schema: Any, param: str) -> Grammar:
        """Output valid under ``schema`` (a JSON schema as a dict or boolean)."""
        check_schema(schema, param)
        comp = self.compiler(tokenizer, eos_ids)
        try:
            return Grammar(comp.compile_json_schema(json.dumps(bounded_strings_as_patterns(schema)),
                                                    any_whitespace=False), "json_schema")
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the reason
            raise GrammarError(f"{param} cannot be compiled: {_clean(e)}", param) from e

    def json_object(self, tokenizer, eos_ids: list[int]) -> Grammar:
        """Any JSON object (``strict_mode=False``: every key and value is allowed)."""
        comp = self.compiler(tokenizer, eos_ids)
        return Grammar(comp.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False),
                       "json_object")

    def structural_tag(self, tokenizer, eos_ids: list[int], tag, param: str) -> Grammar:
        """An xgrammar structural tag (the forced tool calls of :mod:`deltazip.runtime.serve.tool_calls`)."""
        comp = self.compiler(tokenizer, eos_ids)
        try:
            return Grammar(comp.compile_structural_tag(tag), "tool_call")
        except Exception as e:
            raise GrammarError(f"{param} cannot be compiled: {_clean(e)}", param) from e


def check_schema(schema: Any, param: str) -> None:
    """A :class:`GrammarError` naming what makes ``schema`` an invalid JSON schema (its metaschema's
    complaint), before xgrammar sees it."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param)
    try:
        from jsonschema import validators
        from jsonschema.exceptions import SchemaError
    except ImportError:  # xgrammar's own checks still apply
        return
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise GrammarError(f"{param} is not a valid JSON schema: {e.message}" + (f" (at {where})" if where else ""),
                           param) from e


def response_format_grammar(compilers: GrammarCompilers, tokenizer, eos_ids: list[int], rf: Any) -> Grammar | None:
    """The grammar of an OpenAI ``response_format`` (None for ``text`` or none at all)."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return compilers.json_object(tokenizer, eos_ids)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GrammarError("response_format.json_schema must be an object with a `schema` (and a `name`)")
        return compilers.json_schema(tokenizer, eos_ids, spec["schema"], "response_format")
    raise GrammarError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")


# --------------------------------------------------------------------------------------------------
# The engine side: masks of a step
# --------------------------------------------------------------------------------------------------


class MaskFiller:
    """Fills the token bitmasks of a step's constrained rows beside its forward (engine-owned).

    The bitmask is int32 ``[rows, ceil(V / 32)]`` (bit ``t % 32`` of word ``t // 32`` set: token ``t``
    allowed), one buffer reused across steps, pinned when the logits live on a GPU.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        # xgrammar's CPU kernel on a CPU; elsewhere its pure-torch one (no kernel compiled on the engine thread)
        self.backend = "cpu" if self.device.type == "cpu" else "torch_native"
        self._pool: ThreadPoolExecutor | None = None
        self._batch = None
        self._buf: torch.Tensor | None = None

    def start(self, matchers: dict[Hashable, Matcher]) -> StepMasks | None:
        """Begin filling the masks of a step's constrained rows, ``matchers`` keyed by what names each
        row (the engine: sequence ids; several keys may share one matcher, filled once); None when
        there is none: a step without a constrained row does nothing here."""
        if not matchers:
            return None
        if self._pool is None:
            xgr = _xgr()
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltazip-grammar")
            # Its own threads split a large batch; on CPU the forward needs the cores.
            self._batch = xgr.BatchGrammarMatcher(max_threads=1 if self.device.type == "cpu" else "auto")
        unique = list({id(m): m for m in matchers.values()}.values())
        row_of = {id(m): i for i, m in enumerate(unique)}
        buf = self._buffer(len(unique))[:len(unique)]
        fut = self._pool.submit(self._batch.batch_fill_next_token_bitmask, [m.state for m in unique], buf)
        return StepMasks(self, fut, {k: row_of[id(m)] for k, m in matchers.items()}, buf)

    def _buffer(self, n: int) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        if self._buf is None or self._buf.shape[0] < n:
            # The last step's host->device copy finished: its sampling read the tokens back.
            self._buf = torch.full((max(n, 32), words), -1, dtype=torch.int32,
                                   pin_memory=self.device.type == "cuda")
        return self._buf

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class StepMasks:
    """The bitmasks of one step's constrained rows, being filled (``row_of``: key -> bitmask row)."""

    def __init__(self, filler: MaskFiller, fut: Future, row_of: dict[Hashable, int], buf: torch.Tensor):
        self.filler, self.fut, self.row_of, self.buf = filler, fut, row_of, buf
        self._dev: torch.Tensor | None = None

    def bitmask(self) -> torch.Tensor:
        """The filled bitmask ``[constrained rows, W]`` on the logits' device (waits for the fill)."""
        if self._dev is None:
            self.fut.result()
            dev = self.filler.device
            self._dev = self.buf if dev.type == "cpu" else self.buf.to(dev, non_blocking=True)
        return self._dev

    def rows(self, keys: list[Hashable | None]) -> RowMasks | None:
        """The masks of a batch whose row ``b`` is the step's row ``keys[b]`` (None: unconstrained);
        None when no row of it is constrained."""
        at = [(b, self.row_of[k]) for b, k in enumerate(keys) if k is not None]
        return RowMasks(self, len(keys), at) if at else None


class RowMasks:
    """The masks of one batch of logits ``[B, V]``: :meth:`apply` sets to ``-inf`` the tokens the
    grammars of its constrained rows disallow, in one call over those rows; the others are untouched."""

    def __init__(self, step: StepMasks, batch: int, at: list[tuple[int, int]]):
        self.step, self.batch = step, batch
        self.indices = [b for b, _ in at]  # rows of the batch
        self.source = [r for _, r in at]  # their rows of the step's bitmask

    def apply(self, logits: torch.Tensor) -> None:
        """In place on ``logits [B, V]`` (inference tensors too)."""
        from xgrammar import apply_token_bitmask_inplace

        bits = self.step.bitmask()
        if self.indices != self.source or bits.shape[0] < self.batch:  # lay the step's rows out as the batch's
            src = torch.zeros(self.batch, dtype=torch.int64)
            src[self.indices] = torch.tensor(self.source)
            bits = bits.index_select(0, src.to(bits.device, non_blocking=True))
        with torch.inference_mode():  # a forward's logits are inference tensors: updated in place only in this mode
            apply_token_bitmask_inplace(logits, bits, indices=self.indices, vocab_size=self.step.filler.vocab_size,
                                        backend=self.step.filler.backend)
