"""Idefics3 and SmolVLM: the vision transformer on whole squares, and their processors' tiles."""

from __future__ import annotations

from .processor import RESAMPLE_NAMES, VisionEncoder, normalization


def encode(model, pixel_values):
    """The vision transformer on whole squares (every patch an image's: the processor gives no
    other), so a patch's position is its index: transformers' bucketized positions for partial
    images (torch.bucketize, which ONNX has no op for) come to the same for whole ones."""
    import torch

    vision = model.model.vision_model
    embeddings = vision.embeddings
    patches = embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
    hidden = patches + embeddings.position_embedding(torch.arange(patches.shape[1]))
    hidden = vision.post_layernorm(vision.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state)
    return model.model.connector(hidden)


def describe(processor) -> dict:
    """Idefics3 and SmolVLM: the longest side to `size`; then either the square the encoder takes
    (one picture, its tokens between <fake_token_around_image><global-img> and
    <fake_token_around_image>), or (do_image_splitting) each side up to whole tiles, cut into tiles
    named by row and column, and the whole picture as one tile after them."""
    images = processor.image_processor
    side = images.max_image_size["longest_edge"]
    steps = [{"op": "longest_edge", "size": images.size["longest_edge"]}] if images.do_resize else []
    # Idefics3Processor names the whole picture's tag global_image_tag, SmolVLMProcessor global_image_token
    tag = processor.global_image_token if hasattr(processor, "global_image_token") else processor.global_image_tag
    fake = processor.fake_image_token
    whole = f"{fake}{tag}{{image}}{fake}"
    described = {
        "steps": [*steps, {"op": "resize", "height": side, "width": side}],
        "resample": RESAMPLE_NAMES[int(images.resample)],
        "image_token": processor.image_token,
        "tokens_per_image": processor.image_seq_len,
        "marker": processor.image_token,
        "expansion": whole,
        **normalization(images),
    }
    if images.do_image_splitting:
        described["steps"] = [*steps, {"op": "multiple_of", "size": side}]
        described["tiles"] = {
            "size": side,
            "tile": f"{fake}<row_{{row}}_col_{{col}}>{{image}}",
            "row_end": "\n",
            "whole": "\n" + whole,
        }
    return described


VISION = VisionEncoder(encode, describe)
