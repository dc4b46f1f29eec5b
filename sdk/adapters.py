"""The books of an export's LoRA adapters: their names, their tensors, and which row runs which.

The adapters' graph (export/lora.py) takes, for every projection an adapter changes, A
`lora.KEY.a` [rows, in, rank] and B `lora.KEY.b` [rows, rank, out]: one per row of the pass, or a
single one that every row of the pass shares (MatMul broadcasts it). A batch that runs adapters
keeps one row of each for each of its rows (`RowAdapters`), written when a row is assigned its
adapter (zeros for the base model), so a pass binds them where they are and copies nothing: rows
0..n-1, each its own, even where they all run one adapter. A single shared A and B would be read
once for the pass, but MatMul then multiplies the rows as one matrix, with another summation
order than a row alone gets: the last bits differ, and on a quantized base, whose kernels round
the activations to 8 bits, they grow into other tokens. Bound per row, a row's tokens are those
it gets alone. A target's rank is the largest of the adapters' ranks for it; a smaller rank is
padded with zeros, which add nothing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from .errors import SettingsError
from .manifest import Manifest


class Adapters:
    """An export's adapters: names, the shape of one row of each graph input, and each adapter's
    tensors in those shapes (read from its file at its first use, then kept)."""

    def __init__(self, folder: Path, manifest: Manifest, dtype: str):
        self.folder, self.manifest, self.dtype = Path(folder), manifest, np.dtype(dtype)
        self.names = sorted(manifest.adapters)
        self.shapes = row_shapes(manifest)
        self._arrays: dict[str | None, dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()

    def check(self, name: str | None) -> None:
        if name is not None and name not in self.manifest.adapters:
            raise SettingsError(unknown_adapter(name, self.names), "adapter")

    def arrays(self, name: str | None) -> dict[str, np.ndarray]:
        """Adapter `name`'s row of every graph input (None: zeros, the base model)."""
        with self._lock:
            if name not in self._arrays:
                self._arrays[name] = self._read(name)
            return self._arrays[name]

    def _read(self, name: str | None) -> dict[str, np.ndarray]:
        rows = {input_name: np.zeros(shape, self.dtype) for input_name, shape in self.shapes.items()}
        if name is None:
            return rows
        with np.load(self.folder / self.manifest.adapters[name]["file"], allow_pickle=False) as stored:
            for key in self.manifest.adapters[name]["targets"]:
                a, b = stored[f"{key}.a"], stored[f"{key}.b"]
                rows[f"lora.{key}.a"][:, : a.shape[1]] = a
                rows[f"lora.{key}.b"][: b.shape[0]] = b
        return rows

    @property
    def row_bytes(self) -> int:
        return sum(int(np.prod(shape)) for shape in self.shapes.values()) * self.dtype.itemsize


def row_shapes(manifest: Manifest) -> dict[str, tuple[int, int]]:
    """Each adapters' graph input's shape for one row: [in, rank] and [rank, out] at the largest rank."""
    shapes: dict[str, list[int]] = {}
    for entry in manifest.adapters.values():
        for key, (fan_in, rank, fan_out) in entry["targets"].items():
            shapes[key] = [fan_in, max(rank, shapes.get(key, [0, 0, 0])[1]), fan_out]
    rows = {}
    for key, (fan_in, rank, fan_out) in sorted(shapes.items()):
        rows[f"lora.{key}.a"], rows[f"lora.{key}.b"] = (fan_in, rank), (rank, fan_out)
    return rows


def adapter_memory(manifest: Manifest, rows: int) -> int:
    """What serving the adapters holds: every adapter's tensors, and a copy for each of `rows` rows."""
    if not manifest.adapters:
        return 0
    itemsize = np.dtype(manifest.kv.dtype).itemsize
    one_row = sum(int(np.prod(shape)) for shape in row_shapes(manifest).values()) * itemsize
    return (len(manifest.adapters) + rows) * one_row


class RowAdapters:
    """A batch's copy of each row's adapter tensors ([rows, ...] per graph input, on the device),
    and which adapter each row runs."""

    def __init__(self, buffers: dict, num_rows: int):
        self.buffers, self.names = buffers, [None] * num_rows

    def views(self, first: int, rows: int) -> tuple[tuple, dict]:
        """What a pass over rows first..first+rows-1 binds: (a key that changes when it does, and
        each input's (buffer, first row, rows)), each row its own."""
        return (first, rows), {name: (buffer, first, rows) for name, buffer in self.buffers.items()}


def unknown_adapter(name: str, names: list[str]) -> str:
    if not names:
        return (
            f"unknown adapter {name!r}: this export has no adapters; add one with `edgeinfer export-adapter PEFT_DIR "
            "--base EXPORT --name NAME`, or leave the adapter out"
        )
    return f"unknown adapter {name!r}: this export has {', '.join(names)}"
