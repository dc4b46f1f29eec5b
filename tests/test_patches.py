"""export/patches.py: every patch of another library is listed with the version it targets and the
tests that pin it, and those hold for the versions installed. When a library moves, this fails first:
run the patch's pinning tests on the new version, then move its target."""

import ast
import re
from pathlib import Path

import pytest

from edgeinfer.export import patches

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_each_patch_targets_the_installed_version(patch):
    installed = patches.installed_version(patch.library)
    assert installed is not None, f"{patch.library} is not installed"
    series = ".".join(re.split(r"[.+]", installed)[:2])
    assert series == patch.target, (
        f"{patch.name} patches {patch.library} {patch.target}, but {installed} is installed: "
        f"run {', '.join(patch.pinned_by)} on it, then move the target in export/patches.py"
    )


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_each_patch_is_a_function_here_and_its_pinning_tests_exist(patch):
    assert callable(getattr(patches, patch.name))
    for pin in patch.pinned_by:
        file, test = pin.split("::")
        tree = ast.parse((ROOT / file).read_text())
        assert test in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, pin


def test_no_other_module_assigns_to_another_librarys_attributes():
    """The patches live in export/patches.py alone: elsewhere in the library no assignment targets an
    attribute of an imported module or class (the shape every patch has: `library.name = ...`)."""
    offenders = []
    for folder in ("sdk", "serve", "export", "cli", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "patches.py":
                continue
            tree = ast.parse(path.read_text())
            imported = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("edgeinfer"):
                    imported |= {a.asname or a.name for a in node.names}
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
                for target in (t for each in targets for t in (each.elts if isinstance(each, ast.Tuple) else [each])):
                    if isinstance(target, ast.Attribute):
                        base = target.value
                        while isinstance(base, ast.Attribute):
                            base = base.value
                        if isinstance(base, ast.Name) and base.id in imported:
                            offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_gguf_patches_give_back_what_they_replaced():
    import gguf
    from gguf.gguf_reader import GGUFReader

    before = (gguf.get_tensor_name_map, GGUFReader._get_field_parts, gguf.dequantize)
    with patches.faster_gguf(True):
        assert gguf.get_tensor_name_map is not before[0] and gguf.dequantize is not before[2]
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.get_tensor_name_map, GGUFReader._get_field_parts, gguf.dequantize) == before


def test_the_fast_optimizer_class_reports_every_pass_it_runs():
    from onnxruntime.transformers.onnx_model_gpt2 import Gpt2OnnxModel

    model_class = patches.fast_model_class(Gpt2OnnxModel)
    assert model_class.__mro__[1] is patches._FastLookups and issubclass(model_class, Gpt2OnnxModel)
    missing = [name for name in patches.OPTIMIZER_PASSES if not hasattr(Gpt2OnnxModel, name)]
    assert missing == [], f"onnxruntime's optimizer has no {missing}: update OPTIMIZER_PASSES"
    assert all(getattr(model_class, name).__name__ == name for name in patches.OPTIMIZER_PASSES)
