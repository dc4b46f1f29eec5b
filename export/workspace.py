"""The folder an export is written in: a temporary one beside the output, which becomes the output
only once complete; what killed exports left behind is cleaned up by the next."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import uuid
from pathlib import Path

from .budget import free_text


PARTIAL = ".partial-"


def clean_leftovers(out: Path) -> None:
    """Remove what exports of `out` killed halfway left beside it: temporary folders whose
    process is gone. A complete export set aside by --force is put back where `out` is missing."""
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.*-*")):
        kind, _, rest = path.name[len(out.name) + 2 :].partition("-")
        pid = rest.split("-")[0]
        if kind not in ("partial", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not out.exists():
            path.rename(out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process, or a platform that cannot tell: leave it
    return True


def disk_error(error: OSError, out: Path) -> str:
    where = error.filename or out.parent
    if error.errno == errno.ENOSPC:
        return (
            f"no space left on the device while writing {where}: nothing was kept; free some space "
            f"({free_text(out.parent)} free now) or export to another folder"
        )
    return (
        f"the file system refused {where} ({error.strerror or error}): nothing was kept; check the path and its "
        "permissions, or export elsewhere"
    )


def move_into_place(work: Path, out: Path) -> None:
    """Move the finished export to `out`; an old `out` (with --force) goes only after that."""
    old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if out.exists():
        out.rename(old)
    work.rename(out)
    shutil.rmtree(old, ignore_errors=True)
