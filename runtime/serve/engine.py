"""Continuous batching over a base model and many deltas, one engine thread.

Why not transformers' own continuous batching? transformers ships a continuous-batching manager
(``transformers.generation.continuous_batching``: paged KV cache, varlen/flash attention, a FIFO or
prefill-first scheduler, CUDA graphs). We evaluated it and built our own small engine instead:

- its scheduler is internal; the delta-aware policy of paper §5.4 (at most N variants per step,
  line-skipping, preemption of line-skippers with state kept) has no hook there;
- every forward would need the per-row variant index, but its model runner flattens the batch into
  one packed varlen sequence and calls the model itself, so the index would have to be
  reconstructed from its private batch metadata in every layer;
- sampling settings are per manager, while the OpenAI API has per-request temperature, top_p,
  seed and stop strings;
- it is marked as evolving API (the module changed shape between releases).

The engine keeps the KV caches of all sequences in a paged pool (``deltazip.runtime.serve.kv_cache``:
fixed-size blocks, a block table per sequence) when the model class takes attention functions from
transformers' ``AttentionInterface``: the model is switched to ``deltazip_paged``
(``deltazip.runtime.serve.attention``: scaling, sliding windows per layer, soft-capping, GQA), a
step's cache object only appends the new tokens into their blocks and the attention reads the blocks
in place, so the model classes and rotary embeddings stay transformers' own and no past KV is copied.
Other model classes (ALiBi ones: Falcon-ALiBi, BLOOM, MPT) keep SDPA or eager attention and the
contiguous pool of ``deltazip.runtime.serve.model_runner`` (``KVPool``: per layer
``[rows, H_kv, capacity, D]``, a row per sequence; the step object ``StepKV``: one indexed store and
one gather per layer) with explicit attention masks
(``deltazip.runtime.serve.masks``: per layer type, sliding windows, the 2-D masks ALiBi models derive
their bias from). On CUDA, paged decode steps replay CUDA graphs (``deltazip.runtime.serve.cuda_graphs``).
Per step:

1. new requests and cancellations are taken in; the :class:`~deltazip.runtime.serve.scheduler.Scheduler`
   admits requests (at most ``max_deltas`` variants, ``max_num_seqs``, ``max_batch_tokens``);
2. variants that waiting requests need are prefetched into host memory; a variant that is not
   resident is loaded by a background thread (:mod:`~deltazip.runtime.serve.delta_loader`: disk,
   decode and, on CUDA, the host->device copy on a side stream) while the step goes on without its
   requests; once loaded it is written into a device slot between two forwards
   (:class:`~deltazip.runtime.serve.delta_cache.TieredCache`) and its requests are admitted;
3. the step's token budget (``max_batch_tokens``) goes first to one token per decoding sequence, then
   to the next chunk of each prompt still being read (chunked prefill: a long prompt takes several
   steps and never stalls the decoders); one forward runs the prompt chunks (left-padded), one the
   decodes — rows of every variant together, sorted by slot;
4. tokens are sampled for the whole batch in one pass on the device
   (``deltazip.runtime.serve.sampling``: the rows' settings as tensors, ``process_logits``, the draw,
   log probabilities for the rows that ask; the token masks of rows under a grammar,
   ``deltazip.runtime.serve.grammar``, are filled on a worker thread while the forward runs and
   applied last in ``process_logits``), detokenized incrementally, checked against stop strings,
   EOS, stop token ids, ``max_tokens`` and the context length; finished sequences free their KV cache,
   and their line-skippers may be preempted (their KV cache moves to host memory until they resume).

A request of ``n`` samples (``best_of``) is one sequence until its prompt is read; then the other
samples are forked from it (:meth:`SeqBlocks.fork <deltazip.runtime.serve.kv_cache.SeqBlocks.fork>`:
the prompt's blocks shared, nothing re-read; each gets its own grammar matcher) and draw their first
tokens from the same logits. Prompts
whose log probabilities are wanted (``echo``) run in a prefill forward of their own that keeps every
position's logits; the other rows keep only the last position's.

A request that is cancelled (client gone) is dropped at the next step and its KV cache freed.

Variants come and go while serving: :meth:`Engine.run_on_engine` runs a function on the engine
thread between two steps (adding a variant may decouple modules of the model, which must not happen
under a forward), and :meth:`Engine.remove_model` stops accepting requests for a variant at once,
lets the ones already accepted finish, then unloads it from every tier.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from deltazip.models.image_inputs import cross_attention_layers
from deltazip.models.loader import is_image_text, text_config
from deltazip.runtime.serve.delta_cache import TieredCache
from deltazip.runtime.serve.delta_loader import DeltaLoader
from deltazip.runtime.serve.grammar import GrammarCompilers, MaskFiller, StepMasks
from deltazip.runtime.serve.kv_cache import DEFAULT_BLOCK_SIZE, BlockPool, SeqBlocks
from deltazip.runtime.serve.model_runner import SeqKV, forward_step, new_kv_pool, new_seq_kv
from deltazip.runtime.serve.prompt_media import PromptInputs, PromptMedia, is_prefix_lm
from deltazip.runtime.serve.recurrent_state import recurrent_layer_types, tokenwise
from deltazip.runtime.serve.sampling import (
    MAX_TOP_LOGPROBS,
    process_logits,
    sample_seed,
    sample_step,
    step_sampling,
    token_logprobs,
)
from deltazip.runtime.serve.scheduler import BASE_KEY, SchedRequest, Scheduler

# The id its owner gave the request being submitted in this context (the --workers front's, a Ray
# replica's), set around the handler that calls ``submit``: a context variable, so the HTTP routes in
# between need not carry it. The engine reports that request's progress under it to
# ``observer.request_state(tag, state)``: ``prefilling`` before the first forward that reads its
# prompt, ``generating`` when its first token is sampled, each before anything is sent for it.
REQUEST_TAG: contextvars.ContextVar[str | None] = contextvars.ContextVar("deltazip_request_tag", default=None)

log = logging.getLogger("deltazip.serve")


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------


class EngineError(Exception):
    """A request the engine refuses; ``status`` is the HTTP status the server answers with."""

    status = 400
    code = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(EngineError):
    status = 429
    code = "rate_limit_exceeded"


class PromptTooLong(EngineError):
    code = "context_length_exceeded"


class UnknownModel(EngineError):
    status = 404
    code = "model_not_found"


@dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI semantics, with vLLM's extras).

    ``temperature == 0`` is greedy (argmax, what ``generate(do_sample=False)`` does); ``top_p`` keeps
    the smallest set of tokens whose probability reaches it, ``top_k`` (0: off) the ``k`` most likely,
    ``min_p`` those at least ``min_p`` times as likely as the most likely; ``seed`` makes sampling
    reproducible; ``stop`` strings end the completion and are not part of it, nor are
    ``stop_token_ids``, EOS (unless ``ignore_eos``) or anything before ``min_tokens`` tokens.
    ``presence_penalty``/``frequency_penalty`` (output tokens), ``repetition_penalty`` (prompt and
    output tokens) and ``logit_bias`` (token id -> added logit) change the logits before sampling.
    ``grammar`` (a compiled :class:`~deltazip.runtime.serve.grammar.Grammar`) constrains every token
    to it; its completion ends the answer, before ``min_tokens`` too (EOS is then the only token it allows).

    ``n`` samples are returned; ``best_of`` (default ``n``) are drawn and share the prompt's KV cache.
    ``logprobs``: how many alternatives each generated token reports with its log probability (None:
    no log probabilities); ``prompt_logprobs`` the same for the prompt's tokens (echo).
    ``max_tokens == 0`` only scores the prompt.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    top_k: int = 0
    min_p: float = 0.0
    grammar: Any = None

    def __post_init__(self) -> None:
        for name, ok, why in self._checks():
            if not ok:
                raise EngineError(f"{name} {why}, got {getattr(self, name)!r}", name)
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            raise EngineError("stop must be up to 4 non-empty strings", "stop")
        if self.top_k == -1:  # vLLM's spelling of "off"
            self.top_k = 0

    def _checks(self) -> list[tuple[str, bool, str]]:
        inside = lambda x, lo, hi: lo <= x <= hi and not math.isnan(x)  # noqa: E731
        return [
            ("max_tokens", self.max_tokens >= 0, "must be >= 0 (0: only read the prompt, to score it)"),
            ("temperature", inside(self.temperature, 0.0, 2.0), "must lie in [0, 2]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must lie in (0, 1]"),
            ("n", self.n >= 1, "must be >= 1"),
            ("best_of", self.best_of is None or self.best_of >= self.n, "must be >= n"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"must lie in [0, {MAX_TOP_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"must lie in [0, {MAX_TOP_LOGPROBS}]"),
            ("presence_penalty", inside(self.presence_penalty, -2.0, 2.0), "must lie in [-2, 2]"),
            ("frequency_penalty", inside(self.frequency_penalty, -2.0, 2.0), "must lie in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must lie in (0, 10]"),
            ("logit_bias", all(inside(v, -100.0, 100.0) for v in self.logit_bias.values()),
             "values must lie in [-100, 100]"),
            ("min_tokens", 0 <= self.min_tokens <= max(self.max_tokens, 0), "must lie in [0, max_tokens]"),
            ("top_k", self.top_k >= -1, "must be -1 or 0 (off) or >= 1"),
            ("min_p", inside(self.min_p, 0.0, 1.0), "must lie in [0, 1]"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def samples(self) -> int:
        """Sequences drawn for the prompt (``best_of``, default ``n``)."""
        return self.best_of or self.n

    @property
    def ranked(self) -> bool:
        """More samples are drawn than returned: they are ranked by cumulative log probability."""
        return self.samples > self.n


LogprobEntry = tuple[int, float, list[tuple[int, float]]]
"""One token's log probability: ``(token id, logprob, [(alternative id, logprob), ...])``, the
alternatives most likely first."""


@dataclass
class TokenEvent:
    """New text of a sequence (possibly empty while a stop string might still match); ``logprobs``:
    the entries of the tokens this text completes (requests with ``logprobs`` only);
    ``prompt_logprobs``: the prompt's, on the sequence's first event (requests with ``prompt_logprobs``)."""

    text: str
    token_id: int
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None  # on a sequence's first event (echo)


@dataclass
class FinishEvent:
    """End of a sequence: ``reason`` is ``stop``, ``length``, ``cancelled`` or ``error``; ``completion_tokens``
    counts every token drawn, an ending EOS or stop token id included (as vLLM's usage counts it; it has
    no text, and ``logprobs`` lists it).

    ``logprobs``: the entries of the returned text's tokens (requests with ``logprobs``);
    ``prompt_logprobs``: one per prompt token, the first None (requests with ``prompt_logprobs``);
    ``cumulative_logprob``: the sum over every drawn token (requests that need it: ``logprobs`` or
    ``best_of > n``)."""

    reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    cumulative_logprob: float | None = None


Sink = Callable[[TokenEvent | FinishEvent], None]


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted piecewise (the prefix/read-offset scheme of vLLM).

    The window starts a few prompt tokens back so that tokenizers whose pieces depend on their left
    neighbour (SentencePiece's leading spaces, byte fallback) decode the first completion token as
    they would in context; text is only extended when the window no longer ends in an incomplete
    character (``\\ufffd``).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""
        self.emitted = 0
        self.ends: list[int] = []  # per added token, the text's length once it was added
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.ends.append(len(self.text))

    def released(self, start: int, final: bool) -> int:
        """How many added tokens (from ``start`` on) the text handed out so far covers: those that end
        within it, and at the end also those a stop string cut through (their text began in it)."""
        i, n = start, len(self.ends)
        if not final:
            while i < n and self.ends[i] <= self.emitted:
                i += 1
            return i
        cut = len(self.text)
        while i < n and (self.ends[i] <= cut or (self.ends[i - 1] if i else 0) < cut):
            i += 1
        return i

    def find_stop(self) -> bool:
        """Cut the text at the first stop string; True when one was found."""
        if not self.stop:
            return False
        start = max(0, self.emitted - self.holdback)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        return True

    def take(self, final: bool) -> str:
        """Text not handed out yet; while not final, the tail that could begin a stop string stays back."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


# --------------------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------------------


@dataclass
class EngineConfig:
    """Knobs of the engine (``deltazip serve`` options)."""

    max_deltas: int = 4
    max_cpu_deltas: int = 16
    max_batch_tokens: int = 2048
    max_num_seqs: int = 32
    max_queue: int = 256
    preemption: bool = True
    chunked_prefill: bool = True  # prompts longer than the step's token budget left run in chunks
    kv_block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block of the paged KV cache
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (CUDA, paged cache, --mode delta only)

    def __post_init__(self) -> None:
        for name in ("max_deltas", "max_batch_tokens", "max_num_seqs", "max_queue", "kv_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_deltas < 0:
            raise ValueError(f"max_cpu_deltas must be >= 0, got {self.max_cpu_deltas}")


@dataclass
class ServedVariant:
    """What the engine needs per served model name: tokenizer and the token ids that end generation.

    ``tokenizer`` is used by the engine thread only (decoding); ``encoder`` is a second instance of
    the same tokenizer for the thread that encodes prompts (defaults to ``tokenizer`` when the caller
    encodes from the engine's own thread or not at all).
    """

    name: str
    tokenizer: Any
    eos_ids: list[int]
    parent: str | None  # the base's name for variants, None for the base itself
    encoder: Any = None
    files: Any = None  # the directory of its config, tokenizer and processor files (Path), where known

    def __post_init__(self) -> None:
        if self.encoder is None:
            self.encoder = self.tokenizer


@dataclass
class Sequence:
    """One request in the engine."""

    rid: str
    model: str
    key: str  # scheduler variant key
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    detok: IncrementalDetokenizer
    seed: int  # sampling seed (the request's, or drawn at submission; sample i: sample_seed(seed, i))
    arrival: float
    kv: SeqKV | SeqBlocks = field(default_factory=SeqKV)
    output_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    cancelled: bool = False
    finished: bool = False
    kv_on_host: bool = False
    matcher: Any = None  # a constrained request's place in its grammar (grammar.Matcher)
    tag: str | None = None  # REQUEST_TAG at submission: its progress is reported under it
    forks: list[tuple[str, Sink]] = field(default_factory=list)  # samples 1.. of n, made after the prefill
    logprobs: list[LogprobEntry] = field(default_factory=list)
    released: int = 0  # entries of ``logprobs`` handed out with text so far
    prompt_logprobs: list[LogprobEntry | None] | None = None
    cumulative_logprob: float = 0.0
    prompt_sent: bool = False  # its prompt's log probabilities went out with a TokenEvent
    stopped_by_token: bool = False  # it ended on an EOS or stop token id (counted, not in the text)
    media: PromptMedia | None = None  # its prompt's images, until the model has read them into ``inputs``
    inputs: PromptInputs | None = None  # what its images make of the prompt (prompt_media)

    @property
    def wants_logprobs(self) -> bool:
        """The drawn tokens' log probabilities are needed (reported, or to rank ``best_of``)."""
        return self.params.logprobs is not None or self.params.ranked

    def banned(self, eos_ids: list[int]) -> list[int]:
        """Token ids this sequence may not draw now: EOS and stop ids before ``min_tokens``. A grammar's
        completion wins over ``min_tokens``: a constrained sequence's EOS is never banned (its grammar
        allows EOS only once the output is complete, then nothing else: a ban would leave no token)."""
        p = self.params
        if len(self.output_ids) >= p.min_tokens:
            return []
        return ([] if p.ignore_eos or self.matcher is not None else list(eos_ids)) + list(p.stop_token_ids)


class Engine:
    """Continuous-batching engine over a :class:`~deltazip.runtime.serve.model.DeltaModel` or
    :class:`~deltazip.runtime.serve.model.SwapModels` (see the module docstring).

    Args:
        backend: the model object (``forward``, ``load_host``, ``write_slot``, ``clear_slot``).
        served: per model name (base and variants) its tokenizer and EOS ids.
        base_name: the base model's served name.
        config: engine options.
        observer: optional metrics sink with ``ttft(seconds)``, ``e2e(seconds)``, ``finished(reason)``
            and optionally ``request_state(tag, state)`` (see ``REQUEST_TAG``), called from the engine
            thread.
    """

    def __init__(self, backend, served: dict[str, ServedVariant], base_name: str, config: EngineConfig,
                 observer: Any = None):
        self.backend, self.served, self.base_name, self.config = backend, served, base_name, config
        self.observer = observer
        self._report_state = getattr(observer, "request_state", None)
        self.device = backend.device
        self.max_len = _max_len(backend.config)
        self.swap = backend.mode == "swap"
        # Paged KV cache when the model runs the paged attention (kv_cache.py, attention.py), else the
        # contiguous pool (models whose class takes no attention function, e.g. ALiBi ones).
        self.kv_pool = new_kv_pool(backend, config.kv_block_size)
        self.paged = isinstance(self.kv_pool, BlockPool)
        self.graphs = None
        # Not under tensor parallel: each forward is mirrored on the worker ranks, eagerly. Not for
        # recurrent layers either: their states are gathered and written back around each forward.
        if (self.paged and self.device.type == "cuda" and config.cuda_graphs and backend.mode == "delta"
                and getattr(backend, "tensor_parallel", 1) == 1 and not recurrent_layer_types(backend.config)):
            from deltazip.runtime.serve.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(backend, self.kv_pool)
        # Device memory, refreshed by the engine thread (readers never walk the model themselves).
        self._memory = {"device_weight_bytes": backend.base_bytes(), "kv_cache_bytes": 0}
        self._resident_seen: tuple = ()
        self.scheduler = Scheduler(
            max_deltas=1 if self.swap else config.max_deltas,
            max_num_seqs=config.max_num_seqs,
            max_batch_tokens=config.max_batch_tokens,
            preemption=config.preemption,
            base_needs_slot=self.swap,
            chunked_prefill=config.chunked_prefill,
            ready=self._slot_ready,
        )
        self._slot_writes = 0  # device slot (re)writes so far: part of the CUDA graphs' key
        self.cache = TieredCache(backend.load_host, self._write_slot, backend.clear_slot,
                                 num_slots=config.max_deltas, max_cpu=config.max_cpu_deltas)
        self._lock = threading.Condition()
        self.loader = DeltaLoader(self.cache, getattr(backend, "stage_slot", None), self.device, on_done=self._wake)
        self._install_failures: dict[str, BaseException] = {}
        self._loads_landed = 0
        self._inbox: list[Sequence] = []
        self._cancels: list[str] = []
        self._seqs: dict[str, Sequence] = {}
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stop = False
        self._broken: dict[str, str] = {}
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._removing: dict[str, tuple[Future, Callable[[], None] | None]] = {}
        self.last_used: dict[str, float] = {}  # model -> wall time of its latest request
        self._token_times: deque[tuple[float, int]] = deque()
        self.counters = {"requests": 0, "finished": 0, "cancelled": 0, "errors": 0, "generated_tokens": 0,
                         "prompt_tokens": 0, "steps": 0, "preempted": 0}
        self.pad_id = 0
        self._fork_of: dict[str, str] = {}  # rid of a sample not forked yet -> its request's rid
        self.kv_bytes_per_token = _kv_bytes_per_token(backend.config, backend.dtype)
        self._cross_keys = bool(cross_attention_layers(backend.config))  # sequences hold image keys (Mllama)
        vocab = getattr(backend.config, "vocab_size", None) or 0
        self.grammars = GrammarCompilers(vocab)  # compiled by request threads
        self.masks = MaskFiller(vocab, self.device)  # filled beside each step's forward

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="deltazip-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.loader.shutdown()
        self.cache.shutdown()
        self.masks.close()

    # -- submission (any thread) ----------------------------------------------------------------
    def key_of(self, model: str) -> str:
        if model == self.base_name:
            return BASE_KEY
        if model not in self.served:
            raise UnknownModel(f"The model `{model}` does not exist.", "model")
        return model

    def images_refused(self) -> str | None:
        """Why this server cannot read images in prompts (one line), or None when it can."""
        cfg = self.backend.config
        if not is_image_text(cfg):
            return f"the served model ({cfg.model_type}) reads text only; send text content parts"
        if not hasattr(self.backend, "prompt_inputs"):
            return "this server's model does not read images; send text content parts"
        if tokenwise(cfg):  # its recurrent layers continue a state one token per forward: no prompt step reads a chunk
            return f"images are not read by {cfg.model_type}'s recurrent layers here; send text content parts"
        return None

    def validate(self, model: str, prompt_ids: list[int], params: SamplingParams,
                 media: PromptMedia | None = None) -> None:
        """Raise the :class:`EngineError` that ``submit`` would, without queueing anything."""
        self.key_of(model)
        refused = self.images_refused() if media is not None else None
        if refused:
            raise EngineError(refused, "messages")
        n = len(prompt_ids)
        if n == 0:
            raise EngineError("the prompt is empty (no tokens)", "prompt")
        if n >= self.max_len or n + params.max_tokens > self.max_len:
            raise PromptTooLong(f"This model's maximum context length is {self.max_len} tokens. However, you requested "
                                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the "
                                f"completion). Please reduce the prompt or max_tokens.", "max_tokens")
        if n > self.config.max_batch_tokens and not self.config.chunked_prefill:
            raise PromptTooLong(f"the prompt has {n} tokens; this server processes at most {self.config.max_batch_tokens} "
                                f"tokens per step (--max-batch-tokens)", "prompt")
        vocab = getattr(self.backend.config, "vocab_size", None)
        if vocab and any(not 0 <= t < vocab for t in prompt_ids):
            raise EngineError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        if model in self._broken:
            raise EngineError(f"model {model} cannot be loaded: {self._broken[model]}", "model")
        self._check_samples(n, params)

    def _check_samples(self, prompt_len: int, params: SamplingParams) -> None:
        """The samples of one request decode side by side: they must fit one step (``--max-num-seqs``)
        and the KV cache they need must fit the device's free memory."""
        k, param = params.samples, "best_of" if params.ranked else "n"
        if k > self.config.max_num_seqs:
            raise EngineError(f"{param}={k} samples decode together, but this server runs at most "
                              f"{self.config.max_num_seqs} sequences per step (--max-num-seqs)", param)
        if k == 1:
            return
        need = (self.kv_bytes_per_token * (prompt_len + k * (params.max_tokens + self.config.kv_block_size))
                + k * self.kv_pool.states.row_bytes())  # recurrent layers: a fixed state per sequence
        free = self._kv_room()
        if free is not None and need > free:
            raise EngineError(f"{param}={k} samples of {params.max_tokens} tokens need about {need / 2**20:.0f} MiB "
                              f"of KV cache; {free / 2**20:.0f} MiB are free on {self.device}. Lower {param} or "
                              f"max_tokens", param)

    def submit(self, model: str, prompt_ids: list[int], params: SamplingParams, sink: Sink,
               media: PromptMedia | None = None) -> str:
        """Queue a request of one sample; returns its id. Raises :class:`EngineError` (400/404/429)."""
        return self.submit_samples(model, prompt_ids, params, [sink], media)[0]

    def submit_samples(self, model: str, prompt_ids: list[int], params: SamplingParams, sinks: list[Sink],
                       media: PromptMedia | None = None) -> list[str]:
        """Queue a request drawing ``len(sinks)`` samples (``params.samples``) of one prompt; returns
        one id per sample (each can be cancelled). The prompt is prefilled once: the samples after
        the first are forked from its KV cache when the prefill ends (blocks shared, not copied).
        ``media``: the prompt's images (its processor's tensors). Raises :class:`EngineError`
        (400/404/429) when refused."""
        self.validate(model, prompt_ids, params, media)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        with self._lock:
            if self._stop:
                raise EngineError("the server is shutting down")
            if model in self._removing or model not in self.served:
                raise UnknownModel(f"The model `{model}` does not exist.", "model")
            self.last_used[model] = time.time()
            if len(self._inbox) + self.scheduler.num_waiting() >= self.config.max_queue:
                raise QueueFull(f"the request queue is full ({self.config.max_queue} waiting); retry later")
            rid = f"r{self._next_id}"
            self._next_id += 1
            rids = [rid] + [f"{rid}.{i}" for i in range(1, len(sinks))]
            sv = self.served[model]
            seq = Sequence(rid, model, self.key_of(model), list(prompt_ids), params, sinks[0],
                           IncrementalDetokenizer(sv.tokenizer, prompt_ids, params.stop), seed, time.perf_counter(),
                           kv=new_seq_kv(self.kv_pool), tag=REQUEST_TAG.get(), forks=list(zip(rids[1:], sinks[1:])))
            seq.matcher = params.grammar.matcher() if params.grammar is not None else None
            seq.media = media
            if media is None and is_prefix_lm(self.backend.config):  # PaliGemma: the prompt sees itself
                seq.inputs = PromptInputs.prefix(len(seq.prompt_ids))
            for r in rids[1:]:
                self._fork_of[r] = rid
            self._inbox.append(seq)
            self.counters["requests"] += 1
            self._lock.notify_all()
        return rids

    def _kv_room(self) -> int | None:
        """Bytes the KV cache can still take: the device's free memory and the pool's free blocks."""
        from deltazip.runtime.serve.startup_report import device_free_bytes

        free = device_free_bytes(self.device)
        if free is not None and isinstance(self.kv_pool, BlockPool):
            free += len(self.kv_pool._free) * self.kv_pool.block_size * self.kv_bytes_per_token
        return free

    def cancel(self, rid: str) -> None:
        """Drop a request (the client went away); its sequence is freed at the next step."""
        with self._lock:
            self._cancels.append(rid)
            self._lock.notify_all()

    # -- live variant management (any thread) ---------------------------------------------------
    def run_on_engine(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between two steps; its result or exception lands in the
        returned future. Runs at once in the caller's thread when the engine is not running."""
        fut: Future = Future()
        with self._lock:
            running = self._thread is not None and not self._stop
            if running:
                self._commands.append((fn, fut))
                self._lock.notify_all()
        if not running:
            _settle(fut, fn)
        return fut

    def remove_model(self, name: str, unload: Callable[[], None] | None = None) -> Future:
        """Stop accepting requests for variant ``name``, let accepted ones finish, then drop it from
        every tier and call ``unload`` (engine thread). The future resolves when it is gone.

        Raises:
            UnknownModel: not a served variant (the base cannot be removed).
        """
        with self._lock:
            if name == self.base_name or name not in self.served or name in self._removing:
                raise UnknownModel(f"The model `{name}` does not exist.", "model")
            fut: Future = Future()
            self._removing[name] = (fut, unload)
            running = self._thread is not None and not self._stop
            self._lock.notify_all()
        if not running:
            self._finish_removals()
        return fut

    def _finish_removals(self) -> None:
        """Unload every variant being removed that has no request left (engine thread)."""
        with self._lock:
            pending = dict(self._removing)
            queued = {s.model for s in self._inbox}
        live = {s.model for s in self._seqs.values()} | queued
        for name, (fut, unload) in pending.items():
            if name in live:
                continue
            try:
                self.loader.drop(name)
                self.cache.evict(name)
                self._broken.pop(name, None)
                if unload is not None:
                    unload()
            except Exception as e:  # keep serving the others; the caller hears what went wrong
                log.error("unloading %s failed:\n%s", name, traceback.format_exc())
                fut.set_exception(e)
            else:
                fut.set_result(None)
            finally:
                with self._lock:
                    self.served.pop(name, None)
                    self._removing.pop(name, None)
                    self.last_used.pop(name, None)

    def removing(self) -> set[str]:
        with self._lock:
            return set(self._removing)

    # -- introspection --------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing submitted and nothing running: when the background kernel tuner may use the device
        (read without the lock: a stale answer only delays or advances one key by a step)."""
        return not self._inbox and not self._seqs

    def stats(self) -> dict[str, Any]:
        now = time.perf_counter()
        with self._lock:
            while self._token_times and now - self._token_times[0][0] > 10.0:
                self._token_times.popleft()
            window = sum(n for _, n in self._token_times)
            span = (now - self._token_times[0][0]) if self._token_times else 0.0
            queue = len(self._inbox) + self.scheduler.num_waiting()
            running = len(self.scheduler.running)
        return {
            "queue_length": queue,
            "running_seqs": running,
            "resident_deltas": [n for n in self.cache.resident()],
            "loading_deltas": self.loader.in_flight(),
            "host_deltas": self.cache.on_host(),
            "tokens_per_second": window / max(span, 1.0) if window else 0.0,
            "load_stats": self.cache.load_stats(),
            **self._memory,
            **self.counters,
            "preempted": self.scheduler.preempted_total,
        }

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._inbox and not self._cancels and not self._commands \
                        and not self._removing and not self.scheduler.has_work():
                    self._lock.wait(timeout=0.5)
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                commands, self._commands = self._commands, []
            for fn, fut in commands:  # between steps: no forward is running
                _settle(fut, fn)
            for seq in inbox:
                self._seqs[seq.rid] = seq
                self.scheduler.add(SchedRequest(seq.rid, seq.key, len(seq.prompt_ids), width=1 + len(seq.forks)))
            for rid in cancels:
                self._cancel_now(rid)
            if cancels:
                self._refresh_kv_bytes()
            if self._removing:
                self._finish_removals()
            if not self.scheduler.has_work():
                continue
            try:
                self._step()
            except Exception as e:  # a bug must not kill the server: fail what ran, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                for rid in list(self.scheduler.running):
                    seq = self._seqs.get(rid)
                    if seq is not None:
                        self._finish(seq, "error", error=f"internal error: {type(e).__name__}: {e}")
            self._idle_while_loading()
        for seq in list(self._seqs.values()):
            if not seq.finished:
                self._finish(seq, "error", error="the server shut down")
        with self._lock:
            left, self._commands = self._commands, []
            removals, self._removing = self._removing, {}
        for fut in [f for _, f in left] + [f for f, _ in removals.values()]:
            fut.set_exception(EngineError("the server shut down"))

    def _cancel_now(self, rid: str) -> None:
        seq = self._seqs.get(rid)
        if seq is not None and not seq.finished:
            seq.cancelled = True
            self._finish(seq, "cancelled")
            return
        owner = self._seqs.get(self._fork_of.pop(rid, ""))
        if owner is not None:  # a sample not forked yet: it never will be
            gone = [(r, sink) for r, sink in owner.forks if r == rid]
            owner.forks = [(r, sink) for r, sink in owner.forks if r != rid]
            self.scheduler.shrink(owner.rid, len(gone))
            for _, sink in gone:
                self._emit_to(sink, rid, FinishEvent("cancelled", "", len(owner.prompt_ids), 0))

    def _step(self) -> None:
        out = self.scheduler.schedule()
        self.counters["steps"] += 1
        need = [r.variant for r in out.waiting if r.variant != BASE_KEY or self.swap]
        self.cache.prefetch(self._cache_name(k) for k in need if k not in out.selected)
        slots = self._make_resident(out.selected)
        if slots is None:
            return
        self._read_images(out.running, slots)
        prefill, decode = self._plan(out.running)
        if self._report_state is not None:  # before the forward: a death during it finds it reported
            for seq, _ in prefill:
                if seq.tag is not None and seq.kv.length == 0:
                    self._report_state(seq.tag, "prefilling")

        def slot_of(seq: Sequence) -> int:
            return slots[seq.key] if (seq.key != BASE_KEY or self.swap) else -1

        # Grammar masks of the rows that draw a token this step are filled on a worker thread while
        # the forwards run.
        masks = self.masks.start(_constrained(prefill + decode))
        # Prompts whose log probabilities are wanted run in a forward of their own that keeps every
        # position's logits; the other rows keep only the last position's (they pay nothing for it).
        scored = [sn for sn in prefill if sn[0].params.prompt_logprobs is not None]
        plain = [sn for sn in prefill if sn[0].params.prompt_logprobs is None]
        results: list[tuple[Sequence, int, LogprobEntry | None]] = []
        for group, every in ((plain, False), (scored, True), (decode, False)):
            if not group:
                continue
            group.sort(key=lambda sn: slot_of(sn[0]))  # rows of one delta together (paper §5.2)
            results += self._forward(group, [slot_of(s) for s, _ in group], every, masks)
        now = time.perf_counter()
        with self._lock:
            self._token_times.append((now, len(results)))
        for seq, tok, lp in results:
            self._accept(seq, tok, lp, now)
        self._refresh_kv_bytes()  # sequences that just finished gave their blocks back

    def _read_images(self, running: list[SchedRequest], slots: dict[str, int]) -> None:
        """Prompts with images about to start: the model reads their images (with the request's
        variant bound) into what their prompt steps put in place. A model that cannot read them
        fails that request only."""
        for r in running:
            seq = self._seqs.get(r.rid)
            if seq is None or seq.media is None:
                continue
            slot = slots[seq.key] if (seq.key != BASE_KEY or self.swap) else -1
            try:
                seq.inputs = self.backend.prompt_inputs(slot, seq.prompt_ids, seq.media)
            except Exception as e:  # e.g. a language model that takes more from images (ImagesUnsupported)
                log.error("reading the images of %s failed: %s", seq.rid, e)
                self._finish(seq, "error", error=str(e))
                continue
            seq.media = None  # the pixels are read: only what the prompt steps need is kept

    def _plan(self, running: list[SchedRequest]) -> tuple[list[tuple[Sequence, list[int]]], list[tuple[Sequence, list[int]]]]:
        """This step's ``(sequence, new tokens)`` rows: every decoding sequence gets its last token,
        then sequences still in their prompt get the next chunk of it, in admission order, while the
        step's token budget (``max_batch_tokens``) lasts. Split by state rather than by this step's
        admissions: a step that failed to load a variant leaves admitted prompts unprocessed."""
        prefill, decode = [], []
        running = [r for r in running if r.rid in self._seqs]  # not those that failed reading their images
        for r in running:
            seq = self._seqs[r.rid]
            if seq.kv_on_host:  # preempted earlier, resumed now: its KV cache comes back
                seq.kv.attach(self.kv_pool)
                seq.kv_on_host = False
                if seq.inputs is not None:
                    seq.inputs = seq.inputs.to(self.device)
            if seq.output_ids:
                decode.append((seq, [seq.output_ids[-1]]))
        budget = self.config.max_batch_tokens - len(decode)
        for r in running:
            seq = self._seqs[r.rid]
            done = seq.kv.length
            if seq.output_ids or budget < 1:
                continue
            end = min(len(seq.prompt_ids), done + budget)
            end = seq.inputs.chunk_end(done, end) if seq.inputs is not None else end
            chunk = seq.prompt_ids[done:end]
            budget -= len(chunk)
            r.prefill_left = len(seq.prompt_ids) - done - len(chunk)
            prefill.append((seq, chunk))
        return prefill, decode

    def _refresh_kv_bytes(self) -> None:
        """Publish the KV cache's size: the pool (which drops its tensors once no sequence holds a row)
        and the keys and values of images read by cross-attention layers (Mllama), each counted once
        however many samples share them."""
        cross = {} if not self._cross_keys else {
            id(s.inputs.cross.keys): s.inputs.cross.nbytes() for s in self._seqs.values()
            if s.inputs is not None and s.inputs.cross is not None and not s.kv_on_host}
        self._memory = {**self._memory, "kv_cache_bytes": self.kv_pool.nbytes() + sum(cross.values())}

    def _cache_name(self, key: str) -> str:
        return self.base_name if key == BASE_KEY else key

    def _wake(self) -> None:
        """A background load finished (loader thread)."""
        with self._lock:
            self._loads_landed += 1
            self._lock.notify_all()

    def _idle_while_loading(self) -> None:
        """Nothing runs and the waiting requests wait for loads: sleep until one lands or a request,
        cancellation or command arrives, instead of spinning through empty steps."""
        with self._lock:
            if self.scheduler.running or not self.loader.busy():
                return
            seen = self._loads_landed
            self._lock.wait_for(lambda: self._stop or self._inbox or self._cancels or self._commands
                                or self._loads_landed != seen, timeout=0.5)

    def _slot_ready(self, key: str) -> bool:
        """The scheduler's ``ready`` hook (engine thread, between forwards): is variant ``key`` in a
        slot? A finished background load is written into a slot now (one no running request uses);
        a variant not loading yet starts loading, and its requests wait while the others run."""
        name = self._cache_name(key)
        if self.cache.slot_of(name) is not None:
            return True
        state = self.loader.state(name)
        if state == "idle" and name not in self._broken:
            self.loader.start(name)
        if state != "ready":
            return False  # loading; a failure is reported by _fail_broken_loads after the walk
        staged = self.loader.peek(name)
        running = {self._cache_name(r.variant) for r in self.scheduler.running.values()
                   if r.variant != BASE_KEY or self.swap}
        self.loader.adopt(staged)
        try:
            slot = self.cache.install(name, staged.obj, protect=running)
        except Exception as e:  # e.g. tensors that do not fit the model: fails this variant only
            self._install_failures[name] = e
            return False
        if slot is None:  # every slot is used by a running variant: retried next step
            return False
        self.loader.drop(name)
        self._note_resident()
        return True

    def _fail_broken_loads(self) -> None:
        """Variants whose load failed: remember why and fail their waiting requests (the others go on)."""
        failed = {**self.loader.failures(), **self._install_failures}
        self._install_failures = {}
        for name, e in failed.items():
            self.loader.drop(name)
            msg = f"{type(e).__name__}: {e}"
            log.error("loading %s failed: %s", name, msg)
            self._broken[name] = msg
        # A staged load nobody waits for any more (its requests were cancelled) holds device memory
        # on CUDA: let it go (the host tier keeps the decoded variant).
        wanted = {self._cache_name(r.variant) for r in self.scheduler.waiting}
        for name in self.loader.finished():
            if name not in wanted:
                self.loader.drop(name)
        if not self._broken:
            return
        for r in list(self.scheduler.waiting):  # running requests' variants are resident
            name = self._cache_name(r.variant)
            if name in self._broken and (r.variant != BASE_KEY or self.swap):
                self._finish(self._seqs[r.rid], "error", error=f"model {name} cannot be loaded: {self._broken[name]}")

    def _note_resident(self) -> None:
        """Refresh the device-weight gauge when the slots' contents changed."""
        resident = tuple(self.cache.slots)
        if resident != self._resident_seen:
            self._resident_seen = resident
            self._memory = {**self._memory, "device_weight_bytes": self.backend.base_bytes() + sum(
                self.backend.slot_bytes(i) for i, name in enumerate(resident) if name is not None)}

    def _make_resident(self, selected: list[str]) -> dict[str, int] | None:
        """Slots of this step's variants. With the loader they are resident already (the scheduler
        admitted only ready variants); a load the scheduler did not wait for happens here."""
        self._fail_broken_loads()
        keys = [k for k in selected if k != BASE_KEY or self.swap]
        try:
            by_name = self.cache.ensure([self._cache_name(k) for k in keys])
        except Exception as e:  # a variant that cannot be loaded fails its requests, the rest go on
            bad = next((k for k in keys if self.cache.slot_of(self._cache_name(k)) is None), None)
            msg = f"{type(e).__name__}: {e}"
            log.error("loading %s failed: %s", bad, msg)
            if bad is None:
                raise
            self._broken[self._cache_name(bad)] = msg
            for rid in [r.rid for r in list(self.scheduler.running.values()) + self.scheduler.waiting
                        if r.variant == bad]:
                self._finish(self._seqs[rid], "error", error=f"model {self._cache_name(bad)} cannot be loaded: {msg}")
            return None
        self._note_resident()
        return {k: by_name[self._cache_name(k)] for k in keys}

    def _forward(self, group: list[tuple[Sequence, list[int]]], row_slots: list[int], every: bool = False,
                 masks: StepMasks | None = None) -> list[tuple[Sequence, int, LogprobEntry | None]]:
        """Run the rows; sample a token for every row that reached the end of its prompt (and for the
        samples forked from it), constrained rows within their grammar (``masks``: the step's).
        ``every``: keep every position's logits, for prompt log probabilities."""
        seqs = [s for s, _ in group]
        logits = None
        inputs = [s.inputs for s in seqs] if any(s.inputs is not None for s in seqs) else None
        # Rows whose images gave them positions of their own (Qwen2-VL) or cross-attention keys (Mllama)
        # keep them after the prompt too: the captured decode graphs take plain positions and no images.
        own = inputs is not None and any(x is not None and x.own_step() for x in inputs)
        if self.graphs is not None and not every and not own and all(len(t) == 1 for _, t in group):
            logits = self.graphs.run([s.kv for s in seqs], row_slots, [t[0] for _, t in group], self._weights_key())
        if logits is None:
            starts = [s.kv.length for s in seqs]
            logits = forward_step(self.backend, self.kv_pool, [s.kv for s in seqs], row_slots, [t for _, t in group],
                                  starts, self.pad_id, every_position=every, inputs=inputs)
            if every:
                self._score_prompts(seqs, [t for _, t in group], starts, logits)
                logits = logits[:, -1]
        self.counters["prompt_tokens"] += sum(len(t) for s, t in group if not s.output_ids)
        ready = [i for i, s in enumerate(seqs) if s.kv.length >= len(s.prompt_ids)]
        for i in ready:  # a prompt read: its image rows go (its samples keep the positions they follow)
            if seqs[i].inputs is not None:
                seqs[i].inputs = seqs[i].inputs.decoding()
        picked, rows = [], []
        for i in ready:  # a prompt just read forks its other samples, which draw from the same logits
            for s in [seqs[i], *self._fork(seqs[i])]:
                if s.params.max_tokens == 0:  # scoring the prompt only
                    self._finish(s, "length")
                else:
                    picked.append(s)
                    rows.append(i)
        if not picked:
            return []
        raw = logits if rows == list(range(len(seqs))) else logits.index_select(
            0, torch.tensor(rows, device=logits.device))
        return draw_tokens(picked, raw, [self.served[s.model].eos_ids for s in picked], masks)

    def _score_prompts(self, seqs: list[Sequence], chunks: list[list[int]], starts: list[int],
                       logits: torch.Tensor) -> None:
        """Log probabilities of the prompt tokens this forward read (``logits [B, Tm, V]``, rows left-
        padded): position ``j`` of a chunk scores the prompt token after it. One batched pass."""
        tm = logits.shape[1]
        b_idx, t_idx, target, owner = [], [], [], []
        for b, (s, chunk, start) in enumerate(zip(seqs, chunks, starts)):
            if s.prompt_logprobs is None:
                s.prompt_logprobs = [None]  # the first token has nothing before it
            for j in range(len(chunk)):
                if start + j + 1 < len(s.prompt_ids):
                    b_idx.append(b)
                    t_idx.append(tm - len(chunk) + j)
                    target.append(s.prompt_ids[start + j + 1])
                    owner.append(s)
        if not b_idx:
            return
        flat = logits[torch.tensor(b_idx, device=logits.device), torch.tensor(t_idx, device=logits.device)]
        k = max(s.params.prompt_logprobs for s in seqs)
        rows = torch.arange(len(b_idx), device=logits.device)
        chosen, ids, lps = token_logprobs(flat, rows, torch.tensor(target, device=logits.device), k)
        ks = [s.params.prompt_logprobs for s in owner]
        for s, e in zip(owner, _entries(target, chosen.tolist(), ids.tolist(), lps.tolist(), ks)):
            s.prompt_logprobs.append(e)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The other samples of ``seq``'s request, made now that its prompt is in the KV cache: each
        shares the prompt's full blocks (reference counted) and copies only the partial last one."""
        if not seq.forks:
            return []
        sv, kids = self.served[seq.model], []
        for rid, sink in seq.forks:
            self._fork_of.pop(rid, None)
            index = int(rid.rsplit(".", 1)[1])  # sample i of the request (its seed depends on i only)
            kid = Sequence(rid, seq.model, seq.key, seq.prompt_ids, seq.params, sink,
                           IncrementalDetokenizer(sv.tokenizer, seq.prompt_ids, seq.params.stop),
                           sample_seed(seq.seed, index), seq.arrival,
                           kv=seq.kv.fork(), prompt_logprobs=seq.prompt_logprobs, inputs=seq.inputs)
            if seq.params.grammar is not None:  # its own place in the grammar, at the start as its parent's
                kid.matcher = seq.params.grammar.matcher()
            mirror = getattr(self.backend, "fork_kv", None)  # tensor parallel: the ranks fork theirs too
            if mirror is not None:
                mirror(seq.kv, kid.kv)
            self._seqs[rid] = kid
            kids.append(kid)
        seq.forks = []
        self.scheduler.fork(seq.rid, [k.rid for k in kids])
        return kids

    def _write_slot(self, slot: int, name: str, host: Any) -> None:
        self._slot_writes += 1
        self.backend.write_slot(slot, name, host)

    def _weights_key(self) -> tuple:
        """Changes whenever a device slot is (re)loaded: captured graphs read the slots' tensors (a
        counter of writes, not the load stats, which go when a variant is evicted)."""
        return tuple(self.cache.slots), self._slot_writes

    def _accept(self, seq: Sequence, tok: int, lp: LogprobEntry | None, now: float) -> None:
        if seq.finished:
            return
        if seq.first_token_at is None:
            seq.first_token_at = now
            if self.observer is not None:
                self.observer.ttft(now - seq.arrival)
            if seq.tag is not None and self._report_state is not None:  # before the token is emitted
                self._report_state(seq.tag, "generating")
        if lp is not None:
            seq.cumulative_logprob += lp[1]
        eos = tok in self.served[seq.model].eos_ids and not seq.params.ignore_eos
        if seq.matcher is not None:
            if not seq.matcher.accept(tok):  # masked out: only a grammar with no way on gets here
                self._finish(seq, "error", error="the requested output format admits no further token")
                return
            eos = eos or seq.matcher.terminated  # a completed grammar ends the answer, ignore_eos or not
        if eos or tok in seq.params.stop_token_ids:
            # Drawn, so counted in usage (as vLLM counts it) and reported in logprobs, but no text.
            seq.stopped_by_token = True
            self.counters["generated_tokens"] += 1
            if lp is not None and seq.params.logprobs is not None:
                seq.logprobs.append(lp)
                seq.detok.ends.append(len(seq.detok.text))
            self._finish(seq, "stop")
            return
        seq.output_ids.append(tok)
        if lp is not None and seq.params.logprobs is not None:
            seq.logprobs.append(lp)
        self.counters["generated_tokens"] += 1
        seq.detok.add(tok)
        if seq.detok.find_stop():
            self._finish(seq, "stop")
            return
        if len(seq.output_ids) >= seq.params.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_len:
            self._finish(seq, "length")
            return
        text = seq.detok.take(final=False)
        self._emit(seq, TokenEvent(text, tok, self._release(seq, final=False)))

    def _release(self, seq: Sequence, final: bool) -> list[LogprobEntry] | None:
        """Log-probability entries of the tokens the text handed out so far covers, not handed out yet."""
        if seq.params.logprobs is None:
            return None
        end = seq.detok.released(seq.released, final)
        out, seq.released = seq.logprobs[seq.released:end], end
        return out

    def _emit(self, seq: Sequence, event) -> None:
        if isinstance(event, TokenEvent) and seq.params.prompt_logprobs is not None and not seq.prompt_sent:
            event.prompt_logprobs, seq.prompt_sent = seq.prompt_logprobs, True
        if not self._emit_to(seq.sink, seq.rid, event):
            seq.cancelled = True

    @staticmethod
    def _emit_to(sink: Sink, rid: str, event) -> bool:
        try:
            sink(event)
        except Exception:  # a broken consumer must not stop the engine
            log.warning("dropping output of %s: its consumer raised\n%s", rid, traceback.format_exc())
            return False
        return True

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        for r in self.scheduler.finish(seq.rid):
            child = self._seqs[r.rid]
            child.kv.offload()
            child.kv_on_host = True
            if child.inputs is not None:  # its images' rows and cross-attention keys go to host memory too
                child.inputs = child.inputs.to("cpu")
        seq.kv.free()  # its pool row goes to the next sequence now
        self._seqs.pop(seq.rid, None)
        key = {"cancelled": "cancelled", "error": "errors"}.get(reason, "finished")
        self.counters[key] += 1
        if self.observer is not None:
            self.observer.finished(reason)
            if reason in ("stop", "length"):
                self.observer.e2e(time.perf_counter() - seq.arrival)
        done = reason in ("stop", "length")
        final = seq.detok.take(final=True) if done else ""
        entries = self._release(seq, final=True) if done else None
        if final or entries:
            self._emit(seq, TokenEvent(final, -1, entries))
        p = seq.params
        self._emit(seq, FinishEvent(reason, seq.detok.text if done else "", len(seq.prompt_ids),
                                    len(seq.output_ids) + seq.stopped_by_token, error,
                                    logprobs=seq.logprobs[:seq.released] if p.logprobs is not None else None,
                                    prompt_logprobs=seq.prompt_logprobs if p.prompt_logprobs is not None else None,
                                    cumulative_logprob=seq.cumulative_logprob if seq.wants_logprobs else None))
        for rid, sink in seq.forks:  # samples never forked (the prompt did not finish) end with it
            self._fork_of.pop(rid, None)
            self._emit_to(sink, rid, FinishEvent(reason, "", len(seq.prompt_ids), 0, error))
        seq.forks = []


def _settle(fut: Future, fn: Callable[[], Any]) -> None:
    try:
        fut.set_result(fn())
    except BaseException as e:  # handed to the waiting caller, who reports it
        fut.set_exception(e)


def _constrained(rows: list[tuple[Sequence, list[int]]]) -> dict[str, Any]:
    """The matchers of the step's rows that draw a token under a grammar, by sequence id: decoding
    rows and prompts read to their end, with the samples such a prompt forks (they start where it
    does, nothing generated yet: the same mask)."""
    out = {}
    for seq, chunk in rows:
        if seq.matcher is not None and seq.kv.length + len(chunk) >= len(seq.prompt_ids):
            out[seq.rid] = seq.matcher
            out.update((rid, seq.matcher) for rid, _ in seq.forks)
    return out


def draw_tokens(picked: list[Sequence], raw: torch.Tensor, eos_ids: list[list[int]], masks: StepMasks | None = None
                ) -> list[tuple[Sequence, int, LogprobEntry | None]]:
    """A token per row of ``raw [B, V]`` (the model's logits of the sequences ``picked``, whose EOS
    ids are ``eos_ids``) in one batched pass (``deltazip.runtime.serve.sampling``); rows with a
    grammar draw within it (their bitmasks: the step's ``masks``, keyed by sequence id); rows that
    want them get the token's log probability and top alternatives (others: None), from ``raw``."""
    want = [s.wants_logprobs for s in picked]
    lp_k = [(s.params.logprobs or 0) if w else None for s, w in zip(picked, want)]
    st = step_sampling([s.params for s in picked], [s.seed for s in picked], [len(s.output_ids) for s in picked],
                       raw.shape[-1], raw.device, outputs=[s.output_ids for s in picked],
                       prompts=[s.prompt_ids for s in picked],
                       banned=[s.banned(e) for s, e in zip(picked, eos_ids)], logprobs=lp_k)
    if masks is not None:
        st.grammar = masks.rows([s.rid if s.matcher is not None else None for s in picked])
    # Nothing reads the model's logits after the draw unless log probabilities do: changed in place then.
    toks = sample_step(process_logits(raw, st, inplace=st.logprob_rows is None), st)
    if st.logprob_rows is None:
        return [(s, t, None) for s, t in zip(picked, toks.tolist())]
    chosen_toks = toks.index_select(0, st.logprob_rows)
    chosen, top_ids, top_lp = token_logprobs(raw, st.logprob_rows, chosen_toks, st.top_logprobs)
    toks_l = toks.tolist()
    entries = iter(_entries(chosen_toks.tolist(), chosen.tolist(), top_ids.tolist(), top_lp.tolist(),
                            [k for k in lp_k if k is not None]))
    return [(s, t, next(entries) if w else None) for s, t, w in zip(picked, toks_l, want)]


def _entries(tokens: list[int], chosen: list[float], top_ids: list[list[int]], top_lp: list[list[float]],
             ks: list[int]) -> list[LogprobEntry]:
    """Per row, ``(token, its logprob, its first ks[row] alternatives)``."""
    return [(t, c, list(zip(i[:k], v[:k]))) for t, c, i, v, k in zip(tokens, chosen, top_ids, top_lp, ks)]


def _max_len(config) -> int:
    from deltazip.runtime.serve.model import max_context

    return max_context(config)


def _kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token position holds, over every layer (from the model config:
    per layer where it differs by layer, Gemma 4's global layers; the last ``num_kv_shared_layers``
    layers of Gemma 3n/4 reuse earlier layers' keys and values and hold none)."""
    text = text_config(config)
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 1)
    per_layer = text.per_layer_config if getattr(text, "is_heterogeneous", False) else [text] * layers
    total = sum(_kv_width(c) for c in per_layer[:layers - int(getattr(text, "num_kv_shared_layers", 0) or 0)])
    return total * torch.empty((), dtype=dtype).element_size()


def _kv_width(c) -> int:
    """Values of keys and values one token holds in a layer of config ``c``."""
    if getattr(c, "kv_lora_rank", None):  # multi-head latent attention caches one latent and its rope key
        return c.kv_lora_rank + (getattr(c, "qk_rope_head_dim", None) or 0)
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", 1)
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", 0)
    return 2 * kv_heads * (getattr(c, "head_dim", None) or hidden // max(heads, 1))
