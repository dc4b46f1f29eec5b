"""What the chat page's browser tests share (tests/test_ui.py drives Chromium, tests/test_ui_firefox.py Firefox)."""

from __future__ import annotations

import openai

KEY = "ui-test-key"
# the current conversation's last message is a reply the page has finished
REPLY_DONE = """() => {
  const conversation = JSON.parse(localStorage.getItem('edgeinfer.conversations') || '[]')[0];
  const last = conversation && conversation.messages.at(-1);
  return Boolean(last && last.role === 'assistant' && !last.pending);
}"""
# a conversation whose reply is the argument, stored in the browser (shown after a reload)
STORE_REPLY = """(text) => {
  const messages = [{role: 'user', content: 'Show me'}, {role: 'assistant', content: text, model: 'a'}];
  localStorage.setItem('edgeinfer.conversations', JSON.stringify([{id: 'stored', title: 'Stored', model: 'a', messages}]));
  localStorage.setItem('edgeinfer.current', JSON.stringify('stored'));
}"""
# a reply in Markdown, stored into a conversation for the screenshots
MARKDOWN = (
    "Here is code:\n\n```python\nfor n in (2, 3):\n    print(n, n ** 2)\n```\n\n- one\n- **two** and `three`\n\n"
    "| n | $n^2$ |\n|---|---|\n| 2 | 4 |\n| 3 | 9 |"
)
# what the Markdown libraries must render: a table, a quote, links (one to be disarmed), math beside
# prices, and a code block under a list item, its indentation kept
RICH = """| a | b |
|---|---|
| 1 | 2 |

> quoted

See [docs](https://example.com) and [bad](javascript:alert(1)).

Inline $x^2$ costs $5 and $10.

$$\\frac{1}{2}$$

1. Step one:
   ```python
   def f():
       return 1
   ```
2. Step two"""
# what the page made of RICH (in the last assistant message), read in the browser
RICH_SHOWN = """() => {
  const body = [...document.querySelectorAll('.message.assistant .body')].at(-1);
  const links = [...body.querySelectorAll('a')];
  const code = body.querySelector('ol li pre code');
  return {
    cells: [...body.querySelectorAll('table td')].map((c) => c.textContent),
    quote: (body.querySelector('blockquote') || {}).textContent,
    links: links.map((a) => [a.textContent, a.getAttribute('href'), a.getAttribute('target'), a.getAttribute('rel')]),
    math: [...body.querySelectorAll('math')].map((m) => [m.getAttribute('display'), (m.querySelector('msup, mfrac') || {}).tagName, m.querySelector('annotation').textContent, m.querySelector('annotation').getClientRects().length === 0]),
    prices: body.textContent.includes('costs $5 and $10'),
    code: code ? code.textContent : null,
    keywords: code ? code.querySelectorAll('.hljs-keyword').length : 0,
    fences: body.textContent.includes('```'),
    plain: body.classList.contains('plain'),
  };
}"""
RICH_EXPECTED = {
    "cells": ["1", "2"],
    "quote": "\nquoted\n",
    "links": [["docs", "https://example.com", "_blank", "noopener noreferrer"], ["bad", None, "_blank", "noopener noreferrer"]],
    "math": [[None, "msup", "x^2", True], ["block", "mfrac", "\\frac{1}{2}", True]],
    "prices": True,
    "code": "def f():\n    return 1\n",
    "keywords": 2,
    "fences": False,
    "plain": False,
}
# a reply constrained to this (a JSON schema's enum) must show as text and run nothing
MARKUP = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> **bold**'


# a picture given to the page as `kind` ("paste" on the message box, "drop" on the composer),
# from its base64 bytes and media type, as a browser's clipboard or drag would give it
GIVE_PICTURE = """([kind, data, type]) => {
  const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
  const transfer = new DataTransfer();
  transfer.items.add(new File([bytes], 'given.' + type.split('/')[1], { type }));
  const init = { bubbles: true, cancelable: true };
  if (kind === 'paste') {
    document.getElementById('input').dispatchEvent(new ClipboardEvent('paste', { ...init, clipboardData: transfer }));
  } else {
    document.getElementById('composer').dispatchEvent(new DragEvent('drop', { ...init, dataTransfer: transfer }));
  }
}"""


def api_answer(url: str, model: str, text: str, images: tuple[str, ...] = (), **settings) -> str:
    """The server's own reply to one user message (after the pictures `images`, data: URLs), through the openai client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in images), {"type": "text", "text": text}] if images else text
    return (
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **settings)
        .choices[0]
        .message.content
    )
