"""The one build step beyond setuptools' own: the chat page's libraries (serve/ui/vendor.json) fetched
from the npm registry into serve/ui/vendor/ before the package's files are gathered, so that an
editable install serves them from the tree and a wheel carries them. Everything else is in
pyproject.toml. A build without network goes on, saying so: the page then shows replies as plain text.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def ui_vendor():
    """serve/ui_vendor.py by its path: importing edgeinfer.serve would need the serve extra, not installed yet."""
    spec = importlib.util.spec_from_file_location("_edgeinfer_ui_vendor", HERE / "serve" / "ui_vendor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPy(build_py):
    def run(self):
        vendor = ui_vendor()
        try:
            if vendor.fetch():
                print(f"chat page libraries fetched into {vendor.VENDOR}", file=sys.stderr)
        except vendor.VendorError as error:
            print(f"warning: {error}", file=sys.stderr)
        super().run()


setup(cmdclass={"build_py": BuildPy})
