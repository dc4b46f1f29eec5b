"""Generation settings: one small dataclass that checks itself, and how a call's settings are
resolved from the model's defaults, a `config=` and keywords."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
from dataclasses import dataclass

from .errors import SettingsError

DEFAULT_MAX_NEW_TOKENS = 256
TRUNCATE = (None, "left")
MAX_TOP_LOGPROBS = 20
SPECULATIVE = (None, "prompt_lookup", "draft")
MAX_SPECULATIVE_TOKENS = 32
# response_format types: OpenAI's (text: no constraint) and edgeinfer's own.
FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` is "json_schema" (`source` the schema as JSON text; any
    JSON object for OpenAI's json_object), "regex", "lark" (a grammar in llguidance's Lark
    dialect) or "choice" (`source` a JSON list of the allowed strings)."""

    kind: str
    source: str


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate. `temperature=0` is greedy; `top_k=0`, `top_p=1`, `min_p=0` and
    `repetition_penalty=1` turn those filters off. `seed` makes sampling reproducible (None: a
    fresh seed each call). `stop` strings and `stop_token_ids` end generation with finish reason
    "stop"; `ignore_eos` keeps going past the model's EOS (benchmarks that need exactly N tokens).
    `truncate="left"` drops a prompt's oldest tokens where it and `max_new_tokens` would not fit the
    context (None: such a prompt is refused, and generation stops where the context ends).

    OpenAI's penalties: `presence_penalty` and `frequency_penalty` (in [-2, 2]) are subtracted from
    the logits of tokens already generated, once and once per occurrence; `logit_bias` ({token id:
    bias in [-100, 100]}) is added. `response_format` (OpenAI's {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"schema": ...}}, or edgeinfer's {"type": "regex",
    "pattern": ...} and {"type": "grammar", "lark": ...}) or `choice` (a list of strings) constrains
    the output (constraints.py). `logprobs` puts each new token's log-probability on the result,
    with its `top_logprobs` (at most 20) most likely alternatives.

    `speculative` ("prompt_lookup", or "draft" with an engine loaded with a draft model) proposes
    up to `num_speculative_tokens` tokens at a time and checks them in one pass (speculative.py):
    greedy output is the same tokens, sampled output the same distribution, usually sooner.

    `reasoning_budget` ends a reasoning model's thought after that many tokens: its closing marker
    (`</think>`) is forced then, and the answer follows (reasoning.py).

    `adapter` names one of the export's LoRA adapters (`edgeinfer export --adapter`); None is the
    base model."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    truncate: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    response_format: Constraint | None = None
    choice: tuple[str, ...] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    speculative: str | None = None
    num_speculative_tokens: int = 5
    reasoning_budget: int | None = None
    adapter: str | None = None

    def __post_init__(self):
        checked = {
            "max_new_tokens": _integer("max_new_tokens", self.max_new_tokens, low=1),
            "temperature": _real("temperature", self.temperature, "at least 0 (0 is greedy)", lambda v: v >= 0),
            "top_k": _integer("top_k", self.top_k, low=0, hint=" (0 turns it off)"),
            "top_p": _real("top_p", self.top_p, "in (0, 1] (1 turns it off)", lambda v: 0 < v <= 1),
            "min_p": _real("min_p", self.min_p, "in [0, 1] (0 turns it off)", lambda v: 0 <= v <= 1),
            "repetition_penalty": _real("repetition_penalty", self.repetition_penalty, "above 0 (1 turns it off)", lambda v: v > 0),
            "seed": None if self.seed is None else _integer("seed", self.seed, low=0, hint=" or None"),
            "stop": _stop_strings(self.stop),
            "stop_token_ids": _token_ids(self.stop_token_ids),
            "presence_penalty": _real(
                "presence_penalty", self.presence_penalty, "in [-2, 2] (0 turns it off)", lambda v: -2 <= v <= 2
            ),
            "frequency_penalty": _real(
                "frequency_penalty", self.frequency_penalty, "in [-2, 2] (0 turns it off)", lambda v: -2 <= v <= 2
            ),
            "logit_bias": _logit_bias(self.logit_bias),
            "response_format": _response_format(self.response_format),
            "choice": None if self.choice is None else _choices(self.choice),
            "top_logprobs": _integer("top_logprobs", self.top_logprobs, low=0, hint=f" and at most {MAX_TOP_LOGPROBS}"),
            "reasoning_budget": None
            if self.reasoning_budget is None
            else _integer("reasoning_budget", self.reasoning_budget, low=0, hint=" or None (0: the thought ends at once)"),
            "num_speculative_tokens": _integer(
                "num_speculative_tokens", self.num_speculative_tokens, low=1, hint=f" and at most {MAX_SPECULATIVE_TOKENS}"
            ),
        }
        if self.truncate not in TRUNCATE:
            raise SettingsError(f"truncate must be 'left' (keep the end of a long prompt) or None, got {self.truncate!r}", "truncate")
        if not isinstance(self.ignore_eos, bool):
            raise SettingsError(f"ignore_eos must be True or False, got {self.ignore_eos!r}", "ignore_eos")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise SettingsError(f"adapter must be an adapter's name or None, got {self.adapter!r}", "adapter")
        if not isinstance(self.logprobs, bool):
            raise SettingsError(f"logprobs must be True or False, got {self.logprobs!r}", "logprobs")
        if self.speculative not in SPECULATIVE:
            raise SettingsError(
                f"speculative must be 'prompt_lookup', 'draft' (with a draft model) or None, got {self.speculative!r}", "speculative"
            )
        if checked["num_speculative_tokens"] > MAX_SPECULATIVE_TOKENS:
            raise SettingsError(
                f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}",
                "num_speculative_tokens",
            )
        if checked["top_logprobs"] > MAX_TOP_LOGPROBS:
            raise SettingsError(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.top_logprobs}", "top_logprobs")
        if checked["top_logprobs"] and not self.logprobs:
            raise SettingsError("top_logprobs needs logprobs=True", "top_logprobs")
        if checked["response_format"] is not None and checked["choice"] is not None:
            raise SettingsError("give response_format or choice, not both", "response_format")
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.constraint is not None and self.ignore_eos:
            raise SettingsError(
                "ignore_eos cannot be used with a response_format or choice: a constrained output ends "
                "at the model's EOS once it is complete",
                "ignore_eos",
            )

    @property
    def constraint(self) -> Constraint | None:
        """What the output must match, from `response_format` or `choice` (None: anything)."""
        if self.choice is not None:
            return Constraint("choice", json.dumps(list(self.choice)))
        return self.response_format

    @property
    def chooses_by_argmax(self) -> bool:
        """The next token is always the largest logit as the graph gives it: nothing to sample,
        penalize, mask or report, so the host never needs the logits."""
        return (
            (self.temperature == 0 or self.top_k == 1)
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0
            and self.frequency_penalty == 0
            and not self.logit_bias
            and self.constraint is None
            and not self.logprobs
            and self.reasoning_budget is None
        )


FIELDS = tuple(f.name for f in dataclasses.fields(GenerationConfig))


def resolve_settings(defaults: GenerationConfig, config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    """The settings of one call: `config` if given (else the model's defaults), with `overrides`
    (keyword arguments of the call) on top. An unknown keyword is an error."""
    base = defaults if config is None else config
    if not isinstance(base, GenerationConfig):
        raise SettingsError(f"config must be a GenerationConfig, got {type(base).__name__}", "config")
    unknown = [name for name in overrides if name not in FIELDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], FIELDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SettingsError(f"unknown generation setting {unknown[0]!r}: {hint}the settings are {', '.join(FIELDS)}", unknown[0])
    return dataclasses.replace(base, **overrides) if overrides else base


def _integer(name, value, low, hint="") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise SettingsError(f"{name} must be an integer of at least {low}{hint}, got {value!r}", name)
    return int(value)


def _real(name, value, rule, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise SettingsError(f"{name} must be a number {rule}, got {value!r}", name)
    return float(value)


def _stop_strings(stop) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise SettingsError(f"stop must be a string or a list of non-empty strings, got {stop!r}", "stop")
    return tuple(stop)


def _token_ids(ids) -> tuple[int, ...]:
    ids = (ids,) if isinstance(ids, numbers.Integral) else ids
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise SettingsError(f"stop_token_ids must be a list of token ids (integers of at least 0), got {ids!r}", "stop_token_ids")
    return tuple(int(t) for t in ids)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or pairs) as sorted pairs; JSON's string keys ("50256") are token ids too.
    None is no bias."""
    pairs = () if bias is None else bias.items() if isinstance(bias, dict) else bias
    if not isinstance(pairs, (list, tuple, type({}.items()))):
        raise SettingsError(f"logit_bias must map token ids to numbers in [-100, 100], got {bias!r}", "logit_bias")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise SettingsError(f"logit_bias must map token ids to numbers in [-100, 100], got {bias!r}", "logit_bias")
        token, value = pair
        if isinstance(token, str) and token.strip().isascii() and token.strip().isdecimal():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise SettingsError(f"logit_bias keys must be token ids (integers of at least 0), got {token!r}", "logit_bias")
        out[int(token)] = _real(f"logit_bias[{token}]", value, "in [-100, 100]", lambda v: -100 <= v <= 100)
    return tuple(sorted(out.items()))


def _choices(choice) -> tuple[str, ...]:
    if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
        raise SettingsError(f"choice must be a non-empty list of non-empty strings, got {choice!r}", "choice")
    return tuple(choice)


def _response_format(value) -> Constraint | None:
    """OpenAI's response_format dict (or edgeinfer's regex and grammar types) as a Constraint."""
    if value is None or isinstance(value, Constraint):
        return value
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        got = value.get("type") if isinstance(value, dict) else value
        raise SettingsError(
            f"response_format must be a dict whose type is one of {', '.join(FORMATS)}, got {got!r}", "response_format"
        )
    kind = value["type"]
    allowed = {"text": set(), "json_object": set(), "json_schema": {"json_schema"}, "regex": {"pattern"}, "grammar": {"lark"}}[kind]
    extra = set(value) - allowed - {"type"}
    if extra:
        raise SettingsError(
            f"response_format of type {kind!r} takes {sorted(allowed) or 'no other keys'}, not {sorted(extra)}", "response_format"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise SettingsError(
                'response_format json_schema needs {"json_schema": {"schema": {...}}}, the schema a JSON object', "response_format"
            )
        return Constraint("json_schema", json.dumps(spec["schema"]))
    text = value.get({"regex": "pattern", "grammar": "lark"}[kind])
    if not isinstance(text, str) or not text:
        key = {"regex": "pattern", "grammar": "lark"}[kind]
        raise SettingsError(f"response_format of type {kind!r} needs {key!r}, a non-empty string", "response_format")
    return Constraint("lark" if kind == "grammar" else kind, text)
