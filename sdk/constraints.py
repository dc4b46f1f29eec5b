"""Constrained decoding: an output that must match a JSON schema, a regex, a Lark grammar or one of
a list of strings, with llguidance. At each step the constraint says which tokens may come next
(a bitmask over the vocabulary); the others get -inf before the sampler sees the logits, so every
output that ends on the model's EOS matches.

llguidance gets its view of the tokenizer (each token's bytes) from edgeinfer's tokenizer, with no
torch or transformers, once per engine and only when a constraint is first asked for.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from .errors import ConstraintError, SettingsError
from .settings import Constraint
from .tokenizer import Tokenizer


class Constraints:
    """An engine's compiler of constraints, over llguidance's view of the engine's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._source, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        """llguidance's tokenizer, built at the first use from each token's bytes as edgeinfer
        decodes them: llguidance's own reading of a tokenizer.json takes byte-level tokens for text
        where the decoder is not plain ByteLevel (as in tokenizers converted from GGUF), and would
        then let through what it should not."""
        with self._lock:
            if self._tokenizer is None:
                llguidance = _llguidance()
                if not self.eos_ids:
                    raise SettingsError(
                        "this model names no EOS token, which ends a constrained output: generate without response_format or choice"
                    )
                self._tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_Tokens(self._source, self.vocab_size, self.eos_ids)),
                    n_vocab=self.size,
                    eos_token=self.eos_ids,
                )
            return self._tokenizer

    @property
    def size(self) -> int:
        """Token ids llguidance knows: the model's vocabulary, or the tokenizer's where it is larger."""
        return max(self.vocab_size, len(self._source.vocabulary.tokens))

    def start(self, constraint: Constraint | None) -> Matcher | None:
        """A fresh matcher for one output, or None without a constraint. A schema, regex or grammar
        that does not compile, or that nothing can match, is a SettingsError here."""
        if constraint is None:
            return None
        llguidance, param = _llguidance(), "choice" if constraint.kind == "choice" else "response_format"
        try:
            grammar = _grammar(llguidance.LLMatcher, constraint)
        except ValueError as e:  # llguidance's parser: e.g. "recursion limit exceeded" past 127 levels of nesting
            raise SettingsError(f"the {_NAMES[constraint.kind]} cannot be used: {e}", param) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SettingsError(f"the {_NAMES[constraint.kind]} cannot be used: {matcher.get_error()}", param)
        started = Matcher(matcher, self.vocab_size, self.size, self.eos_ids, _NAMES[constraint.kind])
        if not started.allowed().any() or (started.is_finished and not started.is_complete):
            raise SettingsError(
                f"no output can match the {_NAMES[constraint.kind]} (nothing this model's tokens can spell matches it): check it",
                param,
            )
        return started


class _Tokens:
    """The tokenizer as llguidance.TokenizerWrapper reads it: each id's bytes, the special ids
    (with the ids past the tokenizer's vocabulary, which spell nothing), and encoding."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]):
        vocabulary = tokenizer.vocabulary
        extra = range(len(vocabulary.tokens), vocab_size)
        self.tokens = [*vocabulary.tokens, *(f"<[{i}]>".encode() for i in extra)]
        self.special_token_ids = sorted({*vocabulary.special, *extra})
        self.eos_token_id, self.bos_token_id = eos_ids[0], None
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        return self._encode(text, add_special_tokens=False)


class Matcher:
    """Where one output stands in its constraint."""

    def __init__(self, matcher, vocab_size: int, known: int, eos_ids: list[int], name: str = "constraint"):
        """`vocab_size`: the model's logits; `known`: the ids llguidance knows (at least those);
        `eos_ids`: the tokens that end the output where it is complete; `name` what the
        constraint is, for messages."""
        self._matcher, self.vocab_size, self.eos_ids, self.name = matcher, vocab_size, list(eos_ids), name
        self._bitmask = np.zeros((1, (known + 31) // 32), np.int32)

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens that may come next."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def mask(self, scores: np.ndarray) -> np.ndarray:
        """`scores` with -inf for every token that may not come next (a new array). Raises
        ConstraintError at a dead end: an output that does not match yet, which no token continues."""
        allowed = self.allowed()
        if not self.is_complete and not _not(allowed, self.eos_ids).any():
            self._dead_end()
        return np.where(allowed, scores, -np.inf).astype(scores.dtype, copy=False)

    def consume(self, token: int) -> None:
        """Take the next token; ConstraintError where it leaves an output that does not match and
        that nothing may follow."""
        self._matcher.consume_token(token)
        if self.is_finished and not self.is_complete:
            self._dead_end()

    def _dead_end(self):
        raise ConstraintError(
            f"the output cannot match the {self.name}: nothing this model's tokens spell continues it "
            "(a JSON schema that no finite JSON satisfies, such as one whose object must hold itself, "
            "ends so): check it"
        )

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
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
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


def _not(allowed: np.ndarray, ids: list[int]) -> np.ndarray:
    """`allowed` without `ids` (a copy)."""
    others = allowed.copy()
    others[[t for t in ids if t < len(others)]] = False
    return others


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise SettingsError(
            "constrained decoding needs llguidance, which did not install with edgeinfer on this platform: pip install llguidance"
        ) from None
    return llguidance
