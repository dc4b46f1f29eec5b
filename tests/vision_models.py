"""Tiny random-weight vision-language models from transformers' own config classes, saved with a
processor (the test tokenizer with the family's image tokens, and its image processor) as a Hugging
Face folder: what tests/test_vision.py exports and checks against transformers."""

from __future__ import annotations

from pathlib import Path

from conftest import build_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_SIDE, PATCH = 48, 8  # the encoder's square; 36 patches, 9 tokens an image after the 2x2 pixel shuffle
TINY = {
    "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
    "side": IMAGE_SIDE,
    "patch": PATCH,
    "scale": 2,
    "longest_edge": 2 * IMAGE_SIDE,
    "context": 256,
}
TILED = {**TINY, "tiles": True}  # each picture cut into 48x48 tiles, and the whole picture as one more
# SmolVLM-256M-Instruct's shape (its config.json): SmolLM2-135M's layers, a SigLIP base encoder on
# 512x512 squares of 16x16 patches, a 4x4 pixel shuffle: 64 tokens a picture
SMOLVLM_256M = {
    "text": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "vision": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12},
    "side": 512,
    "patch": 16,
    "scale": 4,
    "longest_edge": 2048,
    "context": 8192,
    "vocab_size": 49280,
}


def build_idefics3(folder: Path, seed: int = 0, shape: dict = TINY, dtype=None):
    """(model, processor) of an Idefics3 (SmolVLM's architecture) of `shape` with random weights,
    saved in `folder` (in `dtype`, a torch dtype, where given): the tiny one by default, images
    resized to 96 on their longest side then to the encoder's 48x48 square (no tiles)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # the processor's and the tokenizer's: one file in the folder
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>", *grid]})
    filler = shape.get("vocab_size", 0) - len(tokenizer)  # every id of a larger vocabulary has a text (a random model writes them)
    tokenizer.add_tokens([f"<w{i}>" for i in range(max(0, filler))])
    side, patch, scale = shape["side"], shape["patch"], shape["scale"]
    text = {"model_type": "llama", "vocab_size": shape.get("vocab_size", len(tokenizer)), "max_position_embeddings": shape["context"]}
    config = Idefics3Config(
        text_config={**text, **shape["text"]},
        vision_config={**shape["vision"], "image_size": side, "patch_size": patch},
        scale_factor=scale,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": shape["longest_edge"]},
        max_image_size={"longest_edge": side},
        do_image_splitting=shape.get("tiles", False),
    )
    tokens = (side // patch) ** 2 // scale**2
    processor = Idefics3Processor(images, tokenizer, image_seq_len=tokens, chat_template=CHAT_TEMPLATE)
    (model if dtype is None else model.to(dtype)).save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor
