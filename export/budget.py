"""What an export needs of the machine, checked before the work that needs it: memory (before the
model is loaded, once it is, and for a streamed export) and disk; and the peak it reached."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.memory import size_text

from .quantize import Quantization
from .source import Sizes


# Memory an export takes on top of the loaded PyTorch model: the fp32 weights once more, plus 512 MiB.
# torch.onnx's tracer gets the weights apart, once the graph is traced the model is let go (the
# checks hold ONNX Runtime's weights in its place), and the quantizer reads one weight at a time,
# so the process's high-water mark over the loaded model stays under this on every checkpoint
# measured (docs/benchmarks.md, "Export time and memory").
EXPORT_MEMORY_FACTOR, EXPORT_MEMORY_BASE = 1, 2**29


def fp32_weights(model, as_written: bool = False) -> int:
    """Bytes of the model's weights in fp32; `as_written`: as the ONNX graph stores them, where a
    weight shared by two layers (a tied embedding table and lm_head) is written once for each."""
    return 4 * sum(p.numel() for _, p in model.named_parameters(remove_duplicate=not as_written))


def check_memory(weights: int) -> None:
    """Refuse, once the model is loaded and before the graph is traced, where this machine does
    not have the memory the export's next stages take, for `weights` bytes of fp32 weights."""
    available = available_memory()
    need = EXPORT_MEMORY_FACTOR * weights + EXPORT_MEMORY_BASE
    if available is not None and need > available:
        raise ExportError(
            f"exporting this model needs about {size_text(need)} more memory ({EXPORT_MEMORY_FACTOR:g}x its "
            f"{size_text(weights)} of fp32 weights, and {size_text(EXPORT_MEMORY_BASE)}), and this machine has {size_text(available)} available: "
            "free memory, or export on a machine with more and copy the export folder over (it runs anywhere)"
        )


def check_memory_before_load(parameters: int | None) -> None:
    """Refuse, before any weight is read, where this machine cannot hold the model loaded in fp32
    (4 bytes for each of the source's `parameters`) and what the export takes on top of it
    (`check_memory`): the kernel would otherwise end the export while it loads."""
    available = available_memory()
    if parameters is None or available is None:
        return  # the files do not say: check_memory decides once the model is loaded
    weights = 4 * parameters
    need = (1 + EXPORT_MEMORY_FACTOR) * weights + EXPORT_MEMORY_BASE
    if need > available:
        raise ExportError(
            f"exporting this model needs about {size_text(need)} of memory (its {parameters / 1e9:.2f}B weights loaded in fp32, "
            f"{size_text(weights)}, {EXPORT_MEMORY_FACTOR:g}x that again for the export's stages, and "
            f"{size_text(EXPORT_MEMORY_BASE)}), and this machine has {size_text(available)} available: nothing was loaded; "
            "export on a machine with more memory and copy the export folder over (it runs anywhere)"
        )


def _copy_parameters(sizes: Sizes, layers: int, total: int) -> int:
    """About how many weights a check copy of `layers` of the model's `total` layers holds."""
    return sizes.parameters - sizes.layered + sizes.layered * layers // max(1, total)


def streamed_disk(sizes: Sizes, layers: int, total: int, quantization: Quantization | None) -> int:
    """The bytes a streamed export writes at most: its check copy's fp32 graph (twice while its fuse
    stage rewrites it), or the model's graph: its weights deferred, written once at the end, in fp32
    or quantized (a byte a weight covers 4 or 8 bits, scales and zero points) beside one fp32 table.
    A calibration's sums are checked when the model is loaded (`calibration_disk`)."""
    model = 4 * sizes.parameters if quantization is None else sizes.parameters + 4 * sizes.largest
    return max(8 * _copy_parameters(sizes, layers, total), model)


def check_memory_streamed(sizes: Sizes, layers: int, total: int) -> None:
    """Refuse, before any weight is read, where this machine cannot hold a streamed export: its
    check copy, exported as `check_memory_before_load` counts a model; then the model, whose
    checkpoint is mapped from its files and let go as it is read, and whose quantized weights go
    to disk as they are made, so that what it holds is its largest tensor twice in fp32 (made,
    then copied for the quantizer), GPTQ's Hessian of its widest input and two arrays as large
    (fp32), and `EXPORT_MEMORY_BASE` twice."""
    available = available_memory()
    copy = (1 + EXPORT_MEMORY_FACTOR) * 4 * _copy_parameters(sizes, layers, total) + EXPORT_MEMORY_BASE
    model = 8 * sizes.largest + 12 * sizes.widest**2 + 2 * EXPORT_MEMORY_BASE
    need = max(copy, model)
    if available is None or need <= available:
        return
    what = (
        f"a copy of its first {layers} layers in fp32, checked against PyTorch"
        if copy >= model
        else "its largest tensor twice in fp32 and GPTQ's working memory for its widest input"
    )
    raise ExportError(
        f"exporting this model needs about {size_text(need)} of memory ({what}), and this machine has "
        f"{size_text(available)} available: nothing was loaded; export on a machine with more memory and copy "
        "the export folder over (it runs anywhere)"
    )


def calibration_disk(model, hessian: bool) -> int:
    """The most bytes `calibration.collect_from_model` keeps, whatever the text's length: for each
    nn.Linear's input, one triangle of its Hessian's sum in fp32 where `hessian`, else its
    channels' sums of squares (q, k and v share theirs, which this counts three times)."""
    import torch

    widths = [m.in_features + m.in_features % 2 for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(2 * k * (k + 1) if hessian else 4 * k for k in widths)


def available_memory() -> int | None:
    from edgeinfer.sdk.memory import available_bytes

    return available_bytes("cpu", None)[0]


def peak_memory() -> int | None:
    """The most resident memory this process has held, in bytes (None where the platform cannot tell)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def check_free_space(folder: Path, weights: int) -> None:
    """Refuse before the first graph is written where the disk cannot hold the export: the fp32
    graph (`weights` bytes as written, a tied table twice), and a second copy while fusion and
    quantization rewrite it."""
    check_disk(folder, 2 * weights)


def check_disk(folder: Path, need: int) -> None:
    """Refuse where `folder`'s disk has less than `need` bytes free."""
    free = free_bytes(folder)
    if free < need:
        raise ExportError(
            f"exporting needs about {size_text(need)} free in {folder}, which has {size_text(free)}: "
            "free some space, or export to another folder"
        )


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def free_text(folder: Path) -> str:
    return size_text(free_bytes(folder))
