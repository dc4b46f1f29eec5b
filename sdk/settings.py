"""Generation settings: one small dataclass that checks itself, and how a call's settings are
resolved from the model's defaults, a `config=` and keywords."""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from dataclasses import dataclass

from .errors import SettingsError

DEFAULT_MAX_NEW_TOKENS = 256
TRUNCATE = (None, "left")


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate. `temperature=0` is greedy; `top_k=0`, `top_p=1`, `min_p=0` and
    `repetition_penalty=1` turn those filters off. `seed` makes sampling reproducible (None: a
    fresh seed each call). `stop` strings and `stop_token_ids` end generation with finish reason
    "stop"; `ignore_eos` keeps going past the model's EOS (benchmarks that need exactly N tokens).
    `truncate="left"` drops a prompt's oldest tokens where it and `max_new_tokens` would not fit the
    context (None: such a prompt is refused, and generation stops where the context ends)."""

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

    def __post_init__(self):
        checked = {
            "max_new_tokens": _integer("max_new_tokens", self.max_new_tokens, low=1),
            "temperature": _real("temperature", self.temperature, "at least 0 (0 is greedy)", lambda v: v >= 0),
            "top_k": _integer("top_k", self.top_k, low=0, hint=" (0 turns it off)"),
            "top_p": _real("top_p", self.top_p, "in (0, 1] (1 turns it off)", lambda v: 0 < v <= 1),
            "min_p": _real("min_p", self.min_p, "in [0, 1] (0 turns it off)", lambda v: 0 <= v <= 1),
            "repetition_penalty": _real("repetition_penalty", self.repetition_penalty, "above 0 (1 turns it off)",
                                        lambda v: v > 0),
            "seed": None if self.seed is None else _integer("seed", self.seed, low=0, hint=" or None"),
            "stop": _stop_strings(self.stop),
            "stop_token_ids": _token_ids(self.stop_token_ids),
        }
        if self.truncate not in TRUNCATE:
            raise SettingsError(f"truncate must be 'left' (keep the end of a long prompt) or None, got {self.truncate!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SettingsError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def is_greedy(self) -> bool:
        """The next token is always the largest logit: nothing to sample, nothing to penalize."""
        return (self.temperature == 0 or self.top_k == 1) and self.repetition_penalty == 1.0


FIELDS = tuple(f.name for f in dataclasses.fields(GenerationConfig))


def resolve_settings(defaults: GenerationConfig, config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    """The settings of one call: `config` if given (else the model's defaults), with `overrides`
    (keyword arguments of the call) on top. An unknown keyword is an error."""
    base = defaults if config is None else config
    if not isinstance(base, GenerationConfig):
        raise SettingsError(f"config must be a GenerationConfig, got {type(base).__name__}")
    unknown = [name for name in overrides if name not in FIELDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], FIELDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SettingsError(f"unknown generation setting {unknown[0]!r}: {hint}the settings are {', '.join(FIELDS)}")
    return dataclasses.replace(base, **overrides) if overrides else base


def _integer(name, value, low, hint="") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise SettingsError(f"{name} must be an integer of at least {low}{hint}, got {value!r}")
    return int(value)


def _real(name, value, rule, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise SettingsError(f"{name} must be a number {rule}, got {value!r}")
    return float(value)


def _stop_strings(stop) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise SettingsError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def _token_ids(ids) -> tuple[int, ...]:
    ids = (ids,) if isinstance(ids, numbers.Integral) else ids
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise SettingsError(f"stop_token_ids must be a list of token ids (integers of at least 0), got {ids!r}")
    return tuple(int(t) for t in ids)
