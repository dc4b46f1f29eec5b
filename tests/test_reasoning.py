"""Reasoning models (sdk/reasoning.py): the thinking split from the answer, whole and in any cut of
the stream, the template's enable_thinking switch passed through chat_template_kwargs."""

import pytest
from test_tools import engine, with_template  # noqa: F401 - the tiny engine and its template swap

from edgeinfer.sdk.errors import SettingsError
from edgeinfer.sdk.reasoning import ReasoningFormat, ReasoningSplitter, split_reasoning

from conftest import CHATML

# Qwen3's switch: with enable_thinking false the prompt closes an empty thought for the model.
THINKING = CHATML.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}",
)
FORMAT = ReasoningFormat("<think>", "</think>")
OUTPUT = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        (OUTPUT, "The user asks about Paris.\n", "It is sunny."),
        ("It is sunny.", None, "It is sunny."),
        ("<think>still thinking when the budget ran out", "still thinking when the budget ran out", ""),
        ("  <thinking is not a marker", None, "  <thinking is not a marker"),
    ],
)
def test_a_whole_output_splits(text, reasoning, content):
    assert split_reasoning(text, FORMAT) == (reasoning, content)


def test_every_cut_of_the_stream_gives_the_whole_split():
    whole = split_reasoning(OUTPUT, FORMAT)
    for first in range(len(OUTPUT) + 1):
        for second in range(first, len(OUTPUT) + 1, 3):
            splitter = ReasoningSplitter(FORMAT)
            parts = [p for piece in (OUTPUT[:first], OUTPUT[first:second], OUTPUT[second:]) for p in splitter.feed(piece)]
            parts += splitter.flush()
            got = ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))
            assert got == whole, (first, second, parts)


def test_an_output_that_starts_inside_the_thought_splits_at_its_end():
    opened = ReasoningFormat("<think>", "</think>", opened_by_prompt=True)
    assert split_reasoning("Let me see.</think>Sunny.", opened) == ("Let me see.", "Sunny.")


def test_chat_splits_the_reasoning_and_passes_the_templates_switch(with_template):
    engine = with_template(THINKING)
    result = engine.chat([{"role": "user", "content": "Weather?"}], choice=[OUTPUT], max_new_tokens=60)
    assert (result.reasoning, result.text) == ("The user asks about Paris.\n", "It is sunny.")
    off = engine.chat(
        [{"role": "user", "content": "Weather?"}], choice=["It is sunny."], chat_template_kwargs={"enable_thinking": False}
    )
    assert off.reasoning is None and off.text == "It is sunny."
    prompt = engine.tokenizer.render_chat([{"role": "user", "content": "Weather?"}], template_kwargs={"enable_thinking": False})
    assert prompt.endswith("<think>\n\n</think>\n\n")
    plain = with_template(CHATML).chat([{"role": "user", "content": "Weather?"}], choice=[OUTPUT], max_new_tokens=60)
    assert plain.reasoning is None and plain.text == OUTPUT  # a template that names no markers: nothing is split
    with pytest.raises(SettingsError) as raised:
        engine.chat([{"role": "user", "content": "Weather?"}], chat_template_kwargs=["enable_thinking"])
    assert raised.value.param == "chat_template_kwargs"
