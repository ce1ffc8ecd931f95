"""Tiny models, tokenizers and calibration files built in code for tests (nothing from a hub)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, PreTrainedTokenizerFast

from deltazip.models.loader import causal_lm_class

ALPHABET = list("abcdefghijklmnopqrstuvwxyz0123456789 .,:;=+-?!\n")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def tiny_tokenizer(save_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (vocab 52) that AutoTokenizer can load back."""
    vocab = {t: i for i, t in enumerate(SPECIALS + ALPHABET)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    if save_dir is not None:
        tok.save_pretrained(save_dir)
    return tok


_LM = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
           max_position_embeddings=128)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)
ARCH_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128, sliding_window=None),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_hidden_layers=2, max_position_embeddings=128, rotary_pct=0.5),
    # fused projections: qkv_proj [q; k; v] and gate_up_proj [gate; up]
    "phi3": dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, max_position_embeddings=128),
    "phi": dict(model_type="phi", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_hidden_layers=2, max_position_embeddings=128, partial_rotary_factor=0.5),
    "gemma": dict(model_type="gemma", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128),
    "gemma3": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128,
                   layer_types=["full_attention", "full_attention"], sliding_window=128),
    # q/k norms per head (Qwen3); attention logits soft-capped, sliding-window layers (Gemma 2); scalar
    # multipliers (Granite); layers without rotary positions (SmolLM3)
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128),
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(model_type="granite", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128, attention_multiplier=0.2,
                    residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=2.0),
    "smollm3": dict(model_type="smollm3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128, no_rope_layers=[1, 0]),
    # AltUp (its output scale a parameter of its own), Laurel, per-layer inputs
    "gemma3n": dict(model_type="gemma3n_text", hidden_size=64, intermediate_size=[128, 128], num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=16, num_kv_shared_layers=0,
                    laurel_rank=8, altup_num_inputs=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=128,
                    activation_sparsity_pattern=[0.0, 0.0]),
    "gpt_bigcode": dict(model_type="gpt_bigcode", n_embd=64, n_head=4, n_layer=2, n_positions=128),
    "gpt_bigcode_mha": dict(model_type="gpt_bigcode", n_embd=64, n_head=4, n_layer=2, n_positions=128,
                            multi_query=False),
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2,
                max_position_embeddings=128, word_embed_proj_dim=64),
    # Conv1D linears, weights stored [in, out]
    "gpt2": dict(model_type="gpt2", n_embd=64, n_head=4, n_layer=2, n_positions=128),
    # transformers 5: fused experts [E, out, in]; save_pretrained writes one tensor per expert
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, max_position_embeddings=128, num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                      max_position_embeddings=128, num_experts=4, num_experts_per_tok=2),
    # the router is an nn.Linear subclass with a forward of its own (sparsemixer top-k, a tuple out)
    "phimoe": dict(model_type="phimoe", hidden_size=64, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128, num_local_experts=4,
                   num_experts_per_tok=2),
    # multi-head latent attention (the cache holds latents that kv_b_proj expands), a dense first layer,
    # then routed experts beside a shared one
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, max_position_embeddings=128,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        n_shared_experts=1),
    # attention sinks, sliding and full layers; experts stored [E, in, out] with biases, a router with a bias
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=32)),
    # experts stored [E, in, out] and run by torch.bmm over every token (each scaled by its routing
    # weight, zero where not routed); an nn.Linear router with its own forward; a shared expert; chunked
    # attention on rope layers, temperature-tuned queries on the others
    "llama4": dict(model_type="llama4_text", hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                   max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2, no_rope_layers=[1, 0],
                   attention_chunk_size=16, floor_scale=8, attn_scale=0.5),
    # Gemma 4's MoE form: a dense MLP beside routed experts in every layer; a router module holding a
    # scale, per-expert scales and its projection (a linear); keys doubling as values on global layers
    "gemma4": dict(model_type="gemma4_text", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, global_head_dim=32, num_hidden_layers=2,
                   max_position_embeddings=128, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                   hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1),
    # hybrid: gated-delta-rule linear attention layers (a convolution window and a recurrent state per
    # sequence) beside full attention layers
    "qwen3_5": dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_hidden_layers=3, max_position_embeddings=128,
                    layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    # the same linear attention beside experts with a shared expert (Qwen3-Next's projections fused per key head)
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_hidden_layers=3, max_position_embeddings=128,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                        shared_expert_intermediate_size=32),
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_hidden_layers=3, max_position_embeddings=128,
                       layer_types=["linear_attention", "full_attention", "linear_attention"],
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       shared_expert_intermediate_size=32),
    # hybrid: short-convolution layers (a convolution window per sequence) beside attention layers
    "lfm2": dict(model_type="lfm2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=128,
                 layer_types=["conv", "full_attention", "conv"]),
    # the same, its attention gated per head by a projection of its own (g_proj)
    "lfm3": dict(model_type="lfm3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=128,
                 layer_types=["conv", "full_attention", "conv"]),
    # the same beside experts (a router with a correction bias), the first layer a dense MLP
    "lfm2_moe": dict(model_type="lfm2_moe", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=128,
                     layer_types=["conv", "full_attention", "conv"], num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, num_dense_layers=1),
    # a router whose own [E, H] weight sits beside statistics of its own (a [1, E] correction bias)
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                         moe_num_experts=4, moe_k=2, moe_layer_start_index=1, moe_num_shared_experts=1,
                         initializer_range=0.2),  # at 0.02 its greedy output is one token repeated, whatever the weights
    # a router module holding its gate linear, given [B, T, H] and the block's expert bias
    "afmoe": dict(model_type="afmoe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                  max_position_embeddings=128, num_experts=4, num_experts_per_tok=2, sliding_window=6,
                  layer_types=["sliding_attention", "full_attention"]),
    # hybrid layers: attention and a Mamba-2 mixer side by side in every layer (a KV cache and a state)
    "falcon_h1": dict(model_type="falcon_h1", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128,
                      mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1),
    # linear attention whose checkpoint splits the fused convolution into q/k/v pieces, beside MLA layers
    "kimi_linear": dict(model_type="kimi_linear", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=4, num_hidden_layers=2, max_position_embeddings=128,
                        layer_types=["linear_attention", "full_attention"], linear_num_heads=4, linear_head_dim=16,
                        num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, kv_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    # xIELU activation: two learned scalars per layer (alpha_p, alpha_n), an MLP without a gate
    "apertus": dict(model_type="apertus", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128),
    # LayerNorm1P: a LayerNorm that scales by 1 + weight, with a bias
    "nemotron": dict(model_type="nemotron", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=128),
    # LayerNorm without a bias (the mean subtracted, a weight only)
    "cohere": dict(model_type="cohere", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128),
    # q/k norms over every head (OLMo 2/3; OLMoE and FlexOlmo beside fused experts); OLMo 3's sliding layers
    "olmo2": dict(_LM, model_type="olmo2"),
    # sub-layer norms over the attention's output and the MLP's product, before o_proj and down_proj
    "bitnet": dict(_LM, model_type="bitnet"),
    "olmo3": dict(_LM, model_type="olmo3", sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "olmoe": dict(_LM, model_type="olmoe", num_experts=4, num_experts_per_tok=2, clip_qkv=8.0),
    "flex_olmo": dict(_LM, model_type="flex_olmo", num_experts=4, num_experts_per_tok=2),
    # MLPs named otherwise (StarCoder2's c_fc/c_proj with biases); GPT-J's transformer.h layers (fc_in/fc_out);
    # XGLM's attention reshaping to its own embed_dim; Persimmon's query_key_value, each head's q, k, v together
    "starcoder2": dict(_LM, model_type="starcoder2", sliding_window=None),
    "gptj": dict(model_type="gptj", n_embd=64, n_head=4, n_layer=2, n_positions=128, rotary_dim=8),
    # qkv_proj: 4 blocks (its pretraining's model-parallel shards), each a quarter of the heads' q, v, k
    "codegen": dict(model_type="codegen", n_embd=64, n_head=8, n_layer=2, n_positions=128, rotary_dim=4, n_ctx=128),
    "xglm": dict(model_type="xglm", d_model=64, ffn_dim=128, attention_heads=4, num_layers=2,
                 max_position_embeddings=128),
    "persimmon": dict(_LM, model_type="persimmon", num_key_value_heads=4),
    # Falcon's query_key_value grouped by KV head (Falcon-40B's layout), and by head (no multi-query)
    "falcon": dict(model_type="falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=False,
                   new_decoder_architecture=True, num_kv_heads=2, max_position_embeddings=128),
    "falcon_mq": dict(model_type="falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=False,
                      multi_query=True, max_position_embeddings=128),
    "falcon_mha": dict(model_type="falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=False,
                       multi_query=False, max_position_embeddings=128),
    "minimax_m2": dict(_LM, model_type="minimax_m2", head_dim=16, intermediate_size=32, num_local_experts=4,
                       num_experts_per_tok=2),
    # checkpoint names transformers renames on load, layer prefix included (transformer.h.3.attn.attention.q_proj)
    "exaone": dict(model_type="exaone", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, num_layers=2, max_position_embeddings=128),
    # Mamba and attention layers of two classes in one list; the Mamba mixer reads its dt_proj's weight
    # itself (not by calling it); routed experts every other layer
    "jamba": dict(model_type="jamba", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128, num_experts=4,
                  num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_d_state=16, mamba_dt_rank=8, mamba_expand=2),
    # ALiBi attention (a slope per head, built above the layers): BLOOM's per-head q/k/v rows, MPT's
    # q, k, v blocks (Wqkv), Falcon-RW's per-head rows (multi_query off, sequential attention and MLP)
    "bloom": dict(model_type="bloom", hidden_size=64, n_head=4, n_layer=2),
    "mpt": dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=128),
    "falcon_rw": dict(model_type="falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=True,
                      multi_query=False, parallel_attn=False, bias=True, max_position_embeddings=128),
    # gated delta nets with separate q/k/v/a/b projections and a per-head output norm, beside attention
    "olmo_hybrid": dict(model_type="olmo_hybrid", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                        layer_types=["linear_attention", "full_attention"]),
    # Mamba-1 layers only, under backbone. (dt_proj's weight read by the mixer itself); Falcon-Mamba's
    # mixer normalises its dt, B and C
    "mamba": dict(model_type="mamba", hidden_size=64, num_hidden_layers=2, state_size=16, intermediate_size=128,
                  time_step_rank=16),
    "falcon_mamba": dict(model_type="falcon_mamba", hidden_size=64, num_hidden_layers=2, state_size=16,
                         intermediate_size=128, time_step_rank=16),
    # recurrent layers only (Mamba-2): no attention, the padding mask passed to the layers as it is
    "mamba2": dict(model_type="mamba2", hidden_size=64, num_hidden_layers=2, state_size=16, num_heads=8, head_dim=16,
                   n_groups=1, expand=2),
    # checkpoint under backbone. (the module is model.); Mamba-2, attention, ungated routed experts (up_proj
    # and down_proj, a squared ReLU between) and a dense MLP as layers of their own
    "nemotron_h": dict(model_type="nemotron_h", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=4, head_dim=16, max_position_embeddings=128,
                       mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                       n_group=1, topk_group=1,
                       layers_block_type=["linear_attention", "moe", "full_attention", "mlp"]),
    # experts as flat [E * F, H] matrices (DbrxExpertGLU), which deltazip does not compress
    "dbrx": dict(model_type="dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    # Mamba-2 layers and hybrid layers holding one shared transformer block (tied across layers)
    "zamba2": dict(model_type="zamba2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=128, mamba_d_state=16,
                   mamba_headdim=16, n_mamba_heads=8, hybrid_layer_ids=[1, 3], num_mem_blocks=1,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    # the same with one hybrid layer (nothing tied): attention only inside the hybrid layer
    "zamba2-untied": dict(model_type="zamba2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128, mamba_d_state=16,
                          mamba_headdim=16, n_mamba_heads=8, hybrid_layer_ids=[1], num_mem_blocks=1,
                          layers_block_type=["mamba", "hybrid"]),
    # the model unpacks each layer's output (hidden_states, attn_weights = layer(...))
    # Granite 4: Mamba-2 layers (one group) and attention layers, each beside experts and a shared MLP
    "granitemoehybrid": dict(model_type="granitemoehybrid", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                             layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                             mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                             shared_intermediate_size=64),
    "bamba": dict(model_type="bamba", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128, attn_layer_indices=[1],
                  mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1),
    # image-text checkpoints (a vision tower beside the language model), fine-tuned on text
    "llava": dict(model_type="llava", text_config=dict(_LM, model_type="llama"),
                  vision_config=dict(_VISION, model_type="clip_vision_model", projection_dim=32), image_token_index=120),
    "mistral3": dict(model_type="mistral3", text_config=dict(_LM, model_type="mistral", sliding_window=None),
                     vision_config=dict(_VISION, model_type="pixtral", head_dim=16), image_token_index=120,
                     spatial_merge_size=1),
    # an image's tokens see each other both ways; sliding-window layers
    "gemma3_vl": dict(model_type="gemma3", text_config=dict(_LM, model_type="gemma3_text", head_dim=16, sliding_window=16,
                                                            layer_types=["sliding_attention", "full_attention"]),
                      vision_config=dict(_VISION, model_type="siglip_vision_model"), mm_tokens_per_image=4,
                      image_token_index=120, boi_token_index=121, eoi_token_index=122),
    # images split into tiles (the processor adds its image token, id 129, to the tokenizer)
    "idefics3": dict(model_type="idefics3", text_config=dict(_LM, model_type="llama"),
                     vision_config=dict(_VISION, model_type="idefics3_vision"), image_token_id=129, scale_factor=1),
    # Idefics3's successor (its image token, id 128, is the first of the tokens its processor expects)
    "smolvlm": dict(model_type="smolvlm", text_config=dict(_LM, model_type="llama"),
                    vision_config=dict(_VISION, model_type="smolvlm_vision"), image_token_id=128, scale_factor=1),
    # cross-attention layers, skipped by a text-only forward (a decoder layer after it: what it does to any token shows)
    "mllama": dict(model_type="mllama", text_config=dict(_LM, model_type="mllama_text_model", num_hidden_layers=3,
                                                         cross_attention_layers=[1]),
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1,
                                      attention_heads=2, image_size=28, patch_size=14, vision_output_dim=64,
                                      intermediate_layers_indices=[0]), image_token_index=120),
    "qwen2_vl": dict(model_type="qwen2_vl", text_config=dict(_LM, model_type="qwen2_vl_text", head_dim=16,
                                                              rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3])),
                     vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
                     image_token_id=120, video_token_id=121, vision_start_token_id=122),
    # positions in three sections (multimodal RoPE), equal for text; more vision blocks than decoder layers (as at 7B)
    "qwen2_5_vl": dict(model_type="qwen2_5_vl", text_config=dict(_LM, model_type="qwen2_5_vl_text", head_dim=16,
                                                                  rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3])),
                       vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                          fullatt_block_indexes=[0]),
                       image_token_id=120, video_token_id=121, vision_start_token_id=122),
    # DeepStack: the vision tower's first layer also feeds the first decoder layer's output
    "qwen3_vl": dict(model_type="qwen3_vl", text_config=dict(_LM, model_type="qwen3_vl_text", head_dim=16,
                                                            rope_scaling=dict(rope_type="default", mrope_section=[2, 3, 3],
                                                                              mrope_interleaved=True)),
                     vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                        deepstack_visual_indexes=[0, 1]),
                     image_token_id=120, video_token_id=121, vision_start_token_id=122),
    # per-layer token embeddings beside the input embeddings; 63 tokens per image (the processor's least)
    "gemma4_vl": dict(model_type="gemma4",
                      text_config=dict(_LM, model_type="gemma4_text", head_dim=16, global_head_dim=32,
                                       layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                                       hidden_size_per_layer_input=32, vocab_size_per_layer_input=256,
                                       max_position_embeddings=512),
                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, head_dim=16, patch_size=14, pooling_kernel_size=2,
                                         position_embedding_size=256),
                      image_token_id=120, boi_token_id=121, eoi_token_id=122, video_token_id=123, audio_token_id=124),
    # a prefix language model: its prompt is read with bidirectional attention (the processor's image
    # token, id 128, and its 1,152 location and segmentation tokens grow the tokenizer)
    "paligemma": dict(model_type="paligemma", text_config=dict(_LM, model_type="gemma", head_dim=16),
                      vision_config=dict(_VISION, model_type="siglip_vision_model"), projection_dim=64,
                      image_token_index=128),
    # tiles of 28x28, a token per tile after pixel shuffle (downsample 0.5)
    "internvl": dict(model_type="internvl", text_config=dict(_LM, model_type="qwen2"),
                     vision_config=dict(_VISION, image_size=[28, 28], patch_size=[14, 14]), image_token_id=120,
                     downsample_ratio=0.5),
    "qwen3_vl_moe": dict(model_type="qwen3_vl_moe",
                         text_config=dict(_LM, model_type="qwen3_vl_moe_text", head_dim=16, moe_intermediate_size=64,
                                          num_experts=4, num_experts_per_tok=2,
                                          rope_scaling=dict(rope_type="default", mrope_section=[2, 3, 3],
                                                            mrope_interleaved=True)),
                         vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                            out_hidden_size=64, deepstack_visual_indexes=[0, 1]),
                         image_token_id=120, video_token_id=121, vision_start_token_id=122),
    # images split into a grid of tiles at the best of several resolutions, plus a base view
    "llava_next": dict(model_type="llava_next", text_config=dict(_LM, model_type="llama"),
                       vision_config=dict(_VISION, model_type="clip_vision_model", projection_dim=32),
                       image_token_index=120, image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]]),
    "llava_onevision": dict(model_type="llava_onevision", text_config=dict(_LM, model_type="qwen2"),
                            vision_config=dict(_VISION, model_type="siglip_vision_model"), image_token_index=120,
                            video_token_index=121, image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]],
                            vision_aspect_ratio="anyres_max_9"),
    # a Cohere 2 language model (sliding-window layers) behind a SigLIP tower
    "aya_vision": dict(model_type="aya_vision", text_config=dict(_LM, model_type="cohere2", sliding_window=16,
                                                                layer_types=["sliding_attention", "full_attention"]),
                       vision_config=dict(_VISION, model_type="siglip_vision_model"), image_token_index=120,
                       downsample_factor=1),
    # a perceiver resampler between the tower and the language model (its image token, id 128, is the
    # first of the tokens its processor adds)
    "idefics2": dict(model_type="idefics2", text_config=dict(_LM, model_type="mistral", sliding_window=None),
                     vision_config=dict(_VISION, model_type="idefics2_vision"), image_token_id=128,
                     perceiver_config=dict(hidden_size=64, resampler_n_latents=4, resampler_depth=1,
                                           resampler_n_heads=2, resampler_head_dim=16, num_key_value_heads=1)),
    # positions in three sections (GLM-4.1V)
    "glm4v": dict(model_type="glm4v", text_config=dict(_LM, model_type="glm4v_text", head_dim=16, rope_parameters=dict(
                      rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                     patch_size=14, image_size=28, spatial_merge_size=2, temporal_patch_size=2),
                  image_token_id=120, video_token_id=121, image_start_token_id=121, image_end_token_id=122),
}
# Image-text forms of hybrid language models (recurrent layers beside attention): Qwen3.5 and its MoE form
# (gated delta rule layers; positions in three sections) and LFM2-VL (short convolutions).
ARCH_CONFIGS["qwen3_5_vl"] = dict(
    model_type="qwen3_5", image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    text_config={**{k: v for k, v in ARCH_CONFIGS["qwen3_5"].items() if k != "model_type"}, "model_type": "qwen3_5_text",
                 "rope_parameters": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                         mrope_section=[1, 1, 2], mrope_interleaved=True)},
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                       num_position_embeddings=16))
ARCH_CONFIGS["qwen3_5_moe_vl"] = dict(ARCH_CONFIGS["qwen3_5_vl"], model_type="qwen3_5_moe", text_config={
    **ARCH_CONFIGS["qwen3_5_vl"]["text_config"], "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 32,
    "num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32})
# Gemma 3n: a timm MobileNetV5 tower (the smallest timm builds, 81M parameters; 256 soft tokens per
# image), the vision and audio special tokens after the character tokenizer's 128 ids
ARCH_CONFIGS["gemma3n_vl"] = dict(
    model_type="gemma3n", boi_token_id=128, image_token_id=129, eoi_token_id=130, boa_token_id=131, audio_token_id=132,
    eoa_token_id=133, vision_soft_tokens_per_image=256, audio_soft_tokens_per_image=4,
    text_config={**{k: v for k, v in ARCH_CONFIGS["gemma3n"].items() if k != "model_type"}, "model_type": "gemma3n_text"},
    vision_config=dict(architecture="mobilenetv5_base", hidden_size=2048, vocab_size=3, vocab_offset=128),
    audio_config=dict(vocab_size=3, vocab_offset=131, hidden_size=32, conf_num_attention_heads=2,
                      conf_num_hidden_layers=1, sscp_conv_channel_size=[8, 8]))
ARCH_CONFIGS["lfm2_vl"] = dict(
    model_type="lfm2_vl", image_token_id=120, projector_hidden_size=64, downsample_factor=2,
    text_config={**{k: v for k, v in ARCH_CONFIGS["lfm2"].items() if k != "model_type"}, "model_type": "lfm2"},
    vision_config=dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, patch_size=14, num_patches=16))


def tiny_model(arch: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    cfg = dict(ARCH_CONFIGS[arch])
    model_type = cfg.pop("model_type")
    ids = dict(vocab_size=len(SPECIALS) + len(ALPHABET), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if "text_config" in cfg:  # an image-text model: the vocabulary (and any override) is its language model's
        text = cfg["text_config"] = {**cfg["text_config"], **ids, **overrides}
        ids, overrides = {k: text[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}, {}
    cfg.update(ids)
    cfg.update(overrides)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = causal_lm_class(config)._from_config(config, dtype=dtype).eval()
    if model_type == "mllama":  # its cross-attention gates start at 0 (tanh 0: images change nothing): open them
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_gate"):
                    p.fill_(0.8)
    return model


def perturb(model, scale: float = 0.05, seed: int = 1, skip=("norm",)):
    """A fake 'full fine-tune': every weight moved by scale * std(weight) * noise with some low-rank
    structure (real fine-tune deltas are far from white noise)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in skip):
                continue
            std = (float(p.float().std()) if p.numel() > 1 else 0.0) or 1.0  # one-element gates: unit noise
            noise = torch.randn(p.shape, generator=g)
            if p.dim() in (2, 3):  # matrices, and each expert's of a fused [E, out, in] tensor
                r = max(1, min(p.shape[-2:]) // 8)
                lead = p.shape[:-2]
                noise = noise * 0.5 + (torch.randn(*lead, p.shape[-2], r, generator=g)
                                       @ torch.randn(*lead, r, p.shape[-1], generator=g)) / r**0.5
            p.add_((scale * std * noise).to(p.dtype))
    return model


def lora_adapter(model, out, seed: int = 0, **config):
    """``model`` with a PEFT LoRA adapter (``LoraConfig(**config)``; rank 4, alpha 8, no dropout unless
    given) whose factors are random and non-zero (PEFT starts ``B`` at zero, which changes nothing) and
    whose ``modules_to_save`` copies and trained biases moved, saved to ``out`` as safetensors; the PEFT model, in eval mode."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **config}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.requires_grad:  # the modules_to_save copies, biases it trains
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(out, safe_serialization=True)
    return pm.eval()


def finetune(model, steps: int = 30, lr: float = 3e-3, seed: int = 1, seqlen: int = 24, batch: int = 4):
    """A real (short) full fine-tune: ``steps`` of Adam on next-token loss over random sequences of a
    fixed pattern, so every parameter (norms, biases, embeddings, positions) moves as training moves
    it. In place; returns the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    pattern = torch.randint(4, vocab, (8,), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        start = torch.randint(0, 8, (batch, 1), generator=g)
        ids = pattern[(start + torch.arange(seqlen)) % 8]
        noise = torch.rand(ids.shape, generator=g) < 0.2
        ids = torch.where(noise, torch.randint(4, vocab, ids.shape, generator=g), ids)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def save_model(model, path: Path, tokenizer=True, module_names: bool = False) -> Path:
    """``save_pretrained`` (checkpoint names after transformers' conversions: one tensor per expert for
    MoE models), or with ``module_names`` the state dict under the module names as they are (fused
    ``[E, out, in]`` expert tensors), which transformers loads as well."""
    if module_names:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        tiny_tokenizer(path)
    return path


def make_pair(tmp: Path, arch: str = "llama", dtype=torch.float32, scale: float = 0.05, module_names: bool = False,
              skip=("norm",), **overrides):
    """(base_dir, ft_dir) of a tiny model and a perturbed copy (``module_names``: see ``save_model``;
    ``skip``: see ``perturb``)."""
    base = tiny_model(arch, dtype=dtype, **overrides)
    tag = arch + ("-fused" if module_names else "")
    bdir = save_model(base, tmp / f"{tag}-base", module_names=module_names)
    ft = perturb(base, scale=scale, skip=skip)
    fdir = save_model(ft, tmp / f"{tag}-ft", module_names=module_names)
    return bdir, fdir


def calib_file(tmp: Path, n: int = 64, seed: int = 0) -> Path:
    """A .jsonl of short random 'sentences' over the tiny alphabet."""
    rnd = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "zip", "model", "base", "tune", "12", "345", "=", "+"]
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / "calib.jsonl"
    with open(p, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rnd.choice(words) for _ in range(rnd.randint(6, 14)))}) + "\n")
    return p


def edit_json(path: Path, **updates) -> Path:
    """Rewrite a JSON side file (e.g. a fine-tune's config.json) with some keys set: a side file that
    is no longer byte-identical to the base's."""
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
