"""Speculative decoding: a cheap proposer guesses the next few tokens, and one pass of the model
over all of them checks every guess at once (decode reads every weight once per pass, so checking
k tokens costs little more than making one). The tokens kept are exactly those plain decoding
would choose: greedy keeps a guess where it is the model's argmax; sampling keeps a guess with its
probability under the model's distribution and otherwise draws from the rest (sampling.Sampler).

Two proposers:
- `PromptLookup`: the tokens that followed the latest earlier occurrence of the last few tokens,
  in the prompt or the output (n-gram lookup, as transformers' `prompt_lookup_num_tokens` and
  llama.cpp's lookup decoding). No second model; it shines where the output copies its input
  (summaries, edits, answers quoting a document) and proposes nothing elsewhere.
- `DraftModel`: a smaller export with the same tokenizer proposes its greedy tokens, from its own
  KV cache of the row.

`Speculation` is one row's controller: how many tokens to propose now, and a pause after guesses
that failed (a check of k tokens costs more than a plain step, so a row whose guesses keep failing
proposes less often, and text where lookup finds nothing costs nothing extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .errors import ConstraintError

MAX_NGRAM = 3  # the longest n-gram prompt lookup matches; shorter ones are tried after it
MIN_NGRAM = 2  # a single repeated token predicts little, and a wrong guess costs a longer pass
MAX_PAUSE = 16  # steps a row waits, at most, after guesses that failed in a row


class PromptLookup:
    """Proposes the tokens that followed the most recent earlier occurrence of the sequence's
    last n tokens (n from MAX_NGRAM down to MIN_NGRAM)."""

    def propose(self, tokens: list[int], count: int) -> list[int]:
        return lookup(tokens, count)

    def record(self, proposed: int, accepted: int) -> None:
        """Nothing to update: the next lookup reads the sequence as it stands."""


def lookup(tokens: list[int], count: int, longest: int = MAX_NGRAM, shortest: int = MIN_NGRAM) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the last n of `tokens`,
    for the longest n from `longest` down to `shortest` that occurs earlier; [] if none does."""
    if count < 1:
        return []
    sequence = np.asarray(tokens, np.int64)
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        pattern = sequence[-n:]
        starts = np.flatnonzero(sequence[: len(tokens) - n] == pattern[0])  # earlier starts of the n-gram
        for start in starts[::-1]:
            if np.array_equal(sequence[start : start + n], pattern):
                follows = sequence[start + n : start + n + count]
                return follows.tolist()
    return []


class DraftModel:
    """Proposes the greedy tokens of a draft engine (a smaller export with the same vocabulary),
    which keeps its own KV cache of one row: each call feeds it what it has not seen yet, and
    `record` drops the guesses the model rejected from it."""

    def __init__(self, engine, capacity: int):
        self.runner, self.capacity = engine.runner, capacity
        self.batch = None  # runner.Batch of the draft's one row, made at the first proposal
        self.num_seen = 0  # tokens of the sequence in the draft's cache
        self._num_guesses_in_cache = 0  # of the last proposal, the ones fed back into the cache

    def propose(self, tokens: list[int], count: int) -> list[int]:
        if count < 1:
            return []
        runner, new = self.runner, tokens[self.num_seen :]
        if self.batch is None:
            self.batch = runner.new_batch(1, self.capacity)
            logits = runner.prefill(self.batch, [new])
        else:
            logits = runner.verify(self.batch, 0, new, num_logits=1)  # only the last position proposes
        self.num_seen = len(tokens)
        guesses = []
        for i in range(count):
            guesses.append(int(runner.heads.tokens(logits)[0, -1]))
            if i + 1 < count:
                logits = runner.verify(self.batch, 0, guesses[-1:], num_logits=1)
        self._num_guesses_in_cache = count - 1
        return guesses

    def record(self, proposed: int, accepted: int) -> None:
        """Keep the guesses the model accepted in the draft's cache, and drop the others."""
        kept = min(accepted, self._num_guesses_in_cache)
        self.batch.cache.trim(0, self._num_guesses_in_cache - kept)
        self.num_seen += kept
        self._num_guesses_in_cache = 0


def step(runner, batch, row: int, sequence) -> Iterator:
    """One speculative step of one row (the only one, for the engine and the scheduler alike): its
    newest token (not yet in the cache) and the proposed ones run in one pass; each position's
    choice is taken while it equals the proposal, and the first that differs (or the one after
    the last proposal) is the step's last. The cache then forgets the rejected proposals (a
    recurrent state is put back and the kept tokens run again: runner.take_back). Yields the row's
    pieces; a constraint's dead end ends the row with `Sequence.fail`'s piece."""
    speculation = sequence.speculation
    room = sequence.max_new_tokens - sequence.num_generated - 1
    proposal = speculation.propose(sequence.history, room) if speculation else []
    tokens = [sequence.history[-1], *proposal]
    state = runner.row_state(batch, row, len(tokens)) if proposal else {}
    logits = runner.verify(batch, row, tokens)
    greedy = runner.heads.tokens(logits)[0] if sequence.chooses_by_argmax else None
    every = None if greedy is not None else runner.heads.every(logits)[0]
    accepted = 0
    for i in range(len(proposal) + 1):
        guess = proposal[i] if i < len(proposal) else None
        try:
            token = int(greedy[i]) if greedy is not None else sequence.choose(every[i], guess)
            if token == guess:
                accepted += 1
                speculation.accepted += 1  # before `add`, whose last piece carries the counts
            piece = sequence.add(token)
        except ConstraintError as error:
            token, piece = None, sequence.fail(error)
        if piece is not None:
            yield piece
        if sequence.is_done or token != guess:
            break
    if speculation:
        speculation.record(len(proposal), accepted)
    runner.take_back(batch, row, tokens, len(proposal) - accepted, state)


@dataclass
class Speculation:
    """One row's speculative decoding: its proposer, how many tokens it proposes now (`count`,
    up to `most`), and what it proposed and the model accepted in all."""

    proposer: PromptLookup | DraftModel
    most: int
    count: int = 0
    proposed: int = 0
    accepted: int = 0
    _pause: int = 0
    _misses: int = 0

    def __post_init__(self):
        self.count = self.count or self.most

    def propose(self, tokens: list[int], room: int) -> list[int]:
        """The tokens to check after `tokens` (the sequence so far, prompt included), at most
        `room`; none while paused."""
        if self._pause:
            self._pause -= 1
            return []
        proposal = self.proposer.propose(tokens, min(self.count, room))
        self.proposed += len(proposal)
        return proposal

    def record(self, proposed: int, accepted: int) -> None:
        """Adapt to the last check (the engine has counted each accepted token in `accepted` as
        it took it): all guesses kept, propose 2 more next time; some failed, 1 fewer; none kept,
        pause for 1, 3, 7, 15 steps as the misses run on."""
        if not proposed:
            return
        self.proposer.record(proposed, accepted)
        self.count = min(self.count + 2, self.most) if accepted == proposed else max(1, self.count - 1)
        self._misses = 0 if accepted else self._misses + 1
        self._pause = min(2**self._misses - 1, MAX_PAUSE)
