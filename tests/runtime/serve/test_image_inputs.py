"""Prompts with images, served: the engine gives what the merged model's own forward gives.

The reference is transformers' ``generate`` of the merged checkpoint with the processor's tensors
(``pixel_values`` and the rest), greedy. The served side reads the same images through the engine:
the model's forward up to its language model once per prompt, then ordinary batched steps with the
image rows put in place, mixed with text rows and other variants. Covered: LLaVA (a CLIP tower and a
projector; a variant that changed the projector reads images with its own), Gemma 3 (an image's tokens
see each other both ways; prompts chunked around the image) and Qwen2.5-VL (positions of its own in
three sections, kept after the prompt), and over HTTP with the OpenAI client, data: and http URLs.
"""

from __future__ import annotations

import base64
import importlib.util

import pytest
import torch
from _images import (
    BOI,
    EOI,
    IMAGE,
    N,
    QwenProcessor,
    build_variant,
    gemma3n_processor,
    gemma4_processor,
    generate,
    llava_processor,
    mllama_processor,
    needs_torchvision,
    picture,
    png,
    prompt,
    qwen_vl_processor,
    same,
    served_matches_merged,
    template,
    tokenizer,
)
from _serving import ServedSet, engine_runs, running_server, single_thread

from deltazip.compress.merge import load_merged_model
from deltazip.formats.artifact import Artifact
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.serve.model import DeltaModel
from deltazip.runtime.serve.prompt_media import PromptInputs, PromptMedia
from deltazip.runtime.serve.variant_sources import discover_variants


def _gemma3_processor():
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    tok = tokenizer(template(BOI))
    tok._set_model_specific_special_tokens(special_tokens={"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI})
    return Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 28, "width": 28}), tokenizer=tok,
                           image_seq_length=4)


class _Gemma4Processor:
    """What Gemma 4's processor gives (its class also builds a video processor, which needs
    torchvision): the image processor's patches and their positions, each image's placeholder
    expanded to its soft tokens between the begin and end of image tokens, marked 1 in
    ``mm_token_type_ids``."""

    def __init__(self):
        from transformers import Gemma4ImageProcessorPil

        self.tokenizer = tokenizer(template(IMAGE))
        self.images = Gemma4ImageProcessorPil(patch_size=14, pooling_kernel_size=2, max_soft_tokens=70)

    def __call__(self, text, images, return_tensors, add_special_tokens):
        out = dict(self.images(images=images, return_tensors="pt"))
        for n in out.pop("num_soft_tokens_per_image"):
            text = [t.replace(IMAGE, BOI + "<|p|>" * int(n) + EOI, 1) for t in text]
        text = [t.replace("<|p|>", IMAGE) for t in text]
        enc = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        kinds = (enc["input_ids"] == self.tokenizer.convert_tokens_to_ids(IMAGE)).long()
        return {**enc, **out, "mm_token_type_ids": kinds}


def test_llava_images_in_a_mixed_batch_give_the_merged_output(tmp_path):
    served_matches_merged(tmp_path, "llava", llava_processor(tokenizer()), images_per_prompt=1)


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_images_served_in_bf16_give_the_merged_output_in_bf16(tmp_path, arch):
    """bf16, the dtype GPUs serve in: the vision tower, the image rows and the batched decoder run in
    bf16 as the merged model's ``generate`` does; texts equal, log probabilities within 0.05 (rows
    padded and batched with others round differently)."""
    processor = llava_processor(tokenizer()) if arch == "llava" else QwenProcessor()
    served_matches_merged(tmp_path, arch, processor, images_per_prompt=2, vision_scale=0.5, dtype=torch.bfloat16,
                           tol=0.05)


def test_a_variant_that_changed_the_projector_reads_images_with_its_own(tmp_path):
    refs, prompts, got = served_matches_merged(tmp_path, "llava", llava_processor(tokenizer()),
                                                images_per_prompt=2, vision_scale=0.5)
    art = Artifact(tmp_path / "arts" / "ft")
    assert any("multi_modal_projector" in n and e.kind != "same" for n, e in art.entries().items())
    # Read with the base's projector, the same prompts score otherwise: the served numbers are the variant's.
    base = load_causal_lm(tmp_path / "base", torch.float32).state_dict()
    refs["ft"].load_state_dict({k: v for k, v in base.items() if "multi_modal_projector" in k}, strict=False)
    assert not same(got[0], generate(refs["ft"], *prompts[0]), tol=1e-3)


@pytest.mark.parametrize("budget", [2048, 10])
def test_gemma3_images_see_themselves_both_ways(tmp_path, budget):
    """Gemma 3: an image's four tokens attend to each other both ways (the model's own mask), through
    sliding-window layers; with a budget of 10 tokens per step the prompts run in chunks that end
    before an image rather than inside it."""
    served_matches_merged(tmp_path, "gemma3_vl", _gemma3_processor(), images_per_prompt=2, max_batch_tokens=budget)


def test_qwen2_5_vl_images_keep_their_own_positions(tmp_path):
    """Qwen2.5-VL: the images' tokens take positions of their own in three sections, and every token
    after them is offset (``rope_delta``), generated ones included."""
    served_matches_merged(tmp_path, "qwen2_5_vl", QwenProcessor(), images_per_prompt=2)


@pytest.mark.parametrize(("arch", "budget"), [("qwen3_vl", 2048), ("qwen3_vl", 12), ("qwen3_vl_moe", 12)])
def test_qwen3_vl_images_feed_their_deepstack_features_to_early_layers(tmp_path, arch, budget):
    """Qwen3-VL: beside its image embeddings and three-section positions, features of two vision
    layers are added to the outputs of the first two decoder layers at the images' tokens. The
    variant changed its mergers (DeepStack's included), so it reads images with its own. With a
    budget of 12 tokens per step the images' tokens are split over chunks, each adding its own. The
    MoE form's experts are decoupled per row as usual."""
    served_matches_merged(tmp_path, arch, QwenProcessor(patch=16), images_per_prompt=2,
                           vision_scale=0.5, max_batch_tokens=budget)


# docs/serve.md's: the last user message's images, then its text (PaliGemma's training format).
PALIGEMMA_TEMPLATE = """{%- set m = messages[-1] -%}
{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}
{%- for p in m['content'] if p['type'] == 'image' -%}<image>{%- endfor -%}
{%- for p in m['content'] if p['type'] == 'text' -%}{{ p['text'] }}{%- endfor -%}
{%- endif -%}
"""


def _paligemma_processor():
    from transformers import PaliGemmaProcessor, SiglipImageProcessorPil

    images = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    images.image_seq_length = 4
    return PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer(template("<image>")))


@pytest.mark.parametrize("budget", [2048, 10])
def test_paligemma_reads_its_whole_prompt_both_ways(tmp_path, budget):
    """PaliGemma: a prefix language model. Its prompt, images and text (and a text-only prompt),
    sees itself both ways; generated tokens are causal. With a budget of 10 tokens per step a prompt
    is still read in one step, since no chunk may cut it."""
    served_matches_merged(tmp_path, "paligemma", _paligemma_processor(), images_per_prompt=2,
                           max_batch_tokens=budget)


def test_a_chat_template_given_at_start_up_reads_paligemma_images_over_http(tmp_path):
    """PaliGemma checkpoints ship no chat template: a chat request is a 400 that names
    ``--chat-template``; with a template file given at start-up, a chat request with an image answers
    what the merged model generates for that rendering."""
    import httpx
    from openai import OpenAI

    processor = _paligemma_processor()
    text = PALIGEMMA_TEMPLATE
    processor.tokenizer.chat_template = None
    with single_thread():
        base_dir, arts = build_variant(tmp_path, "paligemma", processor, vocab=len(processor.tokenizer))
    processor.tokenizer.chat_template = text  # the reference renders with the file's template
    one = prompt(processor, "what is it?", [picture(0)])
    want = generate(load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir)), *one, tok=processor.tokenizer)
    (tmp_path / "paligemma.jinja").write_text(text)
    content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": png(picture(0))}}]
    body = {"model": "ft", "messages": [{"role": "user", "content": content}], "max_tokens": N, "temperature": 0}
    with running_server(ServedSet(tmp_path, base_dir, arts), base=str(base_dir)) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--chat-template FILE" in r.json()["error"]["message"], r.text
    with running_server(ServedSet(tmp_path, base_dir, arts), base=str(base_dir),
                        chat_template=tmp_path / "paligemma.jinja") as srv:
        got = OpenAI(base_url=f"{srv.url}/v1", api_key="x").chat.completions.create(**body)
        info = httpx.get(f"{srv.url}/tokenizer_info", params={"model": "ft"}, timeout=60).json()
    assert got.choices[0].message.content == want[0]
    assert got.usage.prompt_tokens == len(one[0])
    image = processor.tokenizer.convert_tokens_to_ids("<image>")  # images first, then BOS, the text, a newline
    assert one[0][:5] == [image] * 4 + [processor.tokenizer.bos_token_id]
    assert processor.tokenizer.decode(one[0][5:]) == "what is it?\n"
    assert info["chat_template"] == text


@pytest.mark.parametrize("both_ways", [False, True])
def test_gemma4_images_with_per_layer_embeddings(tmp_path, both_ways, monkeypatch):
    """Gemma 4: its language model also takes per-layer token embeddings, which its forward makes from
    the ids with each image token's replaced by the pad id; the engine keeps the image rows' and
    makes the others from each step's ids. With ``use_bidirectional_attention: vision`` (the larger
    Gemma 4s) an image's tokens see each other both ways, and a 40-token budget never cuts one."""
    from _factories import ARCH_CONFIGS

    if both_ways:
        cfg = ARCH_CONFIGS["gemma4_vl"]
        monkeypatch.setitem(ARCH_CONFIGS, "gemma4_vl",
                            {**cfg, "text_config": {**cfg["text_config"], "use_bidirectional_attention": "vision"}})
    served_matches_merged(tmp_path, "gemma4_vl", _Gemma4Processor(), images_per_prompt=2, vision_scale=0.5,
                           max_batch_tokens=40 if both_ways else 2048)


def test_a_chunk_never_ends_inside_an_image_seen_both_ways():
    x = PromptInputs(torch.tensor([9, 10, 11, 12]), torch.zeros(4, 2), blocks=[(9, 13)])
    assert x.chunk_end(0, 10) == 9  # before the image
    assert x.chunk_end(9, 11) == 13  # a chunk that starts it takes the whole image
    assert (x.chunk_end(0, 9), x.chunk_end(13, 20), x.chunk_end(0, 13)) == (9, 20, 13)


def test_images_over_http_with_the_openai_client(tmp_path):
    """A data: URL and an http URL (a loopback file server) in one chat request give the merged
    model's answer; broken images are one-line 400s."""
    import functools
    import http.server
    import threading

    import httpx
    from openai import OpenAI

    processor = llava_processor(tokenizer())
    with single_thread():
        base_dir, arts = build_variant(tmp_path, "llava", processor)
    pics = [picture(0), picture(3, (30, 30))]
    (tmp_path / "www").mkdir()
    pics[1].save(tmp_path / "www" / "b.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www"))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{files.server_address[1]}/b.png"
    content = [{"type": "image_url", "image_url": {"url": png(pics[0])}}, {"type": "text", "text": "which?"},
               {"type": "image_url", "image_url": {"url": url}}]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which?"}, {"type": "image"}]}]
    rendered = processor.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    out = processor(text=[rendered], images=pics, return_tensors="pt", add_special_tokens=False)
    ids = out.pop("input_ids")[0].tolist()
    out.pop("attention_mask")
    want = generate(load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir)), ids, PromptMedia(dict(out), 2))
    try:
        with running_server(ServedSet(tmp_path, base_dir, arts), base=str(base_dir), max_num_seqs=4) as srv:
            assert srv.rt.images == {"read": True, "processor": "LlavaProcessor"}
            client = OpenAI(base_url=f"{srv.url}/v1", api_key="x")
            got = client.chat.completions.create(model="ft", messages=[{"role": "user", "content": content}],
                                                 max_tokens=N, temperature=0)
            bad = [("data:image/png;base64,@@@", "not valid base64"),
                   ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not an image"),
                   ("file:///etc/passwd", "only data: and http(s) URLs"),
                   (url.replace("b.png", "missing.png"), "could not be fetched")]
            for ref, words in bad:
                r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={"model": "ft", "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}}]}]})
                assert r.status_code == 400 and words in r.json()["error"]["message"], (ref, r.text)
                assert "\n" not in r.json()["error"]["message"]
            r = httpx.post(f"{srv.url}/tokenize", timeout=60, json={"model": "ft", "messages": [
                {"role": "user", "content": content}]})
            assert r.status_code == 200 and r.json()["tokens"] == ids  # each image's tokens counted
    finally:
        files.shutdown()
    assert got.choices[0].message.content == want[0]
    assert got.usage.prompt_tokens == len(ids)


def test_the_samples_of_an_image_prompt_keep_its_positions(tmp_path):
    """``n=2`` of a Qwen2.5-VL prompt with images: the second sample is forked from the first after
    the prompt, and both decode with the prompt's position offset."""
    processor = QwenProcessor()
    with single_thread():
        base_dir, arts = build_variant(tmp_path, "qwen2_5_vl", processor)
        ck = Checkpoint(base_dir)
        one = prompt(processor, "what is it?", [picture(0), picture(1)])
        want = generate(load_merged_model(Artifact(arts / "ft"), ck), *one)
        dm = DeltaModel(ck, discover_variants(arts), num_slots=2, device=torch.device("cpu"), dtype=torch.float32)
        got = engine_runs(dm, processor.tokenizer, [("ft", one)], N, samples=2)
    assert len(got) == 2 and all(same(ev, want) for ev in got), [ev.text for ev in got]


def test_preempted_image_prompts_resume_with_their_positions(tmp_path):
    """One device slot, two variants (a copy of ``ft`` named ``ft2``): ``ft``'s long Qwen2.5-VL
    requests with images skip the line past ``ft2``'s, are preempted when their parent ends (their KV
    cache to host memory) and resume after ``ft2``, still at the rotary offset their images gave
    them: the same text and log probabilities as the merged model's ``generate``."""
    import shutil

    processor = QwenProcessor()
    with single_thread():
        base_dir, arts = build_variant(tmp_path, "qwen2_5_vl", processor)
        shutil.copytree(arts / "ft", arts / "ft2")
        ck = Checkpoint(base_dir)
        merged = load_merged_model(Artifact(arts / "ft"), ck)
        pics = [prompt(processor, "what is it?", [picture(s), picture(s + 1)]) for s in (0, 4)]
        want = [generate(merged, *p, n=n) for p, n in ((pics[0], 2), (pics[0], 3), (pics[0], 24), (pics[1], 24))]
        dm = DeltaModel(ck, discover_variants(arts), num_slots=1, device=torch.device("cpu"), dtype=torch.float32)
        jobs = [("ft", pics[0], 2), ("ft2", pics[0], 3), ("ft", pics[0], 24), ("ft", pics[1], 24)]
        stats: dict = {}
        got = engine_runs(dm, processor.tokenizer, jobs, N, stats=stats, max_deltas=1, max_cpu_deltas=4)
    assert stats["preempted"] >= 1, stats
    for j, (ev, w) in enumerate(zip(got, want)):
        assert same(ev, w), (j, ev.text, w)


@pytest.mark.parametrize("arch", ["llava", "qwen3_vl"])
def test_swap_mode_reads_images_with_the_variants_whole_model(tmp_path, arch):
    from deltazip.runtime.serve.model import SwapModels

    processor = llava_processor(tokenizer()) if arch == "llava" else QwenProcessor(patch=16)
    with single_thread():
        base_dir, arts = build_variant(tmp_path, arch, processor, vision_scale=0.5, vocab=max(128, len(processor.tokenizer)))
        ck = Checkpoint(base_dir)
        refs = {"ft": load_merged_model(Artifact(arts / "ft"), ck), "base": load_causal_lm(base_dir, torch.float32)}
        one = prompt(processor, "what is it?", [picture(0), picture(1)])
        want = {m: generate(refs[m], *one, tok=processor.tokenizer) for m in refs}
        sm = SwapModels(ck, discover_variants(arts), 2, torch.device("cpu"), torch.float32, "base")
        got = engine_runs(sm, processor.tokenizer, [("ft", one), ("base", one)], N)
    assert same(got[0], want["ft"]) and same(got[1], want["base"])


def test_workers_read_images_behind_the_front(tmp_path):
    """``--workers 2``: a chat request with an image, proxied by the front to a worker process over the
    shared base weights, answers what the merged model generates for it."""
    import httpx

    from deltazip.runtime.cluster.workers import WorkerPool
    from deltazip.runtime.serve.assembly import ServeConfig

    processor = llava_processor(tokenizer())
    with single_thread():
        base_dir, arts = build_variant(tmp_path, "llava", processor, vision_scale=0.5)
        one = prompt(processor, "what is it?", [picture(0)])
        want = generate(load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir)), *one)
    content = [{"type": "image_url", "image_url": {"url": png(picture(0))}}, {"type": "text", "text": "what is it?"}]
    cfg = ServeConfig(artifacts=arts, base=str(base_dir), max_deltas=2, max_cpu_deltas=2, cpu_threads=1, port=0)
    with WorkerPool(cfg, workers=2, env={"OMP_NUM_THREADS": "1"}, restart_backoff=0.2) as pool:
        got = [httpx.post(pool.url + "/v1/chat/completions", timeout=120, json={
            "model": "ft", "messages": [{"role": "user", "content": content}], "max_tokens": N, "temperature": 0,
        }).json() for _ in range(2)]
    assert [g["choices"][0]["message"]["content"] for g in got] == [want[0]] * 2


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3_vl", "mllama",
                                  "gemma4_vl", pytest.param("gemma3n_vl", marks=pytest.mark.skipif(
                                      not all(importlib.util.find_spec(m) for m in ("timm", "torchvision")),
                                      reason="Gemma 3n's vision tower needs timm and torchvision"))])
def test_tensor_parallel_reads_images_on_rank_0_and_every_rank_puts_them_in_place(tmp_path, arch):
    """``--tensor-parallel 2``: the vision tower and projector are whole on every rank, so rank 0 reads
    a prompt's images alone; each step's image rows (and Qwen's own positions, Qwen3-VL's DeepStack
    features, Gemma 3's two-way image spans) go to the other rank with the step, and the served text
    and log probabilities are the merged model's. Mllama: rank 0 sends each request's vision states
    once, and every rank makes its own heads' cross-attention keys from them. Qwen3-VL-MoE: each rank
    holds its share of every expert. Gemma 4 and Gemma 3n: the image rows' per-layer token embeddings
    go with them."""
    from deltazip.runtime.cluster.tp_group import start_tensor_parallel

    processor = {"llava": lambda: llava_processor(tokenizer()), "qwen2_5_vl": QwenProcessor,
                 "qwen3_vl": lambda: QwenProcessor(patch=16), "qwen3_vl_moe": lambda: QwenProcessor(patch=16),
                 "gemma3_vl": _gemma3_processor, "gemma4_vl": _Gemma4Processor, "gemma3n_vl": gemma3n_processor,
                 "mllama": mllama_processor}[arch]()
    with single_thread():
        base_dir, arts = build_variant(tmp_path, arch, processor, vision_scale=0.05 if arch == "mllama" else 0.5,
                                       vocab=max(128, len(processor.tokenizer)))
        ck = Checkpoint(base_dir)
        refs = {"ft": load_merged_model(Artifact(arts / "ft"), ck), "base": load_causal_lm(base_dir, torch.float32)}
        one = prompt(processor, "what is it?", [picture(0), picture(1)])
        want = {m: generate(refs[m], *one) for m in refs}
        want["text"] = generate(refs["ft"], processor.tokenizer("zip model tune")["input_ids"], None)
        tp = start_tensor_parallel(ck, discover_variants(arts), 2, torch.device("cpu"), torch.float32, 2)
        try:
            got = engine_runs(tp, processor.tokenizer, [("ft", one), ("base", one), ("ft", "zip model tune")], N,
                              max_batch_tokens=16)
            # n=2: the second sample forks after the prompt (Mllama: the workers copy its images' keys)
            twice = engine_runs(tp, processor.tokenizer, [("ft", one)], N, samples=2) if arch == "mllama" else []
        finally:
            tp.close()
    assert all(same(g, want[k], tol=1e-3) for g, k in zip(got, ("ft", "base", "text"))), [g.text for g in got]
    assert all(same(g, want["ft"], tol=1e-3) for g in twice), [g.text for g in twice]


def _pixtral_processor():
    from transformers import PixtralImageProcessor, PixtralProcessor

    images = PixtralImageProcessor(size={"longest_edge": 56}, patch_size=14)
    return PixtralProcessor(image_processor=images, tokenizer=tokenizer(template(IMAGE)), patch_size=14,
                            spatial_merge_size=1, image_token=IMAGE, image_break_token=BOI, image_end_token=EOI)


def _internvl_processor():
    from transformers import GotOcr2ImageProcessor, InternVLProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    tok = tokenizer(template(IMAGE))
    tok._set_model_specific_special_tokens(special_tokens={"start_image_token": BOI, "end_image_token": EOI,
                                                           "context_image_token": IMAGE, "video_token": "<reserved_22>"})
    return InternVLProcessor(image_processor=GotOcr2ImageProcessor(size={"height": 28, "width": 28}), tokenizer=tok,
                             video_processor=InternVLVideoProcessor(), image_seq_length=1)


def _smolvlm_processor():
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    tok = tokenizer(template("<image>"))
    tok.add_special_tokens({"additional_special_tokens": [  # the tokens its processor expects to find
        "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<video>",
        *(f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4))]})
    images = SmolVLMImageProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    return SmolVLMProcessor(image_processor=images, tokenizer=tok, video_processor=SmolVLMVideoProcessor(),
                            image_seq_len=4)


PROCESSORS = {"qwen2_5_vl": lambda: qwen_vl_processor("qwen2_5_vl"), "qwen3_vl": lambda: qwen_vl_processor("qwen3_vl"),
              "mistral3": _pixtral_processor, "internvl": _internvl_processor, "gemma4_vl": gemma4_processor,
              "smolvlm": _smolvlm_processor}


@needs_torchvision
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.skipif(
    a == "smolvlm" and importlib.util.find_spec("num2words") is None, reason="SmolVLM's processor needs num2words"))
    for a in PROCESSORS])
def test_the_checkpoints_own_processor_reads_images_over_http(tmp_path, arch):
    """The processor class a checkpoint ships (Qwen2.5-VL's and Qwen3-VL's, with their video
    processors; Mistral 3's Pixtral, rows of patches ended by break tokens; InternVL's, tiles and a
    thumbnail per image; Gemma 4's, with its audio feature extractor; SmolVLM's, tiles between row
    and column tags, which also needs num2words), saved beside the weights and loaded by the server with AutoProcessor: a
    chat request with two images answers what the merged model generates for the processor's own
    tensors."""
    from openai import OpenAI

    processor = PROCESSORS[arch]()
    with single_thread():
        base_dir, arts = build_variant(tmp_path, arch, processor, vision_scale=0.5, vocab=max(128, len(processor.tokenizer)))
    pics = [picture(0), picture(3, (60, 44))]
    one = prompt(processor, "which?", pics)
    want = generate(load_merged_model(Artifact(arts / "ft"), Checkpoint(base_dir)), *one, tok=processor.tokenizer)
    content = [*({"type": "image_url", "image_url": {"url": png(p)}} for p in pics), {"type": "text", "text": "which?"}]
    with running_server(ServedSet(tmp_path, base_dir, arts), base=str(base_dir)) as srv:
        assert srv.rt.images == {"read": True, "processor": type(processor).__name__}
        got = OpenAI(base_url=f"{srv.url}/v1", api_key="x").chat.completions.create(
            model="ft", messages=[{"role": "user", "content": content}], max_tokens=N, temperature=0)
    assert got.choices[0].message.content == want[0] and got.usage.prompt_tokens == len(one[0])


def _idefics3_processor():
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    images = Idefics3ImageProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer(template("<image>")), image_seq_len=4)


def test_idefics3_images_split_into_tiles_give_the_merged_output(tmp_path):
    """Idefics3: each image split into tiles plus a global view, each tile's tokens between its row
    and column tags, pixel masks beside the pixels (the tokenizer grows by the processor's tokens)."""
    served_matches_merged(tmp_path, "idefics3", _idefics3_processor(), images_per_prompt=1)


def test_the_start_up_says_whether_images_are_read(tmp_path, caplog):
    """An image-text checkpoint served without its processor's files is served for text; the start-up
    line (and the ``--json`` document's ``images``) says that images are not read and why. With them,
    the line says they are read, and by what (the images-over-HTTP test)."""
    import logging

    import httpx

    with single_thread():
        base_dir, arts = build_variant(tmp_path, "llava", llava_processor(tokenizer()), processor_files=False)
    with caplog.at_level(logging.INFO, logger="deltazip.serve"):
        with running_server(ServedSet(tmp_path, base_dir, arts), base=str(base_dir)) as srv:
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": "ft", "prompt": "zip", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
            assert not srv.rt.images["read"] and "has no image processor" in srv.rt.images["why"], srv.rt.images
            content = [{"type": "image_url", "image_url": {"url": png(picture(0))}}, {"type": "text", "text": "?"}]
            r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
                "model": "ft", "messages": [{"role": "user", "content": content}], "max_tokens": 2})
            assert r.status_code == 400 and "no image processor" in r.json()["error"]["message"], r.text
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("images:")]
    assert len(lines) == 1 and lines[0].startswith("images: not read") and "no image processor" in lines[0], lines


def test_a_processor_that_cannot_load_is_a_one_line_400(tmp_path):
    """transformers' "requires the Torchvision library" errors start with a newline: the message
    quotes their first line that has text, never an empty reason."""
    from deltazip.formats.errors import first_line
    from deltazip.runtime.serve.images import processor
    from deltazip.runtime.serve.openai_schema import ApiError

    assert first_line(ImportError("\nPixtralProcessor requires the Torchvision library but it was not found.\nmore"))\
        == "PixtralProcessor requires the Torchvision library but it was not found."
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ApiError) as e:
        processor(tmp_path, tmp_path)
    msg = e.value.message if hasattr(e.value, "message") else str(e.value)
    assert e.value.status == 400 and "could not be loaded" in msg and "\n" not in msg and not msg.endswith(": )")
