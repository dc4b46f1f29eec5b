"""What edgeinfer knows about model families, in one place.

The runtime knows no family: it reads the KV layout and inputs from the manifest and the graphs.
Export traces every family alike (export/trace.py: each layer's cache shape is read off what the
model caches) and knows two things about families:
- which ones it supports, each proven by a parity test in tests/test_architectures.py;
- what cannot work, and why.
"""

from __future__ import annotations

SUPPORTED = (
    "arcee",
    "bloom",
    "codegen",
    "cohere",
    "deepseek_v3",
    "falcon",
    "gemma",
    "gemma2",
    "gemma3_text",
    "glm",
    "gpt2",
    "gpt_bigcode",
    "gpt_neo",
    "gpt_neox",
    "gpt_oss",
    "gptj",
    "granite",
    "helium",
    "llama",
    "mistral",
    "mpt",
    "nemotron",
    "olmo",
    "olmo2",
    "opt",
    "phi",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "stablelm",
    # transformers 5's families
    "exaone4",
    "gemma4_text",
    "glm4_moe_lite",
    "granite_swa",
    "hunyuan_v1_dense",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "minicpm3",
    "ministral3",
    "olmo3",
    "olmo_hybrid",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "seed_oss",
)
# Vision-language families: their language model as above, taking image features (export/vision.py
# has how each one's encoder is called and its processor read).
VISION_LANGUAGE = ("gemma3", "idefics3", "qwen2_5_vl", "qwen3_5", "smolvlm")
# Of those, the families whose picture tokens attend to each other both ways (each picture a block
# in the causal mask): their attention stays as traced, and a picture is prefilled in one pass.
IMAGES_ATTEND_BOTH_WAYS = ("gemma3",)
# And those whose rotary positions are three numbers (time, row, column: a picture's tokens placed
# by their row and column), which the runtime computes from the prompt's pictures.
ROTARY_3D = ("qwen2_5_vl", "qwen3_5")
# Families that cannot be exported here, and why.
UNSUPPORTED = {
    "internlm2": "transformers 5 has no internlm2 model; its checkpoints need trust_remote_code, which edgeinfer does not run",
}
