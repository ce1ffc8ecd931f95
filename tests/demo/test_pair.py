"""The demo model pair: tokenizer, files, shapes, the accuracy gap, delta size and determinism."""

from __future__ import annotations

import hashlib
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from deltazip.demo.pair import VOCAB_SIZE, ToyConfig, build_char_tokenizer, make_demo_pair
from deltazip.runtime.eval.generated_tasks import (
    TERMINATOR,
    answer_loss,
    exact_match_accuracy,
    get_task,
    heldout_loss,
)

LINEAR_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    calls: list[tuple[str, int, int]] = []
    built = make_demo_pair(tmp_path_factory.mktemp("demo"), seed=0, progress=lambda *a: calls.append(a))
    built.info["_progress_calls"] = calls
    return built


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tensors(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tasks_are_deterministic_and_distinct():
    shift = get_task("shift")
    a, b = shift.examples(50, seed=3), shift.examples(50, seed=3)
    assert a == b and a != shift.examples(50, seed=4)
    assert len({p for p, _ in a}) == 50
    assert shift.render("s 3918=", "4029") == "s 3918=4029;"
    assert get_task("copy").transform("0912") == "0912"
    assert get_task("decrement").transform("0912") == "9801"
    assert shift.transform("0919") == "1020"
    with pytest.raises(KeyError, match="known tasks"):
        get_task("nope")


class _ScriptedLM(torch.nn.Module):
    """Greedy-decodes a fixed continuation per prompt: logits put all mass on the scripted next token."""

    def __init__(self, tok, continuations: dict[str, str]):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))  # gives the model a device
        self.vocab = len(tok)
        self.scripts = {
            tuple(tok(p)["input_ids"]): tok(c, add_special_tokens=False)["input_ids"]
            for p, c in continuations.items()
        }

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for i, row in enumerate(input_ids.tolist()):
            for prompt, script in self.scripts.items():
                if tuple(row[: len(prompt)]) == prompt:
                    logits[i, -1, script[min(len(row) - len(prompt), len(script) - 1)]] = 1.0
        return SimpleNamespace(logits=logits)


def test_exact_match_needs_the_answer_and_the_terminator():
    tok = build_char_tokenizer()
    examples = [("s 123456=", "234567"), ("s 999999=", "000000"), ("s 12=", "23")]
    right = {p: a + TERMINATOR for p, a in examples}
    assert exact_match_accuracy(_ScriptedLM(tok, right), tok, examples) == 1.0
    # A wrong digit, a missing terminator (runs on), and an answer that stops early all count as wrong.
    wrong = {"s 123456=": "234568;", "s 999999=": "0000000000", "s 12=": "2;"}
    assert exact_match_accuracy(_ScriptedLM(tok, wrong), tok, examples) == 0.0
    mixed = {**wrong, "s 12=": "23;"}
    assert exact_match_accuracy(_ScriptedLM(tok, mixed), tok, examples) == pytest.approx(1 / 3)


class _AnswerOracle(torch.nn.Module):
    """Knows every token from index ``k`` on (logit 50 on it) and nothing before (uniform logits)."""

    def __init__(self, vocab: int, k: int):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.k = vocab, k

    def forward(self, input_ids, attention_mask=None):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for t in range(self.k - 1, input_ids.shape[1] - 1):
            logits[torch.arange(input_ids.shape[0]), t, input_ids[:, t + 1]] = 50.0
        return SimpleNamespace(logits=logits)


def test_answer_loss_counts_only_the_answer_and_its_terminator():
    tok = build_char_tokenizer()
    examples = [("s 123=", "234"), ("s 909=", "010")]
    k = len(tok("s 123=")["input_ids"])  # BOS + 6 characters
    oracle = _AnswerOracle(len(tok), k)
    assert answer_loss(oracle, tok, examples) < 1e-6
    # heldout_loss also scores the prompt: k - 1 uniform predictions per text out of k - 1 + 4
    texts = [p + a + TERMINATOR for p, a in examples]
    assert heldout_loss(oracle, tok, texts) == pytest.approx((k - 1) / (k + 3) * math.log(len(tok)), rel=1e-4)
    assert answer_loss(_AnswerOracle(len(tok), k + 10), tok, examples) == pytest.approx(math.log(len(tok)), rel=1e-4)


def test_tokenizer_round_trips_and_reloads(tmp_path):
    tok = build_char_tokenizer(save_dir=tmp_path)
    text = "s 3918=4029;\nHello, World!\t~"
    ids = tok(text)["input_ids"]
    assert len(tok) == VOCAB_SIZE and VOCAB_SIZE % 128 == 0
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok("é")["input_ids"][1] == tok.unk_token_id

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids
    assert loaded.decode(ids, skip_special_tokens=True) == text
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert loaded(["ab", "abcd"], padding=True)["attention_mask"][0] == [1, 1, 1, 0, 0]


def test_pair_files_and_data(pair):
    for d in (pair.base_dir, pair.finetuned_dir):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / name).is_file(), f"{d / name} missing"
    calib, evals = _read_jsonl(pair.calib_path), _read_jsonl(pair.eval_path)
    task = get_task(pair.task_name)
    assert len(calib) == 128 and len(evals) == 256
    assert all(row["text"].endswith(TERMINATOR) for row in calib)
    for row in evals:
        assert row["text"] == task.render(row["prompt"], row["answer"])
    # Held-out means held out: no eval prompt is in the calibration set.
    calib_prompts = {row["text"].split("=")[0] for row in calib}
    assert not calib_prompts & {row["prompt"].split("=")[0] for row in evals}
    json.dumps({k: v for k, v in pair.info.items() if k != "_progress_calls"})  # info is JSON-ready
    calls = pair.info["_progress_calls"]
    assert calls and calls[-1][1] == calls[-1][2] and any("fine-tune" in c[0] for c in calls)


def test_pair_has_a_chat_template_that_renders_task_prompts(pair):
    """Issue 17 #13: chat never worked on the demo's output (no template anywhere)."""
    evals = _read_jsonl(pair.eval_path)
    for d in (pair.base_dir, pair.finetuned_dir):
        tok = AutoTokenizer.from_pretrained(d)
        for row in evals[:8]:
            msgs = [{"role": "system", "content": "be exact"}, {"role": "user", "content": row["prompt"]}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert list(ids) == tok(row["prompt"])["input_ids"]  # exactly the prompt as trained (with BOS)
        two = tok.apply_chat_template([{"role": "user", "content": "s 1="}, {"role": "assistant", "content": "2"},
                                       {"role": "user", "content": "s 3="}], tokenize=False)
        assert two == "<s>s 1=2;s 3="


def test_base_and_finetuned_have_same_tensors_and_every_weight_moved(pair):
    base, ft = _tensors(pair.base_dir), _tensors(pair.finetuned_dir)
    assert base.keys() == ft.keys()
    for name, w in base.items():
        assert w.shape == ft[name].shape and w.dtype == ft[name].dtype, name
        if w.ndim == 2:  # every linear / embedding: both dims multiples of 128 (groups, 2:4)
            assert w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0, (name, tuple(w.shape))
        # A full fine-tune touches every tensor, not just some.
        assert not torch.equal(w, ft[name]), f"{name} unchanged by the fine-tune"


def test_delta_is_small_relative_to_weights(pair):
    rel = pair.info["relative_delta"]
    for kind in LINEAR_KINDS:
        assert 0.005 < rel[kind] < 0.15, (kind, rel[kind])


def test_finetune_learned_the_task_and_base_did_not(pair):
    evals = _read_jsonl(pair.eval_path)
    examples = [(row["prompt"], row["answer"]) for row in evals]
    tok = AutoTokenizer.from_pretrained(pair.base_dir)
    # fp32 compute on the stored (bf16) weights, as at build time; bf16 matmuls are slow on CPU.
    base = AutoModelForCausalLM.from_pretrained(pair.base_dir, dtype=torch.float32)
    ft = AutoModelForCausalLM.from_pretrained(pair.finetuned_dir, dtype=torch.float32)

    base_acc = exact_match_accuracy(base, tok, examples)
    ft_acc = exact_match_accuracy(ft, tok, examples)
    assert base_acc <= 0.05, base_acc
    assert ft_acc >= 0.9, ft_acc
    # The numbers recorded at build time are the ones a user gets by loading the saved files.
    assert base_acc == pytest.approx(pair.info["base_accuracy"])
    assert ft_acc == pytest.approx(pair.info["finetuned_accuracy"])
    assert min(pair.info["base_pretrain_accuracy"].values()) >= 0.9

    texts = [row["text"] for row in evals[:64]]
    assert heldout_loss(ft, tok, texts) < heldout_loss(base, tok, texts) - 0.2


def test_same_seed_gives_bit_identical_checkpoints(tmp_path):
    # Short schedule: determinism is a property of the code path, not of the step count.
    cfg = ToyConfig(
        pretrain_steps=12, finetune_steps=6, pretrain_warmup=2, finetune_warmup=2, n_eval=16, n_calib=8
    )
    rng_state = torch.get_rng_state()
    first = make_demo_pair(tmp_path / "a", seed=7, config=cfg)
    assert torch.equal(torch.get_rng_state(), rng_state), "make_demo_pair changed the caller's global RNG"
    second = make_demo_pair(tmp_path / "b", seed=7, config=cfg)
    other = make_demo_pair(tmp_path / "c", seed=8, config=cfg)
    for sub in ("base", "finetuned"):
        digest = _sha256(first.base_dir.parent / sub / "model.safetensors")
        assert digest == _sha256(second.base_dir.parent / sub / "model.safetensors"), sub
        assert digest != _sha256(other.base_dir.parent / sub / "model.safetensors"), sub
    assert first.calib_path.read_bytes() == second.calib_path.read_bytes()
    assert first.eval_path.read_bytes() == second.eval_path.read_bytes()


def test_pair_files_honour_the_umask_and_no_temporaries_are_left(tmp_path):
    """Issue 25: the demo wrote its weights 0600 (safetensors' mode), so a service account could not
    read them; every file gets 0666 & ~umask, like every other write."""
    import os

    cfg = ToyConfig(pretrain_steps=2, finetune_steps=2, pretrain_warmup=1, finetune_warmup=1, n_eval=4, n_calib=4)
    old = os.umask(0o027)
    try:
        pair = make_demo_pair(tmp_path / "w", seed=0, config=cfg)
    finally:
        os.umask(old)
    root = pair.base_dir.parent
    modes = {p.relative_to(root).as_posix(): p.stat().st_mode & 0o777 for p in root.rglob("*")}
    assert modes["base/model.safetensors"] == modes["finetuned/model.safetensors"] == 0o640
    assert set(modes.values()) == {0o640, 0o750}, modes
    assert sorted(p.name for p in root.iterdir()) == ["base", "calib.jsonl", "eval.jsonl", "finetuned"]
