"""The chat page (serve/ui) in a real headless Chromium (Debian's, driven by Playwright) against real
`edgeinfer serve` subprocesses on tiny models: a streamed reply equal to the API's, stop, model
switch, conversations kept across a reload, the API-key prompt, a reply's markup shown as text,
and screenshots at desktop and phone size."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
from pathlib import Path

import httpx
import openai
import pytest

from chat_page import GIVE_PICTURE, KEY, MARKDOWN, MARKUP, REPLY_DONE, RICH, RICH_EXPECTED, RICH_SHOWN, STORE_REPLY, api_answer
from conftest import linked_copy
from test_serve import long_export, metric, poll, start  # noqa: F401 - long_export is a fixture
from test_vision import idefics3, png  # noqa: F401 - idefics3 is a fixture

pytestmark = pytest.mark.browser
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[test]'")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium to drive: apt-get install chromium (.ci/run installs it)", allow_module_level=True)
DESKTOP, PHONE = {"width": 1280, "height": 800}, {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        yield launched
        launched.close()


def serving(*args):
    process, url = start(*args)
    return process, url


def stop_server(process) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def two_models(tiny_llama, chain_llama, tmp_path_factory):
    """A server of two models: the tiny llama (a) and the chain llama (b)."""
    folder = tmp_path_factory.mktemp("ui-models")
    linked_copy(tiny_llama[1], folder / "a")
    linked_copy(chain_llama[0], folder / "b")
    process, url = serving(None, "--models", str(folder), "--provider", "cpu", "--keep-alive", "-1")
    yield url
    stop_server(process)


class Page:
    """A fresh browser context (its own localStorage) on the page, failing the test on any script
    error or Content-Security-Policy report."""

    def __init__(self, browser, url: str, viewport=DESKTOP, color_scheme: str = "light"):
        self.context = browser.new_context(viewport=viewport, color_scheme=color_scheme)
        self.page = self.context.new_page()
        self.problems = []
        self.page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        self.page.on("console", lambda m: self.problems.append(m.text) if m.type == "error" and "Security Policy" in m.text else None)
        self.page.goto(url)

    def setting(self, name: str, value: str) -> None:
        if self.page.is_hidden("#settings"):
            self.page.click("#toggle-settings")
        self.page.fill(f"#{name}", value)
        self.page.dispatch_event(f"#{name}", "change")

    def send(self, text: str) -> dict:
        """Send `text` and wait for the whole reply; the reply as the page stored it."""
        self.page.fill("#input", text)
        self.page.click("#send")
        self.page.wait_for_function(REPLY_DONE, timeout=60_000)
        return self.conversations()[0]["messages"][-1]

    def conversations(self) -> list:
        return json.loads(self.page.evaluate("localStorage.getItem('edgeinfer.conversations') || '[]'"))

    def show_reply(self, text: str) -> None:
        """A conversation whose reply is `text`, stored in this browser and shown after a reload."""
        self.page.evaluate(STORE_REPLY, text)
        self.page.reload()
        self.page.wait_for_selector(".message.assistant .body")

    def close(self) -> None:
        self.context.close()
        assert self.problems == []


def test_a_message_streams_the_reply_the_api_gives_and_switching_model_answers_as_that_model(browser, two_models):
    page = Page(browser, two_models)
    page.page.wait_for_selector("#model option[value=b]", state="attached")
    assert page.page.eval_on_selector_all("#model option", "options => options.map(o => o.value)") == ["a", "b"]
    page.setting("max_tokens", "12")
    reply = page.send("Hello there")
    assert reply["content"] == api_answer(two_models, "a", "Hello there", max_tokens=12) and reply["content"]
    assert reply["stats"]["tokens"] == 12 and reply["stats"]["ttft_ms"] > 0
    stats = page.page.inner_text(".message.assistant .stats")
    assert stats.startswith("12 tokens · TTFT ") and " ms" in stats
    page.page.click("#new-chat")
    page.page.select_option("#model", "b")
    reply = page.send("Hi")
    assert reply["model"] == "b" and reply["content"] == api_answer(two_models, "b", "Hi", max_tokens=12)
    assert page.page.locator(".message.assistant .body").last.inner_text() == reply["content"]  # plain text: shown as it is
    assert len(page.conversations()) == 2
    page.close()


def test_conversations_are_kept_in_the_browser_across_a_reload(browser, two_models):
    page = Page(browser, two_models)
    page.setting("max_tokens", "6")
    first = page.send("Remember me")
    page.page.reload()
    page.page.wait_for_selector("#conversations li")
    assert page.page.inner_text("#conversations li") == "Remember me"
    page.page.click("#conversations li")
    assert page.page.inner_text(".message.user .body") == "Remember me"
    assert page.conversations()[0]["messages"][-1] == first
    assert page.page.input_value("#max_tokens") == "6"  # the settings too
    page.close()


def test_stop_cancels_the_request_and_the_server_frees_its_row(browser, long_export):
    process, url = serving(long_export, "--provider", "cpu", "--max-batch", "2")
    try:
        page = Page(browser, url)
        page.setting("max_tokens", "16000")
        page.page.fill("#input", "Go on and on")
        page.page.click("#send")
        page.page.wait_for_function("() => document.querySelector('.message.assistant .body').textContent.length > 20")
        assert metric(url, "edgeinfer_running_rows") == 1
        page.page.click("#stop")
        page.page.wait_for_selector("#send", state="visible")
        poll(url, lambda: metric(url, "edgeinfer_running_rows") == 0, seconds=10)
        reply = page.conversations()[0]["messages"][-1]
        assert reply["stopped"] and 0 < reply["stats"]["tokens"] < 16000 and reply["stats"]["tokens_per_s"] > 0
        stats = page.page.inner_text(".message.assistant .stats")
        assert " tok/s · stopped" in stats and stats.startswith(f"{reply['stats']['tokens']} tokens · TTFT ")
        page.close()
    finally:
        stop_server(process)


def test_the_api_key_is_asked_for_once_and_kept(browser, tiny_llama):
    process, url = serving(tiny_llama[1], "--provider", "cpu", "--api-key", KEY)
    try:
        page = Page(browser, url)
        page.page.wait_for_selector("#key-dialog[open]")
        page.page.fill("#key", "wrong")
        page.page.click("#key-form button")
        page.page.wait_for_selector("#key-error:not([hidden])")
        assert "valid API key is needed" in page.page.inner_text("#key-error")
        page.page.fill("#key", KEY)
        page.page.click("#key-form button")
        page.page.wait_for_selector(f"#model option[value='{tiny_llama[1].name}']", state="attached")
        page.page.reload()
        page.page.wait_for_selector(f"#model option[value='{tiny_llama[1].name}']", state="attached")
        assert not page.page.is_visible("#key-dialog")
        page.setting("max_tokens", "4")
        assert page.send("Hi")["content"] == api_answer(url, tiny_llama[1].name, "Hi", max_tokens=4)
        page.close()
    finally:
        stop_server(process)


def test_markup_a_model_writes_shows_as_text_and_never_runs(browser, two_models):
    """A reply constrained to one JSON string made of a script and an image with an onerror handler."""
    page = Page(browser, two_models)
    page.setting("schema", json.dumps({"enum": [MARKUP]}))
    page.setting("max_tokens", "200")
    reply = page.send("Say it")
    assert json.loads(reply["content"]) == MARKUP
    body = page.page.locator(".message.assistant .body")
    assert "<script>window.pwned = 1</script>" in body.inner_text()
    assert body.locator("script").count() == 0 and body.locator("img").count() == 0
    assert body.locator("strong").inner_text() == "bold"  # Markdown still renders around the text
    assert page.page.evaluate("window.pwned") is None
    page.close()


def test_markdown_tables_quotes_links_math_and_nested_code_render_through_the_libraries(browser, two_models):
    """marked, DOMPurify, KaTeX and highlight.js (fetched at install time: serve/ui_vendor.py) render
    what the old hand-made subset showed as raw text; a javascript: link loses its href."""
    page = Page(browser, two_models)
    page.show_reply(RICH)
    assert page.page.evaluate(RICH_SHOWN) == RICH_EXPECTED
    page.close()


def test_without_its_libraries_the_page_shows_replies_as_plain_text(browser, two_models):
    """A build that could not reach the registry (its /ui/vendor/ files missing: blocked here by the
    browser's router) still works: the reply is its own text, markup included, and nothing runs."""
    page = Page(browser, two_models)
    page.context.route("**/ui/vendor/**", lambda route: route.fulfill(status=404, body=""))
    page.show_reply(MARKUP)
    body = page.page.locator(".message.assistant .body")
    assert body.inner_text() == MARKUP and "plain" in body.get_attribute("class")
    assert body.locator("*").count() == 0 and page.page.evaluate("window.pwned") is None
    page.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_screenshots_at_desktop_and_phone_size(browser, two_models, tmp_path, scheme):
    """Saved where EDGEINFER_ARTIFACTS says (else the test's folder; docs/images holds the ones
    docs/serving.md shows); on a phone the conversations fold away and nothing is wider than the
    screen; light and dark as the system asks."""
    folder = Path(os.environ.get("EDGEINFER_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        page = Page(browser, two_models, viewport, scheme)
        page.setting("max_tokens", "24")
        page.send("Hello")
        page.page.click("#toggle-settings")
        stored = page.conversations()  # a reply in Markdown beside the model's own, shown after a reload
        stored[0]["messages"] += [
            {"role": "user", "content": "Show me some code"},
            {"role": "assistant", "content": MARKDOWN, "model": "a"},
        ]
        page.page.evaluate("c => localStorage.setItem('edgeinfer.conversations', JSON.stringify(c))", stored)
        page.page.reload()
        page.page.wait_for_selector(".message.assistant pre code")
        assert page.page.evaluate("document.documentElement.dataset.theme") == scheme
        shot = folder / f"chat-{name}-{scheme}.png"
        page.page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        assert page.page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
        assert page.page.locator(".message.assistant pre code").count() == 1
        sidebar = page.page.locator("#sidebar").bounding_box()
        assert (sidebar["x"] + sidebar["width"] <= 0) == (name == "phone")
        page.close()


def test_a_tool_call_shows_under_the_reply_as_the_api_makes_it_and_a_cut_one_says_so(browser, long_export):
    """On the long-context tiny model: the tools' description in the prompt outgrows a 256-token context."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                # an enum bounds the call: a free string from random weights may outrun max_tokens
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                    "required": ["city"],
                },
            },
        }
    ]
    process, url = serving(long_export, "--provider", "cpu")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    asked = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "tool_choice": "required"}
    try:
        page = Page(browser, url)
        page.setting("tools", json.dumps(tools))
        page.page.select_option("#tool_choice", "required")
        page.page.dispatch_event("#tool_choice", "change")
        page.setting("max_tokens", "200")
        reply = page.send("Weather in Paris?")
        whole = client.chat.completions.create(model=long_export.name, max_tokens=200, **asked).choices[0]
        call = whole.message.tool_calls[0].function
        assert reply["tool_calls"] == [{"name": call.name, "arguments": call.arguments}] and call.name == "get_weather"
        assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
        assert page.page.inner_text(".message.assistant .tool-call") == f"get_weather({call.arguments})"
        page.page.click("#new-chat")
        page.setting("max_tokens", "60")  # ends inside the call
        reply = page.send("Weather in Paris?")
        cut = client.chat.completions.create(model=long_export.name, max_tokens=60, **asked).choices[0]
        assert cut.message.tool_calls is None and cut.finish_reason == "length"
        partial = cut.model_extra["cut_tool_call"]["function"]
        assert reply["tool_calls"] == [] and reply["cut_tool_call"] == partial
        shown = page.page.inner_text(".message.assistant .tool-call.cut")
        assert shown.startswith(f"get_weather({partial['arguments']}…") and "raise Max tokens" in shown
        page.close()
    finally:
        stop_server(process)


def test_the_drawer_closes_on_escape_a_tap_outside_and_new_chat_at_phone_width(browser, two_models):
    page = Page(browser, two_models, PHONE)
    drawer_open = "() => document.getElementById('sidebar').classList.contains('open')"
    for close in (
        lambda: page.page.keyboard.press("Escape"),
        lambda: page.page.click("#messages"),
        lambda: page.page.click("#new-chat"),
    ):
        page.page.click("#toggle-sidebar")
        assert page.page.evaluate(drawer_open)
        close()
        assert not page.page.evaluate(drawer_open)
        page.page.wait_for_timeout(300)  # the drawer's slide
        assert page.page.locator("#toggle-sidebar").is_visible()  # and the button that opens it is not under it
    page.close()


def test_a_server_that_stopped_gets_a_clear_message_not_the_browsers(browser, tiny_llama):
    process, url = serving(tiny_llama[1], "--provider", "cpu")
    page = Page(browser, url)
    page.page.wait_for_selector("#model option", state="attached")
    stop_server(process)
    reply = page.send("Hello")
    assert reply["error"] == "The server is not answering: is edgeinfer serve still running? Start it again, then resend."
    assert "Failed to fetch" not in page.page.inner_text("#messages")
    page.close()


def test_the_theme_follows_the_system_and_the_button(browser, two_models):
    context = browser.new_context(viewport=DESKTOP, color_scheme="dark")
    page = context.new_page()
    page.goto(two_models)
    background = "() => getComputedStyle(document.body).backgroundColor"
    assert page.evaluate("document.documentElement.dataset.theme") == "dark" and page.evaluate(background) == "rgb(21, 23, 28)"
    page.click("#theme")  # auto -> dark
    page.click("#theme")  # dark -> light, whatever the system says
    assert page.inner_text("#theme") == "Theme: light" and page.evaluate(background) == "rgb(246, 247, 249)"
    page.reload()
    assert page.evaluate(background) == "rgb(246, 247, 249)"  # kept in this browser
    context.close()


def test_a_message_can_be_copied_edited_regenerated_and_deleted(browser, two_models):
    page = Page(browser, two_models)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.setting("max_tokens", "8")
    first = page.send("Hello there")
    page.page.locator(".message.assistant .actions .copy").click()
    assert page.page.evaluate("navigator.clipboard.readText()") == first["content"]
    page.page.locator(".message.assistant .actions .regenerate").click()
    page.page.wait_for_function(REPLY_DONE)
    messages = page.conversations()[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"] == first["content"]  # greedy
    page.page.locator(".message.assistant .actions .delete").click()
    assert [m["role"] for m in page.conversations()[0]["messages"]] == ["user"]
    page.page.locator(".message.user .actions .edit").click()
    assert page.page.input_value("#input") == "Hello there" and page.conversations()[0]["messages"] == []
    page.close()


def test_a_loading_model_is_said_and_the_notice_goes_once_it_has_loaded(browser, two_models):
    """/health's 503 (the server loading its model; held here by the browser's router) shows a
    notice and a waiting reply says the model is loading; the notice goes once /health says 200."""
    context = browser.new_context(viewport=DESKTOP)
    context.route("**/health", lambda route: route.fulfill(status=503, body='{"error": {"message": "loading"}}'))
    page = context.new_page()
    page.goto(two_models)
    page.wait_for_selector("#notice", state="visible")
    assert page.inner_text("#notice") == "The model is loading: the first reply waits for it."
    context.unroute("**/health")
    page.wait_for_selector("#notice", state="hidden", timeout=10_000)  # polled each second until it has loaded
    context.close()


@pytest.fixture(scope="module")
def seeing(idefics3):
    """A server of the tiny vision-language model, and its model's name."""
    process, url = serving(idefics3[2], "--provider", "cpu")
    yield url, httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    stop_server(process)


def test_a_picture_attached_pasted_or_dropped_goes_with_the_message(browser, seeing, tmp_path):
    url, model = seeing
    picture = tmp_path / "p.png"
    picture.write_bytes(png(5))
    as_url = "data:image/png;base64," + base64.b64encode(png(5)).decode()
    page = Page(browser, url)
    page.page.wait_for_selector("#model option", state="attached")
    page.page.set_input_files("#picture", str(picture))  # the + button's file picker
    page.page.wait_for_selector("#attached img")
    page.setting("max_tokens", "8")
    reply = page.send("What is it?")
    sent = page.conversations()[0]["messages"][0]
    assert sent == {"role": "user", "content": "What is it?", "images": [as_url]}
    assert reply["content"] == api_answer(url, model, "What is it?", (as_url,), max_tokens=8)
    assert page.page.locator(".message.user .pictures img").count() == 1 and page.page.locator("#attached img").count() == 0
    for kind in ("paste", "drop"):
        page.page.evaluate(GIVE_PICTURE, [kind, base64.b64encode(png(6)).decode(), "image/png"])
    page.page.wait_for_function("() => document.querySelectorAll('#attached img').length === 2")
    page.page.locator("#attached .remove").first.click()
    assert page.page.locator("#attached img").count() == 1
    page.page.evaluate(GIVE_PICTURE, ["drop", base64.b64encode(b"just text").decode(), "text/plain"])
    assert page.page.inner_text("#attach-error") == "given.plain is not a picture this page sends: PNG, JPEG, WebP, GIF or BMP."
    page.close()
