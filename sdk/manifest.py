"""`edgeinfer.json`: the one contract between export and runtime.

Export writes it; the runtime reads graph names, KV layout and token ids from it (and from the
graphs' own inputs), never from a table of architecture names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ManifestError, ModelNotFoundError, NotAnExportError

# 2: one graph for prefill and decode (1 had a separate prefill graph); 3: the split layout (a
# prefill graph without past inputs beside the decode graph), written only for `--graphs split`;
# 4: LoRA adapters (the adapters' graph and files) or an embedding model, written only for an
# export with adapters or of an embedding model; 5: layers whose caches differ in shape (`kv.layers`,
# Gemma 4) or that keep a recurrent state (`kv.state`, Qwen 3.5), written only for such exports; 6:
# sliding layers whose cache keeps only their window (`kv.windows`), written only for such exports;
# 7: a vision-language model (`vision`: its vision graph, and what an image becomes), written only
# for such exports; 8: one whose pictures need more of the runtime: tokens that attend to each other
# both ways (`vision.attention`, Gemma 3), or pictures at their own shape placed by 3-D rotary
# positions (`vision.grid`, `vision.rotary`, Qwen2.5-VL). So exports stay readable by the edgeinfer versions that read what they use.
WINDOWS_FORMAT_VERSION, LAYERS_FORMAT_VERSION, ADAPTERS_FORMAT_VERSION, SPLIT_FORMAT_VERSION, SINGLE_FORMAT_VERSION = 6, 5, 4, 3, 2
VISION_FORMAT_VERSION = 7
PICTURES_FORMAT_VERSION = 8  # a vision section with `attention`, `grid` or `rotary`
FORMAT_VERSION = PICTURES_FORMAT_VERSION  # the newest this edgeinfer reads
MANIFEST_NAME = "edgeinfer.json"


@dataclass(frozen=True)
class GraphSpec:
    """The export's ONNX graph and the names of its inputs and outputs, in graph order. It takes
    the KV cache as inputs: prefill runs it with an empty past, decode with the cache so far."""

    file: str
    inputs: list[str]
    outputs: list[str]


@dataclass(frozen=True)
class KVSpec:
    """Layout of the KV cache: `past[i]` of the graph is fed from `present[i]` of the
    previous step, and grows along `sequence_axis` (or, `in_place`, is written into the past). Keys have `head_size`; values have
    `value_head_size`, which differs in some families (DeepSeek's multi-head latent attention).
    Where the layers' caches differ in shape (Gemma 4's full-attention layers are wider than its
    sliding ones), `layers` gives each layer's `kv_heads`, `head_size` and `value_head_size`, and
    the fields above are layer 0's; else it is empty and they hold for every layer. `past` and
    `present` name the keys and values alone: layers of linear attention keep a fixed-size state
    instead, listed in `state` (`layer`, its `kind`, conv or recurrent, a layer's later convolutions
    conv1, conv2, ..., the `past` input and
    `present` output, and its `shape` after the rows axis), whose present replaces its past after
    every pass. `windows`: each layer's sliding window where its attention keeps only the window
    (GroupQueryAttention's `sliding_window_cache`: the buffer holds the latest positions from slot
    0, a few more than the window, and the op evicts the oldest), -1 where it keeps every token;
    empty where no layer keeps a window."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sequence_axis: int
    past: list[str]
    present: list[str]
    value_head_size: int | None = None
    # True where the graph's attention writes each step's keys and values into its past inputs
    # (one buffer of fixed capacity per input, right-padded rows): export's GroupQueryAttention.
    in_place: bool = False
    layers: list[dict] = field(default_factory=list)
    state: list[dict] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)

    def __post_init__(self):
        if len(self.past) != len(self.present):
            raise ManifestError(f"KV layout lists {len(self.past)} past inputs but {len(self.present)} present outputs")
        if len(self.past) != 2 * self.num_layers:
            raise ManifestError(
                f"KV layout lists {len(self.past)} past inputs for {self.num_layers} layers' keys and values: re-export the model"
            )
        if self.layers and len(self.layers) != self.num_layers:
            raise ManifestError(f"KV layout describes {len(self.layers)} layers but has {self.num_layers}: re-export the model")
        if any(not {"past", "present", "shape"} <= set(entry) for entry in self.state):
            raise ManifestError("KV layout lists a state without its past, present and shape: re-export the model")
        if self.windows and len(self.windows) != self.num_layers:
            raise ManifestError(f"KV layout gives {len(self.windows)} windows for {self.num_layers} layers: re-export the model")

    def layer_shapes(self) -> list[tuple[int, int, int]]:
        """Each layer's (KV heads, key head size, value head size)."""
        if self.layers:
            return [(layer["kv_heads"], layer["head_size"], layer["value_head_size"]) for layer in self.layers]
        return [(self.num_kv_heads, self.head_size, self.value_head_size or self.head_size)] * self.num_layers


@dataclass(frozen=True)
class TokenizerSpec:
    file: str = "tokenizer.json"
    config: str = "tokenizer_config.json"
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None


PRECISION_WORDS = {"float32": "fp32", "float16": "fp16"}  # a manifest's dtype, in export's --dtype words


@dataclass(frozen=True)
class Manifest:
    source: str
    architecture: str
    dtype: str
    vocab_size: int
    max_context: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    graph: GraphSpec
    kv: KVSpec
    tokenizer: TokenizerSpec
    # Default generation settings (GenerationConfig fields), from the model's generation config.
    generation: dict = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)
    validation: dict = field(default_factory=dict)
    # Weight quantization and its measured cost in quality; empty for fp32 weights.
    quantization: dict = field(default_factory=dict)
    files: dict[str, dict] = field(default_factory=dict)
    format_version: int = SINGLE_FORMAT_VERSION
    # The split layout: `graph` is then the decode graph and `prefill` the graph that reads a
    # prompt on an empty past (export/split.py). `prefill_length`: the prefill graph's fixed number
    # of positions (prompts are padded to it); `static_context`: the decode graph's fixed cache
    # capacity (its attention mask spans it, one token per row per pass).
    prefill: GraphSpec | None = None
    prefill_length: int | None = None
    static_context: int | None = None
    # LoRA adapters (export/lora.py): `lora` is the graph with their inputs, on the same weights
    # file; `adapters` maps each name to its file, rank, the modules it changes, and its check
    # against PEFT.
    lora: GraphSpec | None = None
    adapters: dict[str, dict] = field(default_factory=dict)
    # "generation", or "embedding" (format version 4): `graph` gives `last_hidden_state` and takes no
    # KV cache (`kv` has no layers); `embedding` says how a text's vector is made: `pooling` ("last"
    # or "mean"), `normalize`, `dimensions`, and `matryoshka` (the shorter widths it was trained for).
    task: str = "generation"
    embedding: dict = field(default_factory=dict)
    # A vision-language model (export/vision.py; format version 7): `graph` (pixel_values [images,
    # 3, H, W] -> image_features [images, tokens, hidden]), the image token's id and text, the
    # resize `steps`, `resample`, `rescale`, `mean` and `std` that make an image's pixels, and the
    # `expansion` that stands for an image in a prompt where the template writes its `marker`
    # ({image}: `tokens_per_image` image tokens). The graph then takes `image_features`. `attention`
    # "bidirectional" (format 8): a picture's tokens see each other both ways, so a prefill pass
    # never ends inside a picture; absent, they attend causally as text does. `grid` (format 8), in
    # place of tokens_per_image: a picture keeps its shape, a token a grid-pixel square of it;
    # `rotary` "3d" (format 8): position_ids [3, batch, sequence], computed from the pictures.
    vision: dict = field(default_factory=dict)

    @property
    def layout(self) -> str:
        return "split" if self.prefill is not None else "single"

    @property
    def precision(self) -> str:
        """The weights' precision in export's own words (--quantize int4/int8, --dtype fp32/fp16), as
        every command and /v1/models says it."""
        return (self.quantization or {}).get("method") or PRECISION_WORDS.get(self.dtype, self.dtype)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        version = data.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ManifestError(
                f"manifest format version {version!r} is newer than this edgeinfer reads ({FORMAT_VERSION}): "
                "upgrade edgeinfer, or re-export the model with this version"
            )
        if version == 1:  # its decode graph does both phases; its prefill graph is not needed
            data = {**{k: v for k, v in data.items() if k not in ("prefill", "decode")}, "graph": data.get("decode")}
        nested = {"graph": GraphSpec, "prefill": GraphSpec, "lora": GraphSpec, "kv": KVSpec, "tokenizer": TokenizerSpec}
        try:
            values = {k: (nested[k](**v) if k in nested and v is not None else v) for k, v in data.items()}
            return cls(**values)
        except TypeError as e:
            raise ManifestError(f"manifest is malformed ({e}): re-export the model with `edgeinfer export`") from None

    def save(self, folder: Path) -> None:
        (Path(folder) / MANIFEST_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def lora_graph_file(num_adapters: int) -> str:
    """The adapters' graph (export/lora.py) of an export with `num_adapters`: a new name each time
    an adapter is added, so the graph the manifest names is never overwritten in place."""
    return f"model.lora.{num_adapters}.onnx"


def adapter_file(name: str) -> str:
    """The file that holds adapter `name`'s weights in an export folder."""
    return f"adapter.{name}.npz"


def check_adapter_name(name: str) -> str:
    """Adapter names are what a request asks for (`"model": "BASE:ADAPTER"`) and part of a file name."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        raise ManifestError(
            f"adapter name {name!r} is not usable: use letters, digits, '.', '_' and '-' (at most 64, starting with a letter or digit)"
        )
    return name


def export_folder(model: str | Path) -> Path:
    """The export folder `model` names: a folder, or a catalog name whose export is in edgeinfer's
    cache (ModelNotFoundError where it is not exported yet)."""
    folder = Path(model).expanduser()
    if folder.exists() or not isinstance(model, str):
        return folder
    from edgeinfer.models import exported_model_dir, is_catalog_name

    if not is_catalog_name(model):
        return folder
    cached = exported_model_dir(model)
    if not (cached / MANIFEST_NAME).exists():
        raise ModelNotFoundError(
            f"{model} is a catalog model not exported on this machine yet: export it once with `edgeinfer pull {model}` "
            f"(or edgeinfer.export.export_model({model!r}, edgeinfer.models.exported_model_dir({model!r}))), then load it by name"
        )
    return cached


def load_manifest(folder: str | Path) -> Manifest:
    """Read and check the manifest of an export folder (or of a catalog name's export: export_folder);
    sizes of all listed files are checked too."""
    folder = export_folder(folder)
    if not folder.exists():
        raise NotAnExportError(
            f"model path {folder} does not exist: pass an export folder made by `edgeinfer export`, or a catalog name"
        )
    if not folder.is_dir():
        raise NotAnExportError(f"model path {folder} is a file, not an export folder: run `edgeinfer export {folder} -o OUT` first")
    path = folder / MANIFEST_NAME
    if not path.exists():
        if any(folder.glob("*.onnx")):
            raise NotAnExportError(
                f"{folder} holds ONNX graphs but no edgeinfer.json (an optimum or other export): "
                "run `edgeinfer export` on the Hugging Face model it came from, and load that"
            )
        hint = "it looks like a Hugging Face model folder" if (folder / "config.json").exists() else "it has no edgeinfer.json"
        raise NotAnExportError(f"{folder} is not an edgeinfer export ({hint}): run `edgeinfer export {folder} -o OUT` and load OUT")
    try:
        manifest = Manifest.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON ({e}): the export is damaged, export the model again") from None
    check_file_sizes(folder, manifest.files)
    return manifest


def check_file_sizes(folder: Path, files: dict[str, dict]) -> None:
    for name, info in files.items():
        path = folder / name
        if not path.exists():
            raise NotAnExportError(f"export file {path} is missing: the export is incomplete, export the model again")
        size = path.stat().st_size
        if size != info["size"]:
            raise NotAnExportError(
                f"export file {path} has {size} bytes but the manifest says {info['size']}: "
                "it is truncated or was changed, export the model again"
            )


def describe_files(folder: Path) -> dict[str, dict]:
    """Size and SHA-256 of every file in an export folder, for the manifest."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(Path(folder).iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_files(folder: Path, files: dict[str, dict], up_to: int | None = None) -> int:
    """Check every listed file's SHA-256 (after its size), or only those of at most `up_to`
    bytes (the tokenizer, template and graph files, not the weights); returns the bytes read."""
    if not files:
        raise ManifestError(f"the manifest in {folder} lists no files to verify (an older export): export the model again")
    check_file_sizes(folder, files)
    files = {name: info for name, info in files.items() if up_to is None or info["size"] <= up_to}
    for name, info in files.items():
        if sha256_of(folder / name) != info["sha256"]:
            raise NotAnExportError(
                f"export file {folder / name} does not match the SHA-256 in the manifest: "
                "it was changed or damaged, export the model again"
            )
    return sum(info["size"] for info in files.values())
