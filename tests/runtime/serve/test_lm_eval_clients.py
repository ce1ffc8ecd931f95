"""lm-eval's own OpenAI clients (``local-completions``, ``local-chat-completions``) pointed at
``deltazip serve`` on a compressed variant score what lm-eval's ``hf`` model type scores on the
merged checkpoint: the same per-choice loglikelihoods (to fp32 rounding), accuracies, generations
and exact-match. ``local-completions`` finds the server's tokenizer through ``/tokenizer_info`` and
``/tokenize`` (its remote tokenizer), so no tokenizer is loaded on the client side."""

from __future__ import annotations

import logging

import pytest
import torch
from _lm_eval_tasks import evaluate, generations, loglikelihoods, write_tiny_tasks
from _serving import running_server, served_set, single_thread

pytest.importorskip("lm_eval")
pytest.importorskip("openai")



@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tiny_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def server(served):
    with running_server(served, max_num_seqs=16) as srv:
        yield srv


@pytest.fixture(scope="module")
def merged_alpha(served, tmp_path_factory):
    return served.merged_dir("alpha", tmp_path_factory.mktemp("merged") / "alpha-merged")


def test_local_completions_scores_equal_hf_on_the_merged_checkpoint(server, merged_alpha, tasks_dir, caplog):
    # The remote tokenizer encodes without special tokens (lm-eval's choice): hf is told the same.
    ref = evaluate("hf", tasks_dir, model_args=f"pretrained={merged_alpha},device=cpu,dtype=float32,batch_size=8,"
                                               "add_bos_token=False")
    with caplog.at_level(logging.INFO, logger="lm_eval"):
        ours = evaluate("local-completions", tasks_dir, model_args=(
            f"model=alpha,base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1,batch_size=8,"
            "max_length=120"))
    assert "Using remote tokenizer backend" in caplog.text  # found /tokenizer_info and /tokenize
    a, b = torch.tensor(loglikelihoods(ours)), torch.tensor(loglikelihoods(ref))
    assert a.shape == (24, 3) and a.std() > 0.1  # informative numbers, not all equal
    assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()
    assert ours["results"]["tiny_mc"]["acc,none"] == ref["results"]["tiny_mc"]["acc,none"]
    assert generations(ours) == generations(ref)
    assert ours["results"]["tiny_gen"]["exact_match,none"] == ref["results"]["tiny_gen"]["exact_match,none"]


def test_local_completions_with_the_base_tokenizer_scores_equal_hf_defaults(served, server, merged_alpha, tasks_dir):
    """docs/eval.md's command for a tokenizer that adds a BOS: lm-eval tokenizes with the base's own
    tokenizer, BOS included, and scores what ``hf`` (and so ``deltazip eval``) scores at its defaults."""
    assert served.tokenizer()("ab")["input_ids"][0] == served.tokenizer().bos_token_id  # a BOS-adding tokenizer
    ref = evaluate("hf", tasks_dir, model_args=f"pretrained={merged_alpha},device=cpu,dtype=float32,batch_size=8")
    ours = evaluate("local-completions", tasks_dir, model_args=(
        f"model=alpha,base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1,batch_size=8,max_length=120,"
        f"tokenizer={served.base_dir},tokenizer_backend=huggingface,add_bos_token=True"))
    no_bos = evaluate("hf", tasks_dir, model_args=f"pretrained={merged_alpha},device=cpu,dtype=float32,batch_size=8,"
                                                  "add_bos_token=False")
    a, b = torch.tensor(loglikelihoods(ours)), torch.tensor(loglikelihoods(ref))
    assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()
    assert (a - torch.tensor(loglikelihoods(no_bos))).abs().max() > 0.1  # the BOS changes the numbers here
    assert generations(ours) == generations(ref)
    assert ours["results"]["tiny_mc"]["acc,none"] == ref["results"]["tiny_mc"]["acc,none"]


def test_local_chat_completions_generations_equal_hf_with_the_chat_template(server, merged_alpha, tasks_dir):
    """The chat client renders nothing itself: the server applies the variant's chat template (which
    adds no BOS; nor does hf, told so). lm-eval scores only generate tasks through a chat API (it
    refuses loglikelihood there by design)."""
    ref = evaluate("hf", tasks_dir, tasks=("tiny_gen",), apply_chat_template=True,
                   model_args=f"pretrained={merged_alpha},device=cpu,dtype=float32,batch_size=8,add_bos_token=False")
    ours = evaluate("local-chat-completions", tasks_dir, tasks=("tiny_gen",), apply_chat_template=True,
                    model_args=f"model=alpha,base_url={server.url}/v1/chat/completions,num_concurrent=1,max_retries=1")
    assert generations(ours) == generations(ref) and any(generations(ref))
    assert ours["results"]["tiny_gen"]["exact_match,none"] == ref["results"]["tiny_gen"]["exact_match,none"]
