"""The chat page's build step (serve/ui_vendor.py): libraries fetched from an npm registry at the
pinned versions, refused when their bytes differ from the pinned hash, the folder replaced whole or
not at all. A registry on 127.0.0.1 serves tarballs made here; the shipped lock is checked as it is."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import socket
import tarfile
import threading

import pytest

from edgeinfer.serve import ui_vendor


def tarball(files: dict[str, bytes]) -> bytes:
    """An npm tarball: every file under package/."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


@pytest.fixture()
def registry(monkeypatch):
    """A registry on a free loopback port: {url path: bytes} to serve, and the paths asked for."""
    served, asked = {}, []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = served.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("EDGEINFER_NPM_REGISTRY", f"http://127.0.0.1:{server.server_address[1]}/")
    yield served, asked
    server.shutdown()
    server.server_close()


def two_packages(served: dict) -> dict:
    """A lock of an unscoped and a scoped package, their tarballs put in `served`."""
    first = tarball({"lib/a.umd.js": b"var a = 1;", "LICENSE": b"MIT a"})
    second = tarball({"dist/b.min.js": b"var b = 2;", "LICENSE": b"MIT b"})
    served["/alpha/-/alpha-1.2.3.tgz"] = first
    served["/@scope/beta/-/beta-4.5.6.tgz"] = second
    return {
        "registry": "https://registry.invalid",
        "packages": [
            {
                "name": "alpha",
                "version": "1.2.3",
                "integrity": integrity(first),
                "files": {"lib/a.umd.js": "a.js", "LICENSE": "a.LICENSE"},
            },
            {"name": "@scope/beta", "version": "4.5.6", "integrity": integrity(second), "files": {"dist/b.min.js": "b.js"}},
        ],
    }


def test_the_pinned_files_are_fetched_once_and_stamped(registry, tmp_path):
    served, asked = registry
    locked = two_packages(served)
    folder = tmp_path / "vendor"
    assert ui_vendor.fetch(folder, locked) is True
    assert sorted(asked) == ["/@scope/beta/-/beta-4.5.6.tgz", "/alpha/-/alpha-1.2.3.tgz"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {
        "a.js": b"var a = 1;",
        "a.LICENSE": b"MIT a",
        "b.js": b"var b = 2;",
        "versions.json": json.dumps({"alpha": "1.2.3", "@scope/beta": "4.5.6"}, indent=1).encode() + b"\n",
    }
    assert ui_vendor.fetch(folder, locked) is False and len(asked) == 2  # present: nothing asked again
    locked["packages"][0]["version"] = "1.2.4"  # a new pin fetches again (and finds no such tarball here)
    with pytest.raises(ui_vendor.VendorError, match="alpha-1.2.4.tgz"):
        ui_vendor.fetch(folder, locked)
    assert (folder / "a.js").read_bytes() == b"var a = 1;"  # the old folder stays whole


def test_bytes_that_differ_from_the_pin_are_refused_and_nothing_is_replaced(registry, tmp_path):
    served, _ = registry
    locked = two_packages(served)
    folder = tmp_path / "vendor"
    folder.mkdir()
    (folder / "old.js").write_text("kept")
    served["/@scope/beta/-/beta-4.5.6.tgz"] = tarball({"dist/b.min.js": b"stealBeacon()"})
    with pytest.raises(ui_vendor.VendorError) as refused:
        ui_vendor.fetch(folder, locked)
    message = str(refused.value)
    assert "beta-4.5.6.tgz does not match its pinned hash" in message and "refused" in message
    assert "npm view @scope/beta@4.5.6 dist.integrity" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vendor"]  # no staging folder left
    assert [p.name for p in folder.iterdir()] == ["old.js"]


def test_an_unreachable_registry_says_how_to_build_with_one(monkeypatch, tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("EDGEINFER_NPM_REGISTRY", f"http://127.0.0.1:{port}")
    locked = {
        "registry": "https://registry.invalid",
        "packages": [{"name": "x", "version": "1.0.0", "integrity": "sha512-AA==", "files": {}}],
    }
    with pytest.raises(ui_vendor.VendorError) as failed:
        ui_vendor.fetch(tmp_path / "vendor", locked, timeout=5)
    assert f"could not fetch http://127.0.0.1:{port}/x/-/x-1.0.0.tgz" in str(failed.value)
    assert "EDGEINFER_NPM_REGISTRY" in str(failed.value) and "plain text" in str(failed.value)
    assert not (tmp_path / "vendor").exists()


def test_a_file_the_lock_names_but_the_tarball_lacks_is_an_error_of_the_lock(registry, tmp_path):
    served, _ = registry
    locked = two_packages(served)
    locked["packages"][0]["files"]["lib/gone.js"] = "gone.js"
    with pytest.raises(ui_vendor.VendorError, match=r"alpha@1.2.3 has no file lib/gone.js: fix serve/ui/vendor.json"):
        ui_vendor.fetch(tmp_path / "vendor", locked)


def test_the_shipped_lock_pins_each_library_with_its_licence_and_the_install_fetched_them():
    locked = ui_vendor.lock()
    assert [p["name"] for p in locked["packages"]] == ["marked", "dompurify", "@highlightjs/cdn-assets", "katex"]
    for package in locked["packages"]:
        assert package["integrity"].startswith("sha512-") and len(base64.b64decode(package["integrity"][7:])) == 64
        assert "LICENSE" in package["files"], package["name"]  # each library's licence travels with it
    names = [name for p in locked["packages"] for name in p["files"].values()]
    assert len(names) == len(set(names))
    # the README's install (setup.py's build step) fetched them: the page is not plain text
    assert ui_vendor.present(), (
        "serve/ui/vendor/ is missing or stale: pip install -e . again with network, or python -m edgeinfer.serve.ui_vendor"
    )


def test_without_the_libraries_the_server_serves_none_and_says_the_page_is_plain(monkeypatch, tmp_path):
    from edgeinfer.serve import app, server

    assert list(app.page_libraries()) == ["marked.js", "purify.js", "highlight.js", "highlight.css", "katex.js"]
    assert server._page_line("http://127.0.0.1:8000") == "the chat page at http://127.0.0.1:8000/, "
    monkeypatch.setattr(ui_vendor, "VENDOR", tmp_path / "missing")
    assert app.page_libraries() == {}
    line = server._page_line("http://127.0.0.1:8000")
    assert "showing replies as plain text" in line and "python -m edgeinfer.serve.ui_vendor" in line


def test_the_module_run_as_a_command_says_what_it_holds():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "edgeinfer.serve.ui_vendor"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("already present: marked@18.3.0, dompurify@3.5.0, @highlightjs/cdn-assets@11.12.0, katex@0.19.1 in ")
