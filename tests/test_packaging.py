"""A plain `pip install .` (a built wheel) works, not only the editable install."""

import os
import subprocess
import sys
from pathlib import Path

from edgeinfer.serve import ui_vendor

ROOT = Path(__file__).resolve().parents[1]
CHECK = (
    "import edgeinfer, edgeinfer.sdk, edgeinfer.export, edgeinfer.cli, edgeinfer.models, edgeinfer.serve; "
    "from edgeinfer import Engine, Scheduler; "
    "from edgeinfer.sdk.heads import load_head; assert all(load_head(k, 10) for k in ('argmax', 'last')); "
    "from edgeinfer.models import entries; print(edgeinfer.sdk.__file__, edgeinfer.cli.__file__, sorted(entries()))"
)


def test_built_wheel_imports_and_runs_the_cli(tmp_path):
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    wheel = next((tmp_path / "dist").glob("edgeinfer-*.whl"))
    target = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True, capture_output=True, timeout=600
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    sdk_file, cli_file, names = done.stdout.split(" ", 2)
    assert sdk_file == str(target / "edgeinfer" / "sdk" / "__init__.py")
    assert cli_file == str(target / "edgeinfer" / "cli" / "__init__.py")
    assert names.strip() == "['gemma-3-270m', 'smollm2-135m-instruct']"  # the catalog's JSON is in the wheel
    parts = {"sdk": "sdk", "export": "export", "cli": "cli", "models": "models", "serve": "serve"}
    packages = [init.parent.relative_to(ROOT) for part in parts for init in (ROOT / part).rglob("__init__.py")]
    missing = [str(p) for p in packages if not (target / "edgeinfer" / p / "__init__.py").exists()]
    assert missing == [], f"packages left out of the wheel (pyproject.toml's packages): {missing}"
    ui = target / "edgeinfer" / "serve" / "ui"  # the chat page's files too
    assert sorted(p.name for p in ui.iterdir()) == ["app.js", "favicon.svg", "index.html", "style.css", "vendor", "vendor.json"]
    # and the libraries setup.py's build step fetched, with their licences
    shipped = sorted(p.name for p in (ui / "vendor").iterdir())
    assert shipped == sorted(name for package in ui_vendor.lock()["packages"] for name in package["files"].values()) + [
        "versions.json"
    ]
    help_text = subprocess.run([str(target / "bin" / "edgeinfer"), "--help"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert help_text.returncode == 0 and all(c in help_text.stdout for c in ("export", "run", "info", "serve"))
