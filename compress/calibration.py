"""Calibration data: local json/jsonl/txt/parquet files (or a hub dataset) -> token windows.

Records are read with ``datasets``; a record's text is its ``text`` field, or its chat ``messages``
rendered with the tokenizer's chat template, or ``prompt`` + ``completion``/``answer``/``response``.
Documents are joined with EOS into one token stream from which ``nsamples`` windows of ``seqlen``
tokens are drawn with a seeded generator (non-overlapping when the stream is long enough).
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from deltazip.formats.errors import DeltazipWarning, InputError, first_line
from deltazip.models.hub import hub_offline, offline_miss, require_hub

_LOADERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
# A missing source with one of these extensions is a mistyped file, never a hub dataset id.
_FILE_SUFFIXES = set(_LOADERS) | {".csv", ".tsv", ".text", ".md", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip"}
MIN_TOKENS = 8


@dataclass
class CalibrationSet:
    """Token windows ``input_ids`` int64 ``[nsamples, seqlen]`` plus a summary for the manifest."""

    input_ids: torch.Tensor
    summary: dict


def _record_text(rec: dict, tokenizer) -> str | None:
    if isinstance(rec.get("text"), str):
        return rec["text"]
    msgs = rec.get("messages")
    if isinstance(msgs, list) and msgs:
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(msgs, tokenize=False)
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in msgs if isinstance(m, dict))
    if isinstance(rec.get("prompt"), str):
        for k in ("completion", "answer", "response", "output"):
            if isinstance(rec.get(k), str):
                return rec["prompt"] + rec[k]
        return rec["prompt"]
    return None


def check_calibration_source(source: str) -> None:
    """Fail at once on a calibration path that looks local and is missing.

    A source that does not exist is taken for a hub dataset id (``org/name``) only when nothing says
    it is a file: no data-file extension (``.jsonl``, ``.csv``...), not absolute or ``./``-relative,
    and its first part is not an existing local directory. Otherwise the hub would be retried for
    most of a minute and never say "file not found".

    Raises:
        InputError: naming the path (and the directory that lacks it).
    """
    p = Path(source).expanduser()
    if p.exists():
        return
    parent = p.parent
    looks_local = (p.suffix.lower() in _FILE_SUFFIXES or source.startswith((".", "/", "~"))
                   or source.count("/") != 1 or (str(parent) not in ("", ".") and parent.is_dir()))
    if looks_local:
        where = f" (no such file in {parent})" if str(parent) not in ("", ".") and parent.is_dir() else ""
        raise InputError(f"calibration data {source} does not exist{where}; check the path (a hub dataset id "
                         f"looks like org/name, without an extension)")
    require_hub(f"calibration data {source!r}", LOCAL_DATA)  # once, now: not 30 s of retries later


LOCAL_DATA = "a local .jsonl/.json/.txt/.parquet file"


@contextmanager
def _quiet_datasets():
    """``datasets`` logs its own line (with pyarrow's message) before raising on a bad file; the
    error this module raises says it better, once."""
    import datasets

    datasets.disable_progress_bars()
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        logger.setLevel(level)


def _load_records(source: str):
    p = Path(source).expanduser()
    if p.exists():
        return _load_file(p), _sha256(p)
    check_calibration_source(source)
    with _quiet_datasets() as datasets:
        try:
            return datasets.load_dataset(source, split="train"), None
        except Exception as e:  # datasets raises many types for unreachable hubs and missing datasets
            if hub_offline():
                raise offline_miss(f"calibration data {source!r}", LOCAL_DATA) from e
            raise InputError(f"calibration data {source} could not be read ({type(e).__name__}: "
                             f"{first_line(e)}); pass {LOCAL_DATA}") from e


def _load_file(p: Path):
    kind = _LOADERS.get(p.suffix.lower())
    if kind is None:
        raise InputError(f"calibration file {p} has an unsupported extension; use .jsonl, .json, .txt or .parquet")
    if p.stat().st_size == 0:
        raise InputError(f"calibration file {p} is empty")
    bad = bad_parquet(p) if kind == "parquet" else None  # before pyarrow, which logs as it fails
    if bad:
        raise InputError(f"calibration file {p}: {bad}")
    kwargs = {"sample_by": "paragraph"} if kind == "text" else {}
    with _quiet_datasets() as datasets:
        try:
            return datasets.load_dataset(kind, data_files=str(p), split="train", **kwargs)
        except Exception as e:  # name the line or byte where we can, else what the reader said
            where = bad_json(p) if kind == "json" else None
            raise InputError(f"calibration file {p}: {where or f'cannot be read ({first_line(e.__cause__ or e)})'}"
                             f"; fix the file or pass another") from e


def bad_parquet(p: Path) -> str | None:
    """Where a file is not parquet: a parquet file starts and ends with the magic bytes ``PAR1``."""
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - 4))
        tail = f.read(4)
    if head != b"PAR1":
        return f"byte 0: starts with {head!r}, not with the parquet magic b'PAR1' (not a parquet file?)"
    if size < 12 or tail != b"PAR1":
        return f"byte {max(0, size - 4)}: ends with {tail!r}, not with the parquet footer b'PAR1' (truncated?)"
    return None


def bad_json(p: Path) -> str | None:
    """The first line (JSON Lines) or position (one JSON document) where ``p`` is not valid JSON of
    records, or the first line whose field types differ from earlier lines'; ``None`` if none is found."""
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"byte {e.start}: not UTF-8 text ({raw[e.start:e.start + 4]!r})"
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    try:
        json.loads(first)
    except json.JSONDecodeError:  # not JSON Lines: one document, pretty-printed or a list
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"line {e.lineno}, column {e.colno}: {e.msg}"
        return None
    return _bad_json_line(lines)


def _bad_json_line(lines: list[str]) -> str | None:
    seen: dict[str, tuple[str, int]] = {}  # field -> (type name, first line)
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {i}, column {e.colno}: {e.msg}"
        if not isinstance(rec, dict):
            return f"line {i}: a JSON {type(rec).__name__}, where each line must be one record ({{\"text\": ...}})"
        for k, v in rec.items():
            t = type(v).__name__
            if v is not None and seen.setdefault(k, (t, i))[0] != t:
                return f"line {i}: field {k!r} is {t}, but {seen[k][0]} on line {seen[k][1]}"
    return None


def _sha256(p: Path) -> str:
    return "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len")


def model_context(config: dict) -> int | None:
    """The longest sequence a model's ``config.json`` allows (None when it does not say)."""
    for cfg in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            v = cfg.get(key)
            if isinstance(v, int) and v > 0:
                return v
    return None


def window_plan(nsamples: int, seqlen: int, context: int | None, stream: int) -> tuple[int, int, str | None]:
    """``(windows, tokens per window, why capped or None)``: a window never exceeds the model's
    context nor the data, and there are no more windows than the data holds side by side (beyond
    that they would only repeat the same tokens, at the cost of more forwards)."""
    n, L, why = nsamples, seqlen, []
    if context is not None and L > context:
        L = context
        why.append(f"the model's context is {context} tokens")
    if L > stream:
        L = stream
    if n * L > stream:
        n = max(1, stream // L)
    if (n, L) != (nsamples, seqlen):
        why.append(f"the data holds {stream} tokens")
        return n, L, (f"calibrating on {n} windows of {L} tokens instead of --nsamples {nsamples} x --seqlen "
                      f"{seqlen}: {' and '.join(why)}")
    return n, L, None


def load_calibration(source: str, tokenizer, nsamples: int, seqlen: int, seed: int,
                     context: int | None = None) -> CalibrationSet:
    """Tokenize a calibration source and draw windows.

    Args:
        source: local file path or hub dataset id.
        tokenizer: a transformers tokenizer.
        nsamples: windows to draw (at most as many as the data holds side by side: ``window_plan``).
        seqlen: tokens per window; capped at ``context`` and at the stream length (one warning line
            says so).
        seed: seed of the window sampler.
        context: the model's context (``model_context``), None when unknown.
    """
    ds, digest = _load_records(source)
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    docs = 0
    for rec in ds:
        text = _record_text(rec, tokenizer)
        if not text or not text.strip():
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
        docs += 1
    if docs == 0:
        raise InputError(f"calibration data {source} has no usable records (need a 'text' or 'messages' field)")
    if len(stream) < MIN_TOKENS:
        raise InputError(f"calibration data {source} is too short: {len(stream)} tokens, need at least "
                         f"{MIN_TOKENS}; add more text")
    nsamples, seqlen, why = window_plan(nsamples, seqlen, context, len(stream))
    if why:
        warnings.warn(why, DeltazipWarning, stacklevel=2)
    data = torch.tensor(stream, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    n_windows = len(stream) // seqlen
    if n_windows >= nsamples:
        starts = torch.randperm(n_windows, generator=g)[:nsamples] * seqlen
    else:
        starts = torch.randint(0, len(stream) - seqlen + 1, (nsamples,), generator=g)
    windows = torch.stack([data[s:s + seqlen] for s in starts.tolist()])
    summary = {"source": str(source), "sha256": digest, "documents": docs, "stream_tokens": len(stream),
               "nsamples": nsamples, "seqlen": seqlen, "tokens": nsamples * seqlen, "seed": seed}
    return CalibrationSet(windows, summary)
