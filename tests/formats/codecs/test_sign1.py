"""The ``sign1`` scheme (1-bit sign deltas, one scale per row), added as one codec module: it
compresses, verifies, inspects, merges and serves on CPU through the registry alone, and no other
file of the project names it."""

import subprocess
import threading
from pathlib import Path

import pytest
import torch
from _cli import run_cli
from _factories import perturb, save_model, tiny_model
from _serving import single_thread

from deltazip.compress.config import CompressConfig, scheme_from_options
from deltazip.compress.merge import load_merged_model, reconstruct_state_dict
from deltazip.compress.pipeline import compress_delta
from deltazip.formats import codecs
from deltazip.formats.artifact import Artifact
from deltazip.models.checkpoint import Checkpoint
from deltazip.runtime.serve.assembly import ServeConfig, build_engine
from deltazip.runtime.serve.engine import FinishEvent, SamplingParams

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["alpha beta", "zip model tune", "12 + 345 ="]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from deltazip.demo.pair import build_char_tokenizer

    tmp = tmp_path_factory.mktemp("sign1")
    ids = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    with single_thread():
        # the demo's character tokenizer decodes by concatenation: engine text == generate's decode
        base = save_model(tiny_model("llama", **ids), tmp / "base", tokenizer=False)
        ft = save_model(perturb(tiny_model("llama", **ids), scale=0.3), tmp / "ft", tokenizer=False)
        for d in (base, ft):
            build_char_tokenizer(d)
        art = tmp / "arts" / "signs"
        cfg = CompressConfig(scheme=scheme_from_options(1, "none", -1, True, "sign1"), method="rtn", device="cpu")
        compress_delta(base, ft, None, art, cfg)
    return tmp, base, ft, art


def test_a_scheme_is_one_module_that_nothing_else_names():
    assert codecs.codec_file("sign1") == ROOT / "formats" / "codecs" / "sign1.py"
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    naming = {f for f in tracked if f.endswith((".py", ".toml", ".cfg")) and "sign1" in (ROOT / f).read_text()}
    assert naming == {"formats/codecs/sign1.py", "tests/formats/codecs/test_sign1.py"}


def test_the_reference_is_the_best_scale_times_the_signs():
    codec = codecs.get("sign1")
    rows = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    parts, values = codec.encode(rows, scheme_from_options(1, "none", -1, True, "sign1"))
    assert parts["signs"].shape == (6, 2) and parts["scales"].dtype == torch.float16
    assert torch.equal(values.sign(), torch.where(rows >= 0, 1.0, -1.0))
    assert torch.allclose(values.abs()[:, 0], rows.abs().mean(1), rtol=1e-3)
    # mean |Δ| is the least-squares scale of sign(Δ): a 5% larger or smaller one is worse
    err = float((rows - values).norm())
    assert err < float((rows - 1.05 * values).norm()) and err < float((rows - 0.95 * values).norm())
    entry = codecs.Entry("w", {"kind": "sign1", "shape": [6, 40], "dtype": "float32"})
    assert codec.layout_problems(entry, parts) == []
    bad = dict(parts, signs=parts["signs"].clone())
    bad["signs"][0, -1] |= 1 << 30  # past the 40th column: a padding bit
    assert codec.layout_problems(entry, bad) == ["signs: padding bits not zero"]


def test_compressed_linears_are_sign1_entries_of_one_bit_and_verify(made, capsys, monkeypatch):
    tmp, base, ft, art = made
    a = Artifact(art)
    linears = [e for e in a.entries().values() if e.kind == "sign1"]
    assert len(linears) == 2 * 7 + 1  # two layers of q, k, v, o, gate, up, down, and the untied lm_head
    assert all(e.is_matrix and e.additive and not e.kernel_ready for e in linears)
    for e in linears:
        rows, cols = e.shape
        assert e.scheme.to_json() == {"version": 1, "bits": 1, "group_size": -1, "sparsity": "none", "sym": True,
                                      "kind": "sign1"}
        assert e.stored_bytes == rows * (cols // 8) + rows * 2  # one bit per weight, one fp16 scale per row
    code, out, err = run_cli(capsys, monkeypatch, "verify", art, "--base", base, "--json")
    assert code == 0 and '"ok": true' in out, err
    code, out, err = run_cli(capsys, monkeypatch, "inspect", art, "--json")
    assert code == 0 and '"sign1"' in out, err


def test_merged_sign_deltas_move_the_base_toward_the_fine_tune(made, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    tmp, base, ft, art = made
    a, ck = Artifact(art), Checkpoint(base)
    sd, fts = reconstruct_state_dict(a, ck), Checkpoint(ft)
    for e in (e for e in a.entries().values() if e.kind == "sign1"):
        delta = fts.get(e.name).float() - ck.get(e.name).float()
        assert float((sd[e.name].float() - fts.get(e.name).float()).norm()) < 0.9 * float(delta.norm()), e.name
    code, _, err = run_cli(capsys, monkeypatch, "merge", art, "--base", base, "--out", tmp / "merged")
    assert code == 0, err
    merged = AutoModelForCausalLM.from_pretrained(tmp / "merged").state_dict()
    assert all(torch.equal(merged[n], t) for n, t in sd.items() if n in merged)


def test_served_greedy_outputs_equal_the_merged_model(made):
    """Served as a dense delta (no kernel reads sign parts): each row's output equals the merged
    model's greedy ``generate``."""
    from transformers import AutoModelForCausalLM

    tmp, base, ft, art = made
    with single_thread():
        merged = load_merged_model(Artifact(art), Checkpoint(base))
        eng = build_engine(ServeConfig(art.parent, base=str(base), device="cpu", dtype="float32", max_deltas=1))
        tok = eng.served["signs"].encoder
        done: dict[str, FinishEvent] = {}
        finished = threading.Semaphore(0)

        def sink(p):
            def fn(ev):
                if isinstance(ev, FinishEvent):
                    done[p] = ev
                    finished.release()
            return fn

        for p in PROMPTS:
            eng.submit("signs", tok(p)["input_ids"], SamplingParams(max_tokens=8, temperature=0.0), sink(p))
        eng.start()
        try:
            assert all(finished.acquire(timeout=120) for _ in PROMPTS), "requests did not finish"
        finally:
            eng.shutdown()
        base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        differs = 0
        for p in PROMPTS:
            want, plain = (_greedy(m, tok, p) for m in (merged, base_model))
            assert done[p].reason in ("stop", "length"), done[p]
            assert done[p].text == want, p
            differs += want != plain
        assert differs, "the sign deltas change no output: the test would not see them ignored"


def _greedy(model, tok, prompt: str, n: int = 8) -> str:
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
