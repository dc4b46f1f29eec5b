"""The chat page in Firefox: Debian's firefox-esr, headless, driven through its own Marionette
protocol by Mozilla's marionette-driver (no geckodriver), against real `edgeinfer serve`
subprocesses: a streamed reply equal to the API's, a reply's markup shown as text, stop freeing the
row, a reload keeping the conversation, and a phone-size screenshot."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from chat_page import GIVE_PICTURE, MARKDOWN, MARKUP, REPLY_DONE, RICH, RICH_EXPECTED, RICH_SHOWN, STORE_REPLY, api_answer
from conftest import linked_copy
from test_serve import long_export, metric, poll, start  # noqa: F401 - long_export is a fixture
from test_vision import idefics3, png  # noqa: F401 - idefics3 is a fixture

pytestmark = pytest.mark.browser
marionette = pytest.importorskip("marionette_driver.marionette", reason="marionette-driver is not installed: pip install -e '.[test]'")
FIREFOX = shutil.which("firefox-esr") or shutil.which("firefox")
if FIREFOX is None:
    pytest.skip("no Firefox to drive: apt-get install firefox-esr (.ci/run installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def firefox():
    """A headless Firefox with Marionette on a free port, in a new profile."""
    profile = tempfile.mkdtemp(prefix="edgeinfer-firefox-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefs = {"marionette.port": port, "browser.shell.checkDefaultBrowser": False, "datareporting.policy.dataSubmissionEnabled": False}
    Path(profile, "user.js").write_text("".join(f"user_pref({json.dumps(k)}, {json.dumps(v)});\n" for k, v in prefs.items()))
    command = [FIREFOX, "--headless", "--marionette", "--no-remote", "--profile", profile]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = marionette.Marionette(host="127.0.0.1", port=port, startup_timeout=60)
    client.start_session()
    yield client
    client.delete_session()
    process.terminate()
    process.wait(timeout=30)
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("firefox-models")
    linked_copy(tiny_llama[1], folder / "a")
    process, url = start(None, "--models", str(folder), "--provider", "cpu", "--keep-alive", "-1")
    yield url
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def wait(client, script: str, seconds: float = 60):
    from marionette_driver.wait import Wait

    return Wait(client, timeout=seconds).until(lambda c: c.execute_script(f"return ({script})();"))


def fresh(client, url: str) -> None:
    """The page at `url` with nothing kept from an earlier test, its models listed."""
    client.navigate(url)
    client.execute_script("localStorage.clear();")
    client.navigate(url)
    wait(client, "() => document.querySelectorAll('#model option').length > 0")


def setting(client, name: str, value: str) -> None:
    client.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1]; e.dispatchEvent(new Event('change'));",
        script_args=[name, value],
    )


def send(client, text: str, done: bool = True) -> dict | None:
    client.find_element("css selector", "#input").send_keys(text)
    client.find_element("css selector", "#send").click()
    if done:
        wait(client, REPLY_DONE)
        return conversations(client)[0]["messages"][-1]
    return None


def conversations(client) -> list:
    return json.loads(client.execute_script("return localStorage.getItem('edgeinfer.conversations') || '[]';"))


def test_a_streamed_reply_equals_the_api_and_survives_a_reload(firefox, served):
    fresh(firefox, served)
    setting(firefox, "max_tokens", "12")
    reply = send(firefox, "Hello there")
    assert reply["content"] == api_answer(served, "a", "Hello there", max_tokens=12) and reply["stats"]["tokens"] == 12
    assert firefox.find_element("css selector", ".message.assistant .stats").text.startswith("12 tokens · TTFT ")
    firefox.refresh()
    wait(firefox, "() => document.querySelectorAll('.message').length === 2")
    assert firefox.find_element("css selector", "#conversations li").text == "Hello there"
    assert conversations(firefox)[0]["messages"][-1] == reply


def test_markup_a_model_writes_shows_as_text_and_never_runs(firefox, served):
    fresh(firefox, served)
    setting(firefox, "schema", json.dumps({"enum": [MARKUP]}))
    setting(firefox, "max_tokens", "200")
    reply = send(firefox, "Say it")
    assert json.loads(reply["content"]) == MARKUP
    body = firefox.find_element("css selector", ".message.assistant .body")
    assert "<script>window.pwned = 1</script>" in body.text
    assert (
        firefox.execute_script(
            "return document.querySelectorAll('.message.assistant .body script, .message.assistant .body img').length;"
        )
        == 0
    )
    assert firefox.execute_script("return document.querySelector('.message.assistant .body strong').textContent;") == "bold"
    assert firefox.execute_script("return typeof window.pwned;") == "undefined"


def test_markdown_renders_through_the_libraries_as_in_chromium(firefox, served):
    fresh(firefox, served)
    firefox.execute_script(f"return ({STORE_REPLY})(arguments[0]);", script_args=[RICH])
    firefox.refresh()
    wait(firefox, "() => document.querySelector('.message.assistant .body') !== null")
    assert firefox.execute_script(f"return ({RICH_SHOWN})();") == RICH_EXPECTED


def test_stop_cancels_the_request_and_the_server_frees_its_row(firefox, long_export):
    process, url = start(long_export, "--provider", "cpu", "--max-batch", "2")
    try:
        fresh(firefox, url)
        setting(firefox, "max_tokens", "16000")
        send(firefox, "Go on and on", done=False)
        wait(firefox, "() => (document.querySelector('.message.assistant .body') || {textContent: ''}).textContent.length > 20")
        assert metric(url, "edgeinfer_running_rows") == 1
        firefox.find_element("css selector", "#stop").click()
        wait(firefox, REPLY_DONE)
        poll(url, lambda: metric(url, "edgeinfer_running_rows") == 0, seconds=10)
        assert conversations(firefox)[0]["messages"][-1]["stopped"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_a_phone_size_screenshot(firefox, served, tmp_path):
    folder = Path(os.environ.get("EDGEINFER_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    firefox.set_window_rect(width=390, height=844)
    try:
        fresh(firefox, served)
        setting(firefox, "max_tokens", "12")
        send(firefox, "Hello")
        stored = conversations(firefox)
        stored[0]["messages"] += [
            {"role": "user", "content": "Show me some code"},
            {"role": "assistant", "content": MARKDOWN, "model": "a"},
        ]
        firefox.execute_script("localStorage.setItem('edgeinfer.conversations', arguments[0]);", script_args=[json.dumps(stored)])
        firefox.refresh()
        wait(firefox, "() => document.querySelectorAll('.message.assistant pre code').length === 1")
        shot = folder / "chat-firefox-phone.png"
        shot.write_bytes(base64.b64decode(firefox.screenshot()))
        assert shot.stat().st_size > 10_000
        width = firefox.execute_script("return window.innerWidth;")
        assert firefox.execute_script("return document.documentElement.scrollWidth;") <= width
        assert firefox.execute_script("const r = document.getElementById('sidebar').getBoundingClientRect(); return r.right;") <= 0
    finally:
        firefox.set_window_rect(width=1280, height=800)


@pytest.mark.parametrize("size", [(1280, 800), (390, 844)], ids=["desktop", "phone"])
def test_edit_regenerate_delete_the_drawer_and_the_theme(firefox, served, size):
    """What the Chromium tests check of the message actions, the phone's drawer and the theme, in
    Firefox at both widths (the clipboard is Chromium's test: Marionette grants no permission)."""
    firefox.set_window_rect(width=size[0], height=size[1])
    try:
        fresh(firefox, served)
        setting(firefox, "max_tokens", "8")
        first = send(firefox, "Hello there")
        firefox.execute_script("document.querySelector('.message.assistant .actions .regenerate').click();")
        wait(firefox, REPLY_DONE)
        messages = conversations(firefox)[0]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"] == first["content"]
        firefox.execute_script("document.querySelector('.message.assistant .actions .delete').click();")
        firefox.execute_script("document.querySelector('.message.user .actions .edit').click();")
        assert firefox.execute_script("return document.getElementById('input').value;") == "Hello there"
        assert conversations(firefox)[0]["messages"] == []
        is_open = "return document.getElementById('sidebar').classList.contains('open');"
        if size[0] < 700:  # the drawer: opened by the button, closed by Escape and by New chat
            firefox.find_element("css selector", "#toggle-sidebar").click()
            assert firefox.execute_script(is_open)
            firefox.execute_script("document.dispatchEvent(new KeyboardEvent('keydown', {key: 'Escape'}));")
            assert not firefox.execute_script(is_open)
            wait(firefox, "() => document.getElementById('sidebar').getBoundingClientRect().right <= 0")  # its slide ends
            firefox.find_element("css selector", "#toggle-sidebar").click()
            firefox.execute_script("document.getElementById('new-chat').click();")
            assert not firefox.execute_script(is_open)
        for expected in ("Theme: dark", "Theme: light"):
            firefox.find_element("css selector", "#theme").click()
            assert firefox.find_element("css selector", "#theme").text == expected
        background = "return getComputedStyle(document.body).backgroundColor;"
        assert firefox.execute_script(background) == "rgb(246, 247, 249)"
        firefox.find_element("css selector", "#theme").click()  # back to auto
    finally:
        firefox.set_window_rect(width=1280, height=800)


@pytest.fixture(scope="module")
def seeing(idefics3):
    process, url = start(idefics3[2], "--provider", "cpu")
    yield url
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def test_a_dropped_picture_goes_with_the_message(firefox, seeing):
    """Dropped on the composer (Firefox gives a script's paste event no files of its own: the paste
    is driven in Chromium, tests/test_ui.py)."""
    fresh(firefox, seeing)
    setting(firefox, "max_tokens", "8")
    data = base64.b64encode(png(5)).decode()
    firefox.execute_script(f"return ({GIVE_PICTURE})(arguments[0]);", script_args=[["drop", data, "image/png"]])
    wait(firefox, "() => document.querySelectorAll('#attached img').length === 1")
    reply = send(firefox, "What is it?")
    as_url = "data:image/png;base64," + data
    assert conversations(firefox)[0]["messages"][0] == {"role": "user", "content": "What is it?", "images": [as_url]}
    model = conversations(firefox)[0]["model"]
    assert reply["content"] == api_answer(seeing, model, "What is it?", (as_url,), max_tokens=8)
    assert firefox.execute_script("return document.querySelectorAll('.message.user .pictures img').length;") == 1
