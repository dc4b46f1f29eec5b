"""Images as every API sends them, made into the SDK's image parts ({"type": "image", "image": bytes,
"media_type": ...}, sdk/vision.py): OpenAI Chat's `image_url` part, Responses' `input_image`,
Anthropic's `image` block. A `data:` URL (base64) is the image itself. A remote URL is fetched only
where the server was started with --allow-image-urls or --allowed-image-domains (image_urls.py): an
edge box does not fetch what a client names. Whatever is wrong with an image is a 400 in the API's own error shape (sdk/vision.py's
SettingsError, or image_urls.py's RequestError), the server unharmed."""

from __future__ import annotations

import base64
import binascii
import re

from pydantic import BaseModel, ConfigDict, PrivateAttr


_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<base64>;base64)?,(?P<data>.*)", re.S)


def data_url(url: str) -> dict:
    """The SDK's image part of a `data:` URL; ValueError (a 400 naming the part) for one that is
    not base64 image data."""
    match = _DATA_URL.fullmatch(url)
    if match is None or not match["base64"]:
        raise ValueError("an image data URL is data:image/TYPE;base64,DATA: this one is not")
    return image_data(match["type"] or "", match["data"])


def image_data(media_type: str, data: str) -> dict:
    """The SDK's image part of base64 `data` said to be of `media_type` (a data: URL's, an
    Anthropic block's); ValueError for a type that is not an image's, or data that does not decode."""
    if not media_type.lower().startswith("image/"):
        raise ValueError(f"the image says its data is {media_type or 'of no type'}: send image/png, jpeg, webp or gif")
    try:
        image = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image's base64 data does not decode: send it base64-encoded, without line breaks") from None
    return {"type": "image", "image": image, "media_type": media_type.lower()}


class ImagePartModel(BaseModel):
    """What every API's image part is once read (strict, as the APIs' models are): `sdk_part()`,
    the SDK's image part its validator made (`_part`)."""

    model_config = ConfigDict(extra="forbid")
    _part: dict = PrivateAttr(default_factory=dict)

    def sdk_part(self) -> dict:
        return self._part


def image_part(url: str) -> dict:
    """The SDK's image part of an image URL: its data for a `data:` URL; the URL, to be fetched
    (or refused: `fetched`), for an http(s) one."""
    if url.startswith("data:"):
        return data_url(url)
    if url.startswith(("http://", "https://")):
        return {"type": "image", "url": url}
    raise ValueError(f"an image URL is a data: URL (base64) or an http(s) URL, not {url[:40]!r}")
