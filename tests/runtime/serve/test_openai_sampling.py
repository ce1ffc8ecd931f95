"""Log probabilities, echo, n / best_of and the sampling controls of the OpenAI-compatible server,
against the merged model (fp32, CPU), through the official ``openai`` client on a real server."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from _serving import PROMPTS, running_server, served_set, single_thread

from deltazip.runtime.serve.sampling import sample_seed

openai = pytest.importorskip("openai")

KEY = "sk-test-key"
TOL = 1e-4
VLLM_EXTRAS = {"repetition_penalty", "stop_token_ids", "min_tokens", "top_k", "min_p", "ignore_eos"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


@pytest.fixture(scope="module")
def server(served):
    # max_batch_tokens 12: longer prompts are read in chunks
    with running_server(served, api_key=KEY, max_deltas=2, max_num_seqs=16, max_batch_tokens=12) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def log_softmax(served, model: str, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]``: the merged model's log-probabilities of the token after each position."""
    with torch.no_grad():
        return torch.log_softmax(served.model(model)(torch.tensor([ids])).logits[0].double(), -1)


def greedy_ids(served, model: str, ids: list[int], n: int) -> list[int]:
    with torch.no_grad(), single_thread():
        out = served.model(model).generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                           max_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_greedy_logprobs_equal_the_merged_models_log_softmax(client, served):
    tok = served.tokenizer()
    for model, prompt in (("alpha", PROMPTS[0]), ("gamma", PROMPTS[3])):
        ids = tok(prompt)["input_ids"]
        gen = greedy_ids(served, model, ids, 8)
        ref = log_softmax(served, model, ids + gen)
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == tok.decode(gen, skip_special_tokens=True)
        assert lp.tokens == [tok.decode([t]) for t in gen]
        for j, t in enumerate(gen):
            row = ref[len(ids) - 1 + j]
            assert abs(lp.token_logprobs[j] - row[t].item()) < TOL
            want = row.topk(5).values.tolist()
            got = sorted(lp.top_logprobs[j].values(), reverse=True)
            # the chosen token (greedy: the most likely) and the 5 most likely, keyed by their text
            assert max(abs(a - b) for a, b in zip(got, want)) < TOL and len(got) == 5
        assert lp.text_offset == [sum(len(s) for s in lp.tokens[:j]) for j in range(len(gen))]
        # chat: logprobs + top_logprobs, each entry {token, logprob, bytes, top_logprobs}
        msgs = [{"role": "user", "content": prompt}]
        c = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=3)
        chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
        cgen = greedy_ids(served, model, chat_ids, 6)
        cref = log_softmax(served, model, chat_ids + cgen)
        content = c.choices[0].logprobs.content
        assert [e.token for e in content] == [tok.decode([t]) for t in cgen]
        for j, (e, t) in enumerate(zip(content, cgen)):
            row = cref[len(chat_ids) - 1 + j]
            assert abs(e.logprob - row[t].item()) < TOL and e.bytes == list(e.token.encode())
            want = row.topk(3).values.tolist()
            assert len(e.top_logprobs) == 3 and max(abs(x.logprob - v) for x, v in zip(e.top_logprobs, want)) < TOL


def test_echo_scores_the_prompt_from_the_serving_prefill(client, served):
    """``echo`` with ``max_tokens: 0`` scores a prompt (the first token null); a prompt longer than
    the step's token budget (12) is read in chunks and every chunk's positions are scored."""
    tok = served.tokenizer()
    for model in ("beta", "alpha", "tiny-base"):
        prompt = "delta zip model tune, " * 3  # 67 tokens: six chunks
        ids = tok(prompt)["input_ids"]
        ref = log_softmax(served, "base" if model == "tiny-base" else model, ids)
        r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
        want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < TOL
        greedy = [max(t.values()) == v for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])]
        assert greedy == [ref[j - 1].argmax().item() == ids[j] for j in range(1, len(ids))]
    # echo + generation, token ids as the prompt (what lm-eval sends): prompt entries, then the generated ones
    ids = tok(PROMPTS[2])["input_ids"]
    gen = greedy_ids(served, "gamma", ids, 3)
    ref = log_softmax(served, "gamma", ids + gen)
    r = client.completions.create(model="gamma", prompt=[ids, ids], max_tokens=3, temperature=0, echo=True, logprobs=0)
    for ch in r.choices:
        assert ch.text == tok.decode(ids) + tok.decode(gen, skip_special_tokens=True)
        full = ids + gen
        assert len(ch.logprobs.token_logprobs) == len(full)
        assert max(abs(ch.logprobs.token_logprobs[j] - ref[j - 1, full[j]].item()) for j in range(1, len(full))) < TOL


def test_streamed_logprobs_equal_the_whole_answer(client):
    kw = dict(model="alpha", prompt=PROMPTS[1], max_tokens=10, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0]
    text, toks, lps, offsets = "", [], [], []
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            text += c.text
            if c.logprobs is not None:
                toks += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text and toks == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert lps == whole.logprobs.token_logprobs
    # chat stream: the deltas' logprobs, joined, are the whole answer's
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    w = client.chat.completions.create(model="beta", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=1)
    streamed = [e for ch in client.chat.completions.create(model="beta", messages=msgs, max_tokens=5, temperature=0,
                                                          logprobs=True, top_logprobs=1, stream=True)
                for c in ch.choices if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in w.choices[0].logprobs.content]


def test_n_samples_are_reproducible_whatever_shares_the_batch(server, client, served):
    """n=4 at temperature 1 with a seed: the same four texts alone and inside a crowd of other
    requests; the samples differ; sample i equals a single request seeded with sample_seed(seed, i)
    (so the forked samples, which share the prompt's KV blocks, compute what a fresh prefill does)."""
    prompt = "zip model tune delta " * 2  # 42 tokens: 2 full KV blocks shared, the partial third copied
    kw = dict(model="alpha", prompt=prompt, max_tokens=12, temperature=1.0, seed=1234, n=4)
    alone = [c.text for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)]
    assert len(set(alone)) == 4

    async def crowd():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=300) as http:
            others = [http.post("/v1/completions", json={"model": m, "prompt": p, "max_tokens": 9, "temperature": 0.7,
                                                         "n": 2}) for m in ("beta", "alpha", "tiny-base")
                      for p in PROMPTS[:3]]
            ours = http.post("/v1/completions", json=kw)
            rs = await asyncio.gather(ours, *others)
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
            return [c["text"] for c in sorted(rs[0].json()["choices"], key=lambda c: c["index"])]

    with single_thread():
        assert asyncio.run(crowd()) == alone
    singles = [client.completions.create(model="alpha", prompt=prompt, max_tokens=12, temperature=1.0,
                                         seed=sample_seed(1234, i)).choices[0].text for i in range(4)]
    assert singles == alone
    assert server.rt.engine.kv_pool.nbytes() == 0  # every shared block was given back
    greedy = client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=8, temperature=0, n=3)
    assert {c.text for c in greedy.choices} == {served.expected("gamma", PROMPTS[0], 8)}
    c = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       n=3, seed=9)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2] and c.usage.completion_tokens <= 15


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(client):
    kw = dict(model="beta", prompt=PROMPTS[4], max_tokens=6, temperature=1.0, seed=77)
    every = client.completions.create(n=5, logprobs=0, **kw).choices
    score = {c.text: sum(c.logprobs.token_logprobs) for c in every}
    r = client.completions.create(n=2, best_of=5, **kw)
    assert [c.text for c in r.choices] == sorted(score, key=score.get, reverse=True)[:2]
    # all 5 were drawn; an ending EOS is listed with its logprob and counted, as vLLM counts it
    assert any(c.finish_reason == "stop" for c in every)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every)


def merged_greedy(served, model: str, ids: list[int], steps: int, adjust, eos: int | None = 1) -> list[int]:
    """Greedy decoding of the merged model with ``adjust(logits [V], generated ids)`` applied, ending after
    ``eos`` (the tokenizer's ``</s>``, id 1) as the server's does; ``eos`` None: ``steps`` tokens whatever
    they are."""
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = served.model(model)(torch.tensor([ids + out])).logits[0, -1].double()
        out.append(int(adjust(logits, out).argmax()))
        if out[-1] == eos:
            break
    return out


def test_penalties_bias_and_token_controls_match_a_reference_decoding(client, served):
    tok = served.tokenizer()
    ids = tok(PROMPTS[3])["input_ids"]

    used = []

    def text(model, **kw):
        extra = {k: kw.pop(k) for k in list(kw) if k in VLLM_EXTRAS}  # the openai client sends these as extra_body
        r = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=10, temperature=0, extra_body=extra,
                                      **kw)
        used.append(r.usage.completion_tokens)
        return r.choices[0].text, r.choices[0].finish_reason

    def counts(out):
        return torch.bincount(torch.tensor(out, dtype=torch.long), minlength=128).double() if out else torch.zeros(128)

    plain = greedy_ids(served, "alpha", ids, 10)
    ref = merged_greedy(served, "alpha", ids, 10, lambda x, o: x - 1.5 * counts(o) - 0.5 * (counts(o) > 0))
    assert ref != plain  # the penalties change this decoding: the comparison below can fail
    assert text("alpha", frequency_penalty=1.5, presence_penalty=0.5)[0] == tok.decode(ref, skip_special_tokens=True)
    with torch.no_grad():  # vLLM's repetition penalty is transformers' (prompt and output tokens)
        hf = served.model("gamma").generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                            repetition_penalty=1.8, pad_token_id=2)[0, len(ids):].tolist()
    assert hf != greedy_ids(served, "gamma", ids, 10)
    assert text("gamma", repetition_penalty=1.8)[0] == tok.decode(hf, skip_special_tokens=True)
    bias = {str(plain[0]): -100, "70": 0.2}
    ref = merged_greedy(served, "alpha", ids, 10, lambda x, o: x + torch.tensor(
        [-100.0 if i == plain[0] else 0.2 if i == 70 else 0.0 for i in range(128)]))
    assert ref != plain and ref.count(70) < 10  # token 70 is favoured, not forced
    assert text("alpha", logit_bias=bias)[0] == tok.decode(ref, skip_special_tokens=True)
    # stop_token_ids end the text before that token; min_tokens bans it (and EOS) for that many tokens
    stop_at = plain[3]
    assert text("alpha", stop_token_ids=[stop_at]) == (tok.decode(plain[:plain.index(stop_at)], skip_special_tokens=True),
                                                       "stop")
    assert used[-1] == plain.index(stop_at) + 1  # the stop token id is counted in usage (vLLM's count)
    banned = merged_greedy(served, "alpha", ids, 10, lambda x, o: torch.where(
        (torch.arange(128) == stop_at) | (torch.arange(128) == 1), -torch.inf, x) if len(o) < 6 else x, eos=None)
    end = next((j for j in range(6, 10) if banned[j] in (stop_at, 1)), 10)  # EOS (id 1) ends it too
    want = banned[:end]
    assert len(want) > plain.index(stop_at)
    assert text("alpha", stop_token_ids=[stop_at], min_tokens=6)[0] == tok.decode(want, skip_special_tokens=True)
    # top_k=1 and min_p=1 keep only the most likely token: sampling at any temperature is greedy
    greedy = tok.decode(plain, skip_special_tokens=True)
    for kw in ({"top_k": 1}, {"min_p": 1.0}):
        r = client.completions.create(model="alpha", prompt=PROMPTS[3], max_tokens=10, temperature=1.5, seed=3,
                                      extra_body=kw)
        assert r.choices[0].text == greedy, kw


def test_tokenize_and_detokenize_as_vllm_serves_them(server, served):
    tok = served.tokenizer()
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/tokenize", json={"model": "alpha", "prompt": "zip it", "return_token_strs": True},
                   headers=h).json()
    ids = tok("zip it")["input_ids"]
    assert r == {"count": len(ids), "max_model_len": server.rt.engine.max_len, "tokens": ids,
                 "token_strs": tok.convert_ids_to_tokens(ids)}
    r = httpx.post(server.url + "/tokenize", json={"prompt": "zip it", "add_special_tokens": False}, headers=h).json()
    assert r["tokens"] == tok("zip it", add_special_tokens=False)["input_ids"]
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"model": "beta", "messages": msgs}, headers=h).json()
    assert r["tokens"] == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert httpx.post(server.url + "/detokenize", json={"model": "gamma", "tokens": ids}, headers=h).json() == \
        {"prompt": tok.decode(ids)}
    info = httpx.get(server.url + "/tokenizer_info", headers=h).json()
    assert info["eos_token"] == "</s>" and info["chat_template"] == tok.chat_template
    for path, body, param in (("/tokenize", {"prompt": 3}, "prompt"), ("/detokenize", {"tokens": [1, 999]}, "tokens"),
                              ("/tokenize", {"model": "nope", "prompt": "x"}, "model")):
        bad = httpx.post(server.url + path, json=body, headers=h)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401  # the key guards them too
