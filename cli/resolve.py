"""Turning `--model` into a loaded engine, exporting a catalog model into the cache on first use;
the messages the commands print on stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from edgeinfer.models import DEFAULT_MODEL, cache_lock, entries, exported_model_dir, is_catalog_name, is_hub_id
from edgeinfer.sdk.embedder import NOT_GENERATING, Embedder
from edgeinfer.sdk.errors import EdgeInferError, ModelNotFoundError, SettingsError
from edgeinfer.sdk.manifest import MANIFEST_NAME


def say(message: str) -> None:
    click.echo(message, err=True)


QUIET = {"verbose": True}  # quiet_libraries() sets it False: the provider line then gives no long reason


def quiet_libraries() -> None:
    """Other libraries' logs and warnings kept below what a user needs (--verbose shows them): ONNX
    Runtime's quantizer logs each weight at INFO, transformers warns of a tokenizer's defaults."""
    import logging
    import os
    import warnings

    QUIET["verbose"] = False
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("onnxruntime", "onnx", "onnxscript", "transformers", "torch", "huggingface_hub", *_optimizer_loggers()):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"(torch|transformers|onnx|onnxruntime|onnxscript|optimum)(\.|$)")


def _optimizer_loggers() -> list[str]:
    """The names ONNX Runtime's transformer optimizer logs under: its modules import each other as
    top-level modules (fusion_utils, onnx_model, ...), so their loggers are not under "onnxruntime",
    and its quantizer's import sets the root logger to INFO. Read off its folder, nothing imported."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return []
    folder = Path(next(iter(spec.submodule_search_locations))) / "transformers"
    return [path.stem for path in folder.glob("*.py")] if folder.is_dir() else []


def live_stream():
    """stderr where it is a terminal, for the export's progress line; else None (logs get no redraws)."""
    return sys.stderr if sys.stderr.isatty() else None


def say_timings(piece) -> None:
    say(
        f"time to first token {piece.ttft_s * 1000:.0f} ms, {piece.decode_tokens_per_s:.1f} tokens/s, "
        f"prompt {piece.prompt_tokens} tokens, finish: {piece.finish_reason}"
        + (
            ""
            if piece.proposed_tokens is None
            else f", speculative: {piece.accepted_tokens} of {piece.proposed_tokens} proposed tokens kept"
        )
    )


def load_engine(
    model: str | None,
    provider: str,
    threads: int | None,
    max_context: int | None = None,
    memory_limit: int | None = None,
    prefix_cache: int | None = None,
    max_batch: int = 1,
    draft: str | None = None,
    embeddings: bool = False,
    chat_template: str | None = None,
):
    """The engine for `--model` (and its `--draft`), saying which provider runs it and why.
    `memory_limit` and `prefix_cache` are in MiB. An embedding export is refused unless
    `embeddings` (the server, which serves /v1/embeddings). `chat_template`: a template file's
    path (--chat-template), rendering conversations in place of the export's."""
    from edgeinfer.sdk import Engine

    limit = memory_limit * 2**20 if memory_limit is not None and memory_limit > 0 else memory_limit
    engine = Engine.load(
        resolve_export(model, say),
        provider=provider,
        threads=threads,
        max_context=max_context,
        max_batch=max_batch,
        memory_limit=limit,
        prefix_cache=prefix_cache,
        draft=None if draft is None else resolve_export(draft, say),
        chat_template=None if chat_template is None else read_template(chat_template),
    )
    say(f"provider: {engine.provider}" + _why(engine.provider_reason))
    if QUIET["verbose"] and engine.weights_kernel:
        say(f"quantized weights: {engine.weights_kernel}")
    if isinstance(engine, Embedder) and not embeddings:
        raise SettingsError(NOT_GENERATING, "model")
    return engine


def _why(reason: str) -> str:
    """The provider's reason as the provider line gives it: whole with --verbose; else short."""
    if QUIET["verbose"]:
        return f" ({reason})"
    return " (CUDA is not usable here: --verbose says why)" if reason.startswith("auto chose cpu") else ""


def read_template(path: str) -> str:
    """--chat-template's file: a Jinja chat template, or a tokenizer_config.json that holds one."""
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        template = json.loads(text).get("chat_template")
        if not isinstance(template, str):
            raise SettingsError(f"{path} holds no chat_template string: give a .jinja file or a tokenizer_config.json with one")
        return template
    return text


def resolve_export(model: str | None, say) -> Path:
    """The export folder of a model given by its folder, its catalog name or its hub id (the last
    two exported into the cache at their first use)."""
    model = model or DEFAULT_MODEL
    path = Path(model).expanduser()
    if not path.exists() and (is_catalog_name(model) or is_hub_id(model)):
        return _cached_export(model, say)
    names = ", ".join(sorted(entries()))
    if not path.exists() and ("/" in model or model.startswith((".", "~"))):
        raise ModelNotFoundError(
            f"model path {model} does not exist: pass a folder made by `edgeinfer export`, a catalog name ({names}), "
            "or a hub id (org/name)"
        )
    if not path.exists():
        raise ModelNotFoundError(
            f"{model!r} is not a catalog name ({names}) or an existing folder: "
            "pass a folder made by `edgeinfer export`, or a catalog name"
        )
    return path


def _cached_export(name: str, say) -> Path:
    out = exported_model_dir(name)
    if (out / MANIFEST_NAME).exists():
        return out
    with cache_lock(f"export-{name.replace('/', '--')}", say):  # another process may be exporting it: wait, then use its export
        if not (out / MANIFEST_NAME).exists():
            say(f"{name} has not been exported on this machine yet: exporting it once into {out}")
            export = _exporter()
            export.export_model(name, out, export.ExportOptions(force=True), say, live=live_stream())
            _say_kept(out)
    return out


def _say_kept(out: Path) -> None:
    """What the first use of a catalog model leaves on disk, and how to free the part not needed."""
    from edgeinfer.models import cache_root
    from edgeinfer.sdk.memory import size_text

    kept = sum(folder_bytes(cache_root() / part) for part in ("downloads", "sources", "converted"))
    say(
        f"kept: the export, {size_text(folder_bytes(out))} in {out}, and {size_text(kept)} of downloads it was made from "
        f"in {cache_root()} (`edgeinfer rm --downloads` frees them; `edgeinfer list` shows what is kept)"
    )


def folder_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 where it does not exist)."""
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _exporter():
    try:
        import edgeinfer.export.pipeline  # noqa: F401 - what needs the extra, imported here to name what is missing
        import edgeinfer.export as export
    except ImportError as e:
        raise EdgeInferError(f"exporting needs the export extra ({e.name} is missing): pip install 'edgeinfer[export]'") from None
    return export
