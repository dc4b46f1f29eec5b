"""The model catalog and edgeinfer's cache of fetched sources and exports."""

from .cache import cache_lock, cache_root, exported_model_dir
from .catalog import DEFAULT_MODEL, CatalogEntry, entries, is_catalog_name, is_hub_id, lookup

__all__ = [
    "DEFAULT_MODEL",
    "CatalogEntry",
    "entries",
    "is_catalog_name",
    "is_hub_id",
    "lookup",
    "cache_lock",
    "cache_root",
    "exported_model_dir",
]
