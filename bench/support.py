"""Support matrix: which architectures compress, merge, serve (delta and swap mode) and evaluate.

    python bench/support.py [--quick] [--families llama,gpt2] [--doc docs/support.md] [--out DIR]

For every family a tiny model (2 layers, hidden 64, the demo's 128-character vocabulary) is built in
code from its transformers config, fine-tuned for real (Adam on a repeating-pattern task: every
tensor moves, norms, biases, embeddings and positions included), then:

- compress: ``deltazip compress`` (ΔCompress 4-bit dense, automatic group, calibrated) of the fine-tune,
  without its warning that a tenth or more of the matrix bytes are in tensors it does not compress;
- merge: ``deltazip merge`` of the artifact loads with transformers and is closer to the fine-tune
  than the base is (mean squared logit error on held-out sequences);
- serve delta / serve swap: the engine in that mode, the variant's rows in one batch with base rows;
  every greedy output equals the merged model's ``generate``;
- serve tp2: the same in delta mode on two tensor-parallel ranks (``--tensor-parallel 2``: two
  processes on the CPU, gloo), every layer and the variant's deltas sharded. Its artifact is the
  fine-tune compressed RTN 4-bit in groups of 16 (a shard of a 64-wide ``o_proj`` holds whole groups,
  which the automatic group does not promise; a model with a compressed input width 16 does not
  divide, Gemma 3n's 2-input AltUp coefficients, takes the automatic group), compared with its own
  merged model;
- serve lora: a PEFT LoRA adapter on every linear of the base (``target_modules="all-linear"``, rank 4,
  its factors random; for the Mamba families, whose ``out_proj`` PEFT refuses, every other linear),
  served in delta mode in one batch with base rows; every greedy output equals the ``generate`` of
  PEFT's merged model (``merge_and_unload``), or of PEFT's own model where the base ties an adapted
  weight to another (Zamba2's shared block: a merge would add every tied module's term to one tensor);
- eval: ``deltazip eval`` at its default ``--batch-size 8``: the artifact's perplexity equals the
  merged checkpoint's (relative difference below 1e-4), and on two lm-eval tasks (``deltazip_ticket``,
  multiple choice by loglikelihood; ``deltazip_copy``, generation; 8 examples each) it scores exactly
  what the merged checkpoint scores.

A cell is ``ok``, or the first line of the error (``refused: ...`` for a one-line refusal the tool
gives, ``fails: ...`` for anything else). Prints one JSON document (``{"bench": "support", ...}``);
``--doc`` writes the Markdown table (docs/support.md). ``--quick``: 10 fine-tuning steps, fewer
prompts and tokens (a few minutes on a 2-core CPU for every family).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
             max_position_embeddings=128)
GQA = dict(SHAPE, num_key_value_heads=2)
MROPE3 = dict(rope_type="default", mrope_section=[2, 3, 3], mrope_interleaved=True)
QWEN3_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    deepstack_visual_indexes=[0])
# Qwen3.5's image-text form: a hybrid language model (gated delta rule and attention layers) with
# positions in three sections, behind its vision tower
QWEN3_5_TEXT = dict(GQA, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    rope_parameters=dict(MROPE3, rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[1, 1, 2]))
QWEN3_5_IMAGES = dict(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                         num_position_embeddings=16),
                      image_token_id=120, video_token_id=121, vision_start_token_id=122)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
FAMILIES: dict[str, tuple[str, dict, torch.dtype]] = {
    "llama": ("llama", dict(GQA, tie_word_embeddings=True), torch.float32),
    "llama-untied": ("llama", dict(GQA, tie_word_embeddings=False), torch.float32),
    "llama-bf16": ("llama", dict(GQA, tie_word_embeddings=False), torch.bfloat16),
    "mistral": ("mistral", dict(GQA, sliding_window=None), torch.float32),
    "qwen2": ("qwen2", GQA, torch.float32),
    "qwen3": ("qwen3", dict(GQA, head_dim=16), torch.float32),
    "phi3": ("phi3", dict(SHAPE, num_key_value_heads=4), torch.float32),
    "falcon": ("falcon", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=False,
                              max_position_embeddings=128), torch.float32),
    "falcon-gqa": ("falcon", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=False,
                                  new_decoder_architecture=True, num_kv_heads=2, max_position_embeddings=128),
                   torch.float32),
    # as Falcon-RW, the ALiBi Falcon: one KV head per query head, sequential attention and MLP, biases
    "falcon-alibi": ("falcon", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=True,
                                    multi_query=False, parallel_attn=False, bias=True, max_position_embeddings=128),
                     torch.float32),
    "stablelm": ("stablelm", dict(GQA), torch.float32),
    "gpt_bigcode": ("gpt_bigcode", dict(n_embd=64, n_head=4, n_layer=2, n_positions=128), torch.float32),
    "gemma": ("gemma", dict(GQA, head_dim=16), torch.float32),
    "gemma2": ("gemma2", dict(GQA, head_dim=16, sliding_window=16), torch.float32),
    "gemma3": ("gemma3_text", dict(GQA, head_dim=16, layer_types=["full_attention"] * 2, sliding_window=128),
               torch.float32),
    "gemma3-sliding": ("gemma3_text", dict(GQA, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                                           sliding_window=16), torch.float32),
    "gpt_neox": ("gpt_neox", dict(SHAPE, rotary_pct=0.5), torch.float32),
    "opt": ("opt", dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2,
                        max_position_embeddings=128, word_embed_proj_dim=64), torch.float32),
    "gpt2": ("gpt2", dict(n_embd=64, n_head=4, n_layer=2, n_positions=128), torch.float32),
    "bloom": ("bloom", dict(hidden_size=64, n_head=4, n_layer=2), torch.float32),
    "mpt": ("mpt", dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=128), torch.float32),
    "mixtral": ("mixtral", dict(GQA, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=None), torch.float32),
    "qwen2_moe": ("qwen2_moe", dict(GQA, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                    num_experts=4, num_experts_per_tok=2), torch.float32),
    "qwen3_moe": ("qwen3_moe", dict(GQA, head_dim=16, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2),
                  torch.float32),
    "olmoe": ("olmoe", dict(GQA, num_experts=4, num_experts_per_tok=2), torch.float32),
    "granitemoe": ("granitemoe", dict(GQA, num_local_experts=4, num_experts_per_tok=2), torch.float32),
    "phimoe": ("phimoe", dict(GQA, num_local_experts=4, num_experts_per_tok=2), torch.float32),
    "deepseek_v3": ("deepseek_v3", dict(SHAPE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                        n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=16), torch.float32),
    "gpt_oss": ("gpt_oss", dict(GQA, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
                torch.float32),
    "llama4": ("llama4_text", dict(GQA, head_dim=16, intermediate_size=64, intermediate_size_mlp=128,
                                   num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                                   no_rope_layers=[1, 1], attention_chunk_size=16), torch.float32),
    "glm4_moe": ("glm4_moe", dict(GQA, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                  n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1), torch.float32),
    "ernie4_5_moe": ("ernie4_5_moe", dict(GQA, moe_intermediate_size=32, moe_num_experts=4, moe_k=2,
                                          moe_layer_start_index=1, moe_num_shared_experts=1), torch.float32),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(GQA, head_dim=16, num_experts=4, moe_topk=2), torch.float32),
    "dots1": ("dots1", dict(GQA, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                            n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1), torch.float32),
    "jetmoe": ("jetmoe", dict(hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
                              intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=128), torch.float32),
    "olmo2": ("olmo2", GQA, torch.float32),
    "granite": ("granite", GQA, torch.float32),
    "cohere": ("cohere", GQA, torch.float32),
    "smollm3": ("smollm3", GQA, torch.float32),
    "glm4": ("glm4", GQA, torch.float32),
    "exaone4": ("exaone4", dict(GQA, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
                torch.float32),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(GQA, head_dim=16), torch.float32),
    "ernie4_5": ("ernie4_5", GQA, torch.float32),
    "seed_oss": ("seed_oss", dict(GQA, head_dim=16), torch.float32),
    "ministral": ("ministral", dict(GQA, head_dim=16, sliding_window=16), torch.float32),
    "starcoder2": ("starcoder2", dict(GQA, sliding_window=None), torch.float32),
    "phi": ("phi", dict(SHAPE, partial_rotary_factor=0.5), torch.float32),
    "apertus": ("apertus", GQA, torch.float32),
    "nemotron": ("nemotron", dict(GQA, head_dim=16), torch.float32),
    # (head_dim 64 and MLP width 256: its tensor-parallel artifact takes automatic groups, of 128 there)
    "gemma3n": ("gemma3n_text", dict(GQA, head_dim=64, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=16, num_kv_shared_layers=0, laurel_rank=8, altup_num_inputs=2,
                                     hidden_size_per_layer_input=16, vocab_size_per_layer_input=128,
                                     activation_sparsity_pattern=[0.95, 0.0], intermediate_size=[256, 256]),
                torch.float32),
    "gemma4": ("gemma4_text", dict(GQA, head_dim=16, global_head_dim=32, layer_types=["sliding_attention", "full_attention"],
                                   sliding_window=16, hidden_size_per_layer_input=16, vocab_size_per_layer_input=128),
               torch.float32),
    # the MoE form (26B-A4B): a dense MLP and routed experts in every layer, keys doubling as values on global layers
    "gemma4-moe": ("gemma4_text", dict(GQA, head_dim=16, global_head_dim=32, sliding_window=16,
                                       layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                                       enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                       attention_k_eq_v=True, num_global_key_value_heads=1), torch.float32),
    # the edge form (E2B/E4B): the last layers reuse earlier layers' keys and values
    "gemma4-kv-shared": ("gemma4_text", dict(GQA, num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=16,
                                             layer_types=["sliding_attention", "full_attention"] * 2,
                                             num_kv_shared_layers=2, hidden_size_per_layer_input=16,
                                             vocab_size_per_layer_input=128), torch.float32),
    "ministral3": ("ministral3", dict(GQA, head_dim=16), torch.float32),
    "olmo3": ("olmo3", dict(GQA, sliding_window=16, layer_types=["sliding_attention", "full_attention"]), torch.float32),
    "cohere2": ("cohere2", dict(GQA, head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
                torch.float32),
    "arcee": ("arcee", dict(GQA, head_dim=16), torch.float32),
    "vaultgemma": ("vaultgemma", dict(GQA, head_dim=16, sliding_window=16), torch.float32),
    "granite_swa": ("granite_swa", dict(GQA, sliding_window=16), torch.float32),
    "minimax_m2": ("minimax_m2", dict(GQA, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
                   torch.float32),
    "glm4_moe_lite": ("glm4_moe_lite", dict(SHAPE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                            n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                            qk_nope_head_dim=8, v_head_dim=16), torch.float32),
    "cohere2_moe": ("cohere2_moe", dict(GQA, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                        sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
                    torch.float32),
    "granitemoeshared": ("granitemoeshared", dict(GQA, num_local_experts=4, num_experts_per_tok=2,
                                                  shared_intermediate_size=64), torch.float32),
    "exaone_moe": ("exaone_moe", dict(GQA, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
                   torch.float32),
    "solar_open": ("solar_open", dict(GQA, head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                                      num_experts_per_tok=2, n_group=1, topk_group=1), torch.float32),
    "afmoe": ("afmoe", dict(GQA, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            sliding_window=16, layer_types=["sliding_attention", "full_attention"]), torch.float32),
    "qwen3_5": ("qwen3_5_text", dict(GQA, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                     linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                     linear_value_head_dim=16), torch.float32),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(GQA, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                             layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                                             linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
                    torch.float32),
    "granitemoehybrid": ("granitemoehybrid", dict(GQA, layer_types=["linear_attention", "full_attention"],
                                                  num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4,
                                                  mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                                                  shared_intermediate_size=64), torch.float32),
    "olmo_hybrid": ("olmo_hybrid", dict(GQA, layer_types=["linear_attention", "full_attention"]), torch.float32),
    "kimi_linear": ("kimi_linear", dict(SHAPE, num_key_value_heads=4, layer_types=["linear_attention", "full_attention"],
                                        linear_num_heads=4, linear_head_dim=16, num_experts=4, num_experts_per_token=2,
                                        moe_intermediate_size=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=16), torch.float32),
    "lfm3": ("lfm3", dict(GQA, layer_types=["conv", "full_attention"]), torch.float32),
    "nemotron_h": ("nemotron_h", dict(GQA, num_hidden_layers=4, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
                                      ssm_state_size=16, n_groups=1, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                      n_group=1, topk_group=1,
                                      layers_block_type=["linear_attention", "moe", "full_attention", "mlp"]),
                   torch.float32),
    "qwen3_next": ("qwen3_next", dict(GQA, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      shared_expert_intermediate_size=32,
                                      layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                                      linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
                   torch.float32),
    "lfm2": ("lfm2", dict(GQA, layer_types=["conv", "full_attention"]), torch.float32),
    "falcon_h1": ("falcon_h1", dict(GQA, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                    mamba_d_state=16, mamba_n_groups=1), torch.float32),
    # third sweep: older and newer dense families, MLA, hybrids of two layer classes, Mamba alone
    "deepseek_v2": ("deepseek_v2", dict(SHAPE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                        n_shared_experts=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=16), torch.float32),
    "minicpm3": ("minicpm3", dict(SHAPE, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=16), torch.float32),
    "gptj": ("gptj", dict(n_embd=64, n_head=4, n_layer=2, n_positions=128, rotary_dim=8), torch.float32),
    "gpt_neo": ("gpt_neo", dict(hidden_size=64, num_heads=4, num_layers=2, max_position_embeddings=128,
                                attention_types=[[["global", "local"], 1]], window_size=16, intermediate_size=128),
                torch.float32),
    "codegen": ("codegen", dict(n_embd=64, n_head=4, n_layer=2, n_positions=128, rotary_dim=8, n_ctx=128),
                torch.float32),
    "xglm": ("xglm", dict(d_model=64, ffn_dim=128, attention_heads=4, num_layers=2, max_position_embeddings=128),
             torch.float32),
    "olmo": ("olmo", GQA, torch.float32),
    "persimmon": ("persimmon", dict(SHAPE, num_key_value_heads=4), torch.float32),
    "glm": ("glm", dict(GQA, head_dim=16), torch.float32),
    "helium": ("helium", dict(GQA, head_dim=16), torch.float32),
    "internlm3": ("internlm3", dict(GQA, head_dim=16), torch.float32),
    "exaone": ("exaone", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              num_layers=2, max_position_embeddings=128), torch.float32),
    "bitnet": ("bitnet", GQA, torch.float32),
    "nanochat": ("nanochat", dict(GQA, head_dim=16), torch.float32),
    "mimo_v2_flash": ("mimo_v2_flash", dict(GQA, head_dim=16), torch.float32),
    "hy_v3": ("hy_v3", dict(GQA, head_dim=16), torch.float32),
    "granitemoe_swa": ("granitemoe_swa", dict(GQA, num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
                       torch.float32),
    "flex_olmo": ("flex_olmo", dict(GQA, num_experts=4, num_experts_per_tok=2), torch.float32),
    "lfm2_moe": ("lfm2_moe", dict(GQA, layer_types=["conv", "full_attention"], num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, num_dense_layers=1), torch.float32),
    "dbrx": ("dbrx", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                          attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                          ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)), torch.float32),
    "longcat_flash": ("longcat_flash", dict(SHAPE, num_key_value_heads=4, ffn_hidden_size=64, expert_ffn_hidden_size=32,
                                            n_routed_experts=4, zero_expert_num=2, moe_topk=2, q_lora_rank=32,
                                            kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                            head_dim=8, qk_head_dim=16, num_layers=1), torch.float32),
    "bamba": ("bamba", dict(GQA, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                            mamba_n_groups=1), torch.float32),
    "jamba": ("jamba", dict(GQA, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16, mamba_dt_rank=16,
                            mamba_expand=2), torch.float32),
    "mamba": ("mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=16, intermediate_size=128,
                            time_step_rank=16), torch.float32),
    "mamba2": ("mamba2", dict(hidden_size=64, num_hidden_layers=2, state_size=16, num_heads=8, head_dim=16, n_groups=1,
                              expand=2), torch.float32),
    "falcon_mamba": ("falcon_mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=16, intermediate_size=128,
                                          time_step_rank=16), torch.float32),
    # as published: one shared transformer block used by every hybrid layer
    "zamba2": ("zamba2", dict(GQA, num_hidden_layers=4, mamba_d_state=16, mamba_headdim=16, n_mamba_heads=8,
                              hybrid_layer_ids=[1, 3], num_mem_blocks=1,
                              layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]), torch.float32),
    "minimax": ("minimax", dict(GQA, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                layer_types=["linear_attention", "full_attention"], block_size=16), torch.float32),
    "recurrent_gemma": ("recurrent_gemma", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                num_key_value_heads=1, num_hidden_layers=3, lru_width=64,
                                                attention_window_size=16,
                                                block_types=["recurrent", "recurrent", "attention"]), torch.float32),
    "diffllama": ("diffllama", GQA, torch.float32),
    "doge": ("doge", GQA, torch.float32),
    # image-text checkpoints fine-tuned on text (the vision tower kept, unchanged): served for text
    "gemma3-vision": ("gemma3", dict(text_config=dict(GQA, head_dim=16, sliding_window=16,
                                                      layer_types=["sliding_attention", "full_attention"]),
                                     vision_config=dict(VISION, model_type="siglip_vision_model"),
                                     mm_tokens_per_image=4, image_token_index=120, boi_token_index=121,
                                     eoi_token_index=122), torch.float32),
    "mistral3": ("mistral3", dict(text_config=dict(GQA, model_type="mistral", sliding_window=None),
                                  vision_config=dict(VISION, model_type="pixtral", head_dim=16),
                                  image_token_index=120, spatial_merge_size=1), torch.float32),
    "llava": ("llava", dict(text_config=dict(GQA, model_type="llama"),
                            vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=32),
                            image_token_index=120), torch.float32),
    "qwen2_5_vl": ("qwen2_5_vl", dict(text_config=dict(GQA, model_type="qwen2_5_vl_text",
                                                       rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3])),
                                      vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                         out_hidden_size=64, fullatt_block_indexes=[0]),
                                      image_token_id=120, video_token_id=121, vision_start_token_id=122),
                   torch.float32),
    "qwen2_vl": ("qwen2_vl", dict(text_config=dict(GQA, head_dim=16, model_type="qwen2_vl_text",
                                                   rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3])),
                                  vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
                                  image_token_id=120, video_token_id=121, vision_start_token_id=122), torch.float32),
    "qwen3_vl": ("qwen3_vl", dict(text_config=dict(GQA, head_dim=16, model_type="qwen3_vl_text", rope_scaling=MROPE3),
                                  vision_config=QWEN3_VISION, image_token_id=120, video_token_id=121,
                                  vision_start_token_id=122), torch.float32),
    "qwen3_vl_moe": ("qwen3_vl_moe", dict(text_config=dict(GQA, head_dim=16, model_type="qwen3_vl_moe_text",
                                                           moe_intermediate_size=32, num_experts=4,
                                                           num_experts_per_tok=2, rope_scaling=MROPE3),
                                          vision_config=QWEN3_VISION, image_token_id=120, video_token_id=121,
                                          vision_start_token_id=122), torch.float32),
    "mllama": ("mllama", dict(text_config=dict(GQA, model_type="mllama_text_model", cross_attention_layers=[1]),
                              vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_global_layers=1, attention_heads=2, image_size=28, patch_size=14,
                                                 vision_output_dim=64, intermediate_layers_indices=[0]),
                              image_token_index=120), torch.float32),
    "paligemma": ("paligemma", dict(text_config=dict(GQA, head_dim=16, model_type="gemma"),
                                    vision_config=dict(VISION, model_type="siglip_vision_model", projection_dim=64),
                                    image_token_index=120), torch.float32),
    "idefics3": ("idefics3", dict(text_config=dict(GQA, model_type="llama"),
                                  vision_config=dict(VISION, model_type="idefics3_vision"), image_token_id=120,
                                  scale_factor=1), torch.float32),
    "smolvlm": ("smolvlm", dict(text_config=dict(GQA, model_type="llama"),
                                vision_config=dict(VISION, model_type="smolvlm_vision"), image_token_id=120,
                                scale_factor=1), torch.float32),
    "internvl": ("internvl", dict(text_config=dict(GQA, model_type="qwen2"),
                                  vision_config=dict(VISION, image_size=[28, 28], patch_size=[14, 14]),
                                  image_token_id=120, downsample_ratio=0.5), torch.float32),
    "llava_next": ("llava_next", dict(text_config=dict(GQA, model_type="llama"),
                                      vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=32),
                                      image_token_index=120, image_grid_pinpoints=[[28, 28], [28, 56], [56, 28]]),
                   torch.float32),
    "llava_onevision": ("llava_onevision", dict(text_config=dict(GQA, model_type="qwen2"),
                                                vision_config=dict(VISION, model_type="siglip_vision_model"),
                                                image_token_index=120, video_token_index=121,
                                                image_grid_pinpoints=[[28, 28], [28, 56], [56, 28]]), torch.float32),
    "aya_vision": ("aya_vision", dict(text_config=dict(GQA, model_type="cohere2", sliding_window=16,
                                                       layer_types=["sliding_attention", "full_attention"]),
                                      vision_config=dict(VISION, model_type="siglip_vision_model"),
                                      image_token_index=120, downsample_factor=1), torch.float32),
    "idefics2": ("idefics2", dict(text_config=dict(GQA, model_type="mistral", sliding_window=None),
                                  vision_config=dict(VISION, model_type="idefics2_vision"), image_token_id=120,
                                  perceiver_config=dict(hidden_size=64, resampler_n_latents=4, resampler_depth=1,
                                                        resampler_n_heads=2, resampler_head_dim=16,
                                                        num_key_value_heads=1)), torch.float32),
    "glm4v": ("glm4v", dict(text_config=dict(GQA, head_dim=16, model_type="glm4v_text", rope_parameters=dict(
                                rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
                            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                               out_hidden_size=64, patch_size=14, image_size=28),
                            image_token_id=120, video_token_id=121, image_start_token_id=121,
                            image_end_token_id=122), torch.float32),
    # hybrid language models behind a vision tower (Qwen3.5 is released in this form)
    "qwen3_5-vision": ("qwen3_5", dict(text_config=dict(QWEN3_5_TEXT, model_type="qwen3_5_text"), **QWEN3_5_IMAGES),
                       torch.float32),
    "qwen3_5_moe-vision": ("qwen3_5_moe", dict(text_config=dict(QWEN3_5_TEXT, model_type="qwen3_5_moe_text",
                                                                moe_intermediate_size=32, num_experts=4,
                                                                num_experts_per_tok=2,
                                                                shared_expert_intermediate_size=32),
                                               **QWEN3_5_IMAGES), torch.float32),
    "lfm2_vl": ("lfm2_vl", dict(text_config=dict(GQA, model_type="lfm2", layer_types=["conv", "full_attention"]),
                                vision_config=dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                                                   num_patches=16),
                                image_token_id=120, projector_hidden_size=64, downsample_factor=2), torch.float32),
    "gemma4-vision": ("gemma4", dict(text_config=dict(GQA, head_dim=16, model_type="gemma4_text", global_head_dim=32,
                                                      layer_types=["sliding_attention", "full_attention"],
                                                      sliding_window=16, hidden_size_per_layer_input=16,
                                                      vocab_size_per_layer_input=128)), torch.float32),
}
CHECKS = ("compress", "merge", "serve_delta", "serve_swap", "serve_tp2", "serve_lora", "eval")
EVAL_TASKS = ("deltazip_ticket", "deltazip_copy")  # lm-eval: multiple choice (loglikelihood), generation
TEXT = ("the quick brown fox jumps over the lazy dog. " * 12
        + "0123456789 abcdefghij klmnopqrst uvwxyz, pack my box with five dozen liquor jugs. " * 6)


def log(msg: str) -> None:
    print(f"[bench/support] {msg}", file=sys.stderr, flush=True)


def machine() -> dict:
    import os

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count()}


def tiny(family: str, seed: int = 0):
    from transformers import AutoConfig

    from deltazip.models.loader import causal_lm_class

    model_type, cfg, dtype = FAMILIES[family]
    tokens = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if "text_config" in cfg:  # an image-text model: the vocabulary is its language model's
        cfg = dict(cfg, text_config=dict(cfg["text_config"], **tokens))
        tokens = {k: v for k, v in tokens.items() if k != "vocab_size"}
    config = AutoConfig.for_model(model_type, **tokens, **cfg)
    torch.manual_seed(seed)
    return causal_lm_class(config)._from_config(config, dtype=dtype).eval()


def finetune(model, tok, steps: int, seed: int = 1):
    """Adam on next-token loss over windows of a repeating sentence (fp32 master weights for bf16)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(tok(TEXT)["input_ids"][1:])
    dtype = next(model.parameters()).dtype
    model.float().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - 33, (4,), generator=g)
        batch = torch.stack([ids[s:s + 32] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.to(dtype).eval()


def one_line(e: BaseException) -> str:
    from deltazip.formats.errors import DeltazipError

    msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
    kind = "refused" if isinstance(e, DeltazipError) else "fails"
    return f"{kind}: {msg if isinstance(e, DeltazipError) else f'{type(e).__name__}: {msg}'}"[:300]


class Family:
    """One family's base, fine-tune, artifact and merged checkpoint under ``root``."""

    def __init__(self, name: str, root: Path, steps: int, prompts: int, tokens: int):
        from deltazip.demo.pair import build_char_tokenizer

        self.name, self.root, self.tokens = name, root, tokens
        self.tok = build_char_tokenizer()
        self.base_dir, self.ft_dir = root / "base", root / "ft"
        for d, model in ((self.base_dir, tiny(name)), (self.ft_dir, finetune(tiny(name), self.tok, steps))):
            model.save_pretrained(d, safe_serialization=True)
            self.tok.save_pretrained(d)
        self.art = root / "arts" / "ft"
        self.merged_dir = root / "merged"
        self.prompts = [self.tok(p)["input_ids"] for p in ("the quick", "pack my box", "0123", "lazy dog")[:prompts]]
        (root / "text.txt").write_text(TEXT)

    def compress(self) -> None:
        from deltazip.compress.config import CompressConfig
        from deltazip.compress.pipeline import compress_delta
        from deltazip.kernels.scheme import DeltaScheme

        calib = self.root / "calib.jsonl"
        calib.write_text("".join(json.dumps({"text": TEXT[i:i + 80]}) + "\n" for i in range(0, 640, 40)))
        cfg = CompressConfig(scheme=DeltaScheme(bits=4, sparsity="none"), group_auto=True, method="deltazip",
                             nsamples=8, seqlen=32, device="cpu")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compress_delta(self.base_dir, self.ft_dir, str(calib), self.art, cfg)
        # a tenth or more of the matrix bytes left uncompressed (compress's own warning) fails the check
        big = [str(w.message) for w in seen if "matrix bytes" in str(w.message)]
        if big:
            raise AssertionError(big[0])

    def merge(self) -> None:
        from deltazip.compress.merge import merge_to_dir
        from deltazip.formats.artifact import Artifact
        from deltazip.models.checkpoint import Checkpoint
        from deltazip.models.loader import load_causal_lm

        merge_to_dir(Artifact(self.art), Checkpoint(self.base_dir), self.merged_dir)
        ids = torch.tensor([self.tok(TEXT[i:i + 40])["input_ids"] for i in (3, 50, 120)])
        logits = {}
        for k, d in (("base", self.base_dir), ("ft", self.ft_dir), ("merged", self.merged_dir)):
            m = load_causal_lm(d, torch.float32)
            with torch.no_grad():
                logits[k] = m(input_ids=ids).logits
        err_m = float((logits["merged"] - logits["ft"]).pow(2).mean())
        err_b = float((logits["base"] - logits["ft"]).pow(2).mean())
        if not err_m < err_b:
            raise AssertionError(f"merged model is not closer to the fine-tune than the base ({err_m:.3g} vs {err_b:.3g})")

    def tp_artifact(self) -> Path:
        """The fine-tune compressed RTN 4-bit in groups of 16, and its merged checkpoint beside it."""
        from transformers import AutoConfig

        from deltazip.compress.config import CompressConfig
        from deltazip.compress.merge import merge_to_dir
        from deltazip.compress.pipeline import compress_delta
        from deltazip.formats.artifact import Artifact
        from deltazip.formats.errors import InputError
        from deltazip.kernels.scheme import DeltaScheme
        from deltazip.models.checkpoint import Checkpoint
        from deltazip.runtime.cluster.tensor_parallel import check_config

        check_config(AutoConfig.from_pretrained(self.base_dir), 2)  # a family it does not shard: its refusal
        art = self.root / "tp" / "arts" / "ft"
        cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=16, sparsity="none"), method="rtn", device="cpu")
        try:
            compress_delta(self.base_dir, self.ft_dir, None, art, cfg)
        except InputError as e:
            if "input features, not divisible by" not in str(e):  # (a width the fixed group does not divide)
                raise
            cfg.group_auto = True
            compress_delta(self.base_dir, self.ft_dir, None, art, cfg)
        merge_to_dir(Artifact(art), Checkpoint(self.base_dir), self.root / "tp" / "merged")
        return art

    def reference(self, model, prompt: list[int]) -> str:
        """Greedy text of ``model`` (a checkpoint directory, or a loaded model) after ``prompt``."""
        from deltazip.models.loader import load_causal_lm

        m = load_causal_lm(model, torch.float32) if isinstance(model, Path) else model
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.tokens, do_sample=False,
                             pad_token_id=2, eos_token_id=1)
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def lora(self) -> Path:
        """A PEFT LoRA adapter (rank 4, every linear but the output layer, random factors) on the base
        under ``lora/arts/lora``, and its reference: PEFT's merged model (``lora/merged``), or where the base
        ties an adapted weight to another, PEFT's own model (``self.lora_model``)."""
        from peft import LoraConfig, get_peft_model

        from deltazip.models.loader import load_causal_lm

        def adapted(targets):
            return get_peft_model(load_causal_lm(self.base_dir, torch.float32),
                                  LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))

        try:
            pm = adapted("all-linear")
        except ValueError as e:  # PEFT refuses LoRA on Mamba's out_proj (and conv1d): every other linear
            if "incompatible with Mamba" not in str(e):
                raise
            model = load_causal_lm(self.base_dir, torch.float32)
            pm = adapted(sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                 if isinstance(m, torch.nn.Linear)} - {"out_proj", "lm_head"}))
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # (PEFT starts B at zero, which changes nothing)
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        art = self.root / "lora" / "arts" / "lora"
        pm.save_pretrained(art, safe_serialization=True)
        from deltazip.models.param_names import tied_names

        tied = any(".base_layer." in n for group in tied_names(pm) for n in group)
        self.lora_model = pm.eval() if tied else None
        if not tied:
            pm.merge_and_unload().save_pretrained(self.root / "lora" / "merged", safe_serialization=True)
        return art

    def serve(self, mode: str) -> None:
        from deltazip.models.checkpoint import Checkpoint
        from deltazip.runtime.cluster.tp_group import start_tensor_parallel
        from deltazip.runtime.serve.engine import (
            Engine,
            EngineConfig,
            FinishEvent,
            SamplingParams,
            ServedVariant,
        )
        from deltazip.runtime.serve.model import DeltaModel, SwapModels
        from deltazip.runtime.serve.variant_sources import discover_variants

        art = self.tp_artifact() if mode == "tp2" else self.lora() if mode == "lora" else self.art
        variants = discover_variants(art.parent)
        ck = Checkpoint(self.base_dir)
        if mode in ("delta", "lora"):
            backend = DeltaModel(ck, variants, 2, torch.device("cpu"), torch.float32)
        elif mode == "tp2":
            backend = start_tensor_parallel(ck, variants, 2, torch.device("cpu"), torch.float32, 2)
        else:
            backend = SwapModels(ck, variants, 2, torch.device("cpu"), torch.float32, "base")
        name = art.name  # the variant: "ft", or "lora"
        table = {"base": ServedVariant("base", self.tok, [1], None), name: ServedVariant(name, self.tok, [1], "base")}
        eng = Engine(backend, table, "base", EngineConfig(max_deltas=2, max_cpu_deltas=2))
        jobs = [(m, p) for p in self.prompts for m in (name, "base")]
        got: dict[int, str] = {}
        done = threading.Semaphore(0)

        def sink(i):
            def fn(ev):
                if isinstance(ev, FinishEvent):
                    got[i] = ev.text if ev.reason in ("stop", "length") else f"<{ev.reason}: {ev.error}>"
                    done.release()
            return fn

        for i, (m, p) in enumerate(jobs):
            eng.submit(m, p, SamplingParams(max_tokens=self.tokens, temperature=0.0), sink(i))
        eng.start()
        try:
            for _ in jobs:
                if not done.acquire(timeout=300):
                    raise TimeoutError("the engine did not finish")
        finally:
            eng.shutdown()
            if mode == "tp2":
                backend.close()
        own = getattr(self, "lora_model", None) if mode == "lora" else None
        for i, (m, p) in enumerate(jobs):
            want = self.reference((own or art.parent.parent / "merged") if m == name else self.base_dir, p)
            if got[i] != want:
                raise AssertionError(f"{m} greedy output differs from the merged model's generate ({got[i]!r} vs {want!r})")

    def eval(self) -> None:
        from deltazip.runtime.eval.run import EvalOptions, run_eval

        # lm-eval: one loglikelihood task (multiple choice) and one generation task, at the default
        # batch size; the artifact must score what the merged checkpoint scores
        opts = EvalOptions(base=str(self.base_dir), perplexity=self.root / "text.txt", ppl_window=32,
                           tasks=list(EVAL_TASKS), limit=8, device="cpu", dtype="float32")
        summary = run_eval([str(self.art), str(self.merged_dir)], opts)["summary"]
        ppl = summary["perplexity"]
        a, b = ppl["ft"]["perplexity"], ppl["merged"]["perplexity"]
        if abs(a - b) > 1e-4 * b:
            raise AssertionError(f"eval perplexity {a:.6g} differs from the merged checkpoint's {b:.6g}")
        rows = [r for r in summary["metrics"] if r["task"] in EVAL_TASKS]
        if {r["task"] for r in rows} != set(EVAL_TASKS):
            raise AssertionError(f"lm-eval reported {sorted({r['task'] for r in rows})}, not {list(EVAL_TASKS)}")
        for r in rows:
            if r["values"].get("ft") != r["values"].get("merged"):
                raise AssertionError(f"lm-eval {r['task']} {r['metric']}: {r['values']} (artifact != merged)")


def run_family(name: str, root: Path, quick: bool) -> dict:
    t0 = time.perf_counter()
    row: dict = {"family": name}
    try:
        fam = Family(name, root, steps=10 if quick else 30, prompts=2 if quick else 4, tokens=6 if quick else 12)
    except Exception as e:  # the model cannot even be built or fine-tuned here
        why = one_line(e).replace(f"{root.parent}/", "")
        return {**row, **dict.fromkeys(CHECKS, why), "seconds": round(time.perf_counter() - t0, 1)}
    needs = {"merge": "compress", "serve_delta": "merge", "serve_swap": "merge", "serve_tp2": "serve_delta",
             "eval": "merge"}  # (serve_lora needs only the base)
    for check in CHECKS:
        if check in needs and row.get(needs[check]) != "ok":
            row[check] = f"not run ({needs[check]} did not pass)"
            continue
        try:
            {"compress": fam.compress, "merge": fam.merge, "serve_delta": lambda: fam.serve("delta"),
             "serve_swap": lambda: fam.serve("swap"), "serve_tp2": lambda: fam.serve("tp2"),
             "serve_lora": lambda: fam.serve("lora"),
             "eval": fam.eval}[check]()
            row[check] = "ok"
        except Exception as e:  # one cell per failure: the matrix goes on
            row[check] = one_line(e).replace(f"{root.parent}/", "")  # no temporary paths in the table
            log(f"{name} {check}: {row[check]}")
            if "DELTAZIP_DEBUG" in __import__("os").environ:
                traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def markdown(rows: list[dict], cmd: str, seconds: float, mach: dict | None = None) -> str:
    """The Markdown page: the table (cells cut at 150 characters; the JSON has them whole), closed by
    the run's time and the machine it ran on (``mach``: :func:`machine`'s record)."""
    head = ("# Support matrix\n\nGenerated by `" + cmd + "` (tiny models built in code, fine-tuned briefly; "
            "see the script's docstring for what each check asserts). `ok`: the check passed; otherwise "
            "the first line of the refusal or failure. A family that fails a check the others pass is a "
            "bug or a missing feature, not a limit of the method.\n\n")
    cols = ["family", *CHECKS]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r[c]) if len(str(r[c])) <= 150 else str(r[c])[:149] + "…" for c in cols]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    where = ""
    if mach:
        arch = mach.get("platform", "").split("-with-")[0].rsplit("-", 1)[-1]
        where = f" on {mach.get('cpus')} CPU cores ({arch}, torch {mach.get('torch')})"
    return head + "\n".join(lines) + f"\n\n{len(rows)} families in {seconds:.0f} s{where}.\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer fine-tuning steps, prompts and tokens")
    ap.add_argument("--families", default=None, help=f"comma-separated subset of: {','.join(FAMILIES)}")
    ap.add_argument("--doc", type=Path, default=None, help="write the Markdown table here (docs/support.md)")
    ap.add_argument("--out", type=Path, default=None, help="also write support.json here")
    args = ap.parse_args(argv)
    names = list(FAMILIES) if not args.families else [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        print(f"unknown family {unknown[0]!r}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="deltazip-support-") as tmp:
        for n in names:
            log(f"{n} ...")
            rows.append(run_family(n, Path(tmp) / n, args.quick))
            log(f"{n}: {json.dumps(rows[-1])}")
    doc = {"bench": "support", "machine": machine(), "config": {"quick": args.quick, "families": names},
           "results": rows}
    print(json.dumps(doc, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "support.json").write_text(json.dumps(doc, indent=1) + "\n")
    if args.doc:
        cmd = "python bench/support.py" + (" --quick" if args.quick else "")
        args.doc.write_text(markdown(rows, cmd, sum(r["seconds"] for r in rows), doc["machine"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
