"""The prefix cache: keys and values of recent prompts, kept on the host in blocks, so that a
prompt that starts like an earlier one prefills only the rest; and the copying of a row's cached
tokens between those blocks and a cache's buffers."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class RowCopier(Protocol):
    """Copies the first tokens of one row of buffers [rows, kv_heads, capacity, head_size] to and
    from the host (runtime.HostCopy through host views, runtime.RowCopy on a device)."""

    def write(self, buffer, row: int, values: np.ndarray) -> None: ...

    def read(self, buffer, row: int, tokens: int) -> np.ndarray: ...


def restore_row(prefix: PrefixCache, ids: list[int], buffers: dict, row: int, copier: RowCopier, root=0, held=None) -> int:
    """The cached blocks that start `ids` (under `root`) written into `row` of `buffers`; how many
    tokens they hold. A buffer that keeps a window (`held`: name -> how many latest positions it
    holds after n tokens, cache_kinds.WindowedKV.held) gets those it would hold after those tokens,
    from slot 0: only as many blocks are taken as have kept them for every such buffer."""
    held = held or {}
    blocks = prefix.blocks(ids, root, lambda found: _usable(found, prefix.block, held))
    count = len(blocks) * prefix.block
    for name in blocks[-1].kv if blocks else ():  # the last block has every part (_usable)
        kept = held[name](count) if name in held else count
        first = (count - kept) // prefix.block
        values = np.concatenate([b.kv[name] for b in blocks[first:]], axis=1)
        copier.write(buffers[name], row, values[:, values.shape[1] - kept :])
    return count


def _usable(found: list[_Block], block: int, held: dict) -> int:
    """How many of the `found` blocks can start a row: the most whose end every windowed buffer
    can be filled at (the blocks of the positions it would hold have kept them)."""
    for count in range(len(found), 0, -1):
        end = count * block
        if all(name in b.kv for name, kept in held.items() for b in found[(end - kept(end)) // block : count]):
            return count
    return 0


def store_row(prefix: PrefixCache, ids: list[int], buffers: dict, row: int, copier: RowCopier, root=0, held=None) -> None:
    """Keep the whole blocks of `ids` (under `root`), prefilled in `row` of `buffers`. A buffer that
    keeps a window (`held`, as restore_row's) holds only the latest positions: only the blocks among
    them keep its part."""
    whole = len(ids) // prefix.block * prefix.block
    if not (prefix.budget and whole):
        return
    rows, starts = {}, {}
    for name, buffer in buffers.items():
        if name in (held or {}):
            kept = held[name](len(ids))
            rows[name], starts[name] = copier.read(buffer, row, kept), len(ids) - kept
        else:
            rows[name] = copier.read(buffer, row, whole)
    prefix.store(ids, rows, root, starts)


@dataclass
class _Block:
    id: int
    # each past input's keys or values of the block's tokens [kv_heads, block, head_size]; a layer
    # that keeps a window has a part only where its buffer still held the block's tokens when stored
    kv: dict[str, np.ndarray]


@dataclass
class PrefixCache:
    """Keys and values of recent prompts, kept on the host in blocks of `block` tokens, so that a
    prompt that starts like an earlier one prefills only the rest (a system prompt, a document
    asked about again, a conversation's earlier turns). A block is found by its tokens and the
    block before it, so it stands for its tokens and every token before them, compared exactly.
    A chain starts at a `root`: 0 for the base model, another value for each LoRA adapter, whose
    keys and values differ for the same tokens, so that a prompt cached under one adapter is never
    reused under another.
    Blocks used least recently leave first once `budget` bytes are held; 0 turns it off.

    `take` joins the blocks that start a prompt ([kv_heads, tokens, head_size] each); `store` keeps a
    prefilled prompt's blocks."""

    budget: int
    block: int = 32
    hit_tokens: int = 0  # prompt tokens that came from the cache
    missed_tokens: int = 0  # prompt tokens that were prefilled
    num_bytes: int = 0  # what the blocks hold
    _blocks: OrderedDict = field(default_factory=OrderedDict)  # (parent id, tokens) -> _Block
    _next_id: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)  # an engine serves many threads

    def has_start(self, ids: list[int], root=0) -> bool:
        """Whether the first block of `ids` is cached (counted neither as hit nor as miss)."""
        with self._lock:
            return bool(self.budget) and len(ids) > self.block and (root, tuple(ids[: self.block])) in self._blocks

    def take(self, ids: list[int], root=0) -> tuple[int, dict[str, np.ndarray]]:
        """The cached blocks that start `ids`, joined: how many tokens, and each past input's keys
        or values of them [kv_heads, tokens, head_size] (a cache that grows from its past)."""
        blocks = self.blocks(ids, root)
        if not blocks:
            return 0, {}
        return len(blocks) * self.block, {name: np.concatenate([b.kv[name] for b in blocks], axis=1) for name in blocks[0].kv}

    def blocks(self, ids: list[int], root=0, usable=len) -> list[_Block]:
        """The cached blocks that start `ids`, the first `usable(found)` of them (all, by default);
        their tokens count as hits, the rest of `ids` as misses."""
        with self._lock:
            found = self._match(ids, root)
            found = found[: usable(found)]
            self.hit_tokens += len(found) * self.block
            self.missed_tokens += len(ids) - len(found) * self.block
        return found

    def _match(self, ids: list[int], root) -> list[_Block]:
        found, parent = [], root
        while self.budget and (len(found) + 1) * self.block < len(ids):
            key = (parent, tuple(ids[len(found) * self.block : (len(found) + 1) * self.block]))
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            found.append(block)
            parent = block.id
        return found

    def store(self, ids: list[int], rows: dict[str, np.ndarray], root=0, starts: dict | None = None) -> None:
        """Keep the whole blocks of `ids`, whose keys and values `rows` now hold: each from
        position `starts[name]` (0 where not given) to the end of its array. A block keeps the
        part of each array that holds all its positions, and gains the parts it lacked."""
        with self._lock:
            self._store(ids, rows, root, starts or {})

    def _store(self, ids: list[int], rows: dict[str, np.ndarray], root, starts: dict) -> None:
        parent = root
        for start in range(0, len(ids) - self.block + 1, self.block) if self.budget else ():
            key = (parent, tuple(ids[start : start + self.block]))
            block = self._blocks.get(key)
            if block is None:
                block = self._blocks[key] = _Block(self._next_id, {})
                self._next_id += 1
            for name, row in rows.items():
                offset = start - starts.get(name, 0)
                if name not in block.kv and 0 <= offset and offset + self.block <= row.shape[1]:
                    block.kv[name] = row[:, offset : offset + self.block].copy()
                    self.num_bytes += block.kv[name].nbytes
            self._blocks.move_to_end(key)
            parent = block.id
        while self.num_bytes > self.budget and self._blocks:
            _, dropped = self._blocks.popitem(last=False)
            self.num_bytes -= sum(a.nbytes for a in dropped.kv.values())
