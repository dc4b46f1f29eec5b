"""The chat page's build step: its Markdown renderer, sanitizer, highlighter and math typesetter
(serve/ui/vendor.json names them, their versions and integrity hashes) fetched from the npm registry
into serve/ui/vendor/, which git ignores: the repository holds no copy of third-party code.

setup.py runs it when the package is built or installed (the standard library only: it runs before
any dependency is installed); `python -m edgeinfer.serve.ui_vendor` runs it again. A tarball whose
hash differs from the pinned one is refused, and the folder is replaced whole or not at all. Without
the files the page still works and shows replies as plain text.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

LOCK = Path(__file__).parent / "ui" / "vendor.json"
VENDOR = Path(__file__).parent / "ui" / "vendor"
STAMP = "versions.json"  # in the folder: the name@version of each package it holds
# the registry: npm's own setting where one is made (a mirror), else the lock's
REGISTRY_VARIABLES = ("EDGEINFER_NPM_REGISTRY", "npm_config_registry", "NPM_CONFIG_REGISTRY")


class VendorError(RuntimeError):
    """The page's libraries could not be fetched or did not match their pinned hash."""


def lock(path: Path = LOCK) -> dict:
    return json.loads(path.read_text())


def wanted(locked: dict) -> dict:
    """What the folder must hold: {name: version}."""
    return {package["name"]: package["version"] for package in locked["packages"]}


def present(folder: Path = VENDOR, locked: dict | None = None) -> bool:
    """Whether `folder` holds every file of the lock's packages at the lock's versions."""
    locked = locked or lock()
    try:
        held = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return False
    names = [name for package in locked["packages"] for name in package["files"].values()]
    return held == wanted(locked) and all((folder / name).is_file() for name in names)


def registry(locked: dict) -> str:
    for variable in REGISTRY_VARIABLES:
        if os.environ.get(variable):
            return os.environ[variable].rstrip("/")
    return locked["registry"].rstrip("/")


def tarball_url(base: str, package: dict) -> str:
    """npm's layout: NAME/-/BASENAME-VERSION.tgz, where BASENAME is the name without its @scope/."""
    basename = package["name"].rsplit("/", 1)[-1]
    return f"{base}/{package['name']}/-/{basename}-{package['version']}.tgz"


def download(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as error:
        raise VendorError(
            f"could not fetch {url}: {error}. The chat page's libraries come from the npm registry at build time: "
            f"build with network access, or point EDGEINFER_NPM_REGISTRY at a mirror; without them the page shows "
            f"replies as plain text"
        ) from error


def checked(data: bytes, package: dict, url: str) -> bytes:
    """`data` if its hash is the lock's integrity (npm's `sha512-BASE64`), else VendorError."""
    algorithm, _, expected = package["integrity"].partition("-")
    got = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if got != expected:
        raise VendorError(
            f"{url} does not match its pinned hash ({package['integrity']}, got {algorithm}-{got}): refused. "
            f"A registry or mirror serving other bytes for {package['name']}@{package['version']} is not to be trusted; "
            f"if the lock is what is wrong, take the hash from `npm view {package['name']}@{package['version']} dist.integrity`"
        )
    return data


def unpack(data: bytes, package: dict, into: Path) -> None:
    """The lock's files of one tarball (npm packs them under package/), each to its own name in `into`."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for source, name in package["files"].items():
            try:
                member = archive.extractfile(f"package/{source}")
            except KeyError:
                member = None
            if member is None:  # absent, or not a file
                raise VendorError(f"{package['name']}@{package['version']} has no file {source}: fix serve/ui/vendor.json")
            (into / name).write_bytes(member.read())


def fetch(folder: Path = VENDOR, locked: dict | None = None, timeout: float = 60.0) -> bool:
    """Fill `folder` with the lock's files; False where it already held them (nothing fetched)."""
    locked = locked or lock()
    if present(folder, locked):
        return False
    base = registry(locked)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".vendor-", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp's is 0700: the page's files are for every user who serves it
    try:
        for package in locked["packages"]:
            url = tarball_url(base, package)
            unpack(checked(download(url, timeout), package, url), package, staging)
        (staging / STAMP).write_text(json.dumps(wanted(locked), indent=1) + "\n")
        replace(folder, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def replace(folder: Path, staging: Path) -> None:
    """`staging` becomes `folder`; the old folder goes only once the new one is in place."""
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    staging.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    try:
        fetched = fetch()
    except VendorError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{'fetched' if fetched else 'already present'}: {', '.join(f'{n}@{v}' for n, v in wanted(lock()).items())} in {VENDOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
