"""Images in. A vision-language export's manifest says how an image becomes tokens (`vision`: the
steps that make its pixels, the vision graph that makes its features, the text that stands for it in
a prompt), and this module does what it says, with no family code: Pillow opens and resizes, numpy
rescales and normalizes, the vision graph (through runtime.py) encodes.

In a prompt's ids each of an image's placeholder tokens is a *picture id*: above any vocabulary,
made of the image's content hash and the token's place in the image. The prefix cache keys on ids,
so the same picture asked twice is found there and encoded once, and another picture is never
mistaken for it; the runner gives the graph the image token in their place and the features they
name (`ImageStore.feeds`)."""

from __future__ import annotations

import hashlib
import io
import math
import threading
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SettingsError
from .kv_cache import PAD_ID

PICTURE_BASE = 1 << 32  # picture ids start here, above every vocabulary
INDEX_BITS, KEY_BITS = 16, 40  # a picture id: PICTURE_BASE + (key << INDEX_BITS) + the token's place
# An image larger than this is refused before it is decoded (a decompression bomb says it is small
# on the wire and huge in memory); Pillow's own guard stands behind it.
MAX_PIXELS = 40_000_000
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class Picture:
    """One image of a conversation, made into what the vision graph takes: `pixels` [tiles, 3, H,
    W] float32, `key` its content hash, `text` what stands for it in the prompt, `tokens` how many
    image tokens that text holds (each tile's, in the order of `pixels`)."""

    key: int
    pixels: np.ndarray
    text: str
    tokens: int
    grid: tuple[int, int] | None = None  # its tokens' rows and columns, where the model places them by row and column

    def ids(self) -> list[int]:
        return [PICTURE_BASE + (self.key << INDEX_BITS) + place for place in range(self.tokens)]


def is_picture(ids: np.ndarray) -> np.ndarray:
    return ids >= PICTURE_BASE


def picture_key(picture_id: int) -> tuple[int, int]:
    """(key, place) of a picture id."""
    offset = int(picture_id) - PICTURE_BASE
    return offset >> INDEX_BITS, offset & ((1 << INDEX_BITS) - 1)


def open_image(source, param: str = "messages", media_type: str | None = None):
    """A Pillow RGB image from a path, bytes or a Pillow image; SettingsError naming `param` for
    what cannot be one (not an image, a format it does not take, too many pixels, truncated, or
    other than the `media_type` it was sent as)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return _upright(_checked_size(source, param)).convert("RGB")
    data = _image_bytes(source, param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise SettingsError(f"an image in {image.format} is not taken: send {', '.join(FORMATS)}", param)
            _check_media_type(image, media_type, param)
            _checked_size(image, param).load()
            return _upright(image).convert("RGB")
    except SettingsError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise SettingsError(f"the image has more than {MAX_PIXELS:,} pixels: send a smaller one", param) from None
    except Image.UnidentifiedImageError:
        raise SettingsError(
            "the image cannot be decoded (no picture format recognized): send a PNG, JPEG, WebP, GIF or BMP file", param
        ) from None
    except (OSError, ValueError, SyntaxError) as error:  # Pillow's words for bytes it cannot decode
        raise SettingsError(f"the image cannot be decoded ({error}): send a whole PNG, JPEG, WebP, GIF or BMP file", param) from None


def _upright(image):
    """The image turned as its EXIF orientation says (a phone stores a photo as its sensor read it
    and tags the turn), before any resizing: transformers' load_image does the same."""
    from PIL import ImageOps

    return ImageOps.exif_transpose(image)


def _check_media_type(image, media_type: str | None, param: str) -> None:
    from PIL import Image

    said = {"image/jpg": "image/jpeg"}.get((media_type or "").lower(), (media_type or "").lower())
    if said and Image.MIME.get(image.format) != said:
        raise SettingsError(
            f"the image is {image.format} but was sent as {media_type}: send it as {Image.MIME.get(image.format)}", param
        )


def _image_bytes(source, param: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, Path)):
        try:
            data = Path(source).read_bytes()
        except OSError as error:
            raise SettingsError(f"cannot read the image {source}: {error.strerror}", param) from None
    else:
        raise SettingsError(f"an image is a path, bytes or a PIL image, not {type(source).__name__}", param)
    if not data:
        raise SettingsError("the image is empty (0 bytes)", param)
    return data


def _checked_size(image, param: str):
    width, height = image.size
    if width < 1 or height < 1:
        raise SettingsError(f"the image is {width}x{height} pixels: it has nothing to see", param)
    if width * height > MAX_PIXELS:
        raise SettingsError(f"the image is {width}x{height}, more than {MAX_PIXELS:,} pixels: send a smaller one", param)
    return image


# Pixels, by the manifest's steps.

_RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}  # Pillow's numbers


def picture(source, vision: dict, param: str = "messages", media_type: str | None = None) -> Picture:
    """An image made into the vision graph's input by the manifest's steps (and tiles), with its text."""
    image = open_image(source, param, media_type)
    resample = _RESAMPLE[vision["resample"]]
    for step in vision["steps"]:
        image = image.resize(_size(image.size, step), resample=resample)
    frames, rows, cols = _tiles(image, vision.get("tiles"), resample)
    pixels = np.stack([np.asarray(frame, np.float32) for frame in frames]) * np.float32(vision["rescale"])
    mean, std = (np.asarray(vision[k], np.float32) for k in ("mean", "std"))
    pixels = np.ascontiguousarray(((pixels - mean) / std).transpose(0, 3, 1, 2))
    key = int.from_bytes(hashlib.sha256(pixels.tobytes()).digest()[: KEY_BITS // 8], "big")
    if "grid" in vision:  # a token a `grid`-pixel square of the picture as it was resized
        grid = (pixels.shape[2] // vision["grid"], pixels.shape[3] // vision["grid"])
        return Picture(key, pixels, _picture_text(vision, 0, 0, grid[0] * grid[1]), grid[0] * grid[1], grid)
    tokens = vision["tokens_per_image"]
    return Picture(key, pixels, _picture_text(vision, rows, cols, tokens), len(frames) * tokens)


def _tiles(image, tiles: dict | None, resample: int) -> tuple[list, int, int]:
    """(frames, rows, cols): an image larger than a tile cut into tiles, row by row, then the whole
    image resized to one tile; an image that fits one tile (or a manifest without tiles) alone, 0 x 0."""
    width, height = image.size
    side = tiles and tiles["size"]
    if not tiles or (width <= side and height <= side):
        return [image], 0, 0
    rows, cols = (height - side) // side + 1, (width - side) // side + 1
    crops = [image.crop((c * side, r * side, (c + 1) * side, (r + 1) * side)) for r in range(rows) for c in range(cols)]
    return [*crops, image.resize((side, side), resample=resample)], rows, cols


def _picture_text(vision: dict, rows: int, cols: int, tokens: int) -> str:
    """The text that stands for a picture: each tile's (its row and column named) and the whole
    picture's, or the one form of a picture read whole; `tokens` image tokens a tile."""
    image = vision["image_token"] * tokens
    if not rows:
        return vision["expansion"].replace("{image}", image)
    tiles = vision["tiles"]
    lines = [
        "".join(tiles["tile"].format(row=r + 1, col=c + 1, image=image) for c in range(cols)) + tiles["row_end"] for r in range(rows)
    ]
    return "".join(lines) + tiles["whole"].replace("{image}", image)


def _size(size: tuple[int, int], step: dict) -> tuple[int, int]:
    """(width, height) a resize step makes of an image of `size`: `resize` to a fixed size, or
    `longest_edge` (the longest side to `size`, the other in proportion, rounded up to even)."""
    width, height = size
    if step["op"] == "resize":
        return step["width"], step["height"]
    if step["op"] == "multiple_of":
        return _multiple_of(width, height, step["size"])
    if step["op"] == "fit_pixels":
        return _fit_pixels(width, height, step["multiple"], step["min_pixels"], step["max_pixels"])
    if step["op"] == "longest_edge":
        longest = step["size"]
        if width >= height:
            other = int(longest / (width / height))
            width, height = longest, other + (other % 2)
        else:
            other = int(longest * (width / height))
            width, height = other + (other % 2), longest
        return max(width, 1), max(height, 1)
    raise SettingsError(f"this export's manifest has an image step {step['op']!r} this edgeinfer does not know: update edgeinfer")


def _multiple_of(width: int, height: int, side: int) -> tuple[int, int]:
    """Each side up to a whole number of tiles, the longest first and the other from it in proportion."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / ratio) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * ratio) / side) * side
    return width, height


def _fit_pixels(width: int, height: int, multiple: int, least: int, most: int) -> tuple[int, int]:
    """Each side to the nearest whole number of `multiple`, then both scaled alike into [least,
    most] pixels where they fall outside (Qwen2-VL's processor's rule)."""
    if max(width, height) > 200 * min(width, height):
        raise SettingsError(
            f"a picture of {width} x {height} pixels is more than 200 times as long as it is wide, which this model does "
            "not read: crop it",
            "messages",
        )
    w, h = round(width / multiple) * multiple, round(height / multiple) * multiple
    if w * h > most:
        scale = math.sqrt(height * width / most)
        w, h = (max(multiple, math.floor(side / scale / multiple) * multiple) for side in (width, height))
    elif w * h < least:
        scale = math.sqrt(least / (height * width))
        w, h = (math.ceil(side * scale / multiple) * multiple for side in (width, height))
    return w, h


def rotary_positions(ids, grids: dict) -> tuple[np.ndarray, int]:
    """The 3-D rotary positions [3, len(ids)] (time, row, column) of a prompt, and its shift (the
    position of the token after it, less its index). Text counts on one a token, all three alike; a
    picture's tokens (`grids`: key -> its tokens' rows and columns) all take the time of its first,
    their rows and columns counted from there, and the text after it goes on past the larger."""
    ids = np.asarray(ids, np.int64)
    positions, shift, done = np.empty((3, len(ids)), np.int64), 0, 0
    for start in np.flatnonzero(is_picture(ids)):
        key, place = picture_key(ids[start])
        if place:
            continue
        positions[:, done:start] = np.arange(done, start) + shift  # the text before it
        rows, cols = grids[key]
        first, (row, col) = start + shift, divmod(np.arange(rows * cols), cols)
        positions[:, start : start + rows * cols] = np.stack([np.full(rows * cols, first), first + row, first + col])
        shift += max(rows, cols) - rows * cols
        done = start + rows * cols
    positions[:, done:] = np.arange(done, len(ids)) + shift
    return positions, shift


# Features, kept by picture.


class ImageStore:
    """The features of the pictures a prompt may still need, by key: an image's features are
    made once (the vision graph), kept while a request that needs them is held (`add` ... `let_go`)
    and after it while there is room (the least recently used go first), and given to the language
    model's passes in the place of its picture ids."""

    def __init__(self, encode, hidden_size: int, dtype: str, max_bytes: int = 64 << 20):
        self._encode, self._hidden, self._dtype, self.max_bytes = encode, hidden_size, np.dtype(dtype), max_bytes
        self._features: OrderedDict[int, np.ndarray] = OrderedDict()
        self._holds: Counter[int] = Counter()  # requests not ended that need each picture
        self.grids: dict[int, tuple[int, int]] = {}  # the rows and columns of the pictures placed by them, by key
        self._lock = threading.Lock()
        self.encoded = 0  # pictures encoded so far (the rest were found here)

    @property
    def kept(self) -> int:
        """Pictures whose features are kept now."""
        return len(self._features)

    @property
    def held(self) -> int:
        """Pictures that requests not ended hold."""
        return len(self._holds)

    def add(self, pictures: list[Picture]) -> None:
        """Encode the pictures not kept yet (the vision graph, outside the lock), and hold them all
        for a request: none of them goes until `let_go`."""
        with self._lock:
            self._holds.update(item.key for item in pictures)
        try:
            self._encoded(pictures)
        except BaseException:  # refused: nothing will let them go
            self.let_go(pictures)
            raise

    def _encoded(self, pictures: list[Picture]) -> None:
        for item in pictures:
            with self._lock:
                if item.key in self._features:
                    self._features.move_to_end(item.key)
                    continue
            features = np.asarray(self._encode(item.pixels), self._dtype).reshape(-1, self._hidden)
            with self._lock:
                self._features[item.key] = features
                if item.grid:
                    self.grids[item.key] = item.grid
                self.encoded += 1
                self._evict()

    def let_go(self, pictures) -> None:
        """The request that held `pictures` has ended: they may go once the store is over its room."""
        with self._lock:
            self._holds.subtract(item.key for item in pictures)
            self._holds += Counter()  # drops the counts that reached 0
            self._evict()

    def _evict(self) -> None:
        """The least recently used pictures no request holds, while the store is over its room."""
        size = sum(f.nbytes for f in self._features.values())
        for key in [k for k in self._features if k not in self._holds]:
            if size <= self.max_bytes:
                break
            size -= self._features.pop(key).nbytes
            self.grids.pop(key, None)

    def holds(self, picture_id: int) -> bool:
        """Whether `picture_id` names a place of a picture whose features are held."""
        if picture_id < PICTURE_BASE:
            return False
        key, place = picture_key(picture_id)
        with self._lock:
            return key in self._features and place < len(self._features[key])

    def feeds(self, ids: np.ndarray, image_token_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, image_features) of a pass: picture ids become the image token, and their
        features come in the order the graph reads them (row by row, position by position). The
        image token itself, which only a sampled token can be here (a prompt's are named), has no
        picture: it goes as padding (PAD_ID), where the graph would read a feature row that is not there."""
        ids = np.where(ids == image_token_id, PAD_ID, ids)
        mask = is_picture(ids)
        if not mask.any():
            return ids, np.zeros((0, self._hidden), self._dtype)
        with self._lock:
            rows = [self._row(int(i)) for i in ids[mask]]
        return np.where(mask, image_token_id, ids), np.stack(rows)

    def _row(self, picture_id: int) -> np.ndarray:
        key, place = picture_key(picture_id)
        features = self._features.get(key)
        if features is None or place >= len(features):
            raise SettingsError("an image of this prompt is no longer held: send the request again")
        return features[place]


# A conversation's images, in the prompt.


def user_message(text: str, images=()) -> dict:
    """A user's message: `text` after the pictures `images` (paths, bytes or PIL images), where there are some."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}]}


def take_pictures(messages: list, vision: dict | None) -> tuple[list, list[Picture]]:
    """`messages` as the chat template takes them, and their pictures in order: an image part
    ({"type": "image", "image": a path, bytes or PIL image}) becomes {"type": "image"}, which
    chat templates show as the model's image marker; a content of text parts alone becomes one
    text (text-only templates take a string). SettingsError for an image a text-only model is sent."""
    if not isinstance(messages, (list, tuple)):
        return messages, []
    pictures: list[Picture] = []
    taken = [_message_parts(m, vision, pictures) for m in messages]
    return taken, pictures


def _message_parts(message, vision: dict | None, pictures: list[Picture]):
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, (list, tuple)):
        return message
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            if vision is None:
                raise SettingsError(
                    "this model reads text only, and a message holds an image: send the image to a vision-language "
                    "export (edgeinfer export of a model such as SmolVLM), or leave the image out",
                    "messages",
                )
            pictures.append(picture(part.get("image"), vision, media_type=part.get("media_type")))
            parts.append({"type": "image"})
        else:
            raise SettingsError(
                f"a message's content part {part!r:.80} is not taken: send {{'type': 'text', 'text': ...}} and "
                "{'type': 'image', 'image': a path, bytes or PIL image}",
                "messages",
            )
    return {**message, "content": content_of(parts)}


def content_of(parts: list[dict]) -> str | list[dict]:
    """A message's content from its parts in order: one text where there is no image (text-only
    templates take a string), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def expand(text: str, vision: dict, pictures: list[Picture]) -> str:
    """The rendered prompt with each image marker the template wrote replaced by its picture's
    text (its image tokens and what surrounds them), as the model's processor does."""
    pieces = text.split(vision["marker"])
    if len(pieces) - 1 != len(pictures):
        raise SettingsError(
            f"the chat template wrote {len(pieces) - 1} image markers ({vision['marker']!r}) for {len(pictures)} images: "
            "the messages' text may hold the marker itself (take it out), or the template does not show images",
            "messages",
        )
    out = [pieces[0]]
    for item, piece in zip(pictures, pieces[1:]):
        out += [item.text, piece]
    return "".join(out)


def whole_pictures(spans, prompts: list[list[int]], width: int | None = None) -> list[tuple[int, int]]:
    """(start, stop) spans of prefill passes joined where a cut between two would fall inside a
    picture of one of `prompts` (left-padded to `width` where given): between two of its ids."""
    inside = set()
    for prompt in prompts:
        ids = is_picture(np.asarray(prompt, np.int64))
        offset = width - len(prompt) if width is not None else 0
        inside.update((np.flatnonzero(ids[1:] & ids[:-1]) + 1 + offset).tolist())
    joined: list[tuple[int, int]] = []
    for start, stop in spans:
        if joined and joined[-1][1] in inside:
            joined[-1] = (joined[-1][0], stop)
        else:
            joined.append((start, stop))
    return joined


def name_pictures(ids: list[int], vision: dict, pictures: list[Picture]) -> list[int]:
    """`ids` with the image tokens made picture ids: each picture's, in order."""
    places = [i for i, t in enumerate(ids) if t == vision["image_token_id"]]
    made = sum(item.tokens for item in pictures)
    if len(places) != made:
        raise SettingsError(
            f"the prompt holds {len(places)} image tokens where its {len(pictures)} images make {made}: "
            f"the messages' text may hold the image token {vision['image_token']!r} itself: take it out",
            "messages",
        )
    named, start = list(ids), 0
    for item in pictures:
        for place, picture_id in zip(places[start : start + item.tokens], item.ids()):
            named[place] = picture_id
        start += item.tokens
    return named
