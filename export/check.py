"""`edgeinfer check`: an export against the PyTorch model it came from, on the user's own machine:
greedy tokens, prefill, decode and several-token logits, and a batch against single prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgeinfer.sdk.engine import Engine
from edgeinfer.sdk.settings import GenerationConfig

from .validate import Reference, logits_differences, torch_reference

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


def check_export(
    folder: str | Path, model, prompt: str | list[int] = DEFAULT_PROMPT, new_tokens: int = 16, provider: str = "cpu"
) -> CheckResult:
    """Compare the export in `folder` with `model` (the PyTorch model it was exported from)."""
    engine = Engine.load(folder, provider=provider)
    return check_against(engine, torch_reference(model, engine.prompt_ids(prompt), new_tokens))


def check_against(engine: Engine | str | Path, reference: Reference, provider: str = "cpu", adapter: str | None = None) -> CheckResult:
    """Compare an export (an engine, or its folder) with PyTorch's `reference`: the greedy tokens
    after its prompt, the logits, and a batch of the prompt and its first quarter against each
    alone; with LoRA adapter `adapter` (the reference is then PEFT's)."""
    if not isinstance(engine, Engine):
        engine = Engine.load(engine, provider=provider)
    ids = engine.prompt_ids(reference.ids)
    greedy = GenerationConfig(max_new_tokens=len(reference.greedy), ignore_eos=True, adapter=adapter)
    tokens = engine.generate(ids, greedy).token_ids
    fixed = engine.manifest.prefill_length  # a batch must fit a prefill graph of fixed length
    full = ids[:fixed] if fixed else ids
    short = full[: max(1, len(full) // 4)]
    rows = engine.generate_batch([short, full], greedy)
    singles = [engine.generate(short, greedy).token_ids, tokens if full is ids else engine.generate(full, greedy).token_ids]
    return CheckResult(
        prompt_tokens=len(ids),
        expected_tokens=reference.greedy,
        tokens=tokens,
        **logits_differences(engine, reference, adapter),
        batch_rows_equal_single=[r.token_ids for r in rows] == singles,
    )


# How far a quantized export's quality, measured again, may be from what its manifest recorded at
# export: the same text and the same fp32 model, so only the machine's kernels differ.
AGREEMENT_TOLERANCE = 0.02  # top-1 agreement, absolute
PERPLEXITY_TOLERANCE = 0.02  # perplexity, relative


def check_quality(folder: str | Path, model, recorded: dict) -> tuple[dict, list[str]]:
    """A quantized export's quality against its fp32 `model`, measured as the export measured it
    (quantize.quality), and the figures that moved past the tolerances from `recorded` (the
    manifest's); none are compared where the export did not measure them (--no-quality)."""
    from .quantize import quality, quality_reference

    measured = quality(quality_reference(model, Path(folder)), Path(folder))
    if "top1_agreement" not in recorded:
        return measured, []
    moved = []
    if abs(measured["top1_agreement"] - recorded["top1_agreement"]) > AGREEMENT_TOLERANCE:
        moved.append(f"top-1 agreement {measured['top1_agreement']:.1%} against {recorded['top1_agreement']:.1%} recorded")
    if abs(measured["perplexity"] / recorded["perplexity"] - 1) > PERPLEXITY_TOLERANCE:
        moved.append(f"perplexity {measured['perplexity']:.2f} against {recorded['perplexity']:.2f} recorded")
    return measured, moved
