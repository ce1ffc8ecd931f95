"""Attention variants in the serving engine: ALiBi (Falcon ``alibi=True``, BLOOM, MPT), sliding windows
and soft-capping (Gemma 2), mixed sliding/full layers (Gemma 3's default layer pattern), one window on
every layer (Mistral), layers reusing earlier layers' keys and values (Gemma 4), linear attention
layers with a state per sequence (Qwen3.5), chunked layers and position-scaled queries on layers without rope (Llama 4, whose
experts, run over every token scaled by its routing weight, are served in delta mode too).

Per family: a tiny base built from a transformers config (a small ``sliding_window`` or attention chunk
where there is one), a full fine-tune served as a plain checkpoint and a compressed artifact of another fine-tune.
Every model's greedy output through the engine (delta and swap mode; all models' prompts in one
mixed batch, prompts + completions longer than the window) equals ``generate`` of the model it
stands for; ``deltazip eval --perplexity`` equals the merged model's perplexity.
"""

from __future__ import annotations

import json
import math
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from _cli import run_cli
from _factories import calib_file, perturb
from _serving import single_thread
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import InputError
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
from deltazip.runtime.serve.engine import FinishEvent, SamplingParams, TokenEvent

WINDOW = 6
GEMMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, sliding_window=WINDOW)
# Larger initial weights for the ALiBi families: at the default 0.02 their greedy outputs are one
# repeated token whatever the fine-tune, which would prove little.
FAMILIES = {
    "falcon-alibi": ("falcon", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=True,
                                    new_decoder_architecture=False, multi_query=False, parallel_attn=True, bias=True,
                                    max_position_embeddings=128, initializer_range=0.2)),
    "bloom": ("bloom", dict(hidden_size=64, n_head=4, n_layer=2, initializer_range=0.2)),
    "mpt": ("mpt", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128, expansion_ratio=2, initializer_range=0.2)),
    # soft-capped attention scores and logits (caps small enough to bite on a tiny model's scores);
    # layers alternate sliding / full
    "gemma2": ("gemma2", dict(GEMMA, num_hidden_layers=2, attn_logit_softcapping=0.005, final_logit_softcapping=0.2)),
    # the default layer pattern: five sliding-window layers, then a full one
    "gemma3": ("gemma3_text", dict(GEMMA, num_hidden_layers=6)),
    # Gemma 4's edge form: per-layer inputs, wider global layers, and the last two layers reuse the keys
    # and values of the last earlier layer of their type (they compute the kept logits' queries only)
    "gemma4": ("gemma4_text", dict(GEMMA, num_hidden_layers=4, global_head_dim=32, num_kv_shared_layers=2,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   hidden_size_per_layer_input=32, vocab_size_per_layer_input=128)),
    # Llama 4: a chunked-attention layer (rope), then a full one without rope whose queries are
    # temperature-tuned by position (floor_scale small enough to bite); dense-routed MoE experts
    "llama4": ("llama4_text", dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128,
                                   num_local_experts=4, num_experts_per_tok=1, no_rope_layers=[1, 0],
                                   attention_chunk_size=WINDOW, floor_scale=4, attn_scale=0.5)),
    # Qwen3.5: gated-delta-rule linear attention layers (a state per sequence) beside a full attention layer;
    # its fine-tunes move the recurrent layers' convolution, decay and step size too
    "qwen3_5": ("qwen3_5_text", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, num_hidden_layers=3, max_position_embeddings=128,
                                     layer_types=["linear_attention", "full_attention", "linear_attention"],
                                     linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                     linear_value_head_dim=16)),
    # one window on every layer, no layer_types
    "mistral": ("mistral", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=2, max_position_embeddings=128, sliding_window=WINDOW)),
}
# The demo's character tokenizer (decodes by concatenation): <s>=0, </s>=1, <pad>=2.
IDS = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
PROMPTS = ["zip model", "beta", "12 + 345 = 357"]  # with <s>: 10, 5 and 15 tokens
MAX_TOKENS = 12


def tiny(model_type: str, cfg: dict, seed: int = 0):
    config = AutoConfig.for_model(model_type, **cfg, **IDS)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save(model, path):
    from deltazip.demo.pair import build_char_tokenizer

    model.save_pretrained(path, safe_serialization=True)
    build_char_tokenizer(path)
    return path


class Family:
    """Base, ``ft`` (a full checkpoint: every tensor but norms and, for Gemma, the embedding moved) and
    ``art`` (a 4-bit RTN artifact of another such fine-tune) under ``served``; reference models."""

    def __init__(self, root, name):
        model_type, cfg = FAMILIES[name]
        self.name, self.root = name, root
        # Gemma's embeddings are scaled in forward (the decoupled runtime serves them only when unchanged).
        skip = ("norm", "embed_tokens") if model_type.startswith("gemma") else ("norm",)
        self.base_dir = save(tiny(model_type, cfg), root / "base")
        self.served = root / "served"
        save(perturb(tiny(model_type, cfg), scale=0.5, seed=3, skip=skip), self.served / "ft")
        ft2 = save(perturb(tiny(model_type, cfg), scale=0.5, seed=4, skip=skip), root / "ft2")
        cc = CompressConfig(scheme=DeltaScheme(bits=4, sparsity="none", group_size=32), method="rtn",
                            nsamples=4, seqlen=16,
                            device="cpu")
        compress_delta(self.base_dir, ft2, str(calib_file(root / "calib")), self.served / "art", cc)
        self.refs = {
            "base": AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32).eval(),
            "ft": AutoModelForCausalLM.from_pretrained(self.served / "ft", dtype=torch.float32).eval(),
            "art": load_merged_model(Artifact(self.served / "art"), Checkpoint(self.base_dir)).eval(),
        }
        self.tok = AutoTokenizer.from_pretrained(self.base_dir)

    def expected(self, model: str, prompt: str) -> tuple[list[int], str]:
        """Greedy ``generate`` of the model ``model`` stands for: completion ids (up to EOS) and text."""
        ids = torch.tensor([self.tok(prompt)["input_ids"]])
        with torch.no_grad():
            out = self.refs[model].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                            do_sample=False, pad_token_id=2)
        got = out[0, ids.shape[1]:].tolist()
        got = got[:got.index(1)] if 1 in got else got  # the engine does not emit the EOS token
        return got, self.tok.decode(got, skip_special_tokens=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    with single_thread():
        yield Family(tmp_path_factory.mktemp(request.param), request.param)


def serve_all(fam: Family, mode: str, alone: bool) -> dict[tuple[str, int], tuple[list[int], FinishEvent]]:
    """Every model x prompt through the engine, all submitted before it starts (one mixed prefill
    batch, then mixed decode steps); or ``alone``: each model's longest prompt, one request at a time. Per request: the streamed
    token ids (the last one is reported in the finish event's text only) and the finish event."""
    rt = build_runtime(ServeConfig(artifacts=fam.served, base=str(fam.base_dir), dtype="float32", mode=mode,
                                   max_deltas=3, max_cpu_deltas=3))
    eng, base = rt.engine, rt.base_name
    lock, out, done = threading.Lock(), {}, {}

    def submit(m, i):
        key = (m, i)
        out[key], done[key] = ([], None), threading.Event()

        def sink(ev):
            with lock:
                if isinstance(ev, TokenEvent) and ev.token_id >= 0:
                    out[key][0].append(ev.token_id)
                elif isinstance(ev, FinishEvent):
                    out[key] = (out[key][0], ev)
                    done[key].set()

        eng.submit(base if m == "base" else m, fam.tok(PROMPTS[i])["input_ids"],
                   SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), sink)
        return done[key]

    # alone: the longest prompt of each model, one request at a time
    jobs = [(m, i) for m in ("base", "ft", "art") for i in ((len(PROMPTS) - 1,) if alone else range(len(PROMPTS)))]
    if not alone:
        for m, i in jobs:
            submit(m, i)
    eng.start()
    try:
        for m, i in jobs:
            assert (submit(m, i) if alone else done[m, i]).wait(120), "requests did not finish in time"
    finally:
        eng.shutdown()
    return out


@pytest.mark.parametrize("mode,alone", [("delta", False), ("swap", False), ("delta", True)],
                         ids=["delta-mixed", "swap-mixed", "delta-alone"])
def test_greedy_output_equals_generate(family, mode, alone):
    with single_thread():
        got = serve_all(family, mode, alone)
        for (m, i), (ids, fin) in got.items():
            want_ids, want_text = family.expected(m, PROMPTS[i])
            assert fin.reason in ("stop", "length"), fin.error
            # usage counts an ending EOS (vLLM's count); its text has none
            assert (fin.text, fin.completion_tokens) == (want_text, len(want_ids) + (fin.reason == "stop")), \
                (family.name, mode, m, i)
            assert ids == want_ids[:len(ids)] and len(ids) >= len(want_ids) - 1
    assert len(got) == (3 if alone else 9)
    assert max(fin.prompt_tokens + fin.completion_tokens for _, fin in got.values()) > 2 * WINDOW
    if not alone:  # the fine-tunes really differ from the base (otherwise equality proves little)
        texts = {k: fin.text for k, (_, fin) in got.items()}
        assert any(texts["ft", i] != texts["base", i] for i in range(len(PROMPTS)))
        assert any(texts["art", i] != texts["base", i] for i in range(len(PROMPTS)))


def test_engine_logits_equal_a_plain_forward(family):
    """Prefill of three prompts of different lengths, then decode steps with three different pasts,
    through the engine's cache (paged, or contiguous for the ALiBi models) and masks: every row's
    logits equal a plain forward of its sequence."""
    from deltazip.runtime.serve.kv_cache import BlockPool
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.model_runner import forward_step, new_kv_pool, new_seq_kv, prefill_logits

    with single_thread():
        dm = DeltaModel(Checkpoint(family.base_dir), [], 1, torch.device("cpu"), torch.float32)
        seqs = [family.tok(p)["input_ids"] for p in PROMPTS]
        pool = new_kv_pool(dm)
        assert isinstance(pool, BlockPool) == (family.name not in CONTIGUOUS)
        caches = [new_seq_kv(pool) for _ in seqs]
        got = [prefill_logits(dm, [-1] * 3, seqs, caches, pool, pad_id=2)]
        for step in range(WINDOW):
            nxt = [[4 + (5 * step + 7 * i) % 90] for i in range(3)]
            got.append(forward_step(dm, pool, caches, [-1] * 3, nxt, [c.length for c in caches], pad_id=2))
            for s, t in zip(seqs, nxt):
                s.append(t[0])
        ref = family.refs["base"]
        with torch.no_grad():
            for k, logits in enumerate(got):
                for i, s in enumerate(seqs):
                    want = ref(torch.tensor([s[: len(s) - WINDOW + k]])).logits[0, -1]
                    torch.testing.assert_close(logits[i], want, atol=1e-5, rtol=1e-4)


# Served on the contiguous cache: ALiBi models, and Qwen3.5, whose class takes no attention function
CONTIGUOUS = ("falcon-alibi", "bloom", "mpt", "qwen3_5")
WINDOWED = [n for n, (_, cfg) in FAMILIES.items() if cfg.get("sliding_window") or cfg.get("attention_chunk_size")]


@pytest.mark.parametrize("family", WINDOWED, indirect=True)
def test_sliding_window_and_softcap_are_in_force(family):
    """The reference outputs depend on what the engine must honour: the same weights with the window
    (or the soft-capping) removed give other logits on these prompts."""
    model_type, cfg = FAMILIES[family.name]
    ref = family.refs["base"]
    ids = torch.tensor([family.tok(PROMPTS[2])["input_ids"]])
    changes = [dict(sliding_window=128)] if "sliding_window" in cfg else []
    if model_type == "llama4_text":
        changes += [dict(attention_chunk_size=128), dict(attn_temperature_tuning=False)]
    if model_type == "gemma2":
        changes += [dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None)]
    with torch.no_grad():
        want = ref(ids).logits
        for change in changes:
            other = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**cfg, **change}, **IDS),
                                                     dtype=torch.float32, attn_implementation="eager").eval()
            other.load_state_dict(ref.state_dict())
            assert not torch.allclose(other(ids).logits, want, atol=1e-4), change


@pytest.mark.parametrize("family", WINDOWED, indirect=True)
def test_a_mask_without_the_window_is_refused_at_start_up(family, monkeypatch):
    """The start-up self-check compares the engine's way of running the model with a plain forward:
    an engine that ignored sliding windows would refuse the model in one line, not serve it wrong.
    The windowed families run the paged attention; both it and the contiguous path's masks are made
    to drop the window."""
    from deltazip.runtime.serve import masks
    from deltazip.runtime.serve.kv_cache import PagedStep
    from deltazip.runtime.serve.model import load_base_model

    real, real_blocked = masks.attention_masks_for, PagedStep.blocked

    def windowless(config, key_pos, query_pos, dtype):
        plain = SimpleNamespace(_attn_implementation=config._attn_implementation,
                                num_hidden_layers=config.num_hidden_layers)  # no window, no layer types
        return real(plain, key_pos, query_pos, dtype)

    monkeypatch.setattr(masks, "attention_masks_for", windowless)
    monkeypatch.setattr(PagedStep, "blocked", lambda self, span, window, chunk=None: real_blocked(self, span, None))
    with single_thread(), pytest.raises(InputError, match="other logits in the serving engine"):
        load_base_model(Checkpoint(family.base_dir), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_each_family_is_served_on_its_cache_path(family):
    """Classes with transformers' attention interface run the paged cache and attention (sliding
    windows and soft-capping included); the others (ALiBi models, Qwen3.5) keep the contiguous cache
    and masks."""
    from deltazip.runtime.serve.attention import is_paged
    from deltazip.runtime.serve.masks import uses_padding_mask_bias
    from deltazip.runtime.serve.model import load_base_model

    with single_thread():
        model = load_base_model(Checkpoint(family.base_dir), torch.float32, torch.device("cpu"))
    assert is_paged(model) == (family.name not in CONTIGUOUS)
    assert not is_paged(model) or not uses_padding_mask_bias(model.config)


def _direct_ppl(model, ids: torch.Tensor, window: int) -> float:
    n = ids.numel() // window
    with torch.no_grad():
        nll = [F.cross_entropy(model(w[None]).logits[0, :-1].float(), w[1:]).item()
               for w in ids[: n * window].view(n, window)]
    return math.exp(sum(nll) / n)


@pytest.mark.parametrize("family", ["bloom", "gemma2", "gemma3", "llama4", "qwen3_5"], indirect=True)  # ALiBi, soft-capped,
# mixed-window, chunked with MoE
def test_eval_perplexity_equals_the_merged_models(family, tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer

    text = " ".join(f"zip {i} model {i * 7 % 13} tune base" for i in range(12))
    (tmp_path / "ppl.txt").write_text(text)
    with single_thread():
        code, stdout, err = run_cli(capsys, monkeypatch, "eval", family.served / "art", "base", "--perplexity",
                                    tmp_path / "ppl.txt", "--ppl-window", "24", "--device", "cpu", "--json")
        assert code == 0, err
        got = json.loads(stdout)["perplexity"]
        ids = torch.tensor(AutoTokenizer.from_pretrained(family.base_dir)(text)["input_ids"])
        want_art = _direct_ppl(family.refs["art"], ids, 24)
        want_base = _direct_ppl(family.refs["base"], ids, 24)
    assert got["art"]["window"] == 24 and got["art"]["windows"] == ids.numel() // 24 >= 4
    assert got["art"]["perplexity"] == pytest.approx(want_art, rel=1e-5)
    assert got["base"]["perplexity"] == pytest.approx(want_base, rel=1e-5)
    assert abs(math.log(want_art) - math.log(want_base)) > 1e-3


def test_masks_per_layer_type_window_padding_and_dtype():
    """Key slot -1 is empty; a window of 3 lets position 4 see positions 2..4, chunks of 3 positions 3..4; eager masks are
    additive floats, SDPA masks booleans; ALiBi-from-padding-mask models get the 2-D mask."""
    from deltazip.runtime.serve.masks import attention_masks_for

    key, query = torch.tensor([[-1, 0, 1, 2, 3, 4]]), torch.tensor([[4, 2]])
    cfg = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    eager = attention_masks_for(SimpleNamespace(_attn_implementation="eager", **cfg), key, query, torch.float32)
    assert set(eager) == {"sliding_attention", "full_attention"} and eager["full_attention"].shape == (1, 1, 2, 6)
    assert (eager["full_attention"][0, 0] == 0).tolist() == [[False, True, True, True, True, True],
                                                              [False, True, True, True, False, False]]
    assert (eager["sliding_attention"][0, 0] == 0).tolist() == [[False, False, False, True, True, True],
                                                                 [False, True, True, True, False, False]]
    assert eager["full_attention"].min() == torch.finfo(torch.float32).min
    sdpa = attention_masks_for(SimpleNamespace(_attn_implementation="sdpa", **cfg), key, query, torch.float16)
    assert sdpa["sliding_attention"].dtype == torch.bool
    assert torch.equal(sdpa["sliding_attention"], eager["sliding_attention"] == 0)
    one_type = attention_masks_for(SimpleNamespace(_attn_implementation="sdpa", num_hidden_layers=2, sliding_window=3),
                                   key, query, torch.float32)  # Mistral-style: one window, no layer_types
    assert torch.equal(one_type, sdpa["sliding_attention"])
    chunked = attention_masks_for(SimpleNamespace(_attn_implementation="sdpa", num_hidden_layers=2, attention_chunk_size=3,
                                                  layer_types=["chunked_attention", "full_attention"]),
                                  key, query, torch.float32)  # Llama 4: chunks of 3 positions
    assert chunked["chunked_attention"][0, 0].tolist() == [[False, False, False, False, True, True],
                                                            [False, True, True, True, False, False]]
    assert torch.equal(chunked["full_attention"], sdpa["full_attention"])
    for alibi in (SimpleNamespace(model_type="bloom"), SimpleNamespace(model_type="falcon", alibi=True)):
        assert attention_masks_for(alibi, key, query, torch.float32).tolist() == [[0, 1, 1, 1, 1, 1]]


def test_unsupported_layer_types_are_refused_in_one_line(tmp_path):
    from _factories import tiny_model

    from deltazip.runtime.serve.model import load_base_model

    tiny_model("llama", layer_types=["full_attention", "indexed_attention"]).save_pretrained(tmp_path / "m")
    with pytest.raises(InputError, match="uses indexed_attention layers, which the serving engine does not run"):
        load_base_model(Checkpoint(tmp_path / "m"), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", ["falcon-alibi", "gemma3"], indirect=True)
@pytest.mark.parametrize("mode", ("delta", "swap"))
def test_http_completions_equal_generate(family, mode):
    """Over HTTP (the user's report: a healthy server whose every Falcon-ALiBi request failed with 500)."""
    import httpx

    from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

    metrics = Metrics()
    with single_thread():
        rt = build_runtime(ServeConfig(artifacts=family.served, base=str(family.base_dir), dtype="float32", mode=mode,
                                       max_deltas=2, max_cpu_deltas=3), observer=metrics)
        with ServerThread(create_app(rt, metrics)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
            assert http.get("/health").status_code == 200
            for model in (rt.base_name, "ft", "art"):
                r = http.post("/v1/completions", json={"model": model, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS,
                                                       "temperature": 0})
                assert r.status_code == 200, r.text
                want = family.expected("base" if model == rt.base_name else model, PROMPTS[2])[1]
                assert r.json()["choices"][0]["text"] == want, (mode, model)
