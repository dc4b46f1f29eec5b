"""Where the model to export comes from, and loading it with transformers."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer.models import entries, is_catalog_name, is_hub_id, lookup
from edgeinfer.models.cache import cache_root
from edgeinfer.models.fetch import download_from_hub, fetch_source
from edgeinfer.sdk.errors import ExportError, ModelNotFoundError
from edgeinfer.sdk.manifest import MANIFEST_NAME

from .families import UNSUPPORTED, VISION_LANGUAGE, causal_lm_class, not_a_decoder
from .patches import faster_gguf


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
    if is_hub_id(model):
        return _hub_source(model)
    names = ", ".join(sorted(entries()))
    raise ModelNotFoundError(f"{model!r} is not an existing path, a catalog name ({names}) or a hub id like org/name")


def manifest_source(name: str) -> str:
    """What `resolve_source` takes for a manifest's `source`: a catalog model's name without the
    file it was fetched to ("smollm2-135m-instruct (/path/x.gguf)" is smollm2-135m-instruct)."""
    match = re.fullmatch(r"(\S+) \((.+)\)", name)
    return match.group(1) if match and is_catalog_name(match.group(1)) else name


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


def load_model(source: Source, with_tokenizer: bool = True, layers: int | None = None, precision: str = "fp32"):
    """The PyTorch model and its fast tokenizer (None without `with_tokenizer`). `layers`: only
    the first that many of its layers (a check copy, `truncated`); `precision`: "fp32", or
    "source" for the checkpoint's own (bfloat16 for most), half the memory."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if not source.gguf_file:
        check_supported(_model_type(Path(source.path)))
    try:
        converted = _converted_gguf(source) if source.gguf_file else None
        with faster_gguf(bool(source.gguf_file)):
            config = AutoConfig.from_pretrained(converted or source.path, **({} if converted else kwargs))
            check_supported(config.model_type)
            if layers is not None:
                config = truncated(config, layers)
            dtype = torch.float32 if precision == "fp32" else "auto"
            with _quiet(layers is not None):  # a check copy leaves most weights unread, which transformers would list
                auto = AutoModelForImageTextToText if config.model_type in VISION_LANGUAGE else _causal_lm(config)
                model = auto.from_pretrained(source.path, config=config, dtype=dtype, **kwargs).eval()
            tokenizer = None
            if with_tokenizer:
                tokenizer = AutoTokenizer.from_pretrained(converted or source.path, **({} if converted else kwargs))
                if source.gguf_file and converted is None:
                    _special_tokens_as_gguf(tokenizer, Path(source.path) / source.gguf_file)
        if source.gguf_file and converted is None:
            _keep_converted(source, config, tokenizer)
    except OSError as e:
        raise ModelNotFoundError(
            f"cannot load {source.name}: {first_line(e)}; check the path, or the connection to the Hugging Face hub"
        ) from None
    except (ValueError, IndexError, KeyError) as e:  # transformers' words for a config, checkpoint or GGUF it cannot read
        raise ExportError(
            f"transformers cannot load {source.name} ({type(e).__name__}: {first_line(e)}): check that its files are complete"
        ) from None
    if tokenizer is not None and not tokenizer.is_fast:
        raise ExportError(f"{source.name} has no fast tokenizer (tokenizer.json), which edgeinfer's runtime needs")
    return model, tokenizer


def _causal_lm(config):
    """AutoModelForCausalLM, or the family's causal-LM class where the auto mapping has no entry for
    this config (a composite model's text model saved as its own type)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    return causal_lm_class(type(config)) or AutoModelForCausalLM


def _special_tokens_as_gguf(tokenizer, gguf_path: Path) -> None:
    """Whether a text starts with BOS and ends with EOS, as the GGUF says (`tokenizer.ggml.add_bos_token`,
    `add_eos_token`) and llama.cpp reads it; transformers' conversion does not read them.
    Tokenizer classes with no such setting keep their own."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    for flag in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{flag}")
        if field is not None and isinstance(getattr(type(tokenizer), flag, None), property):
            setattr(tokenizer, flag, bool(field.parts[field.data[0]][0]))


def _converted_gguf(source: Source) -> str | None:
    """The folder where an earlier export of this GGUF file kept its config and tokenizer, which
    transformers otherwise converts again from the GGUF's metadata at every load."""
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


_CONVERSION = 2  # what edgeinfer changes after transformers' conversion: a new value converts every GGUF again


def _conversion_folder(source: Source) -> Path:
    """Named by the file's path, size and modification time, the transformers version that
    converted it and `_CONVERSION`: a changed file or another converter gets a folder of its own."""
    import transformers

    path = Path(source.path) / source.gguf_file
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{_CONVERSION}"
    return cache_root() / "converted" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@contextmanager
def _quiet(quiet: bool):
    """transformers' messages at error level only, meanwhile."""
    from transformers.utils import logging

    before = logging.get_verbosity()
    if quiet:
        logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def truncated(config, layers: int):
    """A copy of `config` with its first `layers` layers: every per-layer list (layer types,
    windows) cut to them. transformers loads such a model from the whole checkpoint, reading
    only those layers' weights."""
    copy = config.__class__.from_dict(config.to_dict())
    total = config.num_hidden_layers
    for name, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == total and name != "num_hidden_layers":
            setattr(copy, name, type(value)(value[:layers]))
    copy.num_hidden_layers = layers
    if getattr(copy, "num_kv_shared_layers", 0):  # Gemma 4's last layers read earlier ones' caches: a copy of the first has none
        copy.num_kv_shared_layers = 0
    return copy


def check_layers(config) -> int:
    """How many of the model's first layers a check copy takes: at least two, and up to the first
    layer of each kind the model has (`layer_types`: linear attention, sliding and full attention)."""
    kinds = list(getattr(config, "layer_types", None) or [])
    last_new = max((kinds.index(kind) for kind in set(kinds)), default=0)
    return min(config.num_hidden_layers, max(2, last_new + 1))


@dataclass(frozen=True)
class Sizes:
    """A checkpoint's size as its files' headers give it."""

    parameters: int  # how many weights
    stored: int  # their bytes as stored (bfloat16 for most)
    largest: int  # the most weights in one tensor
    layered: int  # the weights of the numbered layers (names with `.N.`), the rest being embeddings, norms, heads
    widest: int = 0  # the most input channels of a matrix (a linear layer's [out, in]: in)


def source_sizes(source: Source) -> Sizes | None:
    """The size of a safetensors checkpoint, read from its files' headers alone; None for other
    sources (a GGUF, PyTorch .bin files)."""
    files = [] if source.gguf_file else sorted(Path(source.path).glob("*.safetensors"))
    if not files:
        return None
    entries = dict(item for path in files for item in _safetensors_entries(path).items())
    counts = {name: int(np.prod(entry.get("shape", []), dtype=np.int64)) for name, entry in entries.items()}
    stored = sum(end - start for entry in entries.values() for start, end in [entry.get("data_offsets", (0, 0))])
    layered = sum(count for name, count in counts.items() if re.search(r"\.\d+\.", name))
    widest = max((entry["shape"][1] for entry in entries.values() if len(entry.get("shape", [])) == 2), default=0)
    return Sizes(sum(counts.values()), stored, max(counts.values(), default=0), layered, widest)


def source_parameters(source: Source) -> int | None:
    """How many weights the source holds, read from its files' headers alone (a safetensors
    header, a GGUF's tensor infos), so that export can refuse a model too big for the machine
    before loading any of it; None where the files do not say (PyTorch .bin checkpoints)."""
    if source.gguf_file:
        from gguf import GGUFReader

        with faster_gguf(True):
            return sum(int(tensor.n_elements) for tensor in GGUFReader(Path(source.path) / source.gguf_file).tensors)
    sizes = source_sizes(source)
    return None if sizes is None else sizes.parameters


def _safetensors_entries(path: Path) -> dict[str, dict]:
    """The tensors a safetensors file holds (dtype, shape, data_offsets each), from its header: 8
    bytes of little-endian length, then a JSON map of tensor names to those."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length)) if 0 < length < 2**28 else None
    except (OSError, ValueError) as e:
        raise ExportError(f"{path} is not a readable safetensors file ({first_line(e)}): download the model again") from None
    if not isinstance(header, dict):
        raise ExportError(f"{path} has no safetensors header: download the model again")
    return {name: entry for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)}


def check_supported(model_type: str) -> None:
    """Refuse, in one line and before any work, a model type that cannot be exported; any other
    causal language model is tried, and the export's checks against PyTorch decide."""
    why = UNSUPPORTED.get(model_type) or not_a_decoder(model_type)
    if why:
        raise ExportError(
            f"model type {model_type!r} cannot be exported: {why}; edgeinfer exports decoder-only language models "
            "(`edgeinfer info --architectures` lists those its tests prove)"
        )


def source_model_type(source: Source) -> str | None:
    """The model type a folder's config.json names; None for a GGUF (its type is in the file)."""
    return None if source.gguf_file else _model_type(Path(source.path))


def _model_type(folder: Path) -> str:
    try:
        return str(json.loads((folder / "config.json").read_text())["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ExportError(f"{folder / 'config.json'} has no readable model_type: is it a Hugging Face model folder?") from None


def first_line(error: Exception) -> str:
    """The first line of an error's message, for one-line errors."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
