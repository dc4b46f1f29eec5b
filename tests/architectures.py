"""Tiny random-weight configs for every decoder family edgeinfer exports for
text-generation-with-past: a few layers, hidden size 64 (heads of 16, the smallest GroupQueryAttention takes on CPU), so the whole suite runs on 2 cores.

Each entry sets what its family needs on top of COMMON (attribute names are transformers'; the
configs map the standard names onto their own). Where a family has a shape that breaks naive code,
the entry picks it on purpose: grouped-query or multi-query attention, a sliding window shorter
than the test prompts, ALiBi instead of positions, keys and values of different head sizes.
"""

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
WINDOW = 16  # sliding windows are shorter than the longer test prompt
# Multi-head latent attention's compressed query and keys (deepseek_v3, minicpm3, glm4_moe_lite).
LATENT = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
# Gated DeltaNet layers (three of four): two key heads serve four value heads.
DELTANET = dict(
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# Mamba-2 mixers: eight heads of 16 (the mixer's 128 = 2 x 64), two groups of B and C, a state of 8
# (not the head size: a transposed state would show), chunks of 16 (the prompt is longer).
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)

TINY = {
    "bamba": {**MAMBA2, "num_hidden_layers": 3, "attn_layer_indices": [1]},
    # Mamba-1 mixers alone, no context limit of its own; an lm_head of its own (the tied one makes the
    # tiny model echo its last token)
    "mamba": {"state_size": 16, "tie_word_embeddings": False, "max_position_embeddings": None},
    # Mamba-1 mixers in three layers of four, attention in the second, experts in every other layer
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
    },
    "nemotron_h": {
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
        "head_dim": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "chunk_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 16,
    },
    "falcon_h1": {  # attention and a Mamba-2 mixer side by side in every layer, with muP multipliers
        **MAMBA2,
        "mamba_d_ssm": 128,
        "ssm_in_multiplier": 0.5,
        "ssm_multipliers": [1.0, 0.5, 2.0, 1.5, 0.75],
        "attention_in_multiplier": 0.8,
        "key_multiplier": 1.2,
    },
    "falcon_h1@norm": {**MAMBA2, "mamba_d_ssm": 128, "mamba_rms_norm": True},
    "zamba2": {  # a shared attention block (with per-use LoRA adapters) between Mamba-2 layers
        "num_hidden_layers": 3,
        "layers_block_type": ["mamba", "hybrid", "mamba"],
        "n_mamba_heads": 8,
        "mamba_headdim": 16,
        "mamba_ngroups": 2,
        "mamba_d_state": 8,
        "chunk_size": 16,
        "attention_head_dim": 32,  # its attention reads the hidden state and the embeddings side by side: 2 x 64
        "num_key_value_heads": 4,
        "use_shared_attention_adapter": True,
        "adapter_rank": 4,
    },
    "qwen3_next": {  # gated DeltaNet with its projections interleaved per key head, experts with a gated shared one
        **DELTANET,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    },
    "kimi_linear": {  # delta attention with a decay per key channel; latent attention (MLA) without positions
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "linear_num_heads": 4,
        "linear_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "num_key_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 16,
    },
    "granitemoehybrid": {
        **MAMBA2,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 32,
    },
    "arcee": {},
    "bloom": {"n_embed": 64},
    "codegen": {"n_inner": 128, "rotary_dim": 4, "n_ctx": 256},
    "cohere": {},
    "deepseek_v3": {
        "hidden_size": 32,
        "intermediate_size": 64,
        **LATENT,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "num_key_value_heads": 4,
    },
    "falcon": {"multi_query": True, "new_decoder_architecture": False, "alibi": False},  # multi-query attention
    "falcon@alibi": {"multi_query": False, "new_decoder_architecture": False, "alibi": True},
    "falcon@gqa": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "phi@gqa": {"num_key_value_heads": 2},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 8},
    "gemma3_text": {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 8},
    "glm": {"head_dim": 16},
    "gpt2": {"n_inner": 128},
    "gpt_bigcode": {"n_inner": 128, "multi_query": True},
    "gpt_neo": {"num_layers": 2, "attention_types": [[["global", "local"], 1]], "window_size": WINDOW},
    "gpt_neox": {},
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 2.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    },
    "gptj": {"n_inner": 128, "rotary_dim": 4},
    "granite": {},
    "helium": {"head_dim": 16},
    "internlm2": {},
    "llama": {},
    "mistral": {"head_dim": 16, "sliding_window": WINDOW},
    "mpt": {"expansion_ratio": 2, "max_seq_len": 256},
    "nemotron": {"head_dim": 16},
    "olmo": {},
    "olmo2": {},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "phi": {"num_key_value_heads": 4},
    "phi3": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 16},
    "smollm3": {},
    "stablelm": {},
    # transformers 5's families
    # sliding layers 16 wide, the full layer 32 wide; per-layer input embeddings
    "gemma4_text": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "global_head_dim": 32,
        "hidden_size_per_layer_input": 8,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    # the last two layers read the cache of the last earlier layer of their kind (Gemma 4 E2B's KV sharing)
    "gemma4_text@shared": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "global_head_dim": 32,
        "hidden_size_per_layer_input": 8,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2,
    },
    # gated DeltaNet (linear attention: a convolution and a recurrent state) in three layers of four
    "qwen3_5_text": {"head_dim": 16, **DELTANET},
    # Qwen 3.5's hybrid with a mixture of experts in every layer
    "qwen3_5_moe_text": {"head_dim": 16, **DELTANET, **EXPERTS, "shared_expert_intermediate_size": 16},
    "lfm2_moe": {
        "num_hidden_layers": 4,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        **EXPERTS,
        "num_dense_layers": 1,
    },
    # gated DeltaNet with separate projections and beta up to 2 (negative eigenvalues)
    "olmo_hybrid": {**DELTANET, "linear_allow_neg_eigval": True},
    # short convolutions (gated, no activation) beside full and sliding attention
    "lfm3": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "layer_types": ["conv", "full_attention", "conv", "sliding_attention"],
    },
    "lfm2": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # multi-head latent attention (compressed keys and values, as deepseek_v3's)
    "minicpm3": {"num_key_value_heads": 4, **LATENT},
    # multi-head latent attention and a mixture of experts
    "glm4_moe_lite": {
        "num_key_value_heads": 4,
        **LATENT,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "exaone4": {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "granite_swa": {"sliding_window": WINDOW, "layer_types": ["full_attention", "sliding_attention"]},
    "hunyuan_v1_dense": {"head_dim": 16},
    "ministral3": {"head_dim": 16},
    "olmo3": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "seed_oss": {"head_dim": 16},
}


# Settings on top of a SHRUNK family's shrunk defaults where those disagree with each other: multi-head
# latent attention's rotary size as its head size; expert groups no more than the 4 experts; a shared
# expert where the default names none.
ADJUSTED = {
    "youtu": {"head_dim": 4},
    "dots1": {"n_shared_experts": 1},
    "beam": {"n_group": 1, "topk_group": 1},
    "axk1": {"head_dim": 4, "n_group": 1, "topk_group": 1},
    "bailing_hybrid": {"num_expert_group": 1, "topk_group": 1},
    # DBRX: its attention clamps q, k and v with clip_qkv, which it cannot leave unset; its sub-configs named whole
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2, "hidden_size": 64},
    },
    "longcat_flash": {"head_dim": 4},
    # Zamba: Mamba-1 mixers in two heads; its shared attention block in every other layer (two of them, tied)
    "zamba": {
        "num_hidden_layers": 4,
        "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "attention_head_dim": 16,
        "mamba_dt_rank": 8,
    },
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # Mamba 2 alone: eight heads of 16 (the mixer's 128 = 2 x 64), as MAMBA2 above
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 8, "time_step_rank": 8, "chunk_size": 16},
    # Dory: one input layer, two layers looped twice (each loop its own keys and values), one output layer
    "dory": {
        "num_hidden_layers": 4,
        "n_input_layers": 1,
        "n_recurrent_layers": 2,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
    },
    # BERT for generation: its decoder mode, causal with a cache (transformers' own word for a decoder alone)
    "bert-generation": {"is_decoder": True},
    # RecurrentGemma: two recurrent blocks, then a sliding attention block
    "recurrent_gemma": {"num_hidden_layers": 3, "attention_window_size": WINDOW},
    # ZAYA: its convolutional attention's own check (one expert per token)
    "zaya": {"num_experts_per_tok": 1},
    # Inkling 2: a checkpoint's unembedding is padded past the vocabulary the head gives out
    "inkling2_text": {"unpadded_vocab_size": 300},
    "inkling2_loop_text": {"unpadded_vocab_size": 300},
    # Gemma 3n: the last two of four layers read the keys and values of the last earlier layer of their kind
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "intermediate_size": [128] * 4,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 320,
        "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
        "sliding_window": WINDOW,
    },
}

# Families whose tiny model is their config class's defaults with the sizes shrunk (generic_tiny.py):
# each tried by benchmarks/families.py and found to export and match transformers, then kept here.
SHRUNK = (
    "afmoe",
    "apertus",
    "apertus1p5_text",
    "aria_text",
    "axk1",
    "bailing_hybrid",
    "beam",
    "bert-generation",
    "biogpt",
    "bitnet",
    "cohere2",
    "cohere2_moe",
    "cohere_compass_text",
    "ctrl",
    "cwm",
    "dbrx",
    "deepseek_v2",
    "diffllama",
    "doge",
    "dory",
    "dots1",
    "emu3_text_model",
    "ernie4_5",
    "ernie4_5_moe",
    "exaone",
    "exaone_moe",
    "falcon_mamba",
    "flex_olmo",
    "flint",
    "fuyu",
    "gemma3n_text",
    "gemma4",
    "gemma4_unified",
    "gemma4_unified_text",
    "git",
    "glm4",
    "glm4_moe",
    "got_ocr2",
    "gpt_neox_japanese",
    "granitemoe",
    "granitemoe_swa",
    "granitemoeshared",
    "hrm_text",
    "hunyuan_v1_moe",
    "hy_v3",
    "hyperclovax",
    "inkling2_loop_text",
    "inkling2_text",
    "inkling_text",
    "internlm3",
    "iquestcoder",
    "jais2",
    "jetmoe",
    "kolibri1",
    "laguna",
    "lara_mini",
    "llama4_text",
    "longcat_flash",
    "mamba2",
    "mellum",
    "mimo_v2_flash",
    "minimax",
    "minimax_m2",
    "minimax_m3_vl_text",
    "ministral",
    "mixtral",
    "mllama_text_model",
    "modernbert-decoder",
    "moshi",
    "moss_transcribe_diarize",
    "nanochat",
    "olmoe",
    "persimmon",
    "phi4_multimodal",
    "phimoe",
    "qwen2_moe",
    "recurrent_gemma",
    "sarvam_mla",
    "sarvam_moe",
    "solar_open",
    "starcoder2",
    "trocr",
    "vaultgemma",
    "xglm",
    "youtu",
    "zamba",
    "zaya",
)


def model_type(name: str) -> str:
    """The model type of a TINY entry (`falcon@alibi` is a second falcon)."""
    return name.split("@")[0]


def tiny_config(name: str):
    from transformers import AutoConfig

    if name in SHRUNK:
        from generic_tiny import config_of

        return config_of(name)
    return AutoConfig.for_model(model_type(name), **{**COMMON, **TINY[name]})
