"""The README and docs/ as the project's rules state them: a landing page of at most 200 lines whose
test command is CI's, links that resolve, a site that builds with `mkdocs build --strict`; and the
library's own shape: no function over 60 lines, every error class importable from `edgeinfer`."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import edgeinfer

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("sdk", "serve", "export", "cli", "models", "edgeinfer")
MAX_FUNCTION_LINES = 60


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (the rule mkdocs and GitHub share for plain text)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_the_readme_is_a_landing_page_of_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move reference to docs/"


def test_the_readmes_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    test_commands = [b for b in blocks if b.rstrip().endswith("&& pytest")]
    assert len(test_commands) == 1, blocks
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_commands[0].strip() in ci


def test_the_readmes_links_resolve_to_pages_and_anchors():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    local = [(path, anchor) for path, anchor in links if not path.startswith(("http://", "https://"))]
    assert len(local) >= 9, local  # the docs table links every page
    for path, anchor in local:
        target = ROOT / path
        assert target.is_file(), f"README.md links {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README.md links {path}#{anchor}: no such heading"


def test_every_docs_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages and all(f": {page}" in nav for page in pages), pages
    for page in pages:  # one title a page: the site's navigation and search read it
        text = re.sub(r"```.*?```", "", (ROOT / "docs" / page).read_text(), flags=re.S)
        assert len(re.findall(r"^# ", text, flags=re.M)) == 1, page


def test_the_site_builds_with_strict_link_checks(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is not installed: pip install -e '.[test]' (or '.[docs]')"
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()


def _long_functions() -> list[str]:
    found = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_library_function_is_over_60_lines():
    assert _long_functions() == []


def test_the_length_rule_sees_a_long_function(tmp_path, monkeypatch):
    package = tmp_path / "sdk"
    package.mkdir()
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    (package / "long.py").write_text(f"def long():\n{body}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY", ("sdk",))
    assert _long_functions() == ["sdk/long.py:1 long (61 lines)"]


@pytest.mark.parametrize("page", ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
def test_every_error_class_the_docs_name_is_importable_from_edgeinfer(page):
    names = set(re.findall(r"`(\w+Error)`", (ROOT / page).read_text()))
    ours = {name for name in names if name not in {"InvalidAuthToken"} and not name.startswith("Http")}
    for name in sorted(ours):
        error = getattr(edgeinfer, name, None)
        assert isinstance(error, type) and issubclass(error, edgeinfer.EdgeInferError), f"{page}: {name}"


@pytest.mark.parametrize("script", ["peers.py", "peers_at_size.py", "load_time.py"])
def test_the_peer_benchmarks_run_from_a_clone_with_nothing_beside_it(tmp_path, script):
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "benchmarks", clone / "benchmarks")
    done = subprocess.run(
        [sys.executable, str(clone / "benchmarks" / script), "--help"], cwd=clone, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr
    sources = [p.read_text() for p in (ROOT / "benchmarks").rglob("*.py")]
    assert not [s for s in sources if "shared/peers" in s or '/ "shared" /' in s]
