"""The grammar side of the engine (runtime/serve/grammar.py) without a server: schema checks, the
bounded-string rewrite, and the step masks (filled beside the forward, applied to the right rows)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from deltazip.demo.pair import build_char_tokenizer
from deltazip.runtime.serve.grammar import (
    GrammarCompilers,
    GrammarError,
    MaskFiller,
    bounded_strings_as_patterns,
    response_format_grammar,
)

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

V = 130  # the model's logits are wider than the character tokenizer's 128 ids (padding rows exist)
SCHEMA = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 2}, "n": {"enum": [1, 22]}},
          "required": ["w", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def compilers():
    return GrammarCompilers(V)


def _allowed(words: torch.Tensor) -> torch.Tensor:
    return ((words.unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:V].bool()


def test_bounded_strings_become_patterns():
    schema = {"type": "object", "properties": {"type": {"type": "string", "minLength": 1, "maxLength": 3},
                                               "o": {"type": ["string", "null"], "minLength": 2},
                                               "e": {"enum": [{"type": "string", "maxLength": 1}]},
                                               "p": {"type": "string", "pattern": "^a+$", "maxLength": 2}}}
    out = bounded_strings_as_patterns(schema)
    assert out["properties"]["type"] == {"type": "string", "pattern": "^[\\s\\S]{1,3}$"}
    assert out["properties"]["o"] == {"type": ["string", "null"], "pattern": "^[\\s\\S]{2,}$"}
    assert out["properties"]["e"] == schema["properties"]["e"] and out["properties"]["p"] == schema["properties"]["p"]


def test_a_bounded_string_takes_its_lengths_and_no_raw_control_character(tok, compilers):
    """What the compiled grammar accepts: every plain string within the bounds, none outside them, and
    no raw tab or newline (JSON forbids them in strings; xgrammar 0.2.8's own bounded-string rule took them)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}},
              "required": ["s"], "additionalProperties": False}
    grammar = response_format_grammar(compilers, tok, [1], {"type": "json_schema", "json_schema": {"schema": schema}})

    def accepts(text: str) -> bool:
        m = grammar.matcher().state
        return m.accept_string(text) and m.accept_token(1)  # complete: the stop token is next

    rnd = random.Random(0)
    for _ in range(60):
        s = "".join(rnd.choice("ab .:") for _ in range(rnd.randrange(6)))
        assert accepts(json.dumps({"s": s})) == jsonschema.Draft202012Validator(schema).is_valid({"s": s}), s
    for raw in ("a\tb", "\n", "x\x01"):
        assert not accepts('{"s": "' + raw + '"}')


@pytest.mark.parametrize("rf, needle", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": "w"}}}, "not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 3, "maximum": 2}}},
     "minimum greater than maximum"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be a JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "no schema"}}, "must be an object with a `schema`"),
    ({"type": "grammar"}, "'grammar' is not supported"),
])
def test_bad_response_formats_name_the_problem(tok, compilers, rf, needle):
    with pytest.raises(GrammarError) as e:
        response_format_grammar(compilers, tok, [1], rf)
    assert e.value.param == "response_format" and needle in str(e.value)
    assert not str(e.value).startswith("[")  # xgrammar's "[time] file.cc:line:" prefix is cut


def test_text_or_nothing_is_no_grammar(tok, compilers):
    assert response_format_grammar(compilers, tok, [1], None) is None
    assert response_format_grammar(compilers, tok, [1], {"type": "text"}) is None


def test_rows_without_a_grammar_start_nothing():
    filler = MaskFiller(V, torch.device("cpu"))
    assert filler.start({}) is None
    assert filler._pool is None  # no thread, no buffer: an unconstrained step pays nothing


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_step_masks_touch_only_the_constrained_rows_of_each_batch(tok, compilers, backend):
    """A step with constrained sequences a, b (two states) and c, a sample forked from a's prompt
    (a's row of the bitmask), drawn in two batches laid out differently from the bitmask: after
    apply, each constrained row keeps its allowed tokens' logits and the rest are -inf; every other
    row is bit-identical. Both kernels (``torch_native`` is the one used on GPUs) on the inference
    tensors a forward returns."""
    grammar = response_format_grammar(compilers, tok, [1], {"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    ma, mb = grammar.matcher(), grammar.matcher()
    for ch in '{"w": "a':
        assert mb.accept(tok.convert_tokens_to_ids(ch))
    filler = MaskFiller(V, torch.device("cpu"))
    filler.backend = backend
    masks = filler.start({"a": ma, "b": mb, "c": ma})
    assert masks.rows([None, None]) is None
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        first, second = logits[:3].clone(), logits[3:].clone()
    masks.rows([None, "b", None]).apply(first)
    masks.rows(["c", None, "a"]).apply(second)
    out = torch.cat([first, second])
    assert torch.equal(out[[0, 2, 4]], logits[[0, 2, 4]])
    for row, matcher in ((1, mb), (3, ma), (5, ma)):
        want = xgr.allocate_token_bitmask(1, V)
        matcher.state.fill_next_token_bitmask(want)
        allowed = _allowed(want[0])
        assert torch.equal(out[row][allowed], logits[row][allowed]) and torch.isneginf(out[row][~allowed]).all()
        names = {tok.convert_ids_to_tokens(i) for i in allowed.nonzero().flatten().tolist()}
        assert names == ({"\"", *(c for c in map(chr, range(32, 127)) if c not in "\"\\")} if row == 1 else {"{"})
    filler.close()


def test_the_mask_is_the_last_logit_change_and_logprobs_stay_raw(tok, compilers):
    """Through the engine's draw (``engine.draw_tokens``): a constrained row with ``logit_bias`` and
    ``logprobs`` draws within its grammar (the bias toward a disallowed token does not leak past the
    mask), its log probability is the raw logits' ``log_softmax`` (finite), and the model's logits
    are left as they were; without log probabilities the logits are changed in place (no copy)."""
    from deltazip.runtime.serve.engine import IncrementalDetokenizer, SamplingParams, Sequence, draw_tokens

    grammar = response_format_grammar(compilers, tok, [1], {"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    x = tok.convert_tokens_to_ids("x")

    def seq(rid, **kw):
        s = Sequence(rid, "m", "m", [5], SamplingParams(temperature=0.0, logit_bias={x: 100.0}, **kw),
                     lambda ev: None, IncrementalDetokenizer(None, [], []), seed=0, arrival=0.0)
        s.matcher = grammar.matcher()
        return s

    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    raw = logits.clone()
    filler = MaskFiller(V, torch.device("cpu"))
    seqs = [seq("a", logprobs=2), seq("b")]
    got = draw_tokens(seqs, logits, [[1], [1]], filler.start({s.rid: s.matcher for s in seqs}))
    brace = tok.convert_tokens_to_ids("{")
    assert [t for _, t, _ in got] == [brace, brace]  # "{" is all the grammar allows first; the bias lost
    lp = got[0][2]
    assert lp[0] == brace and lp[1] == pytest.approx(torch.log_softmax(raw[0], -1)[brace].item(), abs=1e-6)
    assert torch.equal(logits, raw)  # a row asked for log probabilities: the mask went on a copy
    plain = [seq("c")]
    one = logits[:1].clone()
    draw_tokens(plain, one, [[1]], filler.start({"c": plain[0].matcher}))
    assert torch.isneginf(one[0]).sum() == V - 1  # no log probabilities: masked in place
    filler.close()


def test_a_completed_grammar_allows_only_the_stop_token(tok, compilers):
    grammar = response_format_grammar(compilers, tok, [1], {"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    m = grammar.matcher()
    for ch in json.dumps({"w": "ab", "n": 22}):
        assert m.accept(tok.convert_tokens_to_ids(ch)), ch
    filler = MaskFiller(V, torch.device("cpu"))
    masks = filler.start({"r": m})
    logits = torch.zeros(1, V)
    masks.rows(["r"]).apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1]  # </s>
    assert not m.terminated and m.accept(1) and m.terminated
    filler.close()
