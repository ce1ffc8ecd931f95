"""More image-text families served with images, each against the merged checkpoint's ``generate``
(``served_matches_merged``: both variants, two prompts of two images, a text row, one batch):

- LLaVA-NeXT and LLaVA-OneVision: each image split into tiles at the best of several resolutions;
- Aya Vision (a Cohere 2 language model with sliding-window layers) and Idefics2 (a perceiver
  resampler between the tower and the language model);
- GLM-4.1V: positions in three sections, as Qwen2-VL's;
- hybrid language models, whose recurrent layers carry a state per sequence through the image
  tokens: Qwen3.5 and Qwen3.5-MoE (gated delta rule layers, positions in three sections; also read in
  chunks) and LFM2-VL (short convolutions).

Also a PEFT LoRA adapter over every linear of LLaVA and Qwen2.5-VL, vision side included.

The processors of LLaVA-OneVision, GLM-4.1V and LFM2-VL need torchvision, and Gemma 3n's tower timm
(``make test-torchvision`` installs both).
"""

from __future__ import annotations

import importlib.util

import pytest
from _images import (
    BOI,
    EOI,
    IMAGE,
    QwenProcessor,
    gemma3n_processor,
    needs_torchvision,
    served_matches_merged,
    template,
    tokenizer,
)


def _llava_next():
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    images = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]])
    return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer(template(IMAGE)), patch_size=14,
                              vision_feature_select_strategy="default", image_token=IMAGE, num_additional_image_tokens=1)


def _llava_onevision():
    from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor,
    )

    tok = tokenizer(template(IMAGE))
    tok._set_model_specific_special_tokens(special_tokens={"image_token": IMAGE, "video_token": "<reserved_22>"})
    images = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                             image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]])
    return LlavaOnevisionProcessor(image_processor=images, tokenizer=tok, video_processor=LlavaOnevisionVideoProcessor(),
                                   num_image_tokens=4, vision_feature_select_strategy="full", image_token=IMAGE,
                                   video_token="<reserved_22>")


def _aya_vision():
    from transformers import AyaVisionProcessor, GotOcr2ImageProcessorPil

    placeholder = "<reserved_26>"  # the template's; each image's patches are id 120
    return AyaVisionProcessor(image_processor=GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, max_patches=2),
                              tokenizer=tokenizer(template(placeholder)), patch_size=14, img_size=28,
                              downsample_factor=1, image_token=placeholder, start_of_img_token=BOI,
                              end_of_img_token=EOI, img_patch_token=IMAGE, img_line_break_token="<reserved_23>",
                              tile_token="<reserved_24>", tile_global_token="<reserved_25>")


def _idefics2():
    from transformers import Idefics2ImageProcessorPil, Idefics2Processor

    tok = tokenizer(template("<image>"))
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<end_of_utterance>"]})
    images = Idefics2ImageProcessorPil(size={"shortest_edge": 28, "longest_edge": 28}, do_image_splitting=False)
    return Idefics2Processor(image_processor=images, tokenizer=tok, image_seq_len=4)


def _glm4v():
    from transformers import Glm4vImageProcessorPil, Glm4vProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    tok = tokenizer(template(BOI + IMAGE + EOI))
    tok._set_model_specific_special_tokens(special_tokens={"image_token": IMAGE, "video_token": "<reserved_23>"})
    images = Glm4vImageProcessorPil(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 24 * 28 * 28}, patch_size=14,
                                    merge_size=2, temporal_patch_size=2)
    return Glm4vProcessor(image_processor=images, tokenizer=tok, video_processor=Glm4vVideoProcessor())


def _lfm2_vl():
    from transformers import Lfm2VlImageProcessor, Lfm2VlProcessor

    tok = tokenizer(template(IMAGE))
    tok._set_model_specific_special_tokens(special_tokens={"image_token": IMAGE, "image_start_token": BOI,
                                                           "image_end_token": EOI, "image_thumbnail": "<reserved_23>"})
    images = Lfm2VlImageProcessor(min_image_tokens=4, max_image_tokens=16, encoder_patch_size=14, downsample_factor=2,
                                  tile_size=28, do_image_splitting=False, max_num_patches=64)
    return Lfm2VlProcessor(image_processor=images, tokenizer=tok)


@pytest.mark.parametrize("arch,processor", [("llava_next", _llava_next), ("aya_vision", _aya_vision),
                                            ("idefics2", _idefics2)])
def test_more_families_give_the_merged_output(tmp_path, arch, processor):
    served_matches_merged(tmp_path, arch, processor(), images_per_prompt=2, vision_scale=0.5)


@pytest.mark.parametrize("arch,budget", [("qwen3_5_vl", 2048), ("qwen3_5_vl", 12), ("qwen3_5_moe_vl", 12)])
def test_qwen3_5_images_through_its_recurrent_layers(tmp_path, arch, budget):
    """Qwen3.5's gated delta rule layers read the image tokens like any other: a prompt read in one step,
    or in chunks of 12 tokens (the state carried from chunk to chunk), with positions of its own; the
    MoE form too."""
    served_matches_merged(tmp_path, arch, QwenProcessor(patch=16), images_per_prompt=2, vision_scale=0.5,
                          max_batch_tokens=budget)


@needs_torchvision
@pytest.mark.parametrize("arch,processor", [("llava_onevision", _llava_onevision), ("glm4v", _glm4v),
                                            ("lfm2_vl", _lfm2_vl)])
def test_families_whose_processors_need_torchvision(tmp_path, arch, processor):
    served_matches_merged(tmp_path, arch, processor(), images_per_prompt=2, vision_scale=0.5)


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_a_lora_adapter_over_every_linear_reads_images_with_its_own_vision_side(tmp_path, arch):
    """A PEFT adapter with ``target_modules="all-linear"`` (the vision tower's, the projector's or
    mergers' and the language model's linears), served beside the base in one batch: a prompt with
    two images answers what PEFT's merged model generates."""
    import torch
    from _images import N, build_variant, generate, llava_processor, picture, prompt, same
    from _serving import engine_runs, single_thread

    pytest.importorskip("peft")  # the eval extra (make test-torchvision installs dev and serve)
    from _factories import lora_adapter

    from deltazip.models.checkpoint import Checkpoint
    from deltazip.models.loader import load_causal_lm
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import discover_variants

    processor = llava_processor(tokenizer()) if arch == "llava" else QwenProcessor()
    with single_thread():
        base_dir, arts = build_variant(tmp_path, arch, processor)
        pm = lora_adapter(load_causal_lm(base_dir, torch.float32), arts / "lora", 1, target_modules="all-linear")
        assert any("lora_A" in n and ("vision" in n or "visual" in n) for n, _ in pm.named_parameters())
        merged = pm.merge_and_unload().eval()
        one = prompt(processor, "what is it?", [picture(0), picture(1)])
        want = {"lora": generate(merged, *one), "base": generate(load_causal_lm(base_dir, torch.float32), *one)}
        dm = DeltaModel(Checkpoint(base_dir), discover_variants(arts), num_slots=2, device=torch.device("cpu"),
                        dtype=torch.float32)
        got = engine_runs(dm, processor.tokenizer, [("lora", one), ("base", one)], N)
    assert want["lora"] != want["base"]
    assert same(got[0], want["lora"]) and same(got[1], want["base"]), [g.text for g in got]


@needs_torchvision
@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="Gemma 3n's vision tower needs timm")
def test_gemma3n_images_with_its_timm_tower_and_per_layer_embeddings(tmp_path):
    """Gemma 3n: a timm MobileNetV5 tower, its image and special tokens embedded by a vision embedder
    of their own, and per-layer token embeddings beside the input embeddings (as Gemma 4's)."""
    served_matches_merged(tmp_path, "gemma3n_vl", gemma3n_processor(), images_per_prompt=1)
