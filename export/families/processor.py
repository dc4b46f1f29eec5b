"""What every vision family's record holds, and the processor readings they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}  # Pillow's numbers


@dataclass(frozen=True)
class VisionEncoder:
    """`encode(model, pixel_values)`: the projected features [images, tokens, hidden] of images
    [images, 3, H, W]; `describe(processor)`: the manifest's steps and text of an image;
    `layout(processor)`, where the processor's pixel values are not pictures [images, 3, H, W]: a
    function that lays the runtime's pixels out as the processor does (the check compares them)."""

    encode: Callable
    describe: Callable
    layout: Callable | None = None


def normalization(images) -> dict:
    return {
        "rescale": float(images.rescale_factor) if images.do_rescale else 1.0,
        "mean": [float(m) for m in images.image_mean] if images.do_normalize else [0.0, 0.0, 0.0],
        "std": [float(s) for s in images.image_std] if images.do_normalize else [1.0, 1.0, 1.0],
    }
