"""Gemma 3's pictures: SigLIP on a fixed square, each picture's tokens attending both ways."""

from __future__ import annotations

from edgeinfer.sdk.errors import ExportError

from .processor import RESAMPLE_NAMES, VisionEncoder, normalization


def encode(model, pixel_values):
    """SigLIP on the fixed square, its patches average-pooled to the picture's tokens and projected."""
    hidden = model.model.vision_tower(pixel_values=pixel_values).last_hidden_state
    return model.model.multi_modal_projector(hidden)


def describe(processor) -> dict:
    """Gemma 3: every picture resized to the encoder's square, its tokens between
    <start_of_image> and <end_of_image>, a blank line either side, in the place of the
    <start_of_image> the chat template writes; the tokens of one picture attend to each other both
    ways. Pan and scan (crops of a long picture, off in Gemma 3's own processor) is not followed."""
    images, tokenizer = processor.image_processor, processor.tokenizer
    if getattr(images, "do_pan_and_scan", False):
        raise ExportError(
            "this Gemma 3 processor crops long pictures (do_pan_and_scan), which edgeinfer's runtime does not do: "
            "set do_pan_and_scan to false in the model's preprocessor_config.json and export again"
        )
    size = images.size
    return {
        "steps": [{"op": "resize", "height": int(size["height"]), "width": int(size["width"])}],
        "resample": RESAMPLE_NAMES[int(images.resample)],
        "image_token": tokenizer.image_token,
        "tokens_per_image": int(processor.image_seq_length),
        "marker": processor.boi_token,
        "expansion": f"\n\n{processor.boi_token}{{image}}{tokenizer.eoi_token}\n\n",
        "attention": "bidirectional",
        **normalization(images),
    }


VISION = VisionEncoder(encode, describe)
