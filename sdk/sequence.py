"""One prompt's generation, token by token: its text, its stop conditions and its timings.
The engine owns the graphs and the batch; a Sequence owns what happens to each new token."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .constraints import Matcher
from .reasoning import ReasoningBudget
from .sampling import Sampler, TokenLogprob
from .settings import GenerationConfig
from .stopping import StopStrings
from .tokenizer import Detokenizer, Tokenizer
from .vision import PICTURE_BASE


@dataclass
class Piece:
    """A piece of streamed output: whole characters of text and the tokens that made them.
    The last piece of a stream has `finish_reason` and the timings set."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    prompt_tokens: int | None = None
    truncated_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    complete: bool | None = None
    proposed_tokens: int | None = None
    accepted_tokens: int | None = None
    cached_tokens: int = 0
    image_tokens: int = 0
    error: Exception | None = None  # the last piece of a row that failed alone (finish_reason "error")


@dataclass
class GenerationResult:
    """`token_ids` are the new tokens, without the EOS or stop token id that ended generation
    (tokens that spelled a stop string are kept; the text ends before the stop string).
    `finish_reason` is "eos", "stop" or "length", or "error" for a row of a batch that failed
    alone (its constraint reached a dead end: `error` says so; the other rows went on). `prompt_tokens` were read; `truncated_tokens`
    were dropped from the prompt's start (`truncate="left"`); `cached_tokens` of the prompt came
    from the prefix cache instead of being prefilled; `image_tokens` of the prompt stood for its
    images (sdk/vision.py). With `logprobs`, one TokenLogprob per
    token of `token_ids`. Under a constraint, `complete` says whether the text matches it as it
    stands (False where `max_new_tokens` or a stop string cut it short of a match); None without one."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    ttft_s: float
    decode_tokens_per_s: float
    truncated_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    complete: bool | None = None
    proposed_tokens: int | None = None
    accepted_tokens: int | None = None
    cached_tokens: int = 0
    image_tokens: int = 0
    tool_calls: list | None = None  # chat with tools: the whole ToolCalls made (tools.py); None without tools
    cut_tool_call: object | None = None  # chat with tools: the call the reply ended inside (a ToolCall as far as it came)
    tool_format: str | None = None  # chat with tools: "generic", or "template" (read off the chat template)
    reasoning: str | None = None  # a reasoning model's thinking (reasoning.py), split from `text`
    reasoning_tokens: int = 0  # chat: the tokens generated while the thought was open
    error: Exception | None = None  # why the row failed, where `finish_reason` is "error"

    @classmethod
    def from_pieces(cls, pieces: list[Piece]) -> GenerationResult:
        last = pieces[-1]
        logprobs = None if last.logprobs is None else [t for p in pieces for t in p.logprobs]
        return cls(
            text="".join(p.text for p in pieces),
            token_ids=[t for p in pieces for t in p.token_ids],
            prompt_tokens=last.prompt_tokens,
            finish_reason=last.finish_reason,
            ttft_s=last.ttft_s,
            decode_tokens_per_s=last.decode_tokens_per_s,
            truncated_tokens=last.truncated_tokens,
            logprobs=logprobs,
            complete=last.complete,
            proposed_tokens=last.proposed_tokens,
            accepted_tokens=last.accepted_tokens,
            cached_tokens=last.cached_tokens,
            image_tokens=last.image_tokens,
            error=last.error,
        )


class Sequence:
    def __init__(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        max_new_tokens: int,
        eos_ids: Iterable[int],
        tokenizer: Tokenizer,
        start: float,
        num_truncated: int = 0,
        constraint: Matcher | None = None,
        budget: ReasoningBudget | None = None,
    ):
        self.prompt_ids = prompt_ids
        self.num_truncated = num_truncated
        self.history = [t for t in prompt_ids if t < PICTURE_BASE]  # what the repetition penalty looks at (not images)
        self.generated: list[int] = []  # what the presence and frequency penalties look at
        self.max_new_tokens = max_new_tokens  # this sequence's, within the room the context leaves
        self.end_ids = {t: "stop" for t in config.stop_token_ids} | ({} if config.ignore_eos else {t: "eos" for t in eos_ids})
        self.sampler = Sampler(config)
        self.chooses_by_argmax = config.chooses_by_argmax  # the device's argmax is the choice
        self.speculation = None  # speculative.Speculation, where its settings ask for it
        self.adapter = config.adapter  # the LoRA adapter its rows run with (None: the base model)
        self.constraint = constraint
        self.budget = budget  # a reasoning model's thought, ended after its budget of tokens
        if constraint is not None:  # the constraint's end is the output's end
            self.end_ids |= {t: "eos" for t in constraint.eos_ids if t not in self.end_ids}
        self.want_logprobs, self.top_logprobs = config.logprobs, config.top_logprobs
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = StopStrings(config.stop)
        self.start, self.times = start, []
        self.num_generated, self.pending, self.pending_logprobs = 0, [], []
        self.chosen: TokenLogprob | None = None  # the last choice's logprobs, until `add` takes the token
        self.finish_reason: str | None = None
        self.num_cached = 0  # prompt tokens restored from the prefix cache (set by whoever prefills)

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    def choose(self, logits: np.ndarray, proposal: int | None = None) -> int:
        """The next token from this row's last-position logits (host side): penalties and bias,
        the constraint's mask, then the sampler (which keeps a speculative `proposal` by the
        rejection rule when it draws)."""
        scores = self.sampler.adjust(logits, self.history, self.generated)
        forced = self.budget.next_token() if self.budget is not None else None
        if forced is not None and self.constraint is not None and not self.constraint.allowed()[forced]:
            forced = None  # the constraint does not take the marker here: the model goes on
        if forced is not None:  # the thought's budget is spent: its closing marker comes next
            scores = np.where(np.arange(scores.size) == forced, 0.0, -np.inf).astype(scores.dtype)
        if self.constraint is not None:
            scores = self.constraint.mask(scores)
        token, logprobs = self.sampler.choose(scores, self.want_logprobs, proposal)
        self.chosen = None if logprobs is None else TokenLogprob.of(token, logprobs, self.top_logprobs)
        return token

    def add(self, token: int) -> Piece | None:
        """Take the next token; return a piece when there is text to show or generation ended."""
        self.times.append(time.perf_counter())
        if token in self.end_ids:
            return self._end(self.end_ids[token], "")
        self.history.append(token)
        self.generated.append(token)
        self.pending.append(token)
        if self.want_logprobs:
            self.pending_logprobs.append(self.chosen)
        if self.constraint is not None:
            self.constraint.consume(token)
        self.num_generated += 1
        said = self.detokenizer.add(token)
        if self.budget is not None:
            self.budget.add(token, said)
        text, stopped = self.stops.add(said)
        if stopped:
            return self._end("stop", text, stopped=True)
        if self.constraint is not None and self.constraint.is_finished:  # only the EOS could follow
            return self._end("eos", text)
        if self.num_generated == self.max_new_tokens:
            return self._end("length", text)
        if not text:
            return None
        return self._piece(text)

    def fail(self, error: Exception) -> Piece:
        """End now because of `error` (a constraint's dead end): the last piece, with what is still
        held back, finish reason "error" and the error."""
        piece = self.finish("error")
        piece.error = error
        return piece

    def finish(self, reason: str) -> Piece:
        """End now (a server shutting down, say), with what is still held back and `reason`."""
        if not self.times:
            self.times.append(time.perf_counter())
        return self._end(reason, "")

    def _piece(self, text: str) -> Piece:
        piece = Piece(text, self.pending, logprobs=self.pending_logprobs if self.want_logprobs else None)
        self.pending, self.pending_logprobs = [], []
        return piece

    def _end(self, reason: str, text: str, stopped: bool = False) -> Piece:
        if not stopped:  # what the detokenizer and the stop strings still hold
            tail, stopped = self.stops.add(self.detokenizer.flush())
            text += tail if stopped else tail + self.stops.flush()
        self.finish_reason = "stop" if stopped else reason
        piece = self._piece(text)
        piece.finish_reason, piece.ttft_s, piece.decode_tokens_per_s = (
            self.finish_reason,
            self.times[0] - self.start,
            _rate(self.times),
        )
        piece.prompt_tokens, piece.truncated_tokens, piece.cached_tokens = len(self.prompt_ids), self.num_truncated, self.num_cached
        piece.image_tokens = sum(1 for t in self.prompt_ids if t >= PICTURE_BASE)
        if self.constraint is not None:
            piece.complete = self.constraint.is_complete and not stopped  # a stop string cut the text
        if self.speculation is not None:
            piece.proposed_tokens, piece.accepted_tokens = self.speculation.proposed, self.speculation.accepted
        return piece


def _rate(times: list[float]) -> float:
    """Tokens per second after the first token."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])
