"""The runner's LoRA side: each row of a batch runs an adapter or the base model (`assign`). The
base graph serves until a row first asks for an adapter; from then on the adapters' graph
(export/lora.py) serves in its place (`graph`), with the rows' adapter tensors bound where the
batch keeps them (adapters.RowAdapters), so rows of different adapters share a pass and one copy
of the weights."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .adapters import Adapters, RowAdapters


class AdapterBinding:
    """What the adapters change in the runner's passes: the graph that serves, each row's tensors,
    and what a pass binds for them. `open_graph` opens the adapters' graph (once, at the first
    adapter asked for)."""

    def __init__(self, adapters: Adapters, dtype: str, open_graph: Callable):
        self.adapters, self.dtype, self._open_graph = adapters, dtype, open_graph
        self.graph = None  # the adapters' graph, once it serves
        self._no_adapter: dict | None = None  # rank-0 tensors for passes of base rows alone
        self._switching = threading.Lock()

    def assign(self, batch, row: int, adapter: str | None) -> None:
        """Run `row` of `batch` with `adapter` (None: the base model) from its next pass on."""
        self.adapters.check(adapter)
        if adapter is None and batch.adapters is None:
            return
        graph = self._serve()
        if batch.adapters is None:
            rows = len(batch.cache.lengths)
            shapes = self.adapters.shapes.items()
            batch.adapters = RowAdapters({name: graph.allocate([rows, *shape], self.dtype) for name, shape in shapes}, rows)
            for other in range(rows):
                if other != row:
                    self._write_row(graph, batch.adapters, other, None)
        self._write_row(graph, batch.adapters, row, adapter)

    def _write_row(self, graph, adapters: RowAdapters, row: int, adapter: str | None) -> None:
        for name, values in self.adapters.arrays(adapter).items():
            graph.write_row(adapters.buffers[name], row, values)
        adapters.names[row] = adapter

    def _serve(self):
        """The adapters' graph in place of the base graph, once. A pass of base rows alone binds
        tensors of rank 0 ([1, in, 0] and [1, 0, out]): the adapters' terms are then zeros that
        read nothing."""
        with self._switching:
            if self.graph is None:
                graph = self._open_graph()
                shapes = self.adapters.shapes.items()  # A: [in, rank], B: [rank, out]
                empty = {name: [1, rows, 0] if name.endswith(".a") else [1, 0, cols] for name, (rows, cols) in shapes}
                self._no_adapter = {name: graph.allocate(shape, self.dtype) for name, shape in empty.items()}
                self.graph = graph
            return self.graph

    def views(self, batch, first: int, rows: int) -> tuple[tuple, dict]:
        """What a pass over rows first.. binds for the adapters: the batch's rows, or rank-0 tensors
        where they all run the base model; nothing while the base graph serves."""
        if self._no_adapter is None:
            return (), {}
        if batch.adapters is None or not any(batch.adapters.names[first : first + rows]):
            return ("base",), self._no_adapter
        return batch.adapters.views(first, rows)

    def bind(self, binding, batch, first: int, rows: int) -> None:
        """The rows' adapter tensors on a kept binding, bound anew only where what they are changed."""
        key, views = self.views(batch, first, rows)
        if views and getattr(binding, "adapters", None) != (key, id(batch.adapters)):
            binding.keep_rows(views)
            binding.adapters = (key, id(batch.adapters))


def chain_root(batch, row: int):
    """Where the prefix cache's chains for the row's adapter start."""
    name = batch.adapters.names[row] if batch.adapters is not None else None
    return 0 if name is None else ("adapter", name)
