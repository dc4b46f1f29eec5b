"""Tiny random-weight vision-language models from transformers' own config classes, saved with a
processor (the test tokenizer with the family's image tokens, and its image processor) as a Hugging
Face folder: what tests/test_vision.py and tests/test_vision_families.py export and check against
transformers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from conftest import build_tokenizer

from edgeinfer.export.patches import images_only

TOKENS = 8  # greedy tokens compared with transformers'


def png(seed: int, size=(70, 41)) -> bytes:
    """A random picture of `size` (width, height), as PNG bytes."""
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# Pillow's transposes that undo each EXIF orientation's (2-8) as ImageOps.exif_transpose applies it
_STORED = {
    2: "FLIP_LEFT_RIGHT",
    3: "ROTATE_180",
    4: "FLIP_TOP_BOTTOM",
    5: "TRANSPOSE",
    6: "ROTATE_90",
    7: "TRANSVERSE",
    8: "ROTATE_270",
}


def oriented(upright: bytes, orientation: int, format: str = "PNG") -> bytes:
    """`upright` stored as a camera stores it: its pixels turned, and the EXIF orientation tag
    (1-8) that says how to turn them back."""
    from PIL import Image

    image = Image.open(io.BytesIO(upright))
    if orientation != 1:
        image = image.transpose(getattr(Image.Transpose, _STORED[orientation]))
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, format=format, exif=exif.tobytes())
    return out.getvalue()


def transformers_tokens(model, processor, messages: list[dict], images: list[bytes]) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers' processor and model: forward passes with its
    own cache, the largest logit each step (TOKENS of them, EOS or not)."""
    import torch
    from PIL import Image

    from transformers.processing_utils import ProcessorMixin

    # the base class's template (SmolVLMProcessor's own reads the video processor built without torchvision)
    text = ProcessorMixin.apply_chat_template(processor, messages, add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images] or None
    inputs = dict(processor(text=text, images=pictures, return_tensors="pt"))
    tokens, past = [], None
    if hasattr(
        model.model, "rope_deltas"
    ):  # Qwen2.5-VL keeps the last prompt's position shift, which would shift a prompt without pictures
        model.model.rope_deltas = None
    with torch.no_grad():
        for _ in range(TOKENS):
            out = model(**inputs, cache=past, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
            past, inputs = out.cache, {"input_ids": torch.tensor([[tokens[-1]]])}
    return processor(text=text, images=pictures)["input_ids"][0], tokens


def built_and_exported(folder: Path, build, **shape) -> tuple:
    """(transformers model, processor, export folder): `build` (build_idefics3, build_gemma3) into
    `folder`/hf, exported to `folder`/export."""
    from edgeinfer.export import export_model

    model, processor = build(folder / "hf", **shape)
    export_model(str(folder / "hf"), folder / "export")
    return model, processor, folder / "export"


def asked(question: str, *images: bytes, as_parts: bool = True) -> tuple[list[dict], list[dict]]:
    """(the SDK's messages, transformers' messages) of one user turn: the images, then the question."""
    sdk = [{"type": "image", "image": data} for data in images] + [{"type": "text", "text": question}]
    hf = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    return [{"role": "user", "content": sdk}], [{"role": "user", "content": hf}]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_SIDE, PATCH = 48, 8  # the encoder's square; 36 patches, 9 tokens an image after the 2x2 pixel shuffle
TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY = {
    "text": TINY_TEXT,
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


def build_idefics3(folder: Path, seed: int = 0, shape: dict = TINY, dtype=None, family: str = "idefics3"):
    """(model, processor) of an Idefics3 (SmolVLM's architecture) of `shape` with random weights,
    saved in `folder` (in `dtype`, a torch dtype, where given): the tiny one by default, images
    resized to 96 on their longest side then to the encoder's 48x48 square (no tiles). `family`
    "smolvlm": the same model in SmolVLM's own classes (model_type smolvlm, SmolVLMProcessor), as
    SmolVLM's published checkpoints are saved."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMProcessor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    classes = {
        "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, Idefics3ImageProcessorPil),
        "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMProcessor, SmolVLMImageProcessorPil),
    }
    config_class, model_class, processor_class, images_class = classes[family]

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # the processor's and the tokenizer's: one file in the folder
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>", *grid]})
    filler = shape.get("vocab_size", 0) - len(tokenizer)  # every id of a larger vocabulary has a text (a random model writes them)
    tokenizer.add_tokens([f"<w{i}>" for i in range(max(0, filler))])
    side, patch, scale = shape["side"], shape["patch"], shape["scale"]
    text = {"model_type": "llama", "vocab_size": shape.get("vocab_size", len(tokenizer)), "max_position_embeddings": shape["context"]}
    config = config_class(
        text_config={**text, **shape["text"]},
        vision_config={**shape["vision"], "image_size": side, "patch_size": patch},
        scale_factor=scale,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    images = images_class(
        size={"longest_edge": shape["longest_edge"]},
        max_image_size={"longest_edge": side},
        do_image_splitting=shape.get("tiles", False),
    )
    tokens = (side // patch) ** 2 // scale**2
    (model if dtype is None else model.to(dtype)).save_pretrained(folder)
    if family == "smolvlm":  # saved as a checkpoint has it (the processor's save needs its video processor: torchvision)
        images.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "processor_config.json").write_text(json.dumps({"processor_class": "SmolVLMProcessor", "image_seq_len": tokens}))
    videos = {"video_processor": None} if family == "smolvlm" else {}
    with images_only():
        processor = processor_class(images, tokenizer, image_seq_len=tokens, chat_template=CHAT_TEMPLATE, **videos)
    if family != "smolvlm":
        processor.save_pretrained(folder)
    return model, processor


GEMMA3_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
GEMMA3_TINY = {
    "text": {
        **TINY_TEXT,
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 24,
        "max_position_embeddings": 256,
    },
    "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
    "side": 48,
    "patch": 8,
    "tokens": 9,  # 6x6 patches pooled 2x2
}


def build_smolvlm(folder: Path, seed: int = 0, shape: dict = TINY):
    """(model, processor) of build_idefics3's model in SmolVLM's classes."""
    return build_idefics3(folder, seed, shape, family="smolvlm")


def build_gemma3(folder: Path, seed: int = 0, shape: dict = GEMMA3_TINY):
    """(model, processor) of a Gemma 3 vision-language model of `shape` with random weights, saved in
    `folder`: images resized to the encoder's square, each picture's tokens attending to each other
    both ways (the tiny one's sliding window, 24, holds a picture's 9), its projector random."""
    import json

    import torch
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_IMAGE_TOKENS.values())})
    tokenizer.save_pretrained(folder)
    written = json.loads((folder / "tokenizer_config.json").read_text())
    written.update(extra_special_tokens=GEMMA3_IMAGE_TOKENS, chat_template=GEMMA3_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(written))
    tokenizer = AutoTokenizer.from_pretrained(folder)  # the named image tokens are read from the file
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_IMAGE_TOKENS.items()}
    config = Gemma3Config(
        text_config={"vocab_size": len(tokenizer), **shape["text"]},
        vision_config={**shape["vision"], "image_size": shape["side"], "patch_size": shape["patch"]},
        mm_tokens_per_image=shape["tokens"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts the projector at zeros, which would make every picture the same
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.1)
    images = Gemma3ImageProcessorPil(size={"height": shape["side"], "width": shape["side"]})
    processor = Gemma3Processor(images, tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=shape["tokens"])
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor


QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4, "out_hidden_size": 64}
QWEN2_5_VL_TINY = {
    "text": {
        **TINY_TEXT,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    },
    # 4x4 patches merged 2x2: a token is an 8x8 square; windows of 2x2 tokens, the second block's attention whole
    "vision": {**QWEN_VISION, "window_size": 16, "fullatt_block_indexes": [1]},
    "min_pixels": 8 * 8 * 4,
    "max_pixels": 96 * 96,
}


QWEN3_5_TINY = {
    # Qwen 3.5's hybrid: three gated-DeltaNet layers and one of attention, rotary on half of each head
    "text": {
        **QWEN2_5_VL_TINY["text"],
        "num_hidden_layers": 4,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            **QWEN2_5_VL_TINY["text"]["rope_parameters"],
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    },
    # 4x4 patches merged 2x2, a learned 4x4 position table resampled to each picture
    "vision": {**QWEN_VISION, "num_position_embeddings": 16},
    "min_pixels": 8 * 8 * 4,
    "max_pixels": 96 * 96,
}


def build_qwen2_5_vl(folder: Path, seed: int = 0, shape: dict = QWEN2_5_VL_TINY):
    """(model, processor) of a Qwen2.5-VL of `shape` with random weights, saved in `folder`: a picture
    resized to whole 8x8 tokens within the pixel bounds, its tokens placed by 3-D rotary positions."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    return _build_qwen(folder, seed, shape, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor)


def build_qwen3_5(folder: Path, seed: int = 0, shape: dict = QWEN3_5_TINY):
    """(model, processor) of a Qwen 3.5 (its vision-language model) of `shape` with random weights,
    saved in `folder`: pictures as Qwen2.5-VL's, the language model a hybrid of linear attention."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor

    return _build_qwen(folder, seed, shape, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor)


def _build_qwen(folder: Path, seed: int, shape: dict, config_class, model_class, processor_class):
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS)})
    ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS]
    config = config_class(
        text_config={"vocab_size": len(tokenizer), **shape["text"]},
        vision_config=shape["vision"],
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": shape["min_pixels"], "longest_edge": shape["max_pixels"]},
        patch_size=shape["vision"]["patch_size"],
        merge_size=2,
    )
    model.save_pretrained(folder)
    # saved as a checkpoint has it (the processor's save needs its video processor, which needs torchvision)
    images.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "processor_config.json").write_text(f'{{"processor_class": "{processor_class.__name__}"}}')
    with images_only():
        processor = processor_class(image_processor=images, tokenizer=tokenizer, chat_template=QWEN_TEMPLATE)
    return model, processor
