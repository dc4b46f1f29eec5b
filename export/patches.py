"""Every change edgeinfer makes to another library's code, in one place.

Each patch is scoped (a context manager around one call, or a subclass or wrapper of one object),
gives back exactly what it replaced, and is listed in PATCHES with the library version it was
written against and the tests that pin its result to the library's own. When a library moves,
tests/test_patches.py fails first: run the patch's pinning tests on the new version, then move its
target. The export checks every graph against PyTorch in any case.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Patch:
    name: str  # the function in this module
    library: str  # the distribution it changes
    target: str  # the major.minor series it was written and tested against
    pinned_by: tuple[str, ...]  # tests/FILE.py::TEST, each comparing the patched result with the library's own
    why: str


PATCHES = (
    Patch(
        "weights_apart",
        "torch",
        "2.13",
        ("tests/test_architectures.py::test_the_graph_with_its_weights_written_apart_is_torch_onnxs_own",),
        "torch.onnx's TorchScript exporter copies every weight into ONNX messages, once for shape inference and "
        "three times for the graph it serializes",
    ),
    Patch(
        "constant_repeat_interleave",
        "torch",
        "2.13",
        ("tests/test_patches.py::test_repeat_interleave_by_a_constant_gives_torchs_own",),
        "torch.onnx's TorchScript symbolic for repeat_interleave concatenates tensors of different ranks once the axis "
        "sizes are dynamic",
    ),
    Patch(
        "missing_symbolics",
        "torch",
        "2.13",
        ("tests/test_patches.py::test_the_added_symbolics_give_torchs_own",),
        "torch.onnx's TorchScript exporter has no symbolic for aten::expm1 (Apertus' xIELU activation) or aten::rms_norm "
        "(torch.nn.RMSNorm, DiffLlama's)",
    ),
    Patch(
        "images_only",
        "transformers",
        "5.24",
        ("tests/test_vision_families.py::test_a_qwen_processor_is_built_without_torchvision_as_transformers_builds_it",),
        "transformers' processors check each part's class by name, and the video processors' base class exists only "
        "with torchvision, so Qwen2.5-VL's and Qwen 3.5's processors cannot be built without it",
    ),
    Patch(
        "traceable_falcon_alibi",
        "transformers",
        "5.24",
        (
            "tests/test_patches.py::test_falcons_alibi_in_float32_gives_transformers_own",
            "tests/test_architectures.py::test_family_matches_transformers",
        ),
        "torch.onnx's TorchScript exporter types falcon's bfloat16-by-integer ALiBi product as complex128",
    ),
    Patch(
        "traceable_linear_attention",
        "transformers",
        "5.24",
        (
            "tests/test_linear_attention.py::test_the_traced_state_layers_give_transformers_own",
            "tests/test_architectures.py::test_family_matches_transformers",
        ),
        "transformers' gated DeltaNet loops over the prompt's chunks and tokens in Python, which a trace unrolls",
    ),
    Patch(
        "traceable_mamba2",
        "transformers",
        "5.24",
        (
            "tests/test_linear_attention.py::test_the_traced_state_layers_give_transformers_own",
            "tests/test_architectures.py::test_family_matches_transformers",
        ),
        "transformers' Mamba-2 mixers scan the prompt in chunks of Python-sized blocks, and decode one token "
        "through another path, which a trace freezes at the traced length",
    ),
    Patch(
        "real_rotary",
        "transformers",
        "5.24",
        (
            "tests/test_patches.py::test_real_rotary_turns_as_transformers_complex_one",
            "tests/test_architectures.py::test_family_matches_transformers",
        ),
        "DeepSeek-V2's and Llama 4's rotary positions are complex numbers (torch.polar), which ONNX has no type for",
    ),
    Patch(
        "traceable_mamba",
        "transformers",
        "5.24",
        (
            "tests/test_linear_attention.py::test_the_traced_state_layers_give_transformers_own",
            "tests/test_architectures.py::test_family_matches_transformers",
        ),
        "transformers' Mamba-1 mixers scan a prompt token by token in Python (a trace unrolls it for the traced "
        "length) and decode one token through another path",
    ),
    Patch(
        "traceable_routed_experts",
        "transformers",
        "5.24",
        ("tests/test_architectures.py::test_family_matches_transformers",),
        "transformers' DBRX, JetMoE and LongCat-Flash experts pick each expert's tokens in Python (a loop over the "
        "experts hit, a split by per-expert counts), which a trace freezes at the traced tokens",
    ),
    Patch(
        "state_op_shapes",
        "onnxruntime",
        "1.31",
        ("tests/test_linear_attention.py::test_the_optimizer_fuses_a_hybrid_graphs_norms",),
        "ONNX Runtime's symbolic shape inference knows no LinearAttention or CausalConvWithState and gives up on the graph",
    ),
    Patch(
        "weighted_norms_only",
        "onnxruntime",
        "1.31",
        ("tests/test_patches.py::test_a_norm_without_a_weight_is_not_fused_with_the_next_mul",),
        "the transformer optimizer's RMS norm fusion takes whatever Mul follows a norm as its scale: after a norm "
        "without a weight (NanoChat's) that is a product of activations, and the fused graph has a cycle",
    ),
    Patch(
        "scalar_quick_gelu_only",
        "onnxruntime",
        "1.31",
        ("tests/test_patches.py::test_a_gate_scaled_by_a_vector_is_not_fused_as_quick_gelu",),
        "the transformer optimizer's QuickGelu fusion reads the scale under x * sigmoid(scale * x) as one number and "
        "raises where it is a vector (Dory's attention gate)",
    ),
    Patch(
        "faster_gguf",
        "gguf",
        "0.19",
        (
            "tests/test_export_safety.py::test_the_fast_gguf_array_reader_gives_the_readers_own_fields",
            "tests/test_export_safety.py::test_gguf_tensors_dequantized_a_block_of_rows_at_a_time_equal_the_whole",
        ),
        "GGUFReader reads metadata arrays an element at a time, transformers builds a tensor name map per module, "
        "and dequantize makes temporaries twice its output",
    ),
    Patch(
        "fast_model_class",
        "onnxruntime",
        "1.31",
        ("tests/test_architectures.py::test_the_fast_optimizer_gives_onnx_runtimes_graph",),
        "the transformer optimizer's lookups walk the whole graph in Python on every call",
    ),
    Patch(
        "one_weight_at_a_time",
        "onnxruntime",
        "1.31",
        ("tests/test_quantization.py::test_one_weight_at_a_time_writes_the_quantizers_own_graph",),
        "MatMulNBitsQuantizer expects every fp32 weight loaded into the graph before it starts",
    ),
    Patch(
        "one_weight_loaded",
        "onnxruntime",
        "1.31",
        ("tests/test_quantization.py::test_hqq_one_weight_loaded_writes_the_quantizers_own_graph",),
        "the HQQ quantizer reads a weight with onnx's reader, which takes no file path: it expects every fp32 weight "
        "loaded into the graph before it starts",
    ),
    Patch(
        "traceable_inkling",
        "transformers",
        "5.24",
        ("tests/test_architectures.py::test_family_matches_transformers",),
        "transformers' Inkling short convolutions decode one token through a fused update kernel and a prompt through "
        "another path, which a trace freezes at the traced length",
    ),
    Patch(
        "traceable_minimax",
        "transformers",
        "5.24",
        ("tests/test_architectures.py::test_family_matches_transformers",),
        "transformers' MiniMax lightning attention runs a prompt in Python blocks and decodes token by token, which a "
        "trace unrolls for the traced length",
    ),
    Patch(
        "traceable_recurrent_gemma",
        "transformers",
        "5.24",
        ("tests/test_architectures.py::test_family_matches_transformers",),
        "transformers' RecurrentGemma blocks keep their states on the modules, decode a token through another path and "
        "scan a prompt token by token in Python, which a trace unrolls for the traced length",
    ),
    Patch(
        "write_as_made",
        "onnxruntime",
        "1.31",
        ("tests/test_quantization.py::test_one_weight_at_a_time_writes_the_quantizers_own_graph",),
        "MatMulNBitsQuantizer adds each node's blocks to the graph's message, whose bytes stay in its arena until the "
        "whole graph goes: a model's quantized weights would all be in memory at once",
    ),
)


def installed_version(library: str) -> str | None:
    """The installed version of a distribution; onnxruntime is onnxruntime-gpu where that is installed."""
    names = ("onnxruntime-gpu", "onnxruntime") if library == "onnxruntime" else (library,)
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# --- torch: the weights held apart from torch.onnx's messages -------------------------------------

_EXPORTING = threading.Lock()  # the patch is process-wide: one export uses it at a time
APART_BYTES = 1024  # floating-point tensors this large are written apart from torch.onnx's message


@contextmanager
def weights_apart():
    """While torch.onnx's TorchScript exporter runs, its shape inference
    (`_jit_pass_onnx_graph_shape_type_inference`, which takes the values for constant propagation) and
    its serializer (`Graph._export_onnx`) are given only the tensors under 1 KiB and those that are
    not floating point (what shape inference may read), so the others become graph inputs of known
    shapes. The dict yielded holds them (the weights, and what constant folding made of them), for
    `graphs.write_weights` to put in the data file one at a time."""
    import torch

    graph_class, held = torch._C.Graph, {}
    export_original, infer_original = graph_class._export_onnx, torch._C._jit_pass_onnx_graph_shape_type_inference

    def small(params):
        return {name: tensor for name, tensor in params.items() if not (onnx_float(tensor) and nbytes(tensor) >= APART_BYTES)}

    def infer(graph, params, *args, **kwargs):
        return infer_original(graph, small(params), *args, **kwargs)

    def export_onnx(self, params, *args, **kwargs):
        kept = small(params)
        held.update((name, tensor) for name, tensor in params.items() if name not in kept)
        return export_original(self, kept, *args, **kwargs)

    with _EXPORTING:
        graph_class._export_onnx, torch._C._jit_pass_onnx_graph_shape_type_inference = export_onnx, infer
        try:
            yield held
        finally:
            graph_class._export_onnx, torch._C._jit_pass_onnx_graph_shape_type_inference = export_original, infer_original


def onnx_float(tensor) -> int | None:
    """The ONNX element type of a floating-point torch tensor; None for other tensors."""
    import onnx
    import torch

    return {
        torch.float32: onnx.TensorProto.FLOAT,
        torch.float16: onnx.TensorProto.FLOAT16,
        torch.bfloat16: onnx.TensorProto.BFLOAT16,
        torch.float64: onnx.TensorProto.DOUBLE,
    }.get(tensor.dtype)


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


# --- torch: repeat_interleave by a constant, traced ----------------------------------------------


_INTERLEAVING = threading.Lock()  # the patch is process-wide: one trace uses it at a time


@contextmanager
def constant_repeat_interleave():
    """While a model is traced, `repeat_interleave` by an int along one axis is done as unsqueeze,
    expand and flatten, which gives the same tensor. torch.onnx's TorchScript symbolic for it
    concatenates tensors of different ranks once the axis sizes are dynamic, and fails (cohere's,
    glm's and helium's interleaved rotations). Other calls go to torch's own."""
    import torch

    def interleaved(original):
        def repeat_interleave(x, repeats, dim=None, **kwargs):
            if not isinstance(repeats, int) or dim is None or kwargs.get("output_size") is not None:
                return original(x, repeats, dim, **kwargs)
            dim %= x.dim()
            return x.unsqueeze(dim + 1).expand(*x.shape[: dim + 1], repeats, *x.shape[dim + 1 :]).flatten(dim, dim + 1)

        return repeat_interleave

    with _INTERLEAVING:  # the originals are read under the lock: another trace may have patched them until now
        tensor_method, function = torch.Tensor.repeat_interleave, torch.repeat_interleave
        torch.Tensor.repeat_interleave, torch.repeat_interleave = interleaved(tensor_method), interleaved(function)
        try:
            yield
        finally:
            torch.Tensor.repeat_interleave, torch.repeat_interleave = tensor_method, function


# --- torch: symbolics torch.onnx lacks -------------------------------------------------------------

_SYMBOLICS = threading.Lock()  # the registration is process-wide: one trace uses it at a time


@contextmanager
def missing_symbolics():
    """While a model is traced, aten::expm1 is written as Exp - 1 and aten::rms_norm as its formula
    (x / sqrt(mean(x^2) + eps) * weight over the normalized axes, eps torch's default where none is
    given, a weight of ones where none is given): torch.onnx's TorchScript exporter has neither and
    refuses the model. A norm without its Mul was fused by ONNX Runtime with the next Mul in the
    graph as its scale, which made a cycle ("Graph is not a DAG", NanoChat's). aten::cumsum of
    booleans casts them to int64 first, as torch sums them (the exporter's CumSum took the booleans,
    which ONNX's CumSum refuses: Llama 4's)."""
    import torch
    from torch.onnx import symbolic_helper

    def expm1(g, x):
        return g.op("Sub", g.op("Exp", x), g.op("Constant", value_t=torch.tensor(1.0)))

    def rms_norm(g, x, shape, weight, eps):
        normalized = symbolic_helper._get_const(shape, "is", "normalized_shape")
        axes = list(range(-len(normalized), 0))
        given = symbolic_helper._maybe_get_const(eps, "f")
        epsilon = float(given) if isinstance(given, float) else float(torch.finfo(torch.float32).eps)
        # Pow, not Mul(x, x): ONNX Runtime 1.31's norm fusion reads a Mul parent wrongly and fails
        squares = g.op("Pow", x, g.op("Constant", value_t=torch.tensor(2.0)))
        if symbolic_helper.GLOBALS.export_onnx_opset_version >= 18:  # ReduceMean's axes became an input
            mean = g.op("ReduceMean", squares, g.op("Constant", value_t=torch.tensor(axes)), keepdims_i=1)
        else:
            mean = g.op("ReduceMean", squares, axes_i=axes, keepdims_i=1)
        out = g.op("Div", x, g.op("Sqrt", g.op("Add", mean, g.op("Constant", value_t=torch.tensor(epsilon)))))
        if symbolic_helper._is_none(weight):  # a scale of ones: ONNX Runtime's norm fusion takes a norm by the Mul after it
            weight = g.op("Constant", value_t=torch.ones(normalized))
        return g.op("Mul", out, weight)

    def cumsum(g, x, dim, dtype=None):
        from torch.onnx._internal.torchscript_exporter._type_utils import JitScalarType

        axis = g.op("Constant", value_t=torch.tensor(symbolic_helper._get_const(dim, "i", "dim"), dtype=torch.int))
        target = None if dtype is None or symbolic_helper._is_none(dtype) else symbolic_helper._maybe_get_const(dtype, "i")
        if isinstance(target, int):
            x = g.op("Cast", x, to_i=JitScalarType(target).onnx_type())
        elif x.type().scalarType() == "Bool":
            x = g.op("Cast", x, to_i=JitScalarType.INT64.onnx_type())
        return g.op("CumSum", x, axis)

    from torch.onnx._internal.torchscript_exporter.registration import registry

    # each at the opset of torch's own, where it has one: a symbolic is taken from the closest opset
    added = {"aten::expm1": (expm1, 9), "aten::rms_norm": (rms_norm, 9), "aten::cumsum": (cumsum, 11)}
    with _SYMBOLICS:
        new = [name for name in added if name not in registry._registry]
        for name, (symbolic, opset) in added.items():
            torch.onnx.register_custom_op_symbolic(name, symbolic, opset)
        try:
            yield
        finally:
            for name, (_, opset) in added.items():
                torch.onnx.unregister_custom_op_symbolic(name, opset)
            for name in new:  # unregistering leaves an empty entry, which torch.onnx then fails on obscurely
                registry._registry.pop(name, None)


# --- transformers: a processor without its video processor ----------------------------------------

_PROCESSORS = threading.Lock()  # the patch is process-wide


@contextmanager
def images_only():
    """Processors built meanwhile may go without their video processor (None): transformers checks
    each part's class by name, and the video processors' base class exists only with torchvision,
    which edgeinfer does not install. edgeinfer reads images only; every other part is checked."""
    from transformers import processing_utils

    with _PROCESSORS:
        check = processing_utils.ProcessorMixin.check_argument_for_proper_class

        def lenient(self, name, part):
            return None if name == "video_processor" and part is None else check(self, name, part)

        processing_utils.ProcessorMixin.check_argument_for_proper_class = lenient
        try:
            yield
        finally:
            processing_utils.ProcessorMixin.check_argument_for_proper_class = check


# --- transformers: falcon's ALiBi, traced -----------------------------------------------------------

_ALIBI = threading.Lock()  # the patch is process-wide: one trace uses it at a time


@contextmanager
def traceable_falcon_alibi():
    """While a model is traced, falcon's ALiBi bias is computed as transformers computes it (the
    slopes rounded to bfloat16, times the positions, rounded to bfloat16) but in float32 with casts
    for the rounding: torch.onnx's TorchScript exporter types a bfloat16-by-integer product as
    complex128 (torch's enum number for bfloat16), which ONNX Runtime refuses."""
    import torch
    from transformers.models.falcon import modeling_falcon

    def rounded_alibi(attention_mask, num_heads, dtype):
        batch, length = attention_mask.shape
        slopes = _alibi_slopes(num_heads).to(attention_mask.device).to(torch.bfloat16).float()
        positions = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :].float()
        alibi = (slopes[..., None] * positions).to(torch.bfloat16)
        return alibi.reshape(batch * num_heads, 1, length).to(dtype)

    with _ALIBI:  # the original is read under the lock: another trace may have patched it until now
        original = modeling_falcon.build_alibi_tensor
        modeling_falcon.build_alibi_tensor = rounded_alibi
        try:
            yield
        finally:
            modeling_falcon.build_alibi_tensor = original


_COMPLEX_ROTARY = threading.Lock()  # the patch is process-wide: one trace uses it at a time


@contextmanager
def real_rotary():
    """While a model is traced, DeepSeek-V2's and Llama 4's rotary positions, which transformers
    computes as complex numbers (torch.polar, view_as_complex: ONNX has no complex type), are the
    same rotation in real numbers: the rotary embedding gives (cos, sin) pairs [..., dim / 2, 2]
    (times its scaling), and each pair (a, b) of a query or key turns to (a cos - b sin, a sin + b cos)."""
    import torch
    from transformers.models.deepseek_v2 import modeling_deepseek_v2
    from transformers.models.llama4 import modeling_llama4

    def pairs(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return torch.stack([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling

    def turned(x, cos, sin):
        a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)

    def llama4_apply(xq, xk, freqs):  # queries and keys [batch, sequence, heads, dim]
        cos, sin = freqs[:, :, None, :, 0], freqs[:, :, None, :, 1]
        return turned(xq, cos, sin), turned(xk, cos, sin)

    def deepseek_apply(xq, xk, freqs):  # [batch, heads, sequence, dim]
        cos, sin = freqs[:, None, :, :, 0].to(xq.device), freqs[:, None, :, :, 1].to(xq.device)
        return turned(xq, cos, sin), turned(xk, cos, sin)

    replaced = [
        (modeling_llama4, "apply_rotary_emb", llama4_apply),
        (modeling_deepseek_v2, "apply_rotary_emb", deepseek_apply),
        (modeling_llama4.Llama4TextRotaryEmbedding, "forward", pairs),
        (modeling_deepseek_v2.DeepseekV2RotaryEmbedding, "forward", pairs),
    ]
    with _COMPLEX_ROTARY:  # the originals are read under the lock: another trace may have patched them until now
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
        for owner, name, value in replaced:
            setattr(owner, name, value)
        try:
            yield
        finally:
            for owner, name, value in originals:
                setattr(owner, name, value)


def _alibi_slopes(num_heads: int):
    """ALiBi's per-head slopes in float32, as transformers' falcon computes them."""
    import math

    import torch

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32), torch.arange(1, 1 + closest))
    if closest != num_heads:
        extra = min(closest, num_heads - closest)
        base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        slopes = torch.cat([slopes, torch.pow(base, torch.arange(1, 1 + 2 * extra, 2))])
    return slopes


# --- transformers: gated DeltaNet layers, traced into ONNX Runtime's ops -----------------------------

_DELTANET = threading.Lock()  # the patch is process-wide: one trace uses it at a time


@contextmanager
def traceable_linear_attention():
    """While a model is traced, gated DeltaNet layers (Qwen 3.5's, Qwen3-Next's, OLMo Hybrid's, Lara Mini's, Kimi Linear's, Bailing's) and short
    convolutions (LFM 2's and 3's) run export/linear_attention.py's
    forward, whose convolution and delta rule trace into ONNX Runtime's CausalConvWithState and
    LinearAttention: transformers' own runs Python loops over the prompt's chunks and tokens, which
    a trace would unroll for the traced length alone."""
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.lara_mini import modeling_lara_mini
    from transformers.models.lfm2 import modeling_lfm2
    from transformers.models.lfm2_moe import modeling_lfm2_moe
    from transformers.models.lfm3 import modeling_lfm3
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    from .linear_attention import gated_deltanet_forward, kimi_delta_forward, short_conv_forward

    forwards = {
        modeling_qwen3_5.Qwen3_5GatedDeltaNet: gated_deltanet_forward,
        modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet: gated_deltanet_forward,
        modeling_qwen3_next.Qwen3NextGatedDeltaNet: gated_deltanet_forward,
        modeling_kimi_linear.KimiLinearDeltaAttention: kimi_delta_forward,
        modeling_bailing_hybrid.BailingHybridDeltaAttention: kimi_delta_forward,
        modeling_olmo_hybrid.OlmoHybridGatedDeltaNet: gated_deltanet_forward,
        modeling_lara_mini.LaraMiniGatedDeltaNet: gated_deltanet_forward,
        modeling_lfm2.Lfm2ShortConv: short_conv_forward,
        modeling_lfm2_moe.Lfm2MoeShortConv: short_conv_forward,
        modeling_lfm3.Lfm3ShortConv: short_conv_forward,
    }
    with _DELTANET:  # the originals are read under the lock: another trace may have patched them until now
        originals = {layer: layer.forward for layer in forwards}
        for layer, forward in forwards.items():
            layer.forward = forward
        try:
            yield
        finally:
            for layer, original in originals.items():
                layer.forward = original


_MAMBA = threading.Lock()  # the patches are process-wide: one trace uses them at a time


@contextmanager
def traceable_mamba2():
    """While a model is traced, Mamba-2 mixers (Mamba 2's, Bamba's, Granite 4.0-H's, Nemotron-H's, Falcon-H1's, Zamba 2's) run
    export/linear_attention.py's `mamba2_forward`, whose convolution and selective scan trace into
    ONNX Runtime's CausalConvWithState and LinearAttention (its gated rule)."""
    from transformers.models.bamba import modeling_bamba
    from transformers.models.falcon_h1 import modeling_falcon_h1
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid
    from transformers.models.mamba2 import modeling_mamba2
    from transformers.models.nemotron_h import modeling_nemotron_h
    from transformers.models.zamba2 import modeling_zamba2

    from .linear_attention import mamba2_forward

    mixers = (
        modeling_bamba.BambaMixer,
        modeling_granitemoehybrid.GraniteMoeHybridMambaLayer,
        modeling_nemotron_h.NemotronHMamba2Mixer,
        modeling_falcon_h1.FalconH1Mixer,
        modeling_zamba2.Zamba2MambaMixer,
        modeling_mamba2.Mamba2Mixer,
    )
    with _forwards_replaced(mixers, mamba2_forward):
        yield


@contextmanager
def traceable_mamba():
    """While a model is traced, Mamba-1 mixers (Mamba's, Falcon Mamba's, Jamba's; Zamba's, in heads)
    run export/linear_attention.py's `mamba_forward` (`zamba_mamba_forward`): its convolution and
    selective scan trace into CausalConvWithState and LinearAttention's gated rule, a head per channel."""
    from transformers.models.falcon_mamba import modeling_falcon_mamba
    from transformers.models.jamba import modeling_jamba
    from transformers.models.mamba import modeling_mamba
    from transformers.models.zamba import modeling_zamba

    from .linear_attention import mamba_forward, zamba_mamba_forward

    forwards = {
        modeling_mamba.MambaMixer: mamba_forward,
        modeling_falcon_mamba.FalconMambaMixer: mamba_forward,
        modeling_jamba.JambaMambaMixer: mamba_forward,
        modeling_zamba.ZambaMambaMixer: zamba_mamba_forward,
    }
    with forwards_replaced(forwards):
        yield


@contextmanager
def traceable_routed_experts():
    """While a model is traced, DBRX's, JetMoE's and LongCat-Flash's experts run
    export/families/routed_experts.py's forwards: each (token, choice) pair through its expert's
    matrices, batched, where transformers' pick each expert's tokens in Python."""
    from transformers.models.dbrx import modeling_dbrx
    from transformers.models.jetmoe import modeling_jetmoe
    from transformers.models.longcat_flash import modeling_longcat_flash

    from .families import routed_experts as experts

    forwards = {
        modeling_dbrx.DbrxExperts: experts.dbrx_experts_forward,
        modeling_longcat_flash.LongcatFlashExperts: experts.longcat_experts_forward,
        modeling_jetmoe.JetMoeTopKGating: experts.jetmoe_gating_forward,
        modeling_jetmoe.JetMoeParallelExperts: experts.jetmoe_experts_forward,
        modeling_jetmoe.JetMoeMoE: experts.jetmoe_moe_forward,
        (modeling_jetmoe.JetMoeMoA, "reduce"): experts.jetmoe_moa_reduce,
    }
    with forwards_replaced(forwards):
        yield


@contextmanager
def traceable_recurrent_gemma():
    """While a model is traced, RecurrentGemma's recurrent blocks run
    export/families/recurrent_gemma.py's forward: their states in the cache, one path for a prompt
    and a token, the recurrence in one LinearAttention."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma

    from .families import recurrent_gemma

    with forwards_replaced({modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock: recurrent_gemma.recurrent_block_forward}):
        yield


@contextmanager
def traceable_minimax():
    """While a model is traced, MiniMax's lightning attention runs export/families/minimax.py's
    forward: one LinearAttention for a prompt and a token, where transformers' runs Python blocks
    and a token loop."""
    from transformers.models.minimax import modeling_minimax

    from .families import minimax

    with forwards_replaced({modeling_minimax.MiniMaxLightningAttention: minimax.lightning_attention_forward}):
        yield


@contextmanager
def traceable_inkling():
    """While a model is traced, Inkling's and Inkling 2's short convolutions run
    export/families/inkling.py's forwards: one path for a prompt and a token, from a state of the
    kernel's last K - 1 inputs, where transformers' decode a token through a fused update."""
    from transformers.models.inkling import modeling_inkling
    from transformers.models.inkling2 import modeling_inkling2
    from transformers.models.inkling2_loop import modeling_inkling2_loop

    from .families import inkling

    forwards = {
        modeling_inkling.InklingShortConvolution: inkling.inkling_short_conv_forward,
        modeling_inkling2.Inkling2ShortConvolution: inkling.inkling2_short_conv_forward,
        modeling_inkling2.Inkling2DynamicShortConvolution: inkling.inkling2_dynamic_conv_forward,
        modeling_inkling2_loop.Inkling2LoopShortConvolution: inkling.inkling2_short_conv_forward,
        modeling_inkling2_loop.Inkling2LoopDynamicShortConvolution: inkling.inkling2_dynamic_conv_forward,
    }
    with forwards_replaced(forwards):
        yield


@contextmanager
def _forwards_replaced(classes: tuple, forward):
    """`forward` in place of each class's own, put back after; one trace at a time."""
    with forwards_replaced(dict.fromkeys(classes, forward)):
        yield


@contextmanager
def forwards_replaced(forwards: dict):
    """Each class's forward (or, keyed (class, name), that method) replaced by the function
    `forwards` gives it, put back after; one trace at a time."""
    places = {key if isinstance(key, tuple) else (key, "forward"): function for key, function in forwards.items()}
    with _MAMBA:  # the originals are read under the lock: another trace may have patched them until now
        originals = {place: getattr(*place) for place in places}
        for (cls, name), function in places.items():
            setattr(cls, name, function)
        try:
            yield
        finally:
            for (cls, name), original in originals.items():
                setattr(cls, name, original)


# --- gguf: reading and dequantizing a GGUF file ----------------------------------------------------

_LOADING_GGUF = threading.Lock()  # the patches are process-wide: one GGUF load uses them at a time


@contextmanager
def faster_gguf(gguf: bool):
    """Three of the gguf library's functions, replaced while a GGUF file loads and given back after:
    - `gguf.get_tensor_name_map`, which transformers' loader calls for every module of the model,
      returns one map per (architecture, layer count), the only things it depends on;
    - `GGUFReader._get_field_parts` reads arrays of numbers or strings in one pass
      (`fast_array_parts`), the same parts;
    - `gguf.dequantize` dequantizes large tensors a block of rows at a time into the output
      (`in_row_blocks`), the same values without temporaries of twice the output."""
    if not gguf:
        yield
        return
    import gguf as library
    from gguf.gguf_reader import GGUFReader

    with _LOADING_GGUF:
        name_map, field_parts, dequantize = library.get_tensor_name_map, GGUFReader._get_field_parts, library.dequantize
        library.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
        GGUFReader._get_field_parts = fast_array_parts(field_parts)
        library.dequantize = in_row_blocks(dequantize)  # transformers imports it from gguf at each load
        try:
            yield
        finally:
            library.get_tensor_name_map, GGUFReader._get_field_parts, library.dequantize = name_map, field_parts, dequantize


def fast_array_parts(original):
    """`GGUFReader._get_field_parts` with arrays of numbers or strings read in one pass: the same
    parts (a view of each element), indices and types; other fields go to `original`."""
    import numpy as np
    from gguf.constants import GGUFValueType

    def get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return original(self, orig_offs, raw_type)
        raw_itype, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item_type, count, offs = GGUFValueType(int(raw_itype[0])), int(length[0]), orig_offs + 12
        parts, types = [raw_itype, length], [GGUFValueType.ARRAY] + ([item_type] if count else [])
        number = self.gguf_scalar_to_np.get(item_type)
        if number is not None:
            values = self._get(offs, number, count)
            parts += list(values.reshape(count, 1))
            return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types
        if item_type != GGUFValueType.STRING:
            return original(self, orig_offs, raw_type)  # arrays of arrays
        data, size = np.asarray(self.data), np.dtype(np.uint64).newbyteorder(self.byte_order)
        indices = []
        for _ in range(count):
            string_length = data[offs : offs + 8].view(size)
            end = offs + 8 + int(string_length[0])
            parts += (string_length, data[offs + 8 : end])
            indices.append(len(parts) - 1)
            offs = end
        return offs - orig_offs, parts, indices, types

    return get_field_parts


def in_row_blocks(original, rows: int = 8192):
    """`gguf.dequantize` for tensors of more than `rows` rows, `rows` at a time into one output
    array. GGUF's quantization blocks never cross a row, so each block of rows dequantizes alone
    to the same values. F32 tensors go to `original`, which returns a view of the file's bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType

    def dequantize(data, qtype):
        if data.ndim < 2 or data.shape[0] <= rows or qtype == GGMLQuantizationType.F32:
            return original(data, qtype)
        first = original(data[:rows], qtype)
        out = np.empty((data.shape[0], *first.shape[1:]), first.dtype)
        out[:rows] = first
        for start in range(rows, data.shape[0], rows):
            out[start : start + rows] = original(data[start : start + rows], qtype)
        return out

    return dequantize


# --- onnxruntime: the transformer optimizer's lookups ----------------------------------------------

# The model methods that change nodes or names: each forgets the maps the lookups below keep.
_INVALIDATING = (
    "add_node",
    "add_nodes",
    "remove_node",
    "remove_nodes",
    "replace_output_of_all_nodes",
    "update_graph",
    "prune_graph",
    "topological_sort",
    "remove_unused_constant",
    "remove_useless_cast_nodes",
    "remove_cascaded_cast_nodes",
    "clean_graph",
    "rename_graph_output",
    "add_prefix_to_names",
)

# BertOnnxModel.optimize's passes in the order it runs them, for the progress line.
OPTIMIZER_PASSES = (
    "remove_useless_cast_nodes",
    "fuse_constant_fold",
    "fuse_layer_norm",
    "fuse_simplified_layer_norm",
    "fuse_gelu",
    "preprocess",
    "fuse_reshape",
    "fuse_skip_layer_norm",
    "fuse_skip_simplified_layer_norm",
    "fuse_rotary_embeddings",
    "fuse_attention",
    "fuse_shape",
    "postprocess",
    "fuse_bias_gelu",
    "fuse_add_bias_skip_layer_norm",
    "remove_unused_constant",
    "topological_sort",
)


class _FastLookups:
    """The answers of OnnxModel's lookups for a graph without subgraphs (every decoder export), from
    loops that run once over the node list instead of a walk of the graph per call; a graph with
    subgraphs gets the base class's own. Mixed in before the base class (`fast_model_class`)."""

    _outputs = None  # output_name_to_node(), kept until a node changes
    _readers = None  # input_name_to_nodes(), held through the rotary pass, which changes no node until it ends
    _renamed = None  # the readers of each name, kept up to date through the useless-Cast pass's renames
    progress = staticmethod(lambda doing, fraction=None: None)

    def _flat(self):
        return len(self.graphs()) == 1

    def output_name_to_node(self, exclude_subgraphs=False):
        if exclude_subgraphs:
            return super().output_name_to_node(exclude_subgraphs)
        if self._outputs is None:
            self._outputs = super().output_name_to_node()
        return dict(self._outputs)  # a copy: some fusions edit the map they are given

    def nodes(self):
        return list(self.model.graph.node) if self._flat() else super().nodes()

    def get_nodes_by_op_type(self, op_type):
        if not self._flat():
            return super().get_nodes_by_op_type(op_type)
        return [node for node in self.model.graph.node if node.op_type == op_type]

    def input_name_to_nodes(self, exclude_subgraphs=False):
        if not self._flat():
            return super().input_name_to_nodes(exclude_subgraphs)
        readers = {}
        for node in self.model.graph.node:
            for name in node.input:
                if name:
                    readers.setdefault(name, []).append(node)
        return readers

    def get_graph_by_node(self, node):
        return self.model.graph if self._flat() else super().get_graph_by_node(node)

    def get_children(self, node, input_name_to_nodes=None, output_index=None):
        return super().get_children(node, input_name_to_nodes or self._readers, output_index)

    def fuse_rotary_embeddings(self, *args, **kwargs):
        # Its fusion asks get_children(), without a map, about every node of many paths. Until it
        # removes and adds nodes at its end (methods that forget the map), its calls only collect
        # nodes, so one map answers them all.
        self._readers = self.input_name_to_nodes()
        try:
            return super().fuse_rotary_embeddings(*args, **kwargs)
        finally:
            self._readers = None

    def fuse_skip_layer_norm(self, *args, **kwargs):
        # It starts from LayerNormalization nodes, after a symbolic shape inference of the whole graph;
        # on a graph without any (RMS-norm models) it would change nothing.
        if self._flat() and not self.get_nodes_by_op_type("LayerNormalization"):
            return None
        return super().fuse_skip_layer_norm(*args, **kwargs)

    def remove_node(self, node):
        if not self._flat():
            return super().remove_node(node)
        try:
            self.model.graph.node.remove(node)  # the base class first asks `node in graph.node`: a second walk
        except ValueError:
            super().remove_node(node)  # its warning

    def replace_input_of_all_nodes(self, old_input_name, new_input_name):
        if not self._flat():
            return super().replace_input_of_all_nodes(old_input_name, new_input_name)
        if self._renamed is None:
            readers = [node for node in self.model.graph.node if old_input_name in node.input]
        else:  # the nodes that read the name, and from now on read the new one
            readers = self._renamed.pop(old_input_name, [])
            self._renamed.setdefault(new_input_name, []).extend(readers)
        for node in readers:
            self.replace_node_input(node, old_input_name, new_input_name)

    def remove_useless_cast_nodes(self):
        # It renames the inputs of all nodes once per Cast it removes, each a walk over the graph; a
        # map of the readers of each name, renamed with them, finds the same nodes. A removed Cast
        # stays among its input's readers, where renaming it again changes nothing.
        if self._flat():
            self._renamed = self.input_name_to_nodes()
        try:
            return super().remove_useless_cast_nodes()
        finally:
            self._renamed = None


def fast_model_class(base):
    """`base` (an onnxruntime.transformers OnnxModel class) with the lookups of `_FastLookups`, the
    maps forgotten by every method that changes nodes, and `progress` told of each pass."""
    model_class = type(f"Fast{base.__name__}", (_FastLookups, base), {})
    for name in _INVALIDATING:
        if hasattr(base, name):
            setattr(model_class, name, _forgetting(getattr(model_class, name)))
    for index, name in enumerate(OPTIMIZER_PASSES):
        if hasattr(base, name):
            setattr(model_class, name, _reported(getattr(model_class, name), name, index))
    return model_class


def _reported(method, name: str, index: int):
    def call(self, *args, **kwargs):
        self.progress(f"optimizer: {name.removeprefix('fuse_').replace('_', ' ')}", index / len(OPTIMIZER_PASSES))
        return method(self, *args, **kwargs)

    call.__name__ = name
    return call


def _forgetting(method):
    def call(self, *args, **kwargs):
        self._outputs = self._readers = None
        try:
            return method(self, *args, **kwargs)
        finally:
            self._outputs = self._readers = None

    call.__name__ = method.__name__
    return call


# --- onnxruntime: shape inference of the linear-attention ops ----------------------------------------

_SHAPES = threading.Lock()  # the patch is process-wide: one optimizer run uses it at a time
# Each op's outputs and the input whose shape and type each takes: (output index, input index).
_STATE_OP_SHAPES = {"LinearAttention": ((0, 2), (1, 3)), "CausalConvWithState": ((0, 0), (1, 3))}


@contextmanager
def state_op_shapes():
    """While ONNX Runtime's transformer optimizer runs, its symbolic shape inference knows
    LinearAttention's and CausalConvWithState's output shapes (each output has one input's shape
    and type). It knows no such op, gives up on the whole graph, and its fusions that need shapes
    (skip + RMS norm) then leave a hybrid model's graph alone."""
    from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInferenceHelper

    # the optimizer's helper derives from the module as its own path imports it (symbolic_shape_infer,
    # not onnxruntime.tools.symbolic_shape_infer): a class of its own
    inference = SymbolicShapeInferenceHelper.__mro__[1]

    def with_state_ops(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            for op, pairs in _STATE_OP_SHAPES.items():
                self.dispatcher_[op] = lambda node, pairs=pairs, self=self: [
                    self._propagate_shape_and_type(node, source, output) for output, source in pairs
                ]

        return __init__

    with _SHAPES:  # the original is read under the lock: another run may have patched it until now
        original = inference.__init__
        inference.__init__ = with_state_ops(original)
        try:
            yield
        finally:
            inference.__init__ = original


_NORMS = threading.Lock()  # the patches are process-wide: one optimizer run uses each at a time
_QUICK_GELU = threading.Lock()


@contextmanager
def weighted_norms_only():
    """While ONNX Runtime's transformer optimizer runs, its RMS norm fusion fuses a norm only where
    the Mul it takes as the norm's scale multiplies by a weight (an initializer): otherwise the Mul
    is the model's own product of the norm's output and another activation, which the fused norm
    would take as its weight, read before it is made."""

    def activations_only(self, node) -> bool:
        return node.op_type == "Mul" and not any(self.model.get_initializer(name) is not None for name in node.input)

    with _fusion_skipping(_optimizer_class("FusionSimplifiedLayerNormalization"), activations_only, _NORMS):
        yield


@contextmanager
def scalar_quick_gelu_only():
    """While ONNX Runtime's transformer optimizer runs, its QuickGelu fusion (x * sigmoid(alpha * x))
    is tried only where the Mul under the Sigmoid takes one number: it reads that input with
    `.item()`, which raises on a vector of scales (Dory's attention gate, x * sigmoid(x * s^2)) and
    on an input that is not a constant."""

    def not_one_number(self, node) -> bool:
        path = self.model.match_parent_path(node, ["Sigmoid", "Mul"], [1, 0]) if node.op_type == "Mul" else None
        if path is None:
            return False
        scale = self.model.get_constant_value(path[1].input[1])
        return scale is None or scale.size != 1

    with _fusion_skipping(_optimizer_class("FusionQuickGelu"), not_one_number, _QUICK_GELU):
        yield


def _optimizer_class(name: str):
    """A fusion class as the optimizer's own modules import it (fusion_quickgelu, not
    onnxruntime.transformers.fusion_quickgelu): read off the module that calls it."""
    from onnxruntime.transformers.onnx_model_gpt2 import Gpt2OnnxModel

    return getattr(sys.modules[Gpt2OnnxModel.__mro__[1].__module__], name)


@contextmanager
def _fusion_skipping(fusion, skip, lock: threading.Lock):
    """`fusion.fuse` left out for the nodes where `skip(fusion, node)` holds, put back after; the
    original is read under `lock`: another run may have patched it until now."""
    with lock:
        original = fusion.fuse

        def fuse(self, node, input_name_to_nodes, output_name_to_node):
            return None if skip(self, node) else original(self, node, input_name_to_nodes, output_name_to_node)

        fusion.fuse = fuse
        try:
            yield
        finally:
            fusion.fuse = original


# --- onnxruntime: the quantizer reads one weight at a time -----------------------------------------


def one_weight_at_a_time(node_quantizer, folder: Path) -> None:
    """Make `node_quantizer` (MatMulNBitsQuantizer's) read a node's weight from `folder`'s data file
    for the time it quantizes that node: the tensor's file reference is made absolute meanwhile, so
    that the quantizer's reader (onnx_ir) maps the bytes from the file instead of copying them, and
    the pages are let go with the mapping. The quantizer otherwise expects every weight loaded
    into the graph, each then held twice while it is quantized."""
    from onnx.external_data_helper import uses_external_data
    from onnxruntime.quantization.matmul_nbits_quantizer import get_initializer

    from .stream import is_deferred

    quantize = node_quantizer.quantize

    def one_weight(node, graph_stack):
        weight = get_initializer(node.input[1], graph_stack)[0] if len(node.input) > 1 else None
        if weight is None or not uses_external_data(weight):
            return quantize(node, graph_stack)
        if is_deferred(weight):
            return quantized_deferred(quantize, node, graph_stack, weight, folder)
        (location,) = [entry for entry in weight.external_data if entry.key == "location"]
        relative, location.value = location.value, str(Path(folder).resolve() / location.value)
        try:
            return quantize(node, graph_stack)
        finally:
            location.value = relative

    node_quantizer.quantize = one_weight


def one_weight_loaded(node_quantizer, folder: Path) -> None:
    """Make `node_quantizer` (the HQQ quantizer's) find a node's weight loaded into the graph for
    the time it quantizes that node, and let it go after: one fp32 weight in memory at a time."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data
    from onnxruntime.quantization.matmul_nbits_quantizer import get_initializer

    from .stream import is_deferred

    quantize = node_quantizer.quantize

    def one_weight(node, graph_stack):
        weight = get_initializer(node.input[1], graph_stack)[0] if len(node.input) > 1 else None
        if weight is None or not uses_external_data(weight):
            return quantize(node, graph_stack)
        if is_deferred(weight):
            return quantized_deferred(quantize, node, graph_stack, weight)
        reference = onnx.TensorProto()
        reference.CopyFrom(weight)
        load_external_data_for_tensor(weight, str(folder))
        weight.data_location = onnx.TensorProto.DEFAULT
        del weight.external_data[:]
        try:
            return quantize(node, graph_stack)
        finally:
            weight.CopyFrom(reference)

    node_quantizer.quantize = one_weight


def write_as_made(node_quantizer, path: Path) -> None:
    """Make `node_quantizer` write the tensors each node's quantizing adds (its blocks, scales,
    zero points) to the file `path` as they are made, the graph taking only a reference to them
    there: a model's quantized weights are never all in memory (a message's bytes stay in its
    arena until the whole graph goes, cleared or not). `save_graph` copies them into the
    export's data file; the caller removes `path`."""
    from onnxruntime.quantization import matmul_nbits_quantizer as module

    quantize = node_quantizer.quantize

    def written(node, graph_stack):
        original = module.get_initializer

        def get_initializer(name, graph_path):
            found, graph = original(name, graph_path)
            return found, (_WrittenAsAdded(graph, path) if found is not None else graph)

        module.get_initializer = get_initializer
        try:
            return quantize(node, graph_stack)
        finally:
            module.get_initializer = original

    node_quantizer.quantize = written


class _WrittenAsAdded:
    """A graph whose `initializer.extend` writes each tensor's bytes (1 KiB or more) to `path`
    first, so that the graph's message holds a reference to them, not the bytes."""

    def __init__(self, graph, path: Path):
        self._graph, self._path = graph, path

    def __getattr__(self, name):
        return getattr(self._graph, name)

    @property
    def initializer(self):
        return self

    def extend(self, tensors) -> None:
        from .stream import refer

        with open(self._path, "ab") as out:
            for tensor in tensors:
                if tensor.HasField("raw_data") and len(tensor.raw_data) >= 1024:
                    offset = out.tell()
                    out.write(tensor.raw_data)
                    refer(tensor, self._path.name, offset, out.tell() - offset)
        self._graph.initializer.extend(tensors)

    def __iter__(self):
        return iter(self._graph.initializer)


_MADE_APART = "deferred.partial"  # a deferred weight made for the node that quantizes it


def quantized_deferred(quantize, node, graph_stack, weight, folder: Path | None = None):
    """`quantize(node, graph_stack)` with the node's deferred `weight` (export/stream.py) made for
    the time it takes, then let go where the node no longer reads it. With `folder`, the weight is
    written to a file there, which the quantizer's reader maps (one copy of it, in the page cache,
    where a message of its own held its bytes, and the array they were made from, beside it)."""
    from .stream import forget, standalone, written_apart

    path = Path(folder).resolve() / _MADE_APART if folder is not None else None
    try:
        with initializer_standing_in(written_apart(weight, path) if path else standalone(weight)):
            quantized = quantize(node, graph_stack)
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
    if not any(weight.name in new.input for new in quantized):  # quantized, not left as it was
        forget(weight)
    return quantized


@contextmanager
def initializer_standing_in(tensor):
    """ONNX Runtime's quantizer finds `tensor` (a message of its own) for the graph's initializer
    of its name meanwhile: a deferred weight (export/stream.py), made for the time it is quantized.
    Put into the graph's own message, its bytes would stay there until the whole graph goes."""
    from onnxruntime.quantization import matmul_nbits_quantizer as module

    original = module.get_initializer

    def get_initializer(name, graph_path):
        found, graph = original(name, graph_path)
        return (tensor, graph) if found is not None and name == tensor.name else (found, graph)

    module.get_initializer = get_initializer
    try:
        yield
    finally:
        module.get_initializer = original
