"""LoRA adapters on fused experts parameters (PEFT's ``target_parameters``, as GPT-OSS and Qwen3-MoE
are fine-tuned): served in delta mode beside base rows and in swap mode, both as PEFT computes, and
their files checked against the base in one line."""

from __future__ import annotations

import json

import pytest
import torch
from _factories import lora_adapter, save_model, tiny_model
from _serving import adapter_rows, peft_logits, single_thread, swap_logits

from deltazip.formats.errors import InputError
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.serve.lora_variant import linear_shapes, lora_base, read_lora_spec
from deltazip.runtime.serve.variant_sources import discover_variants

pytest.importorskip("peft")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _adapter(tmp_path, arch: str, vocab: dict | None = None, **config):
    """A tiny ``arch`` base (``vocab``: its token ids' config) and a PEFT adapter on its attention's
    ``q_proj`` and every layer's experts parameters; the base's directory and the PEFT model (eval mode)."""
    base = save_model(tiny_model(arch, **(vocab or {})), tmp_path / "base")
    pm = lora_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / "lora", 2,
                      **{"target_modules": ["q_proj"], "target_parameters": EXPERTS, **config})
    return base, pm


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "qwen3_moe"])
def test_experts_lora_rows_and_swap_give_pefts_logits(tmp_path, arch):
    """Mixtral and Qwen3-MoE store experts ``[E, out, in]``, GPT-OSS ``[E, in, out]`` (with biases, its
    gate and up columns interleaved): each adapted expert weight gets ``scale · B_e A_e`` from PEFT's
    ``[r·E, in]`` / ``[out, r·E]`` factors, beside the ``q_proj`` LoRA. The adapter's rows equal PEFT's
    logits and base rows the base's, in one batch; swap mode merges the same."""
    with single_thread():
        base, pm = _adapter(tmp_path, arch)
        (v,) = discover_variants(tmp_path / "arts")
        ck = Checkpoint(base)
        ids = torch.randint(4, 51, (2, 24), generator=torch.Generator().manual_seed(0))
        want, plain = peft_logits(pm, ids)
        assert (want - plain).abs().max() > 0.05  # the adapter matters
        plain_model = load_causal_lm(base, torch.float32)
        spec = read_lora_spec(v.path, linear_shapes(plain_model), arch, None, lora_base(plain_model))
        assert len(spec.params) == 2 * len(pm.base_model.model.model.layers)
        got = adapter_rows(ck, v, ids)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(swap_logits(ck, v, ids), want, rtol=1e-4, atol=1e-4)


def test_experts_lora_files_that_do_not_fit_the_base_are_refused_in_one_line(tmp_path):
    """An experts factor of the wrong shape (another base), factors nested deeper than the parameters
    ``target_parameters`` names, and a targeted experts bias: each named in one line."""
    with single_thread():
        base, _ = _adapter(tmp_path, "mixtral")
        model = load_causal_lm(base, torch.float32)
    lin, base, path = linear_shapes(model), lora_base(model), tmp_path / "arts" / "lora"
    table = base.experts
    read_lora_spec(path, lin, "MixtralForCausalLM", None, base)
    cfg_file = path / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "target_parameters": ["mlp.experts.down_proj"]}))
    with pytest.raises(InputError, match=r"holds factors under model\.layers\.0\.mlp\.experts\.base_layer, but "
                                         r"target_parameters \['mlp\.experts\.down_proj'\] names 1 parameter") as e:
        read_lora_spec(path, lin, "MixtralForCausalLM", None, base)
    assert "\n" not in str(e.value)
    cfg_file.write_text(json.dumps(cfg))
    wide = {**table, "model.layers.0.mlp.experts": table["model.layers.0.mlp.experts"]._replace(
        params=[(p, (s[0], s[1], s[2] * 2)) for p, s in table["model.layers.0.mlp.experts"].params])}
    with pytest.raises(InputError, match=r"model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj has lora_A .* the base "
                                         r"parameter is .*; the adapter belongs to another base model"):
        read_lora_spec(path, lin, "MixtralForCausalLM", None, base._replace(experts=wide))


def test_an_experts_lora_served_over_http_answers_as_pefts_merged_model(tmp_path):
    """``deltazip serve`` on a real loopback port, the OpenAI client: the adapter's completion is the
    text PEFT's merged model generates greedily, the base's the base's."""
    openai = pytest.importorskip("openai")
    from deltazip.demo.pair import build_char_tokenizer
    from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
    from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

    prompt, n = "zip model tune", 8
    with single_thread():
        base, pm = _adapter(tmp_path, "qwen3_moe", dict(bos_token_id=0, eos_token_id=1, pad_token_id=2, vocab_size=128))
        tok = build_char_tokenizer()  # (one character per token: a completion's text is its tokens')
        tok.save_pretrained(base)
        ids = torch.tensor([tok(prompt)["input_ids"]])
        want = {}
        with torch.no_grad():
            for name, model in (("lora", pm.merge_and_unload()), ("base", load_causal_lm(base, torch.float32))):
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
                want[name] = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert want["lora"] != want["base"]
        metrics = Metrics()
        rt = build_runtime(ServeConfig(artifacts=tmp_path / "arts", base=str(base), device="cpu"), observer=metrics)
        with ServerThread(create_app(rt, metrics)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
            for name in ("lora", "base"):
                r = client.completions.create(model=name, prompt=prompt, max_tokens=n, temperature=0)
                assert r.choices[0].text == want[name], name


def test_experts_lora_slots_hold_factors_and_adapters_of_two_ranks_share_a_batch(tmp_path):
    """Two adapters on Mixtral's experts alone, rank 2 then rank 6 (the factor tables grow when the
    second is written), and a base row in one batch: each row gives its own PEFT model's logits. A slot
    holds each adapted parameter's factors, ``E · r · (in + out)`` values, not a copy of the experts."""
    from deltazip.runtime.serve.model import DeltaModel

    with single_thread():
        base = save_model(tiny_model("mixtral"), tmp_path / "base")
        pms = {name: lora_adapter(load_causal_lm(base, torch.float32), tmp_path / "arts" / name, seed, r=r,
                                  lora_alpha=2 * r, target_modules=None, target_parameters=EXPERTS)
               for name, seed, r in (("low", 2, 2), ("high", 3, 6))}
        variants = {v.name: v for v in discover_variants(tmp_path / "arts")}
        ids = torch.randint(4, 51, (3, 20), generator=torch.Generator().manual_seed(1))
        model = DeltaModel(Checkpoint(base), list(variants.values()), num_slots=3, device=torch.device("cpu"),
                           dtype=torch.float32)
        for slot, name in enumerate(("low", "high")):
            model.write_slot(slot, name, model.load_host(name))
        model.ctx.bind([0, 1, -1], "cpu")
        try:
            with torch.no_grad():
                got = model.model(input_ids=ids).logits
        finally:
            model.ctx.unbind()
        want = {name: peft_logits(pm, ids) for name, pm in pms.items()}
    torch.testing.assert_close(got[0], want["low"][0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want["high"][0][1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[2], want["low"][1][2], rtol=1e-5, atol=1e-5)
    assert (want["low"][0] - want["high"][0]).abs().max() > 0.05
    experts = [m for m in model.modules.values() if type(m).__name__ == "DeltaExperts"]
    for slot, r in ((0, 2), (1, 6)):
        held = sum(m.resident_bytes(slot) for m in experts)
        per = [r * (m.weight_of(p).shape[1] + m.weight_of(p).shape[2]) * m.num_experts * 4
               for m in experts for p in ("gate_up_proj", "down_proj")]
        dense = sum(m.weight_of(p).numel() * 4 for m in experts for p in ("gate_up_proj", "down_proj"))
        assert held == sum(per) == model.slot_bytes(slot) <= model.resident_estimate(("low", "high")[slot])
        assert held < dense / 4
