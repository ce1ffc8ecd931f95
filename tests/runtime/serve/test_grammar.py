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
    assert filler.start([None, None, None]) is None
    assert filler._pool is None  # no thread, no buffer: an unconstrained step pays nothing


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_step_masks_touch_only_the_constrained_rows_of_each_forward(tok, compilers, backend):
    """Six rows in two forwards (prefill rows 0-2, decode rows 3-5), constrained rows 1 and 4 at two
    different states: after apply, their allowed tokens keep their logits and the rest are -inf;
    every other row is bit-identical. Both kernels (``torch_native`` is the one used on GPUs) on the
    inference tensors a forward returns."""
    grammar = response_format_grammar(compilers, tok, [1], {"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    m1, m4 = grammar.matcher(), grammar.matcher()
    for ch in '{"w": "a':
        assert m4.accept(tok.convert_tokens_to_ids(ch))
    filler = MaskFiller(V, torch.device("cpu"))
    filler.backend = backend
    masks = filler.start([None, m1, None, None, m4, None])
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefill, decode = logits[:3].clone(), logits[3:].clone()
    masks.apply(prefill, 0)
    masks.apply(decode, 3)
    out = torch.cat([prefill, decode])
    assert torch.equal(out[[0, 2, 3, 5]], logits[[0, 2, 3, 5]])
    for row, matcher in ((1, m1), (4, m4)):
        want = xgr.allocate_token_bitmask(1, V)
        matcher.state.fill_next_token_bitmask(want)
        allowed = _allowed(want[0])
        assert torch.equal(out[row][allowed], logits[row][allowed]) and torch.isneginf(out[row][~allowed]).all()
        names = {tok.convert_ids_to_tokens(i) for i in allowed.nonzero().flatten().tolist()}
        assert names == ({"{"} if row == 1 else {"\"", *(c for c in map(chr, range(32, 127)) if c not in "\"\\")})
    filler.close()


def test_a_completed_grammar_allows_only_the_stop_token(tok, compilers):
    grammar = response_format_grammar(compilers, tok, [1], {"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    m = grammar.matcher()
    for ch in json.dumps({"w": "ab", "n": 22}):
        assert m.accept(tok.convert_tokens_to_ids(ch)), ch
    filler = MaskFiller(V, torch.device("cpu"))
    masks = filler.start([m])
    logits = torch.zeros(1, V)
    masks.apply(logits, 0)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1]  # </s>
    assert not m.terminated and m.accept(1) and m.terminated
    filler.close()
