"""A vision-language export's side of the runner's passes: the vision graph and the store of the
features it makes (vision.ImageStore), each pass's picture tokens fed as the image token with
their features, rotary positions of three numbers a token where the model places a picture by
rows and columns (the manifest's vision.rotary "3d"), and prefill passes joined where a picture's
tokens attend to each other both ways. For a text export (`images` None) every call passes the
inputs through as they are."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .errors import GenerationError
from .manifest import Manifest
from .runtime import Graph, RuntimeOptions
from .vision import ImageStore, rotary_positions, whole_pictures

IMAGE_INPUT = "image_features"  # a vision-language graph's: the features of the pass's image tokens


class PictureFeeds:
    """The pictures of the runner's prompts (see the module's text). Each row's shift of its rotary
    positions is kept in the cache's books (`cache.shifts`): the tokens after a prompt's pictures
    are at their count plus that shift."""

    def __init__(self, folder: Path, manifest: Manifest, provider: str, options: RuntimeOptions, image_dtype: str | None):
        """`image_dtype`: the language graph's `image_features` type (None: it has no such input)."""
        self.vision = manifest.vision
        self.images = _image_store(folder, self.vision, provider, options, image_dtype) if self.vision else None
        self.rotary_3d = self.vision.get("rotary") == "3d"

    def see(self, pictures) -> None:
        """Make the features of a prompt's pictures (those not kept yet) before it runs, and hold
        them until `let_go`, when the request has ended."""
        if pictures:
            if self.images is None:
                raise GenerationError("this export reads text only: images need a vision-language export")
            self.images.add(list(pictures))

    def let_go(self, pictures) -> None:
        if pictures and self.images is not None:
            self.images.let_go(pictures)

    def feeds(self, inputs: dict) -> dict:
        """A pass's inputs with its picture ids given to the graph as the image token and their features."""
        if self.images is None:
            return inputs
        ids, features = self.images.feeds(inputs["input_ids"], self.vision["image_token_id"])
        return {**inputs, "input_ids": ids, IMAGE_INPUT: features}

    def passes(self, spans: Iterator[tuple[int, int]], prompts: list[list[int]], width: int | None = None):
        """The prefill passes: `spans`, or, where a picture's tokens attend to each other both ways,
        spans joined so that no picture is cut between two passes."""
        if self.vision.get("attention") == "bidirectional":
            return whole_pictures(spans, prompts, width)
        return spans

    def left_padded_positions(self, cache, prompts: list[list[int]], width: int) -> np.ndarray | None:
        """The 3-D positions of prompts left-padded to `width` [3, rows, width], each row's shift
        kept; None where positions are one number."""
        if not self.rotary_3d:
            return None
        positions, cache.shifts = np.zeros((3, len(prompts), width), np.int64), np.zeros(len(prompts), np.int64)
        for row, prompt in enumerate(prompts):
            positions[:, row, width - len(prompt) :], cache.shifts[row] = rotary_positions(prompt, self.images.grids)
        return positions

    def prompt_positions(self, inputs: dict, cache, rows: list[int], prompts: list[list[int]], start: int = 0) -> dict:
        """`inputs` of a pass over positions start.. of the prompts in `rows` (right-padded), with their 3-D positions."""
        if not self.rotary_3d:
            return inputs
        placed = np.zeros((3, *inputs["position_ids"].shape), np.int64)
        for index, (row, prompt) in enumerate(zip(rows, prompts)):
            positions, cache.shifts[row] = rotary_positions(prompt, self.images.grids)
            part = positions[:, start : start + placed.shape[2]]
            placed[:, index, : part.shape[1]] = part
        return {**inputs, "position_ids": placed}

    def text_positions(self, inputs: dict, cache, rows: slice) -> dict:
        """`inputs` of a pass over tokens after the prompts (position_ids [rows, n]), with their 3-D positions."""
        if not self.rotary_3d or inputs["position_ids"].ndim == 3:
            return inputs
        shifted = inputs["position_ids"] + cache.shifts[rows][:, None]
        return {**inputs, "position_ids": np.repeat(shifted[None], 3, axis=0)}


def _image_store(folder: Path, vision: dict, provider: str, options: RuntimeOptions, image_dtype: str) -> ImageStore:
    """The vision graph, and the store of the features it makes (sdk/vision.py)."""
    # Half the cores: a picture is encoded beside the decode loop's passes, which keep the rest,
    # so the other streams do not stall while it runs (the trade is measured in docs/benchmarks.md).
    threads = max(1, (options.threads or os.cpu_count() or 2) // 2)
    encoder = Graph(folder / vision["graph"]["file"], provider, threads)
    encoder.check_names(vision["graph"]["inputs"], vision["graph"]["outputs"])
    pixels_type = encoder.input_dtype("pixel_values")

    def encode(pixels: np.ndarray) -> np.ndarray:
        return encoder.run({"pixel_values": pixels.astype(pixels_type)}, [], ["image_features"])[1]["image_features"]

    return ImageStore(encode, int(vision["hidden_size"]), image_dtype)
