"""The generation loop of a call to the engine: prefill once, then choose → yield → decode until
every sequence has ended. Sequences with speculative decoding step by `speculative.step` instead
of the shared decode pass. The runner does every pass; a Sequence owns what each token means."""

from __future__ import annotations

from collections.abc import Iterator

from .errors import ConstraintError
from .runner import Batch, ModelRunner
from .sequence import Piece, Sequence
from .speculative import step


def generate(runner: ModelRunner, sequences: list[Sequence], capacity: int) -> Iterator[tuple[int, Piece]]:
    """(row, piece) as each sequence's output is made, from a batch of `capacity` tokens per row."""
    batch = runner.new_batch(len(sequences), capacity, reuses_logits=True)
    for row, sequence in enumerate(sequences):
        runner.assign(batch, row, sequence.adapter)
    logits = runner.prefill(batch, [s.prompt_ids for s in sequences])
    for sequence, num_cached in zip(sequences, batch.num_cached):
        sequence.num_cached = num_cached
    yield from _take(runner.choose(logits, sequences, list(range(len(sequences))), batch.bindings), sequences, range(len(sequences)))
    if any(s.speculation for s in sequences):
        yield from _speculate(runner, batch, sequences)
        return
    while live := [row for row, s in enumerate(sequences) if not s.is_done]:
        logits = runner.decode(batch, [None if s.is_done else s.history[-1] for s in sequences])
        yield from _take(runner.choose(logits, [sequences[row] for row in live], live, batch.bindings), sequences, live)


def _speculate(runner: ModelRunner, batch: Batch, sequences: list[Sequence]) -> Iterator[tuple[int, Piece]]:
    """Row by row, one speculative step each, until every row has ended."""
    while not all(s.is_done for s in sequences):
        for row, sequence in enumerate(sequences):
            if not sequence.is_done:
                yield from ((row, piece) for piece in step(runner, batch, row, sequence))


def _take(tokens: list[int | ConstraintError], sequences: list[Sequence], rows) -> Iterator[tuple[int, Piece]]:
    """Each row's chosen token added to its sequence; a constraint's dead end is raised."""
    for row, token in zip(rows, tokens):
        if isinstance(token, ConstraintError):
            raise token
        piece = sequences[row].add(token)
        if piece is not None:
            yield row, piece
