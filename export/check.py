"""`edgeinfer check`: an export against the PyTorch model it came from, on the user's own machine:
greedy tokens, prefill, decode and several-token logits, and a batch against single prompts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgeinfer.sdk.engine import Engine
from edgeinfer.sdk.settings import GenerationConfig

from .validate import logits_differences

DEFAULT_PROMPT = "The capital of France is Paris. Edge boxes run small language models close to their users, and"


@dataclass
class CheckResult:
    prompt_tokens: int
    expected_tokens: list[int]  # transformers' greedy tokens
    tokens: list[int]  # the export's
    max_abs_diff_prefill: float
    max_abs_diff_decode: float
    max_abs_diff_extend: float  # a pass of several tokens on a filled cache (speculative decoding's check)
    tolerance: float
    batch_rows_equal_single: bool

    @property
    def tokens_equal(self) -> bool:
        return self.tokens == self.expected_tokens

    @property
    def worst(self) -> float:
        """The largest logits difference."""
        return max(self.max_abs_diff_prefill, self.max_abs_diff_decode, self.max_abs_diff_extend)

    @property
    def passed(self) -> bool:
        return self.tokens_equal and self.batch_rows_equal_single and self.worst <= self.tolerance


def check_export(folder: str | Path, model, prompt: str | list[int] = DEFAULT_PROMPT, new_tokens: int = 16,
                 provider: str = "cpu") -> CheckResult:
    """Compare the export in `folder` with `model` (the PyTorch model it was exported from)."""
    engine = Engine.load(folder, provider=provider)
    ids = engine.prompt_ids(prompt)
    greedy = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    tokens = engine.generate(ids, greedy).token_ids
    fixed = engine.manifest.prefill_length  # a batch must fit a prefill graph of fixed length
    full = ids[:fixed] if fixed else ids
    short = full[: max(1, len(full) // 4)]
    rows = engine.generate_batch([short, full], greedy)
    singles = [engine.generate(short, greedy).token_ids, tokens if full is ids else engine.generate(full, greedy).token_ids]
    return CheckResult(
        prompt_tokens=len(ids), expected_tokens=transformers_greedy(model, ids, new_tokens), tokens=tokens,
        **logits_differences(engine, model, ids),
        batch_rows_equal_single=[r.token_ids for r in rows] == singles,
    )


def transformers_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens after `ids`, exactly `new_tokens` of them: the model's forward
    with its own KV cache, the largest logit each step (`generate` would stop at, or suppress, EOS)."""
    import torch

    tokens, past, new_ids = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(new_ids, past_key_values=past, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
            past, new_ids = out.past_key_values, torch.tensor([[tokens[-1]]])
    return tokens
