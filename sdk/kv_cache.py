"""The KV cache of one generation: the only code that knows how present becomes past."""
from __future__ import annotations

from .manifest import KVSpec
from .runtime import sequence_length


class KVCache:
    """Holds the past keys and values as OrtValues on the engine's device.

    They are never copied to the host: each step's `present.*` outputs are kept on the device
    by the runtime and bound, as they are, as the next step's `past_key_values.*` inputs.
    """

    def __init__(self, spec: KVSpec):
        self.spec = spec
        self.past: dict = {}

    @property
    def length(self) -> int:
        """Tokens held in the cache."""
        if not self.past:
            return 0
        return sequence_length(next(iter(self.past.values())), self.spec.sequence_axis)

    @property
    def present_names(self) -> list[str]:
        return self.spec.present

    def update(self, present: dict) -> None:
        """Take a step's present outputs as the past of the next step."""
        self.past = {past: present[name] for past, name in zip(self.spec.past, self.spec.present)}
