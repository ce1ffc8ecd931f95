"""Images for the tests of image-text models: pictures, a character tokenizer with image tokens,
processors over it, prompts as processors give them, a compressed tiny image-text variant, and the
merged model's greedy reference, and the check of served against merged output."""

from __future__ import annotations

import base64
import importlib.util
import io

import numpy as np
import pytest
import torch
from _factories import calib_file, finetune, save_model, tiny_model
from _serving import engine_runs, single_thread

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.demo.pair import build_char_tokenizer
from deltazip.formats.artifact import Artifact
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.loader import load_causal_lm
from deltazip.runtime.serve.model import DeltaModel
from deltazip.runtime.serve.prompt_media import PromptMedia
from deltazip.runtime.serve.variant_sources import discover_variants

N = 8

IMAGE, BOI, EOI = "<reserved_19>", "<reserved_20>", "<reserved_21>"  # ids 120-122, as in the tiny configs


def template(placeholder: str) -> str:
    return ("{% for message in messages %}{{ message['role'] + ': ' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + placeholder +
            "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


TEMPLATE = template(IMAGE)


def picture(seed: int, size=(40, 52)):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


def png(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def tokenizer(template: str = TEMPLATE):
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE, BOI, EOI]})  # one token each (in the vocab)
    tok.chat_template = template
    return tok


# Processors whose image or video side needs torchvision, as checkpoints ship them (loaded with
# AutoProcessor from the saved files). CI's CPU torch has no torchvision build to match it.
needs_torchvision = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                       reason="the processor needs torchvision (not installed)")


def qwen_vl_processor(arch: str):
    """Qwen2.5-VL's (``qwen2_5_vl``, patches of 14) or Qwen3-VL's (``qwen3_vl``, 16; Qwen3.5's too) processor class
    over the character tokenizer, its image token id 120 between the vision start and end tokens."""
    import transformers
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = tokenizer(template(BOI + IMAGE + EOI))
    tok._set_model_specific_special_tokens(special_tokens={"image_token": IMAGE, "video_token": "<reserved_22>",
                                                           "vision_bos_token": BOI, "vision_eos_token": EOI})
    patch = 16 if arch.startswith("qwen3") else 14
    images = Qwen2VLImageProcessor(min_pixels=4 * (2 * patch) ** 2, max_pixels=24 * (2 * patch) ** 2, patch_size=patch,
                                   merge_size=2, temporal_patch_size=2)
    cls = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor", "qwen3_5_vl": "Qwen3VLProcessor"}[arch]
    return getattr(transformers, cls)(image_processor=images, tokenizer=tok, video_processor=Qwen2VLVideoProcessor())


class QwenProcessor:
    """What Qwen2.5-VL's (``patch=14``) and Qwen3-VL's (``patch=16``) processors give (their classes
    also build a video processor, which needs torchvision): the image processor's patches and grid,
    each image's placeholder expanded to one token per merged patch between the vision start and end
    tokens."""

    def __init__(self, patch: int = 14):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = tokenizer(template(BOI + IMAGE + EOI))
        side = 2 * patch  # a merged patch
        self.images = Qwen2VLImageProcessorPil(min_pixels=4 * side * side, max_pixels=24 * side * side, patch_size=patch,
                                               merge_size=2, temporal_patch_size=2)

    def __call__(self, text, images, return_tensors, add_special_tokens):
        out = dict(self.images(images=images, return_tensors="pt"))
        for thw in out["image_grid_thw"]:
            text = [t.replace(BOI + IMAGE + EOI, BOI + "<|p|>" * (int(thw.prod()) // 4) + EOI, 1) for t in text]
        text = [t.replace("<|p|>", IMAGE) for t in text]
        enc = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        kinds = (enc["input_ids"] == self.tokenizer.convert_tokens_to_ids(IMAGE)).int()  # 1: an image's token
        return {**enc, **out, "mm_token_type_ids": kinds}


def gemma3n_processor():
    """Gemma 3n's processor (its timm tower needs timm and torchvision to run), 256 image tokens."""
    from transformers import Gemma3nProcessor, SiglipImageProcessorPil
    from transformers.models.gemma3n.feature_extraction_gemma3n import Gemma3nAudioFeatureExtractor

    tok = tokenizer(template("<img>"))
    tok.add_special_tokens({"additional_special_tokens": ["<boi>", "<img>", "<eoi>", "<boa>", "<aud>", "<eoa>"]})
    tok._set_model_specific_special_tokens(special_tokens={  # ids 128-133, as in the tiny config
        "boi_token": "<boi>", "image_token": "<img>", "eoi_token": "<eoi>", "boa_token": "<boa>", "audio_token": "<aud>",
        "eoa_token": "<eoa>"})
    return Gemma3nProcessor(feature_extractor=Gemma3nAudioFeatureExtractor(), tokenizer=tok, audio_seq_length=4,
                            image_processor=SiglipImageProcessorPil(size={"height": 64, "width": 64}),
                            image_seq_length=256)


def gemma4_processor():
    """Gemma 4's processor class (its video processor needs torchvision), 70 soft tokens per image."""
    from transformers import Gemma4ImageProcessorPil, Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    tok = tokenizer(template(IMAGE))
    tok._set_model_specific_special_tokens(special_tokens={  # the audio tokens: its processor checks they exist
        "image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI, "audio_token": "<reserved_23>",
        "boa_token": "<reserved_24>", "eoa_token": "<reserved_25>"})
    images = Gemma4ImageProcessorPil(patch_size=14, pooling_kernel_size=2, max_soft_tokens=70)
    return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images, tokenizer=tok,
                           video_processor=Gemma4VideoProcessor(), image_seq_length=70)


def mllama_processor():
    """Mllama's processor over the character tokenizer: 28-pixel tiles, up to 4 per image (5 vision
    tokens each with the tiny tower), its image token id 120."""
    from transformers import MllamaImageProcessorPil, MllamaProcessor

    tok = tokenizer(template(IMAGE))
    tok._set_model_specific_special_tokens(special_tokens={"image_token": IMAGE})
    images = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=4)
    return MllamaProcessor(image_processor=images, tokenizer=tok)


def parts_prompt(processor, parts: list):
    """Token ids and tensors of a user message of ``parts`` (a PIL image, or text), in order."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    rendered = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                       add_generation_prompt=True)
    images = [p for p in parts if not isinstance(p, str)]
    out = processor(text=[rendered], images=images, return_tensors="pt", add_special_tokens=False)
    ids = out.pop("input_ids")[0].tolist()
    out.pop("attention_mask", None)
    return ids, PromptMedia(dict(out), len(images))


def llava_processor(tok):
    from transformers import CLIPImageProcessor, LlavaProcessor

    ip = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token=IMAGE, chat_template=TEMPLATE)


def prompt(processor, text: str, images: list):
    msgs = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    rendered = processor.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    out = processor(text=[rendered], images=images, return_tensors="pt", add_special_tokens=False)
    ids = out.pop("input_ids")[0].tolist()
    for k in ("attention_mask", "labels"):
        out.pop(k, None)
    return ids, PromptMedia(dict(out), len(images))


def generate(model, ids: list[int], media: PromptMedia | None, n: int = N, tok=None) -> tuple[str, list[float]]:
    """Greedy text (decoded by ``tok``, default the demo's character tokenizer) and each drawn token's
    log probability."""
    x = torch.tensor([ids])
    extra = {} if media is None else dict(media.tensors)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=2,
                             eos_token_id=1, output_logits=True, return_dict_in_generate=True, **extra)
    toks = out.sequences[0, len(ids):].tolist()
    lps = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, toks)]
    return (tok or build_char_tokenizer()).decode(toks, skip_special_tokens=True), lps


def build_variant(root, arch, processor, vision_scale: float = 0.0, vocab: int = 128, processor_files: bool = True):
    """``(base dir, artifacts dir)``: a tiny image-text base of ``arch`` and its fine-tune (text, and with
    ``vision_scale`` its projector, mergers or cross-attention moved too), compressed 4-bit as ``ft``; without
    ``processor_files`` the checkpoints keep only the tokenizer."""
    tok = processor.tokenizer
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2, vocab_size=vocab)  # the demo's tokenizer
    base_dir = save_model(tiny_model(arch, **ids), root / "base", tokenizer=False)
    ft = finetune(tiny_model(arch, **ids), steps=30, seed=3)
    if vision_scale:
        with torch.no_grad():
            for name, p in ft.named_parameters():
                if any(k in name for k in ("multi_modal_projector", "merger", "cross_attn.")):
                    # LLaVA's projector, Qwen's mergers, Mllama's cross-attention
                    p.add_(vision_scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    ft_dir = save_model(ft, root / "ft", tokenizer=False)
    for d in (base_dir, ft_dir):
        if hasattr(processor, "save_pretrained") and processor_files:
            processor.save_pretrained(d)
        tok.save_pretrained(d)
    # Gemma 3n's AltUp coefficients have 2 inputs, which no group of 32 divides: groups picked per tensor
    cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=32, sparsity="none"), method="deltazip", nsamples=8,
                         seqlen=32, device="cpu", group_auto=arch.startswith("gemma3n"))
    compress_delta(base_dir, ft_dir, str(calib_file(root / "calib", n=16)), root / "arts" / "ft", cfg)
    return base_dir, root / "arts"


def same(got, want, tol=1e-4) -> bool:
    """A served finish event against a reference ``(text, logprobs)``: equal text, log probabilities
    within ``tol``."""
    lps = [e[1] for e in got.logprobs]
    k = min(len(lps), len(want[1]))
    return got.text == want[0] and k > 0 and max(abs(a - b) for a, b in zip(lps[:k], want[1][:k])) < tol


def served_matches_merged(tmp_path, arch, processor, images_per_prompt, vision_scale=0.0, dtype=torch.float32,
                           tol=1e-4, **engine):
    """Served (delta mode, in ``dtype``) against the merged checkpoint's ``generate`` in ``dtype``: equal
    texts, log probabilities within ``tol``."""
    tok = processor.tokenizer
    with single_thread():
        base_dir, arts = build_variant(tmp_path, arch, processor, vision_scale, vocab=max(128, len(tok)))
        ck = Checkpoint(base_dir)
        refs = {"ft": load_merged_model(Artifact(arts / "ft"), ck, dtype), "base": load_causal_lm(base_dir, dtype)}
        prompts = [prompt(processor, "what is it?", [picture(s) for s in range(images_per_prompt)]),
                   prompt(processor, "and this one", [picture(7 + s, (60, 44)) for s in range(images_per_prompt)])]
        want = {(m, i): generate(refs[m], *prompts[i], tok=tok) for m in refs for i in range(2)}
        want["ft", "text"] = generate(refs["ft"], tok("zip model tune")["input_ids"], None, tok=tok)
        assert any(want["ft", i] != want["base", i] for i in range(2))  # the fine-tune matters
        dm = DeltaModel(ck, discover_variants(arts), num_slots=2, device=torch.device("cpu"), dtype=dtype)
        jobs = [("ft", 0), ("base", 0), ("ft", "text"), ("ft", 1), ("base", 1)]
        got = engine_runs(dm, tok, [(m, prompts[i] if i != "text" else "zip model tune") for m, i in jobs], N,
                          **engine)
    for j, ev in zip(jobs, got):
        assert same(ev, want[j], tol), (j, ev.text, want[j])
    worst = max(abs(e[1] - w) for j, ev in zip(jobs, got) for e, w in zip(ev.logprobs, want[j][1]))
    print(f"{arch} {str(dtype).removeprefix('torch.')}: served vs merged max |d logprob| {worst:.3g}")  # pytest -s
    return refs, prompts, got
