"""``deltazip eval`` on families beyond Llama, at the default ``--batch-size 8``: perplexity through
the serving path equals the merged checkpoint's. GPTBigCode passes its default position ids as
``[1, T]`` (one row for the whole batch) to its learned-position table; the decoupled table must
broadcast them. A variant the runtime cannot decouple is refused with advice eval can follow."""

from __future__ import annotations

import pytest
import torch
from _factories import calib_file, finetune, save_model, tiny_model
from _serving import single_thread

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import merge_to_dir
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import InputError
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.runtime.eval.perplexity import perplexity
from deltazip.runtime.eval.run import EvalOptions
from deltazip.runtime.eval.targets import EvalBank, parse_targets
from deltazip.runtime.serve.model import DeltaModel, load_tokenizer

TEXT = "alpha beta gamma delta zip model base tune 12 345 = + " * 8
DEFAULT_BATCH = EvalOptions(perplexity="x").batch_size


def family(tmp_path, arch):
    base_dir = save_model(tiny_model(arch), tmp_path / "base")
    ft_dir = save_model(finetune(tiny_model(arch), steps=30), tmp_path / "ft")
    art = tmp_path / "art"
    cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=32, sparsity="none"), method="deltazip",
                         nsamples=8, seqlen=32,
                         device="cpu")
    compress_delta(base_dir, ft_dir, str(calib_file(tmp_path / "calib", n=16)), art, cfg)
    return base_dir, art


@pytest.mark.parametrize("arch", ["gpt_bigcode", "gemma", "gpt2"])
def test_perplexity_at_the_default_batch_size_equals_the_merged_model(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    assert DEFAULT_BATCH == 8
    with single_thread():
        base_dir, art = family(tmp_path, arch)
        merged_dir = merge_to_dir(Artifact(art), Checkpoint(base_dir), tmp_path / "merged")
        (target,) = parse_targets([str(art)])
        bank = EvalBank([target], str(base_dir), device="cpu", dtype="float32")
        tok = load_tokenizer(base_dir)
        got = perplexity(bank.model_for(target), tok, TEXT, window=16, batch_size=DEFAULT_BATCH)
        assert got.windows > DEFAULT_BATCH  # several rows per forward, and a short last batch
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        want = perplexity(merged, tok, TEXT, window=16, batch_size=1)
        assert got.perplexity == pytest.approx(want.perplexity, rel=1e-5)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        assert perplexity(base, tok, TEXT, window=16).perplexity != pytest.approx(want.perplexity, rel=1e-3)


def test_a_refused_variant_gets_advice_eval_can_follow(tmp_path, monkeypatch):
    with single_thread():
        base_dir, art = family(tmp_path, "gpt2")
        monkeypatch.setattr(DeltaModel, "_decoupled_kind", staticmethod(lambda mod, attr: None))
        with pytest.raises(InputError) as err:
            EvalBank(parse_targets([str(art)]), str(base_dir), device="cpu", dtype="float32")
    msg = str(err.value)
    assert "\n" not in msg and "--mode" not in msg
    assert "cannot apply per request" in msg and f"deltazip merge ARTIFACT --base {base_dir}" in msg
