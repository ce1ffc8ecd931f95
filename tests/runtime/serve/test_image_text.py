"""Image-text checkpoints fine-tuned on text: LLaVA (a CLIP tower beside a Llama), Mllama (cross-attention
layers a text-only forward skips) and Qwen2.5-VL (multimodal RoPE).

They load as their image-text class, which holds the whole checkpoint (transformers maps Mllama's
config to a causal LM that holds the language model only, and LLaVA's and Qwen2.5-VL's to none). A
text fine-tune leaves the vision tower as it was: compress stores it as unchanged, and the engine
serves the variant's text, alone and in one batch with base rows, exactly as the merged model's
``generate`` does. A processor's chat template that reads message content only as typed parts gets
the message's text as a part (given a string it would render nothing for it).
"""

from __future__ import annotations

import json

import pytest
import torch
from _factories import calib_file, finetune, lora_adapter, save_model, tiny_model
from _serving import ServedSet, char_greedy, engine_texts, running_server, single_thread

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.demo.pair import build_char_tokenizer
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import causal_lm_class, load_causal_lm
from deltazip.runtime.serve.chat_content import as_template_reads
from deltazip.runtime.serve.engine import Engine, EngineConfig, ServedVariant
from deltazip.runtime.serve.model import DeltaModel
from deltazip.runtime.serve.variant_sources import discover_variants

IDS = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)  # the demo's character tokenizer
PROMPTS = ["alpha beta", "zip model tune"]
VISION = ("vision_tower.", "vision_model.", "visual.", "multi_modal_projector.")
# A processor template in LLaVA's style: content is read as typed parts only.
PARTS_TEMPLATE = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}"
                  "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}<image>"
                  "{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
                  "{{ content['text'] + ' ' }}{% endfor %}{% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


@pytest.mark.parametrize("arch,cls", [("llava", "LlavaForConditionalGeneration"),
                                      ("mllama", "MllamaForConditionalGeneration"),
                                      ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
                                      ("llama", "LlamaForCausalLM")])
def test_the_loaded_class_holds_the_whole_checkpoint(arch, cls):
    from deltazip.models.model_walk import decoder_layers

    model = tiny_model(arch, **IDS)
    assert type(model).__name__ == cls == causal_lm_class(model.config).__name__
    if arch != "llama":
        assert any(n.startswith(("model.vision", "model.visual")) for n, _ in model.named_parameters())
        # the language model's layers, also where the vision tower has more blocks (Qwen2.5-VL: 3 > 2)
        assert decoder_layers(model)[0] == "model.language_model.layers"


def test_a_config_transformers_maps_to_no_generating_model_is_none():
    from transformers import CLIPVisionConfig

    assert causal_lm_class(CLIPVisionConfig()) is None


def _build(root, arch):
    tok = build_char_tokenizer()
    base_dir = save_model(tiny_model(arch, **IDS), root / "base", tokenizer=False)
    tok.save_pretrained(base_dir)
    ft = finetune(tiny_model(arch, **IDS), steps=30, seed=3)
    ft_dir = save_model(ft, root / "ft", tokenizer=False)
    tok.save_pretrained(ft_dir)
    cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=32, sparsity="none"), method="deltazip", nsamples=8,
                         seqlen=32, device="cpu")
    compress_delta(base_dir, ft_dir, str(calib_file(root / "calib", n=16)), root / "arts" / "ft", cfg)
    return base_dir, root / "arts", tok


@pytest.mark.parametrize("arch", ["llava", "mllama", "qwen2_5_vl"])
def test_a_text_finetune_keeps_the_vision_tower_and_serves_the_merged_output(tmp_path, arch):
    n = 8
    with single_thread():
        base_dir, arts, tok = _build(tmp_path, arch)
        art = Artifact(arts / "ft")
        vision = [e for name, e in art.entries().items() if any(v in name for v in VISION)]
        assert vision and all(e.kind == "same" for e in vision)  # the tower is stored as unchanged: no bytes
        assert any(e.kind == "packed" for e in art.entries().values())  # the language model's linears compressed
        ck = Checkpoint(base_dir)
        refs = {"ft": load_merged_model(art, ck), "base": load_causal_lm(base_dir, torch.float32)}
        want = {(m, p): char_greedy(refs[m], tok, p, n) for m in refs for p in PROMPTS}
        assert any(want["ft", p] != want["base", p] for p in PROMPTS)  # the fine-tune matters
        dm = DeltaModel(ck, discover_variants(arts), num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
        jobs = [(m, p) for p in PROMPTS for m in ("ft", "base")]
        assert engine_texts(dm, tok, jobs, n) == [want[j] for j in jobs]
        eng = Engine(dm, {"base": ServedVariant("base", tok, [1], None)}, "base", EngineConfig())
        try:  # images: read (Mllama's by its cross-attention layers)
            refused = eng.images_refused()
        finally:
            eng.shutdown()
        assert refused is None, refused


def test_a_template_reading_parts_gets_the_text_as_a_part():
    tok = build_char_tokenizer()
    msgs = [{"role": "user", "content": "zip the model"}]
    parts = as_template_reads(tok, PARTS_TEMPLATE, msgs, add_generation_prompt=True)
    assert parts == [{"role": "user", "content": [{"type": "text", "text": "zip the model"}]}]
    assert "zip the model" in tok.apply_chat_template(parts, chat_template=PARTS_TEMPLATE, tokenize=False,
                                                      add_generation_prompt=True)
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert as_template_reads(tok, plain, msgs, add_generation_prompt=True) is msgs  # strings kept as strings


def test_a_processor_chat_template_serves_the_message_text(tmp_path):
    """An image-text checkpoint whose only chat template is its processor's ``chat_template.json``, in
    LLaVA's parts-only style: the server reads it, renders the user's text, and answers what the merged
    model's ``generate`` gives for that prompt."""
    from openai import OpenAI

    with single_thread():
        base_dir, arts, tok = _build(tmp_path, "llava")
    assert not tok.chat_template
    (base_dir / "chat_template.json").write_text(json.dumps({"chat_template": PARTS_TEMPLATE}))
    served = ServedSet(tmp_path, base_dir, arts)
    messages = [{"role": "user", "content": "zip the model"}]
    ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "zip the model"}]}],
                                  chat_template=PARTS_TEMPLATE, add_generation_prompt=True, tokenize=True)
    ids = tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert tok.decode(ids) == "USER: zip the model ASSISTANT:"
    with running_server(served, base=str(base_dir), max_num_seqs=4) as srv:
        import httpx

        r = httpx.post(f"{srv.url}/tokenize", json={"model": "ft", "messages": messages}, timeout=60)
        assert r.status_code == 200 and tuple(r.json()["tokens"]) == ids
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="x")
        got = client.chat.completions.create(model="ft", messages=messages, max_tokens=8, temperature=0)
    ref = load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir))
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=8, do_sample=False, pad_token_id=2, eos_token_id=1)
    assert got.choices[0].message.content == tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_a_broken_processor_chat_template_is_one_line(tmp_path):
    from deltazip.formats.errors import InputError
    from deltazip.runtime.serve.model import load_tokenizer

    build_char_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "chat_template.json").write_text("{not json")
    with pytest.raises(InputError, match=r"chat_template.json: not a chat template file .*; fix or remove it"):
        load_tokenizer(tmp_path)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="memfd and abstract sockets")
def test_workers_map_an_image_text_base_saved_under_its_legacy_names(tmp_path):
    """LLaVA's checkpoint names are not its parameters' (``language_model.model.layers.0...`` for
    ``model.language_model.layers.0...``): workers building the model over the owner's mapped
    tensors place them through transformers' renaming, and answer what the merged model generates."""
    import httpx

    from deltazip.runtime.cluster.workers import WorkerPool
    from deltazip.runtime.serve.assembly import ServeConfig

    with single_thread():
        base_dir, arts, tok = _build(tmp_path, "llava")
    assert any(n.startswith("language_model.") for n in Checkpoint(base_dir).names)
    cfg = ServeConfig(artifacts=arts, base=str(base_dir), max_deltas=2, max_cpu_deltas=2, cpu_threads=1, port=0)
    with WorkerPool(cfg, workers=2, env={"OMP_NUM_THREADS": "1"}, restart_backoff=0.2) as pool:
        h = pool.health()
        assert h["workers_ready"] == 2 and all(w["weights"] == "mapped" for w in h["workers"])
        got = [httpx.post(pool.url + "/v1/completions", timeout=120,
                          json={"model": "ft", "prompt": p, "max_tokens": 8, "temperature": 0}).json()
               for p in PROMPTS]
    ref = load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir))
    assert [r["choices"][0]["text"] for r in got] == [char_greedy(ref, tok, p, 8) for p in PROMPTS]


def test_the_merged_checkpoint_keeps_the_processor_files(tmp_path):
    """The processor's files travel with the artifact (by reference when the base has the same), so
    ``deltazip merge`` writes a checkpoint that still reads images and chats with its template."""
    from deltazip.compress.merge import merge_to_dir

    with single_thread():
        base_dir, arts, _ = _build(tmp_path, "llava")
    pre = json.dumps({"image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 28, "width": 28}})
    (base_dir / "preprocessor_config.json").write_text(pre)
    (base_dir / "chat_template.json").write_text(json.dumps({"chat_template": PARTS_TEMPLATE}))
    ft_dir = tmp_path / "ft"
    for f in ("preprocessor_config.json", "chat_template.json"):
        (ft_dir / f).write_bytes((base_dir / f).read_bytes())
    (ft_dir / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor"}))
    cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=32, sparsity="none"), method="rtn", device="cpu")
    compress_delta(base_dir, ft_dir, None, tmp_path / "art2", cfg)
    out = merge_to_dir(Artifact(tmp_path / "art2"), Checkpoint(base_dir), tmp_path / "merged")
    for f in ("preprocessor_config.json", "chat_template.json", "processor_config.json"):
        assert (out / f).read_bytes() == (ft_dir / f).read_bytes(), f


def _adapter(base_dir, out, seed: int, legacy: bool):
    """A PEFT LoRA adapter on the language model's q/v projections (random non-zero factors). With
    ``legacy``, its keys are renamed to the layout an adapter trained under transformers 4.x has
    (``base_model.model.language_model.model.layers.0...``), as the checkpoint itself is saved."""
    from safetensors.torch import load_file, save_file

    pm = lora_adapter(load_causal_lm(base_dir, torch.float32), out, seed,
                      target_modules=r".*language_model.*\.(q_proj|v_proj)")
    if legacy:
        f = out / "adapter_model.safetensors"
        tensors = load_file(f)
        save_file({k.replace("base_model.model.model.language_model.", "base_model.model.language_model.model."): v
                   for k, v in tensors.items()}, str(f))
    return pm.merge_and_unload().eval()


def test_lora_adapters_in_either_naming_serve_beside_the_artifact(tmp_path):
    """LoRA adapters of an image-text base, one named as transformers 5 names the modules, one in the
    older layout (which its regex ``target_modules`` was written against): both serve, in one batch with
    the artifact and base rows, and each answers what PEFT's merged model generates."""
    n = 8
    with single_thread():
        base_dir, arts, tok = _build(tmp_path, "llava")
        refs = {"lora-new": _adapter(base_dir, arts / "lora-new", 1, legacy=False),
                "lora-old": _adapter(base_dir, arts / "lora-old", 2, legacy=True)}
        assert any(k.startswith("base_model.model.language_model.model.")
                   for k in __import__("safetensors").safe_open(arts / "lora-old" / "adapter_model.safetensors",
                                                                 "pt").keys())
        ck = Checkpoint(base_dir)
        refs["ft"] = load_merged_model(Artifact(arts / "ft"), ck)
        refs["base"] = load_causal_lm(base_dir, torch.float32)
        dm = DeltaModel(ck, discover_variants(arts), num_slots=4, device=torch.device("cpu"), dtype=torch.float32)
        jobs = [(m, p) for p in PROMPTS for m in ("lora-old", "ft", "lora-new", "base")]
        want = [char_greedy(refs[m], tok, p, n) for m, p in jobs]
        assert want[0] != want[3] and want[2] != want[3]  # the adapters matter
        assert engine_texts(dm, tok, jobs, n) == want


@pytest.mark.parametrize("arch", ["llava", "mistral3", "qwen2_vl", "qwen2_5_vl"])
def test_tensor_parallel_shards_the_language_model_of_an_image_text_base(tmp_path, arch):
    """``--tensor-parallel 2`` over LLaVA, Mistral 3, Qwen2-VL and Qwen2.5-VL (Llama, Mistral and Qwen2 language
    models; Mistral 3's Pixtral tower has ``o_proj`` and ``down_proj`` of its own, Qwen2.5-VL's more
    blocks than its decoder has layers): the decoder layers' linears are
    split over the ranks, the vision tower stays whole, and a batch of artifact and base rows gives
    the single-process model's logits (fp32, summed in another order)."""
    from deltazip.runtime.cluster.tp_group import start_tensor_parallel
    from deltazip.runtime.serve.model_runner import prefill_logits

    with single_thread():
        base_dir, arts, tok = _build(tmp_path, arch)
        variants, ck = discover_variants(arts), Checkpoint(base_dir)
        ref = DeltaModel(ck, variants, 2, torch.device("cpu"), torch.float32)
        tp = start_tensor_parallel(ck, variants, 2, torch.device("cpu"), torch.float32, 2)
        try:
            for m in (ref, tp):
                m.write_slot(0, "ft", m.load_host("ft"))
            tokens = [tok(p)["input_ids"] for p in PROMPTS] * 2
            slots = [0, -1, -1, 0]
            want, got = prefill_logits(ref, slots, tokens), prefill_logits(tp, slots, tokens)
            shapes = {n: tuple(p.shape) for n, p in tp.model.named_parameters()}
        finally:
            tp.close()
    assert (got - want).abs().max().item() < 1e-4 and torch.equal(got.argmax(-1), want.argmax(-1))
    full = {n: tuple(p.shape) for n, p in ref.model.named_parameters()}
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert shapes[q] == (full[q][0] // 2, full[q][1])  # the language model's linears are split
    vision = [n for n in full if any(v in n for v in VISION) and len(full[n]) == 2]
    assert vision and all(shapes[n] == full[n] for n in vision)  # the tower is whole
