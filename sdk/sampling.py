"""Choosing the next token from the last position's logits."""
from __future__ import annotations

import numpy as np


def greedy(logits: np.ndarray) -> int:
    """The id of the largest logit of the last position; `logits` is [batch=1, seq, vocab]."""
    return int(np.argmax(logits[0, -1]))
