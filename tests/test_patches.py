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


def test_repeat_interleave_by_a_constant_gives_torchs_own(tmp_path):
    """Inside the patch, repeat_interleave by an int gives torch's own tensor on every axis, and a
    module using it traces into a graph whose output ONNX Runtime computes the same for other sizes
    than the traced ones (the unpatched symbolic fails to export it)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    original = torch.repeat_interleave, torch.Tensor.repeat_interleave
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    expected = {dim: torch.repeat_interleave(x, 2, dim=dim) for dim in (0, 1, -1)}
    with patches.constant_repeat_interleave():
        for dim, want in expected.items():
            assert torch.equal(torch.repeat_interleave(x, 2, dim=dim), want)
            assert torch.equal(x.repeat_interleave(2, dim=dim), want)
        assert torch.equal(
            x.repeat_interleave(torch.tensor([1, 2, 1]), dim=1), torch.repeat_interleave(x, torch.tensor([1, 2, 1]), dim=1)
        )

    class Interleaved(torch.nn.Module):
        def forward(self, x):
            return x[..., : x.shape[-1] // 2].repeat_interleave(2, dim=-1) * 3

    with patches.constant_repeat_interleave():
        torch.onnx.export(
            Interleaved(),
            (x,),
            str(tmp_path / "m.onnx"),
            dynamo=False,
            input_names=["x"],
            dynamic_axes={"x": {0: "a", 1: "b", 2: "c"}},
        )
    other = np.random.default_rng(0).standard_normal((3, 5, 6)).astype(np.float32)
    (got,) = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": other})
    assert np.array_equal(got, Interleaved()(torch.from_numpy(other)).numpy())
    assert (torch.repeat_interleave, torch.Tensor.repeat_interleave) == original  # torch gets its own back


def test_falcons_alibi_in_float32_gives_transformers_own():
    """The traced ALiBi bias equals transformers' falcon's to the bit: heads that are and are not a
    power of two, rows with left padding."""
    import torch
    from transformers.models.falcon import modeling_falcon

    original = modeling_falcon.build_alibi_tensor
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    for heads in (1, 4, 6, 12, 71):
        with patches.traceable_falcon_alibi():
            ours = modeling_falcon.build_alibi_tensor(mask, heads, torch.float32)
        theirs = original(mask, heads, torch.float32)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), heads
    assert modeling_falcon.build_alibi_tensor is original


def test_the_added_symbolics_give_torchs_own(tmp_path):
    """expm1 and rms_norm (with and without a weight and eps, over one axis and two) traced
    through `missing_symbolics` give torch's values; torch.onnx refuses them without it, and again after."""
    import numpy as np
    import onnxruntime as ort
    import torch

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(6, eps=1e-5)
            self.plain = torch.nn.RMSNorm([5, 6], elementwise_affine=False)
            torch.nn.init.normal_(self.norm.weight)

        def forward(self, x):
            return torch.expm1(x) + self.norm(x) + self.plain(x)

    x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(0))

    def export(path):
        torch.onnx.export(Both().eval(), (x,), str(path), dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "a"}})

    with pytest.raises(Exception, match="expm1|rms_norm"):
        export(tmp_path / "refused.onnx")
    torch.manual_seed(0)
    model = Both().eval()
    with patches.missing_symbolics():
        torch.onnx.export(model, (x,), str(tmp_path / "m.onnx"), dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "a"}})
    other = np.random.default_rng(0).standard_normal((2, 5, 6)).astype(np.float32)
    (got,) = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": other})
    assert np.abs(got - model(torch.from_numpy(other)).detach().numpy()).max() < 1e-5
    with pytest.raises(Exception, match="expm1|rms_norm"):  # torch's own refusal, as before: its registry as it was
        export(tmp_path / "after.onnx")


def test_a_cumsum_of_booleans_sums_them_as_integers(tmp_path):
    """torch sums booleans as int64; torch.onnx's own symbolic hands the booleans to CumSum, which
    ONNX Runtime refuses to load (Llama 4's masks). Under `missing_symbolics` the graph loads and
    gives torch's sums, and a cumsum with a dtype still casts to it; after, torch's own again."""
    import numpy as np
    import onnxruntime as ort
    import torch

    class Sums(torch.nn.Module):
        def forward(self, x):
            return (x > 0).cumsum(-1), x.cumsum(0, dtype=torch.float64)

    x = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 5.0, 6.0]])

    def export(path):
        torch.onnx.export(Sums(), (x,), str(path), dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "a"}})
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    with pytest.raises(Exception, match="tensor\\(bool\\)"):
        export(tmp_path / "refused.onnx")
    with patches.missing_symbolics():
        session = export(tmp_path / "m.onnx")
    flags, sums = session.run(None, {"x": x.numpy()})
    assert flags.tolist() == [[1, 1, 2], [0, 1, 2]] and flags.dtype == np.int64
    assert sums.dtype == np.float64 and sums.tolist() == [[1.0, -2.0, 3.0], [0.0, 3.0, 9.0]]
    with pytest.raises(Exception, match="tensor\\(bool\\)"):
        export(tmp_path / "after.onnx")


def test_real_rotary_turns_as_transformers_complex_one():
    """Under `real_rotary`, DeepSeek-V2's and Llama 4's rotary embedding gives (cos, sin) pairs and
    their apply_rotary_emb turns queries and keys by them in real numbers: the same values as
    transformers' complex numbers, each in its own layout; the originals are back after."""
    import torch
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as deepseek
    from transformers.models.llama4 import modeling_llama4 as llama4

    from architectures import tiny_config

    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([[3, 4, 5, 9]])
    cases = [
        (llama4, llama4.Llama4TextRotaryEmbedding, tiny_config("llama4_text"), (1, 4, 4, 16)),  # [batch, sequence, heads, dim]
        (deepseek, deepseek.DeepseekV2RotaryEmbedding, tiny_config("deepseek_v2"), (1, 4, 4, 4)),  # [batch, heads, sequence, dim]
    ]
    for module, rotary_class, config, shape in cases:
        rotary = rotary_class(config)
        q, k = torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)
        expected = module.apply_rotary_emb(q, k, rotary(q, positions))
        original = module.apply_rotary_emb
        with patches.real_rotary():
            pairs = rotary(q, positions)
            got = module.apply_rotary_emb(q, k, pairs)
        assert not pairs.is_complex() and pairs.shape[-1] == 2
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))
        assert module.apply_rotary_emb is original and rotary(q, positions).is_complex()


def test_a_norm_without_a_weight_is_not_fused_with_the_next_mul(tmp_path):
    """A norm with no weight whose output is multiplied by an activation made from it (NanoChat's
    norms before its rotations): the optimizer, under `weighted_norms_only`, leaves it as ops and
    the graph runs as traced; a norm with a weight beside it is still fused. Without the patch the
    fused graph has a cycle."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    from edgeinfer.export.optimize import optimize

    class Norms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16))
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            gated = plain * torch.sigmoid(self.linear(plain))
            return gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    torch.manual_seed(0)
    model, x = Norms().eval(), torch.randn(2, 3, 16)
    torch.onnx.export(model, (x,), str(tmp_path / "m.onnx"), dynamo=False, input_names=["x"], opset_version=14)
    optimized = optimize(onnx.load(str(tmp_path / "m.onnx")), 4, 16)
    assert [n.op_type for n in optimized.graph.node].count("SimplifiedLayerNormalization") == 1
    onnx.save(optimized, str(tmp_path / "o.onnx"))
    (got,) = ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    assert np.abs(got - model(x).detach().numpy()).max() < 1e-5


def test_a_gate_scaled_by_a_vector_is_not_fused_as_quick_gelu(tmp_path):
    """x * sigmoid(x * s) with s a vector (Dory's attention gate) is left as ops by the optimizer,
    under `scalar_quick_gelu_only`, and runs as traced; x * sigmoid(1.702 * x) beside it is still
    fused. Without the patch the optimizer raises (`.item()` on the vector)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    from edgeinfer.export.optimize import optimize

    class Gates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.rand(16) + 0.5)
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            gated = x * torch.sigmoid(x * self.scale.square())
            h = self.linear(gated)
            return h * torch.sigmoid(1.7021484375 * h)

    torch.manual_seed(0)
    model, x = Gates().eval(), torch.randn(2, 3, 16)
    torch.onnx.export(model, (x,), str(tmp_path / "m.onnx"), dynamo=False, input_names=["x"], opset_version=14)
    optimized = optimize(onnx.load(str(tmp_path / "m.onnx")), 4, 16)
    assert [n.op_type for n in optimized.graph.node].count("QuickGelu") == 1
    assert [n.op_type for n in optimized.graph.node].count("Sigmoid") == 1
    onnx.save(optimized, str(tmp_path / "o.onnx"))
    (got,) = ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    assert np.abs(got - model(x).detach().numpy()).max() < 1e-5
