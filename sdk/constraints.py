"""Constrained decoding: an output that must match a JSON schema, a regex, a Lark grammar or one of
a list of strings, with llguidance. At each step the constraint says which tokens may come next
(a bitmask over the vocabulary); the others get -inf before the sampler sees the logits, so every
output that ends on the model's EOS matches.

llguidance builds its view of the tokenizer from the export's tokenizer.json (no torch or
transformers), once per engine and only when a constraint is first asked for.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from .errors import SettingsError
from .settings import Constraint


class Constraints:
    """An engine's compiler of constraints, and the bytes of each token (logprobs report them)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer_file, self.vocab_size, self.eos_ids = Path(tokenizer_file), vocab_size, list(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        """llguidance's tokenizer, built at the first use (about a second for a 50k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                llguidance = _llguidance()
                try:
                    self._tokenizer = llguidance.LLTokenizer(self.tokenizer_file.read_text(), n_vocab=self.vocab_size,
                                                             eos_token=self.eos_ids or None)
                except Exception as e:  # noqa: BLE001 - llguidance raises bare errors on tokenizers it cannot read
                    raise SettingsError(f"constrained decoding cannot use this model's tokenizer ({e}): generate without "
                                        "response_format or choice") from None
            return self._tokenizer

    def start(self, constraint: Constraint | None) -> Matcher | None:
        """A fresh matcher for one output, or None without a constraint. A schema, regex or grammar
        that does not compile, or that nothing can match, is a SettingsError here."""
        if constraint is None:
            return None
        llguidance = _llguidance()
        grammar = _grammar(llguidance.LLMatcher, constraint)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SettingsError(f"the {_NAMES[constraint.kind]} cannot be used: {matcher.get_error()}")
        started = Matcher(matcher, self.vocab_size, self.tokenizer.eos_tokens)
        if not started.allowed().any() or (started.is_finished and not started.is_complete):
            raise SettingsError(f"no output can match the {_NAMES[constraint.kind]} (nothing this model's tokens can spell "
                                "matches it): check it")
        return started

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token adds to the text (a byte-level token may hold part of a character);
        none for special tokens and ids the tokenizer does not know, which add no text, and for a
        token of the byte 0xFF (never in UTF-8 text), which llguidance reserves."""
        tokenizer = self.tokenizer
        return b"" if tokenizer.is_special_token(token) else tokenizer.decode_bytes([token])


class Matcher:
    """Where one output stands in its constraint."""

    def __init__(self, matcher, vocab_size: int, eos_ids: list[int]):
        """`eos_ids`: the tokens that end the output where it is complete (the model's EOS, or
        llguidance's guess from the tokenizer where the export names none)."""
        self._matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, list(eos_ids)
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), np.int32)

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens that may come next."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def mask(self, scores: np.ndarray) -> np.ndarray:
        """`scores` with -inf for every token that may not come next (a new array)."""
        return np.where(self.allowed(), scores, -np.inf).astype(scores.dtype, copy=False)

    def consume(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def is_complete(self) -> bool:
        """The output so far matches the constraint as it stands."""
        return self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Nothing may follow but the end of the output."""
        return self._matcher.is_stopped()


# JSON as json.dumps writes it (", " and ": " between items, no newlines): a small model free to
# add whitespace can spend its whole budget on it. A schema's own "x-guidance" key overrides this,
# e.g. {"x-guidance": {"whitespace_flexible": true}}.
JSON_DEFAULTS = {"whitespace_flexible": False}
_NAMES = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar", "choice": "choice"}


def _grammar(matcher_class, constraint: Constraint) -> str:
    if constraint.kind == "json_schema":
        return matcher_class.grammar_from_json_schema(constraint.source, defaults=JSON_DEFAULTS)
    if constraint.kind == "regex":
        return matcher_class.grammar_from_regex(constraint.source)
    if constraint.kind == "lark":
        return matcher_class.grammar_from_lark(constraint.source)
    choices = json.loads(constraint.source)
    return matcher_class.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise SettingsError("constrained decoding needs llguidance, which did not install with edgeinfer on this "
                            "platform: pip install llguidance") from None
    return llguidance
