"""Images through every API of a real `edgeinfer serve` of the tiny Idefics3, driven by the real
openai and anthropic clients: OpenAI Chat's image_url data: URLs, Responses' input_image and
Anthropic's base64 image blocks give the SDK's own reply; a remote URL is refused unless the server
was started with --allow-image-urls; and the hostile images (truncated, huge, nested, empty, of the
wrong type, 4 MB of junk), each answered with a 4xx in the API's own error shape, the server unharmed."""

from __future__ import annotations

import base64
import io
import http.server
import os
import signal
import struct
import threading
import time
import zlib

import anthropic
import httpx
import openai
import numpy as np
import pytest
from PIL import Image

from test_serve import start
from test_vision import idefics3, png  # noqa: F401 - idefics3 is a fixture

from edgeinfer import Engine

QUESTION = "What is in the picture?"


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def stop(process) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def served(idefics3):
    process, url = start(idefics3[2], "--provider", "cpu", "--model", f"vlm={idefics3[2]}")
    yield url
    stop(process)


@pytest.fixture(scope="module")
def expected(idefics3):
    """The SDK's own greedy reply to QUESTION about png(3), and its prompt's tokens."""
    engine = Engine.load(idefics3[2], provider="cpu")
    messages = [{"role": "user", "content": [{"type": "image", "image": png(3)}, {"type": "text", "text": QUESTION}]}]
    result = engine.chat(messages, max_new_tokens=8, temperature=0)
    return result.text, result.prompt_tokens


def test_chat_completions_take_an_image_url_data_url_and_count_its_tokens(served, expected):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="vlm",
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": data_url(png(3))}}, {"type": "text", "text": QUESTION}],
            }
        ],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content == expected[0]
    assert reply.usage.prompt_tokens == expected[1] and reply.usage.prompt_tokens_details.image_tokens == 9


def test_responses_take_an_input_image(served, expected):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0)
    reply = client.responses.create(
        model="vlm",
        input=[
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": data_url(png(3))}, {"type": "input_text", "text": QUESTION}],
            }
        ],
        max_output_tokens=8,
        temperature=0,
    )
    assert reply.output_text == expected[0] and reply.usage.input_tokens == expected[1]


def test_anthropic_messages_take_a_base64_image_block(served, expected):
    client = anthropic.Anthropic(base_url=served, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(3)).decode()}
    reply = client.messages.create(
        model="vlm",
        messages=[{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}],
        max_tokens=8,  # greedy: the model's generation config does not sample
    )
    assert reply.content[0].text == expected[0] and reply.usage.input_tokens == expected[1]


def test_every_api_turns_a_photo_upright_by_its_exif_orientation(served, idefics3, expected):
    """png(3) stored turned a quarter (EXIF orientation 6, as phones write it) gets the SDK's reply to
    png(3) upright through all three APIs, not the reply to its pixels as stored."""
    from vision_models import oriented

    stored = oriented(png(3), 6)
    engine = Engine.load(idefics3[2], provider="cpu")
    unturned = Image.fromarray(np.asarray(Image.open(io.BytesIO(stored)).convert("RGB")))  # the pixels, no tag
    as_stored = engine.chat(
        [{"role": "user", "content": [{"type": "image", "image": unturned}, {"type": "text", "text": QUESTION}]}],
        max_new_tokens=8,
        temperature=0,
    )
    assert as_stored.text != expected[0]  # the test can tell a turned reading from an upright one
    url = data_url(stored)
    chat = openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0)
    texts = [
        chat.chat.completions.create(
            model="vlm",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}
            ],
            max_tokens=8,
            temperature=0,
        )
        .choices[0]
        .message.content,
        chat.responses.create(
            model="vlm",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": QUESTION}]}],
            max_output_tokens=8,
            temperature=0,
        ).output_text,
    ]
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(stored).decode()}
    messages = anthropic.Anthropic(base_url=served, api_key="x", max_retries=0).messages
    reply = messages.create(
        model="vlm",
        messages=[{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}],
        max_tokens=8,
    )
    assert texts + [reply.content[0].text] == [expected[0]] * 3


@pytest.fixture(scope="module")
def picture_site():
    """A web server on 127.0.0.1 serving png(3) at /p.png, and the paths asked for."""
    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = png(3)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}/p.png", asked
    site.shutdown()
    site.server_close()


def test_a_remote_image_url_is_refused_unless_the_server_allows_them(served, idefics3, expected, picture_site):
    url, asked = picture_site
    body = {
        "model": "vlm",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    refused = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and asked == []  # nothing was fetched
    error = refused.json()["error"]
    assert (
        "does not fetch image URLs" in error["message"] and "--allow-image-urls" in error["message"] and error["param"] == "messages"
    )
    process, public = start(idefics3[2], "--provider", "cpu", "--model", f"vlm={idefics3[2]}", "--allow-image-urls")
    try:  # --allow-image-urls: public addresses only, and 127.0.0.1 is loopback
        refused = httpx.post(f"{public}/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 400 and asked == []
        assert refused.json()["error"]["code"] == "image_url_not_allowed" and refused.json()["error"]["param"] == "messages"
    finally:
        stop(process)
    process, allowing = start(
        idefics3[2], "--provider", "cpu", "--model", f"vlm={idefics3[2]}", "--allowed-image-domains", "127.0.0.1"
    )
    try:
        fetched = httpx.post(f"{allowing}/v1/chat/completions", json=body, timeout=60)
        assert fetched.status_code == 200 and asked == ["/p.png"]
        assert fetched.json()["choices"][0]["message"]["content"] == expected[0]
    finally:
        stop(process)


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (a decompression bomb's shape: small on the wire)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))  # noqa: E731
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def _tiff() -> bytes:
    from io import BytesIO

    from PIL import Image

    out = BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="TIFF")
    return out.getvalue()


HOSTILE = {
    "truncated": (data_url(png(3)[:100]), 400, "cannot be decoded"),
    "huge": (data_url(_png_claiming(100_000, 100_000)), 400, "more than 40,000,000 pixels"),
    "nested": (data_url(data_url(png(3)).encode()), 400, "cannot be decoded"),
    "zero-size": ("data:image/png;base64,", 400, "the image is empty"),
    "zero-pixels": (data_url(_png_claiming(0, 5)), 400, None),
    "wrong MIME (text)": (data_url(png(3), "text/plain"), 400, "says its data is text/plain"),
    "wrong MIME (jpeg for png)": (data_url(png(3), "image/jpeg"), 400, "the image is PNG but was sent as image/jpeg"),
    "unsupported format": (data_url(_tiff(), "image/tiff"), 400, "is not taken"),
    "not base64": ("data:image/png;base64,@@@not base64@@@", 400, "does not decode"),
    "not a URL": ("ftp://example.invalid/a.png", 400, "a data: URL (base64) or an http(s) URL"),
    "4 MB of junk": (data_url(os.urandom(3 * 2**20)), 413, "over"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_image_gets_a_4xx_in_each_apis_shape_and_the_server_goes_on(served, expected, name):
    url, status, words = HOSTILE[name]
    chat = {
        "model": "vlm",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}
        ],
        "max_tokens": 4,
    }
    answered = httpx.post(f"{served}/v1/chat/completions", json=chat, timeout=60)
    assert answered.status_code == status, answered.text
    error = answered.json()["error"]
    assert error["type"] in ("invalid_request_error", "request_too_large") and (words is None or words in error["message"])
    assert status == 413 or error["param"].startswith("messages"), error
    parts = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": QUESTION}]
    response = httpx.post(
        f"{served}/v1/responses",
        json={"model": "vlm", "input": [{"role": "user", "content": parts}], "max_output_tokens": 4},
        timeout=60,
    )
    assert response.status_code == status and (status == 413 or response.json()["error"]["param"].startswith("input")), response.text
    if url.startswith("data:image/") and ";base64," in url and status == 400:  # the same bytes as an Anthropic block
        media, data = url[5:].split(";base64,")
        block = {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
        messages = {
            "model": "vlm",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}],
        }
        refused = httpx.post(f"{served}/v1/messages", json=messages, timeout=60)
        assert (
            refused.status_code == 400
            and refused.json()["type"] == "error"
            and refused.json()["error"]["type"] == "invalid_request_error"
        )
    # unharmed: a good request right after is answered as before
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0)
    good = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(png(3))}}, {"type": "text", "text": QUESTION}],
        }
    ]
    assert (
        client.chat.completions.create(model="vlm", messages=good, max_tokens=8, temperature=0).choices[0].message.content
        == expected[0]
    )


def test_image_urls_that_never_answer_hold_no_text_request_and_end_at_the_deadline(idefics3):
    """Twelve requests whose image URLs never answer (the fetch pool holds 4 at a time): a text chat
    and /tokenize are answered while every one of them is still waiting, and each ends at the
    deadline with a 400 in its API's shape naming its field."""
    from test_image_urls import Silent

    silent = Silent()
    process, url = start(idefics3[2], "--provider", "cpu", "--model", f"vlm={idefics3[2]}", "--allowed-image-domains", "127.0.0.1")
    ended: list[tuple[str, httpx.Response]] = []

    def ask(i: int) -> None:
        image = f"http://127.0.0.1:{silent.port}/{i}.png"
        path, body = [
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]},
            ),
            ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": image}]}]}),
            (
                "/v1/messages",
                {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": image}}]}]},
            ),
        ][i % 3]
        budget = {"max_output_tokens": 4} if path == "/v1/responses" else {"max_tokens": 4}
        ended.append((path, httpx.post(f"{url}{path}", json={"model": "vlm", **budget, **body}, timeout=60)))

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    try:
        for asker in askers:
            asker.start()
        deadline = time.monotonic() + 10
        while silent.accepted < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert silent.accepted == 4  # the pool's threads are all held by silent hosts
        text = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "vlm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        )
        counted = httpx.post(f"{url}/tokenize", json={"model": "vlm", "content": "Hello there"})
        assert text.status_code == 200 and counted.status_code == 200 and ended == []
        for asker in askers:
            asker.join(60)
        for path, answered in ended:
            assert answered.status_code == 400, answered.text
            error = answered.json()["error"]
            field = "input" if path == "/v1/responses" else "messages"
            assert error["type"] == "invalid_request_error" and "did not arrive within 10 s" in error["message"], error
            assert path == "/v1/messages" or (error["param"], error["code"]) == (field, "image_url_timeout"), error
        assert len(ended) == 12  # some never connected: they waited for a thread of the pool past their deadline
    finally:
        stop(process)
        silent.close()


def test_an_image_sent_to_a_text_only_model_is_a_400_saying_so(tiny_llama):
    process, url = start(tiny_llama[1], "--provider", "cpu")
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        chat = {
            "model": model,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(3))}}]}],
            "max_tokens": 4,
        }
        answered = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert answered.status_code == 400 and "reads text only" in answered.json()["error"]["message"]
        assert answered.json()["error"]["param"] == "messages"
    finally:
        stop(process)
