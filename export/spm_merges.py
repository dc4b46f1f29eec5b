"""A GGUF's SentencePiece vocabulary whose scores are merge ranks, tokenized as llama.cpp does.

A GGUF with `tokenizer.ggml.model` "llama" keeps a SentencePiece vocabulary with one score per
piece. llama.cpp tokenizes it by merging, again and again, the adjacent pair whose merged piece has
the highest score. transformers converts Gemma's GGUF vocabularies to a Unigram model that reads the
scores as log-probabilities instead. Where the scores are minus each piece's merge rank (whole
numbers, as in Gemma 3's), that reading favours many short pieces over the word's own piece.
`as_merges` rebuilds such a tokenizer as the BPE model that merges in score order (docs/export.md
has what it changes)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path


def has_rank_scores(model: dict) -> bool:
    """A Unigram model whose scores are all whole numbers: merge ranks, not log-probabilities."""
    if model.get("type") != "Unigram":
        return False
    scores = [score for _, score in model.get("vocab", [])]
    return len(scores) > 1 and all(float(score).is_integer() for score in scores)


def merges(vocab: list[tuple[str, float]]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces of the vocabulary, the merged piece's score
    highest first (ties: the left piece's, then the right piece's score highest first)."""
    score = dict(vocab)
    found = []
    for piece, merged in vocab:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in score and right in score:
                found.append((-merged, -score[left], -score[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _ids(vocab: list[tuple[str, float]]) -> dict[str, int]:
    """Each piece's id. A byte piece that the conversion renamed to its character ("<0x09>" to a tab)
    while the character is a piece of its own too takes its byte name back, so that no id is lost."""
    count = Counter(piece for piece, _ in vocab)
    ids, seen = {}, set()
    for index, (piece, _) in enumerate(vocab):
        if count[piece] > 1 and piece not in seen and len(piece.encode()) == 1:
            seen.add(piece)
            piece = f"<0x{piece.encode()[0]:02X}>"
        ids.setdefault(piece, index)
    return ids


def as_merges(tokenizer_json: str) -> str:
    """`tokenizer_json` (a fast tokenizer's file) with its Unigram model of rank scores replaced by
    the BPE model that merges in score order; any other tokenizer is returned as it is."""
    data = json.loads(tokenizer_json)
    model = data["model"]
    if not has_rank_scores(model):
        return tokenizer_json
    vocab = [(piece, float(score)) for piece, score in model["vocab"]]
    unk = vocab[model["unk_id"]][0] if model.get("unk_id") is not None else None
    data["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": bool(model.get("byte_fallback")),
        "ignore_merges": False,
        "vocab": _ids(vocab),
        "merges": [list(pair) for pair in merges(vocab)],
    }
    return json.dumps(data, ensure_ascii=False)


def rewrite(path: Path) -> bool:
    """Rewrite the tokenizer file at `path` (where there is one) with `as_merges`; returns whether it changed."""
    if not path.is_file():
        return False
    text = path.read_text(encoding="utf-8")
    merged = as_merges(text)
    if merged != text:
        path.write_text(merged, encoding="utf-8")
    return merged != text
