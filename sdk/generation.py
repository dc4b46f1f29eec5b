"""The step loop, for the engine's calls and the scheduler alike: choose → add → decode. The runner
does every pass; a Sequence owns what each token means. `add_chosen` adds each row's chosen token
to its sequence, `decode_step` is one decode pass over the decoding rows and their choices, and
`generate` is the engine's loop over them: prefill once, then decode steps until every row has
ended (rows with speculative decoding step by `speculative.step` instead). A row whose constraint
reaches a dead end ends alone, with a last piece whose finish reason is "error"; the others go on."""

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
    rows = dict(enumerate(sequences))
    yield from add_chosen(runner.choose(logits, sequences, list(rows), batch.bindings), rows)
    if any(s.speculation for s in sequences):
        yield from _speculate(runner, batch, rows)
        return
    while live := {row: s for row, s in rows.items() if not s.is_done}:
        yield from decode_step(runner, batch, live)


def decode_step(runner: ModelRunner, batch: Batch, rows: dict[int, Sequence]) -> Iterator[tuple[int, Piece]]:
    """One decode pass over `rows` (each fed its sequence's newest token; a row between them that
    is not decoding gets a pad token), and each row's next token chosen and added."""
    tokens: list[int | None] = [None] * (max(rows) + 1)
    for row, sequence in rows.items():
        tokens[row] = sequence.history[-1]
    logits = runner.decode(batch, tokens)
    yield from add_chosen(runner.choose(logits, list(rows.values()), list(rows), batch.bindings), rows)


def add_chosen(tokens: list[int | ConstraintError], rows: dict[int, Sequence]) -> Iterator[tuple[int, Piece]]:
    """Each row's chosen token added to its sequence: (row, piece) where there is one. A row whose
    constraint reached a dead end (when choosing or adding) ends with `Sequence.fail`'s piece."""
    for (row, sequence), token in zip(rows.items(), tokens):
        try:
            if isinstance(token, ConstraintError):
                raise token
            piece = sequence.add(token)
        except ConstraintError as error:
            piece = sequence.fail(error)
        if piece is not None:
            yield row, piece


def _speculate(runner: ModelRunner, batch: Batch, rows: dict[int, Sequence]) -> Iterator[tuple[int, Piece]]:
    """Row by row, one speculative step each, until every row has ended."""
    while live := {row: s for row, s in rows.items() if not s.is_done}:
        for row, sequence in live.items():
            yield from ((row, piece) for piece in step(runner, batch, row, sequence))
