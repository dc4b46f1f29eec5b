"""Tracing a model without its weights, then streaming them into the graph's data file one at a time.

Every model is traced with its matrices *hollow*: each is an fp32 view of a few NaN values (its
own small storage, strides 1, 2, 4, ... so that a view of it says which axes it swapped). Tracing
records the ops, not the values, so the graph comes out the same; torch.onnx's constant folding
transposes weights as views, which still point at their matrix's storage, where over the real
weights it would make a transposed copy of each. The weights held apart (`patches.weights_apart`)
are then each written from the loaded model's own tensor, made fp32 and permuted as the view says,
one at a time. A streamed export (pipeline.py) loads the model in its checkpoint's precision
(bfloat16 for most): the process never holds the fp32 model, only the checkpoint's and one tensor
in fp32.

A fold that computed something from a hollow matrix (not a view of it) holds NaN: that family
cannot be streamed, and export says so.

A streamed export that quantizes without calibration goes further: its weights are *deferred*
(`defer`), each an initializer whose location names the function that makes it. The fuse stage
packs them into new deferred weights, the quantizer makes each as it quantizes it, and what is
left (an embedding table) is made when the graph is written. No fp32 weight is written to disk.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import numpy_helper

from edgeinfer.sdk.errors import ExportError

from .patches import APART_BYTES

# fp32 matrices this large are hollow while tracing: exactly those that torch.onnx's message leaves
# out (`patches.weights_apart`) and that are written from the loaded tensor; a smaller one would be
# kept in the message, hollow.
HOLLOW_BYTES = APART_BYTES


class FoldedWeight(ExportError):
    """torch.onnx computed a constant from a hollow matrix (through more than a transpose)."""


@contextmanager
def hollow_weights(model, enabled: bool = True):
    """Meanwhile, `model`'s floating-point parameters of two or more axes and `HOLLOW_BYTES` in
    fp32 are hollow views, its other float parameters and buffers fp32. Yields the map from each
    hollow storage's address to (the parameter's name, the loaded tensor, the view's strides);
    not `enabled`, nothing is hollow (a model in fp32 whose trace folds a matrix into a constant)."""
    import torch

    if not enabled:
        with torch.no_grad():
            yield {}
        return
    hollow, replaced, originals = {}, {}, []
    for module_name, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in list(getattr(module, kind).items()):
                if tensor is None or not tensor.is_floating_point():
                    continue
                originals.append((module, kind, name, tensor))
                if id(tensor) not in replaced:
                    replaced[id(tensor)] = _stand_in(tensor, f"{module_name}.{name}".lstrip("."), kind, hollow)
                getattr(module, kind)[name] = replaced[id(tensor)]
    try:
        with torch.no_grad():
            yield hollow
    finally:
        for module, kind, name, tensor in originals:
            getattr(module, kind)[name] = tensor


def _stand_in(tensor, name: str, kind: str, hollow: dict):
    """What stands in for `tensor` while tracing: a hollow fp32 view (recorded in `hollow`) for a
    large parameter matrix, else the tensor in fp32."""
    import torch

    if kind == "_buffers" or tensor.dim() < 2 or 4 * tensor.numel() < HOLLOW_BYTES:
        value = tensor.detach().float()
        return torch.nn.Parameter(value, requires_grad=False) if kind == "_parameters" else value
    strides = tuple(2**axis for axis in range(tensor.dim()))
    size = 1 + sum((length - 1) * stride for length, stride in zip(tensor.shape, strides))
    view = torch.full((size,), float("nan")).as_strided(tuple(tensor.shape), strides)
    hollow[view.untyped_storage().data_ptr()] = (name, tensor, strides)
    return torch.nn.Parameter(view, requires_grad=False)


def streamed(held: dict, hollow: dict) -> dict:
    """The weights torch.onnx held apart, each a tensor or a function that makes it: a view of a
    hollow matrix is made from the loaded tensor it stands for (fp32, its axes permuted as the
    view's); a tensor folded from the model's small weights is itself. Refuses a fold of a hollow
    matrix that is not a view (it holds NaN)."""
    import torch

    weights = {}
    for name, tensor in held.items():
        source = hollow.get(tensor.untyped_storage().data_ptr())
        if source is not None:
            weights[name] = _maker(*source, tensor)
        elif torch.isnan(tensor).any():
            raise FoldedWeight(
                f"torch.onnx folded a large weight into {name} ({tuple(tensor.shape)}) through more than a transpose, "
                "which a streamed export cannot write: export without streaming (--no-stream), on a machine with "
                "the memory for the model in fp32"
            )
        else:
            weights[name] = tensor
    return weights


def _maker(name: str, loaded, strides: tuple[int, ...], view):
    """The function that makes `view`'s tensor from `loaded` (the parameter `name`), in fp32."""
    if sorted(view.stride()) != sorted(strides) or view.storage_offset() != 0:
        raise FoldedWeight(
            f"torch.onnx folded the weight {name} into a view of shape {tuple(view.shape)} that is not a permutation "
            "of its axes, which a streamed export cannot write: export without streaming (--no-stream)"
        )
    order = [strides.index(stride) for stride in view.stride()]

    def make():
        value = loaded.detach().permute(order).contiguous().float()  # transposed in its own precision: fewer bytes to move
        release_file_pages(loaded)
        return value

    def rows(start: int, stop: int):
        value = loaded.detach().permute(order)[start:stop].float()
        release_file_pages(loaded)
        return value

    make.source = name  # tied weights (one parameter) have one name
    make.rows = rows  # a band of its rows, made alone
    return make


# --- weights written only at the end (a streamed export that quantizes) -------------------------------

DEFERRED = "edgeinfer-deferred:"  # a weight's location until it is written: this prefix, then its key in _MAKERS
_MAKERS: dict[str, object] = {}
_KEYS = itertools.count()


@contextmanager
def deferring():
    """Meanwhile, weights may be deferred (`defer`); after, every one is forgotten (and the loaded
    tensors they would be made from let go)."""
    try:
        yield
    finally:
        _MAKERS.clear()


def defer(name: str, maker, shape, data_type: int) -> onnx.TensorProto:
    """The initializer `name` whose values `maker` makes (a function returning an fp32 tensor)
    when they are read or written, not before: its location names the maker."""
    key = f"{DEFERRED}{next(_KEYS)}"
    _MAKERS[key] = maker
    tensor = onnx.TensorProto(name=name, dims=list(shape), data_type=data_type)
    refer(tensor, key, 0, 4 * int(np.prod(shape, dtype=np.int64)))
    return tensor


def refer(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make `tensor` reference its bytes in a data file (`location`, `offset`, `length`), none in the message."""
    tensor.ClearField("raw_data")
    for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _location(tensor: onnx.TensorProto) -> str:
    return next(e.value for e in tensor.external_data if e.key == "location")


def is_deferred(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL and _location(tensor).startswith(DEFERRED)


def made(tensor: onnx.TensorProto) -> np.ndarray:
    """A deferred weight's values, made now."""
    location = _location(tensor)
    if location not in _MAKERS:
        raise ExportError(
            f"weight {tensor.name} was deferred by an export that has ended: this is a bug in edgeinfer, please report it"
        )
    return _array(_MAKERS[location]())


def row_reader(tensor: onnx.TensorProto):
    """A function (start, stop) -> a deferred weight's rows start:stop in fp32, each band made alone
    where its maker can (a weight made from a loaded parameter), else cut from the whole made once."""
    maker = _MAKERS.get(_location(tensor))
    if maker is not None and hasattr(maker, "rows"):
        return lambda start, stop: _array(maker.rows(start, stop))
    whole = made(tensor)
    return lambda start, stop: whole[start:stop]


def _array(value) -> np.ndarray:
    return value.numpy() if hasattr(value, "numpy") else value


MADV_DONTNEED = 4  # Linux: the pages go; a mapped file's are read again from it if touched


def release_file_pages(tensor) -> None:
    """Let go of the resident pages of `tensor` where it is a view of a mapped safetensors file (as
    transformers loads a checkpoint in its own precision): read once to make a weight, they would
    otherwise count in the process's memory until the export ends. Pages that were written to (no
    longer the file's) and other memory are left alone."""
    import ctypes

    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if last <= first or not _in_mapped_checkpoint(first, last) or not _file_pages(first, last):
        return
    ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


_PAGE = 4096
_PRESENT, _FILE_PAGE = 1 << 63, 1 << 61  # /proc/self/pagemap's bits for a page


def _in_mapped_checkpoint(first: int, last: int) -> bool:
    """Whether the addresses [first, last) lie in one mapping of a .safetensors file."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                low, high = (int(bound, 16) for bound in fields[0].split("-"))
                if low <= first and last <= high:
                    return len(fields) >= 6 and fields[5].endswith(".safetensors")
    except OSError:  # not Linux
        return False
    return False


def _file_pages(first: int, last: int) -> bool:
    """Whether every resident page in [first, last) is still the file's (none was copied on write)."""
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first // _PAGE * 8)
            entries = np.frombuffer(pagemap.read((last - first) // _PAGE * 8), dtype=np.uint64)
    except OSError:
        return False
    present = (entries & np.uint64(_PRESENT)) != 0
    return bool(np.all(~present | ((entries & np.uint64(_FILE_PAGE)) != 0)))


def source_of(tensor: onnx.TensorProto) -> str | None:
    """The name of the parameter a deferred weight is made from (None for a packed one)."""
    return getattr(_MAKERS.get(_location(tensor)), "source", None)


def sources_of(tensor: onnx.TensorProto) -> list[str]:
    """The names of the parameters a deferred weight is made from: one, or a packed weight's parts'."""
    maker = _MAKERS.get(_location(tensor))
    if hasattr(maker, "source"):
        return [maker.source]
    return [name for part in getattr(maker, "parts", ()) for name in sources_of(part)]


def forget(tensor: onnx.TensorProto) -> None:
    """Let a deferred weight go once it is quantized: its function, those of the weights it joins,
    and with the last of them the loaded tensor it is made from."""
    maker = _MAKERS.pop(_location(tensor), None)
    for part in getattr(maker, "parts", ()):
        forget(part)


_WRITE_BYTES = 64 << 20  # a deferred weight is written in rows of about this many bytes


def written_apart(tensor: onnx.TensorProto, path) -> onnx.TensorProto:
    """A deferred weight made and written to the file `path` a block of rows at a time (a tied
    lm_head, the embedding's transpose, is never copied whole), and a message of its name that
    references it there: a reader maps the file instead of holding the bytes."""
    value = made(tensor)
    rows = max(1, _WRITE_BYTES // max(1, value[:1].nbytes))
    with open(path, "wb") as out:
        for start in range(0, value.shape[0], rows):
            np.ascontiguousarray(value[start : start + rows]).tofile(out)
    reference = onnx.TensorProto(name=tensor.name, data_type=onnx.helper.np_dtype_to_tensor_dtype(value.dtype))
    reference.dims.extend(value.shape)
    refer(reference, str(path), 0, value.nbytes)
    return reference


def standalone(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """A deferred weight made into a message of its own: its bytes go when it does (a graph's
    messages keep every byte ever put in them until the whole graph goes)."""
    return numpy_helper.from_array(np.ascontiguousarray(made(tensor)), tensor.name)
