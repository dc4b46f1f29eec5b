"""Models on this machine: `edgeinfer list` (the exports in edgeinfer's cache and the other files it
keeps), `pull` (export a catalog model or a hub id into the cache now), `rm` (remove an export from
the cache, or the downloads it was made from), `ps` (what a running server holds)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import click

from edgeinfer.models import cache_root, entries, exported_model_dir, is_catalog_name, is_hub_id
from edgeinfer.sdk.errors import ModelNotFoundError
from edgeinfer.sdk.manifest import MANIFEST_NAME, Manifest
from edgeinfer.sdk.memory import size_text

from .resolve import folder_bytes, resolve_export, say

KEPT = ("downloads", "sources", "converted")  # what an export of a catalog model is made from, kept for the next


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per export instead of a table.")
def list_models(as_json):
    """The exports in edgeinfer's cache (the catalog models exported here), and the bytes of the
    downloads they were made from."""
    rows = [_row(folder) for folder in _exports()]
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    if not rows:
        click.echo(f"no exports in {cache_root() / 'exports'}: `edgeinfer pull NAME` exports one of {', '.join(sorted(entries()))}")
    else:
        click.echo(f"{'NAME':<28} {'SIZE':>10} {'CONTEXT':>8} {'PRECISION':<10} MODIFIED")
        for row in rows:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["modified"]))
            click.echo(f"{row['name']:<28} {size_text(row['bytes']):>10} {row['context']:>8} {row['precision']:<10} {when}")
    kept = sum(folder_bytes(cache_root() / part) for part in KEPT)
    if kept:
        say(f"and {size_text(kept)} of downloads and sources they were made from (`edgeinfer rm --downloads` removes them)")


@click.command()
@click.argument("name")
def pull(name):
    """Export NAME (a catalog name, or a hub id: org/name) into edgeinfer's cache now (what
    `run -m NAME` does at its first use)."""
    if not is_catalog_name(name) and not is_hub_id(name):
        raise ModelNotFoundError(
            f"{name!r} is not a catalog name ({', '.join(sorted(entries()))}) or a hub id (org/name): for a folder or a "
            ".gguf file, use `edgeinfer export MODEL -o OUT`"
        )
    folder = resolve_export(name, say)
    say(f"{name} is exported in {folder} ({size_text(folder_bytes(folder))})")


@click.command()
@click.argument("names", nargs=-1)
@click.option("--downloads", is_flag=True, help="Also remove the downloads and sources exports are made from.")
def rm(names, downloads):
    """Remove the exports NAMES from edgeinfer's cache (folders elsewhere are yours: remove them yourself)."""
    if not names and not downloads:
        raise click.UsageError("give the NAMES of exports to remove (`edgeinfer list` shows them), or --downloads")
    for name in names:
        folder = exported_model_dir(name)
        if not (folder / MANIFEST_NAME).exists() or ".." in Path(name).parts:
            shown = ", ".join(_row(f)["name"] for f in _exports()) or "none"
            raise ModelNotFoundError(f"no export named {name!r} in {cache_root() / 'exports'}: the exports there are {shown}")
        freed = folder_bytes(folder)
        shutil.rmtree(folder)
        say(f"removed {name} ({size_text(freed)})")
    if downloads:
        freed = sum(folder_bytes(cache_root() / part) for part in KEPT)
        for part in KEPT:
            shutil.rmtree(cache_root() / part, ignore_errors=True)
        say(f"removed the downloads and sources ({size_text(freed)}); a catalog model not exported yet downloads again")


def _exports() -> list[Path]:
    """The cache's exports: exports/NAME, and exports/ORG/NAME of hub ids."""
    root = cache_root() / "exports"
    return sorted(m.parent for pattern in ("*", "*/*") for m in root.glob(f"{pattern}/{MANIFEST_NAME}")) if root.is_dir() else []


def _row(folder: Path) -> dict:
    manifest = Manifest.from_dict(json.loads((folder / MANIFEST_NAME).read_text()))
    return {
        "name": folder.relative_to(cache_root() / "exports").as_posix(),
        "path": str(folder),
        "bytes": folder_bytes(folder),
        "context": manifest.max_context,
        "precision": manifest.precision,
        "modified": int((folder / MANIFEST_NAME).stat().st_mtime),
    }


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The server's address.")
@click.option("--api-key", envvar="EDGEINFER_API_KEY", default=None, help="Its API key, where it has one [env: EDGEINFER_API_KEY].")
def ps(url, api_key):
    """The models a running `edgeinfer serve` holds: loaded or not, pinned, the memory each holds,
    and the seconds until an idle one is unloaded (through its /v1/models)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            models = json.load(response)["data"]
    except urllib.error.HTTPError as e:
        way = "pass --api-key (or EDGEINFER_API_KEY)" if e.code == 401 else "is it edgeinfer serve?"
        raise ModelNotFoundError(f"{url} answered {e.code} to /v1/models: {way}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ModelNotFoundError(
            f"no server answers at {url} ({getattr(e, 'reason', e)}): start one (edgeinfer serve), or pass --url"
        ) from None
    click.echo(f"{'NAME':<32} {'LOADED':<7} {'PINNED':<7} {'MEMORY':>10} UNTIL")
    for model in (m for m in models if "parent" not in m):
        memory = size_text(model["memory_bytes"]) if "memory_bytes" in model else "-"
        until = f"{model['expires_in_s']:.0f} s" if "expires_in_s" in model else ("kept" if model.get("loaded") else "-")
        loaded, pinned = ("yes" if model.get(k) else "no" for k in ("loaded", "pinned"))
        click.echo(f"{model['id']:<32} {loaded:<7} {pinned:<7} {memory:>10} {until}")
