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
# a reply in Markdown, stored into a conversation for the screenshots
MARKDOWN = "Here is code:\n\n```python\nprint('edge')\n```\n\n- one\n- **two** and `three`"
# a reply constrained to this (a JSON schema's enum) must show as text and run nothing
MARKUP = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> **bold**'


def api_answer(url: str, model: str, text: str, **settings) -> str:
    """The server's own reply to one user message, through the openai client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    return (
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **settings)
        .choices[0]
        .message.content
    )
