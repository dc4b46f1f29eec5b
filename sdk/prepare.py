"""Request preparation, the one place both the engine and the scheduler turn a call into
Sequences: settings resolved and checked, prompts encoded and truncated, the room left in the
context, the constraint compiled and the speculative decoding chosen. Everything a bad call can
get wrong is refused here, before any work."""

from __future__ import annotations

import time

from .errors import ContextLengthError, SettingsError
from .reasoning import ReasoningBudget, reasoning_format
from .sequence import Sequence
from .settings import GenerationConfig, resolve_settings
from .speculative import DraftModel, PromptLookup, Speculation


def prepare(engine, prompts: list, config: GenerationConfig | list[GenerationConfig] | None, settings: dict) -> list[Sequence]:
    """Each prompt's Sequence (its token budget, stop conditions, sampler, constraint and
    speculation). `config` is one GenerationConfig for every prompt, or a list of one per prompt;
    `settings` (keywords) apply to every one. In a batch the longest prompt sets the room left in
    the context for every row."""
    start = time.perf_counter()
    configs = config if isinstance(config, (list, tuple)) else [config] * len(prompts)
    if len(configs) != len(prompts):
        raise SettingsError(f"{len(configs)} configs for {len(prompts)} prompts: pass one config, or one per prompt", "config")
    configs = [resolve_settings(engine.default_config, c, settings) for c in configs]
    for c in configs:
        check_token_ids(c, engine.manifest.vocab_size)
        engine.runner.adapters.check(c.adapter)  # an unknown adapter is refused here
    given = [engine.prompt_ids(p, c.truncate != "left") for p, c in zip(prompts, configs)]
    ids = [truncate(row, c, engine.max_context) for row, c in zip(given, configs)]
    room = room_left(ids, engine.max_context, engine.manifest.max_context)
    sequences = [
        Sequence(
            row,
            c,
            min(c.max_new_tokens, room),
            engine.manifest.eos_token_ids,
            engine.tokenizer,
            start,
            len(full) - len(row),
            engine.constraints.start(c.constraint),
            budget(engine.tokenizer, row, c.reasoning_budget),
        )
        for row, full, c in zip(ids, given, configs)
    ]
    for sequence, c in zip(sequences, configs):
        sequence.speculation = speculation(engine, c, len(sequences), len(sequence.prompt_ids) + sequence.max_new_tokens)
    return sequences


def budget(tokenizer, prompt_ids: list[int], tokens: int | None) -> ReasoningBudget | None:
    """The thought's budget of a reasoning model's output, or None without one; the prompt's end
    says whether the output starts inside the thought."""
    if tokens is None:
        return None
    tail = tokenizer.decode_all(prompt_ids[-16:])
    format = reasoning_format(tokenizer, tail)
    if format is None:
        raise SettingsError(
            "reasoning_budget needs a model that thinks between <think> and </think>, and this model's chat "
            "template and vocabulary name no such markers: leave reasoning_budget out",
            "reasoning_budget",
        )
    return ReasoningBudget(format, tokens, tokenizer.encode(format.closing, False))


def speculation(engine, config: GenerationConfig, num_rows: int, capacity: int) -> Speculation | None:
    """A sequence's speculative decoding as its settings ask, or None; raises where the engine cannot."""
    if config.speculative is None:
        return None
    if not engine.runner.can_verify:
        raise SettingsError(
            "this export gives the logits of the last position only, and speculative decoding checks "
            f"several: export the model again with this edgeinfer (`edgeinfer export MODEL -o {engine.folder} "
            "--force`)",
            "speculative",
        )
    if not all(kind.forgets for kind in engine.runner.kinds) and not engine.manifest.kv.in_place:
        raise SettingsError(
            "this export keeps the attention as traced beside a recurrent state (linear attention), whose cache "
            "cannot take back the tokens of a rejected draft: generate without speculative decoding",
            "speculative",
        )
    if num_rows > 1 and not engine.manifest.kv.in_place:
        raise SettingsError(
            "this export keeps the attention as traced, whose cache serves speculative decoding for one "
            "prompt at a time: generate the prompts one by one",
            "speculative",
        )
    if config.speculative == "draft" and config.adapter is not None:
        raise SettingsError(
            f"speculative='draft' proposes with the draft model's base weights, which know nothing of adapter "
            f"{config.adapter!r}: use speculative='prompt_lookup' with an adapter",
            "speculative",
        )
    if config.speculative == "draft" and engine.draft is None:
        raise SettingsError(
            "speculative='draft' needs a draft model: load the engine with draft=DRAFT_DIR, or use speculative='prompt_lookup'",
            "speculative",
        )
    proposer = DraftModel(engine.draft, capacity) if config.speculative == "draft" else PromptLookup()
    return Speculation(proposer, config.num_speculative_tokens)


def truncate(ids: list[int], config: GenerationConfig, max_context: int) -> list[int]:
    """With `truncate="left"`, the end of a prompt that leaves too little room for
    `max_new_tokens` (at least one prompt token is kept)."""
    if config.truncate != "left":
        return ids
    return ids[-max(1, max_context - config.max_new_tokens) :]


def check_token_ids(config: GenerationConfig, vocab_size: int) -> None:
    for name, ids in (("stop_token_ids", config.stop_token_ids), ("logit_bias", [t for t, _ in config.logit_bias])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise SettingsError(f"{name} {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})", name)


def room_left(prompts: list[list[int]], max_context: int, model_context: int) -> int:
    """New tokens each row may make before the context ends; in a batch the longest prompt sets it."""
    longest = max(len(p) for p in prompts)
    room = max_context - longest
    if room < 1:
        which = "the prompt has" if len(prompts) == 1 else "the longest prompt of the batch has"
        context = "model's" if max_context == model_context else "engine's (max_context)"
        raise ContextLengthError(
            f"{which} {longest} tokens but the {context} context is {max_context}: shorten the "
            "prompt, or pass truncate='left' to keep its end",
            longest,
            max_context,
        )
    return room
