"""Where the model to export comes from, and loading it with transformers."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.models import entries, is_catalog_name, lookup
from edgeinfer.models.cache import cache_root
from edgeinfer.models.fetch import download_from_hub, fetch_source
from edgeinfer.sdk.errors import ExportError, ModelNotFoundError
from edgeinfer.sdk.manifest import MANIFEST_NAME

from .families import SUPPORTED, UNSUPPORTED

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Source:
    """What `from_pretrained` loads (`path`, plus `gguf_file` inside it), and how the manifest names it."""

    name: str
    path: str
    gguf_file: str | None = None


def resolve_source(model: str, say=lambda message: None) -> Source:
    """A local folder, a `.gguf` file, a catalog name, or a hub id, in that order."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{model} is a file but not a .gguf: pass a Hugging Face model folder, a .gguf file, a catalog name or a hub id"
            )
        return Source(str(path.resolve()), str(path.resolve().parent), path.name)
    if path.is_dir():
        return _folder_source(path)
    if is_catalog_name(model):
        fetched = resolve_source(fetch_source(lookup(model), say))
        return Source(f"{model} ({fetched.name})", fetched.path, fetched.gguf_file)
    if _HUB_ID.match(model) and not model.startswith((".", "/", "~")):
        return _hub_source(model)
    names = ", ".join(sorted(entries()))
    raise ModelNotFoundError(f"{model!r} is not an existing path, a catalog name ({names}) or a hub id like org/name")


def _hub_source(hub_id: str) -> Source:
    folder = download_from_hub(hub_id)
    if folder is None:
        raise ModelNotFoundError(
            f"cannot download {hub_id} from the Hugging Face hub (offline, no such model, or no access): "
            "pass a local model folder or .gguf file, or log in with HF_TOKEN for a gated model"
        )
    return Source(hub_id, folder)


def _folder_source(path: Path) -> Source:
    if (path / MANIFEST_NAME).exists():
        raise ExportError(f"{path} is already an edgeinfer export: load it with `edgeinfer run --model {path}`")
    if not (path / "config.json").exists():
        raise ModelNotFoundError(
            f"{path} has no config.json, so it is not a Hugging Face model folder: pass a model folder, a .gguf file, a catalog name or a hub id"
        )
    return Source(str(path.resolve()), str(path.resolve()))


def load_model(source: Source, with_tokenizer: bool = True):
    """The fp32 PyTorch model and its fast tokenizer (None without `with_tokenizer`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if not source.gguf_file:
        check_supported(_model_type(Path(source.path)))
    try:
        converted = _converted_gguf(source) if source.gguf_file else None
        with _faster_gguf(bool(source.gguf_file)):
            config = AutoConfig.from_pretrained(converted or source.path, **({} if converted else kwargs))
            check_supported(config.model_type)
            model = AutoModelForCausalLM.from_pretrained(source.path, config=config, dtype=torch.float32, **kwargs).eval()
            tokenizer = None
            if with_tokenizer:
                tokenizer = AutoTokenizer.from_pretrained(converted or source.path, **({} if converted else kwargs))
        if source.gguf_file and converted is None:
            _keep_converted(source, config, tokenizer)
    except OSError as e:
        raise ModelNotFoundError(
            f"cannot load {source.name}: {first_line(e)}; check the path, or the connection to the Hugging Face hub"
        ) from None
    except ValueError as e:  # transformers' word for a config or GGUF it cannot read
        raise ExportError(f"transformers cannot load {source.name}: {first_line(e)}") from None
    if tokenizer is not None and not tokenizer.is_fast:
        raise ExportError(f"{source.name} has no fast tokenizer (tokenizer.json), which edgeinfer's runtime needs")
    return model, tokenizer


_PATCHED = threading.Lock()  # the patches below are process-wide: one GGUF load uses them at a time


@contextmanager
def _faster_gguf(gguf: bool):
    """Two of the gguf library's functions, replaced while a GGUF file loads and given back afterwards:
    - transformers 4.57's loader builds gguf's TensorNameMap once for every module of the model (12
      of SmolLM2's 29 s of load under a profiler); the map depends only on the architecture and the
      layer count, so `gguf.get_tensor_name_map` returns one map per pair;
    - `GGUFReader` reads arrays in its metadata one element at a time (3.5 s for SmolLM2's 245,000
      tokens, token types and merges, on every read of the file); `fast_array_parts` reads them in
      one pass into the same parts;
    - `gguf.dequantize` makes temporaries of about twice its output: Gemma 3 270M's Q8_0 embedding
      (671 MB in fp32) set the export's peak memory, 2.80 GiB, in the load stage. `in_row_blocks`
      dequantizes large tensors a block of rows at a time into the output."""
    if not gguf:
        yield
        return
    import gguf as library
    from gguf.gguf_reader import GGUFReader

    with _PATCHED:
        name_map, field_parts, dequantize = library.get_tensor_name_map, GGUFReader._get_field_parts, library.dequantize
        library.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
        GGUFReader._get_field_parts = fast_array_parts(field_parts)
        library.dequantize = in_row_blocks(dequantize)  # transformers imports it from gguf at each load
        try:
            yield
        finally:
            library.get_tensor_name_map, GGUFReader._get_field_parts, library.dequantize = name_map, field_parts, dequantize


def fast_array_parts(original):
    """`GGUFReader._get_field_parts` with arrays of numbers or strings read in one pass: the same
    parts (a view of each element), indices and types; other fields go to `original`."""
    import numpy as np
    from gguf.constants import GGUFValueType

    def get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return original(self, orig_offs, raw_type)
        raw_itype, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item_type, count, offs = GGUFValueType(int(raw_itype[0])), int(length[0]), orig_offs + 12
        parts, types = [raw_itype, length], [GGUFValueType.ARRAY] + ([item_type] if count else [])
        number = self.gguf_scalar_to_np.get(item_type)
        if number is not None:
            values = self._get(offs, number, count)
            parts += list(values.reshape(count, 1))
            return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types
        if item_type != GGUFValueType.STRING:
            return original(self, orig_offs, raw_type)  # arrays of arrays
        data, size = np.asarray(self.data), np.dtype(np.uint64).newbyteorder(self.byte_order)
        indices = []
        for _ in range(count):
            string_length = data[offs : offs + 8].view(size)
            end = offs + 8 + int(string_length[0])
            parts += (string_length, data[offs + 8 : end])
            indices.append(len(parts) - 1)
            offs = end
        return offs - orig_offs, parts, indices, types

    return get_field_parts


def in_row_blocks(original, rows: int = 8192):
    """`gguf.dequantize` for tensors of more than `rows` rows, `rows` at a time into one output
    array. GGUF's quantization blocks never cross a row, so each block of rows dequantizes alone
    to the same values. F32 tensors go to `original`, which returns a view of the file's bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType

    def dequantize(data, qtype):
        if data.ndim < 2 or data.shape[0] <= rows or qtype == GGMLQuantizationType.F32:
            return original(data, qtype)
        first = original(data[:rows], qtype)
        out = np.empty((data.shape[0], *first.shape[1:]), first.dtype)
        out[:rows] = first
        for start in range(rows, data.shape[0], rows):
            out[start : start + rows] = original(data[start : start + rows], qtype)
        return out

    return dequantize


def _converted_gguf(source: Source) -> str | None:
    """The folder where an earlier export of this GGUF file kept its config and tokenizer, which
    transformers otherwise converts again from the GGUF's metadata (with it and the name map above,
    SmolLM2's load stage went from 44 s to 12 s, medians of 3)."""
    folder = _conversion_folder(source)
    return str(folder) if (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file() else None


def _keep_converted(source: Source, config, tokenizer) -> None:
    """Keep the config and tokenizer converted from the GGUF for the next export of the same file.
    The cache is only a saving: where it cannot be written, the export goes on without it."""
    if tokenizer is None:
        return
    folder = _conversion_folder(source)
    partial = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(folder)
    except OSError:
        pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _conversion_folder(source: Source) -> Path:
    """Named by the file's path, size and modification time, and the transformers version that
    converted it: a changed file or another converter gets a folder of its own."""
    import transformers

    path = Path(source.path) / source.gguf_file
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return cache_root() / "converted" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def check_supported(model_type: str) -> None:
    """Refuse, in one line, a model type that edgeinfer cannot export."""
    if model_type in UNSUPPORTED:
        raise ExportError(
            f"model type {model_type!r} cannot be exported: {UNSUPPORTED[model_type]}; "
            "`edgeinfer info --architectures` lists the supported ones"
        )
    if model_type not in SUPPORTED:
        raise ExportError(
            f"model type {model_type!r} cannot be exported: edgeinfer exports decoder-only language models "
            "of the families that `edgeinfer info --architectures` lists"
        )


def _model_type(folder: Path) -> str:
    try:
        return str(json.loads((folder / "config.json").read_text())["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ExportError(f"{folder / 'config.json'} has no readable model_type: is it a Hugging Face model folder?") from None


def first_line(error: Exception) -> str:
    """The first line of an error's message, for one-line errors."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
