"""bf16 fine-tunes (format v2: packed lm_head, row-wise embeddings, exact norms; with and without the
lossless stage) served in delta and swap mode give the merged models' greedy output."""

from __future__ import annotations

import pytest
import torch
from _factories import calib_file, perturb, tiny_model
from _serving import PROMPTS, single_thread

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

openai = pytest.importorskip("openai")

IDS = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def bf16_set(tmp_path_factory):
    from deltazip.demo.pair import build_char_tokenizer

    root = tmp_path_factory.mktemp("bf16")
    tok = build_char_tokenizer()
    base_dir = root / "base"
    tiny_model("llama", dtype=torch.bfloat16, **IDS).save_pretrained(base_dir, safe_serialization=True)
    tok.save_pretrained(base_dir)
    calib = calib_file(root / "calib")
    arts = root / "artifacts"
    for name, lossless, seed in (("plain", "none", 21), ("packed", "gdeflate", 22)):
        ft = perturb(tiny_model("llama", dtype=torch.bfloat16, **IDS), scale=0.3, seed=seed, skip=())
        ft_dir = root / f"ft-{name}"
        ft.save_pretrained(ft_dir, safe_serialization=True)
        tok.save_pretrained(ft_dir)
        cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=32), nsamples=8, seqlen=32, device="cpu")
        compress_delta(base_dir, ft_dir, str(calib), arts / name, cfg, lossless=lossless)
    return base_dir, arts, tok


def _expected(base_dir, arts, tok, name, prompt, n):
    model = load_merged_model(Artifact(arts / name), Checkpoint(base_dir), dtype=torch.float32)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("mode", ("delta", "swap"))
def test_bf16_variants_serve_their_merged_greedy_output(bf16_set, mode):
    base_dir, arts, tok = bf16_set
    kinds = {n: {e["kind"] for e in Artifact(arts / n).tensors.values()} for n in ("plain", "packed")}
    assert Artifact(arts / "plain").tensors["lm_head.weight"]["kind"] == "packed"
    assert all("rows" in k and "packed" in k for k in kinds.values()), kinds
    metrics = Metrics()
    with single_thread():
        rt = build_runtime(ServeConfig(artifacts=arts, base=str(base_dir), dtype="float32", mode=mode,
                                       max_deltas=2, max_cpu_deltas=2), observer=metrics)
        with ServerThread(create_app(rt, metrics)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
            texts = {}
            for name in ("plain", "packed", "base"):
                for p in PROMPTS[:3]:
                    r = client.completions.create(model=name, prompt=p, max_tokens=10, temperature=0)
                    texts[name, p] = r.choices[0].text
                    if name != "base":
                        assert texts[name, p] == _expected(base_dir, arts, tok, name, p, 10), (mode, name, p)
            # the variants really differ from the base (otherwise the comparison proves little)
            assert any(texts["plain", p] != texts["base", p] for p in PROMPTS[:3])
