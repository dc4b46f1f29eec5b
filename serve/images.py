"""Images as every API sends them, made into the SDK's image parts ({"type": "image", "image": bytes,
"media_type": ...}, sdk/vision.py): OpenAI Chat's `image_url` part, Responses' `input_image`,
Anthropic's `image` block. A `data:` URL (base64) is the image itself. A remote URL is fetched only
where the server was started with --allow-image-urls: an edge box does not fetch what a client
names. Whatever is wrong with an image is a 400 in the API's own error shape (sdk/vision.py's
SettingsError, or RequestError here), the server unharmed."""

from __future__ import annotations

import base64
import binascii
import re
import urllib.error
import urllib.request

from pydantic import BaseModel, ConfigDict, PrivateAttr

from .checks import RequestError

_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<base64>;base64)?,(?P<data>.*)", re.S)
FETCH_TIMEOUT_S = 10
MAX_FETCHED = 4 * 1024 * 1024  # bytes of a fetched image: as much as a request's body may hold (guard.MAX_BODY)


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


def fetched(conversation: list[dict], allow_urls: bool) -> list[dict]:
    """The conversation with each remote image fetched, where the server allows it; RequestError
    (400) where it does not, or where the fetch fails."""
    return [_message_fetched(m, allow_urls) for m in conversation]


def _message_fetched(message: dict, allow_urls: bool) -> dict:
    content = message.get("content")
    if not isinstance(content, list) or not any(isinstance(p, dict) and "url" in p for p in content):
        return message
    return {**message, "content": [_part_fetched(p, allow_urls) if "url" in p else p for p in content]}


def _part_fetched(part: dict, allow_urls: bool) -> dict:
    url = part["url"]
    if not allow_urls:
        raise RequestError(
            f"this server does not fetch image URLs ({url[:60]}): send the image itself as a data: URL "
            "(data:image/png;base64,...), or start the server with --allow-image-urls",
            "messages",
        )
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "edgeinfer"}), timeout=FETCH_TIMEOUT_S) as got:
            data = got.read(MAX_FETCHED + 1)
            media_type = got.headers.get_content_type()
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise RequestError(f"the image at {url[:60]} could not be fetched: {error}", "messages") from None
    if len(data) > MAX_FETCHED:
        raise RequestError(f"the image at {url[:60]} is over {MAX_FETCHED} bytes: send a smaller one", "messages")
    return {"type": "image", "image": data, "media_type": media_type if media_type.startswith("image/") else None}
