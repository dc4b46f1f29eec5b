"""What an engine will need in memory, worked out before anything is allocated, and what the
device has. Loading refuses a context or batch that cannot fit, with the figures and the
setting that would fit, instead of failing halfway through an allocation."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import GenerationError, SettingsError
from .adapters import adapter_memory
from .cache_kinds import cache_kinds
from .manifest import Manifest

_GRAPH_FILES = (".onnx", ".data")
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes an engine holds: its weights (the graph files), its KV cache for `context` tokens in
    each of `batch` rows (and what each row holds whatever its length: a recurrent state, windows),
    and what its prefix cache may hold."""

    weights: int
    kv_per_token: int
    context: int
    batch: int
    prefix_cache: int = 0
    state_per_row: int = 0

    @classmethod
    def of(cls, manifest: Manifest, context: int, batch: int, weight_copies: int = 1) -> MemoryPlan:
        """`weight_copies`: sessions that each hold the weights (the split layout's two on the CPU)."""
        weights = sum(f["size"] for name, f in manifest.files.items() if name.endswith(_GRAPH_FILES))
        weights = weights * weight_copies + adapter_memory(manifest, batch)
        return cls(weights, kv_bytes_per_token(manifest), context, batch, state_per_row=state_bytes_per_row(manifest, context))

    @property
    def kv(self) -> int:
        return (self.kv_per_token * self.context + self.state_per_row) * self.batch

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.prefix_cache

    def check(self, available: int | None, where: str) -> None:
        """Refuse, with the figures and what would fit, where the plan needs more than `available`."""
        if available is None or self.total <= available:
            return
        need = f"{size_text(self.weights)} of weights and {size_text(self.kv)} of KV cache ({self.context} tokens x {self.batch} rows)"
        if self.prefix_cache:
            need += f" and a prefix cache of {size_text(self.prefix_cache)}"
        room = available - self.weights - self.prefix_cache - self.state_per_row * self.batch
        if room < max(1, 2 * self.kv_per_token * self.batch):  # not even a context of 2 tokens
            raise SettingsError(
                f"the model needs {need}, but {where} has {size_text(available)}: the weights alone do not fit; "
                "use a quantized export (edgeinfer export --quantize int4) or free memory"
            )
        fits = room // max(1, self.kv_per_token * self.batch)
        rows = (room + self.state_per_row * self.batch) // max(1, self.kv_per_token * self.context + self.state_per_row)
        batch_hint = f", or max_batch={rows}" if self.batch > 1 and rows >= 1 else ""
        raise SettingsError(
            f"the model needs {need}, but {where} has {size_text(available)}: load it with "
            f"max_context={fits}{batch_hint}, or free memory"
        )


TOKENIZER_BYTES_PER_FILE_BYTE = 9  # a loaded tokenizer's memory over its tokenizer.json's size (docs/serving.md)


def tokenizer_bytes(manifest: Manifest) -> int:
    """Host memory a loaded tokenizer holds (its vocabulary, merges and lookup tables), from the
    size of its tokenizer.json."""
    return TOKENIZER_BYTES_PER_FILE_BYTE * manifest.files.get("tokenizer.json", {}).get("size", 0)


def kv_bytes_per_token(manifest: Manifest) -> int:
    """Bytes of keys and values one token adds to one row of the cache (in the layers that keep every token)."""
    itemsize = np.dtype(manifest.kv.dtype).itemsize
    return sum(kind.bytes_per_token(itemsize) for kind in cache_kinds(manifest.kv, manifest.max_context))


def state_bytes_per_row(manifest: Manifest, context: int) -> int:
    """Bytes one row holds whatever its length: the recurrent state of the linear-attention layers,
    and the keys and values of the layers that keep only their window (their buffers' slots on the
    CPU, which are the most: cache_kinds.window_capacity), in rows of `context` tokens."""
    itemsize = np.dtype(manifest.kv.dtype).itemsize
    return sum(kind.bytes_per_row(context, itemsize) for kind in cache_kinds(manifest.kv, context))


def available_bytes(device: str, limit: int | None) -> tuple[int | None, str]:
    """Memory this engine may use on `device` and how to name it in a message: `limit` where the
    caller set one, else what the device has free now; None where that cannot be told."""
    if limit is not None:
        return limit, "the memory limit"
    if device == "cuda":
        return _cuda_free(), "the GPU"
    return _host_free(), "this machine"


def _host_free() -> int | None:
    """MemAvailable, or less where a cgroup (a container) limits this process."""
    try:
        free = (
            int(next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable:")).split()[1])
            * 1024
        )
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((_CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def _cuda_free() -> int | None:
    """Free GPU memory from the CUDA runtime that onnxruntime-gpu loads; None where it is not found."""
    for name in ("libcudart.so.13", "libcudart.so.12", "cudart64_13.dll", "cudart64_12.dll"):
        try:
            cudart = ctypes.CDLL(name)
        except OSError:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0:
            return free.value
        return None
    return None


def check_generation(plan: MemoryPlan, batch: int, capacity: int, device: str, limit: int | None) -> None:
    """Before a generation allocates its KV cache (`batch` rows of `capacity` tokens): it must fit
    beside the weights within the memory limit, or else in what the device has free now."""
    need = (plan.kv_per_token * capacity + plan.state_per_row) * batch
    free, where = available_bytes(device, limit)
    if free is None:
        return
    if limit is not None:
        free -= plan.weights + plan.prefix_cache
    if need > free:
        rows = free // (plan.kv_per_token * capacity + plan.state_per_row)
        way = (
            f"run at most {rows} prompts at a time, or ask for fewer new tokens"
            if rows >= 1
            else "ask for fewer new tokens, or free memory"
        )
        raise GenerationError(
            f"{batch} rows of {capacity} tokens need {size_text(need)} of KV cache, but {where} has "
            f"{size_text(max(free, 0))} left: {way}"
        )


def give_back_freed_memory() -> None:
    """Return to the system what the C allocator keeps of memory already freed (glibc keeps much of
    what ONNX Runtime's sessions freed), so that the next step's peak starts from what is really in
    use. Without glibc, nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_M_MMAP_THRESHOLD = -3  # mallopt's parameter


def map_large_blocks(threshold: int = 1 << 20) -> None:
    """Have glibc serve blocks of `threshold` bytes or more from their own mappings, which go back to
    the system as soon as they are freed, for the rest of the process. By default glibc raises that
    threshold (to 32 MiB) each time such a block is freed, and smaller blocks stay in its heap, which
    makes an export's peak memory higher and vary between runs. Without glibc, nothing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


def size_text(n: int) -> str:
    """A size in words: GiB, MiB or KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True)
class LoadLimits:
    """What an engine is loaded to serve: prompts and replies of up to `max_context` tokens (None:
    the export's context), in batches of `max_batch` rows, within `memory_limit` bytes (None:
    whatever the device has free). Loading checks that the weights and that much KV cache fit."""

    max_context: int | None = None
    max_batch: int = 1
    memory_limit: int | None = None
    prefix_cache: int | None = 0  # bytes the prefix cache may hold (kv_cache.PrefixCache); None: what fits, up to a default

    def __post_init__(self):
        for name, low in (("max_context", 2), ("max_batch", 1), ("memory_limit", 1), ("prefix_cache", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise SettingsError(f"{name} must be an integer of at least {low}, got {value!r}")
