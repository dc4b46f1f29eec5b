"""Stop strings: text is held back only while it could still be the start of a stop string, so a
stop string that spans several tokens is caught and never reaches the caller."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.held = ""

    def add(self, text: str) -> tuple[str, bool]:
        """Text that is safe to show, and whether a stop string has appeared (the text before
        it is returned; the stop string and anything after it are dropped)."""
        self.held += text
        hits = [self.held.find(stop) for stop in self.stops if stop in self.held]
        if hits:
            safe, self.held = self.held[: min(hits)], ""
            return safe, True
        keep = self._open_prefix()
        safe, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return safe, False

    def flush(self) -> str:
        """The held-back text, at the end of generation without a stop."""
        text, self.held = self.held, ""
        return text

    def _open_prefix(self) -> int:
        """Length of the longest end of the held text that begins some stop string."""
        for size in range(min(len(self.held), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.held[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0
