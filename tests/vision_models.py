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


def build_idefics3(folder: Path, seed: int = 0):
    """(model, processor) of a 2-layer Idefics3 (SmolVLM's architecture) saved in `folder`, images
    resized to 96 on their longest side then to the encoder's 48x48 square (no tiles)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # the processor's and the tokenizer's: one file in the folder
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>", *grid]})
    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIDE,
            "patch_size": PATCH,
        },
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * IMAGE_SIDE}, max_image_size={"longest_edge": IMAGE_SIDE}, do_image_splitting=False
    )
    processor = Idefics3Processor(images, tokenizer, image_seq_len=(IMAGE_SIDE // PATCH) ** 2 // 4, chat_template=CHAT_TEMPLATE)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor
