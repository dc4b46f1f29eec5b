"""Streaming text out of byte-level tokens: whole characters only, joined pieces equal the decode."""

import pytest

from conftest import build_tokenizer
from edgeinfer.sdk.manifest import TokenizerSpec
from edgeinfer.sdk.tokenizer import Detokenizer, Tokenizer

TEXTS = ["Ünïcödé text, 東京, and emoji 🙂!", "🙂🙂 東京タワー ok", "plain ascii"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(folder)
    return Tokenizer(folder, TokenizerSpec())


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_join_to_the_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) / 3  # multi-byte characters span several byte-level tokens
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add(token) for token in ids] + [detokenizer.flush()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_an_unfinished_character_is_held_back_until_flush(tokenizer):
    ids = tokenizer.encode("🙂")
    detokenizer = Detokenizer(tokenizer)
    assert [detokenizer.add(token) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.add(ids[-1]) == "🙂"
    assert detokenizer.add(ids[0]) == "" and detokenizer.flush() == "\ufffd"
