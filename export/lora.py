"""LoRA adapters: read from a PEFT folder, written beside an export, served as inputs of a second graph.

An adapter adds `x @ A @ B * scale` to a projection's output. Export keeps the base graph as it is
(`model.onnx`) and writes `model.lora.N.onnx` (N adapters) beside it, on the same weights file:
each projection an adapter targets gains that term, with A and B graph inputs of one per row
([rows, in, rank] and [rows, rank, out]; [1, ...] broadcasts, for a pass of one row), so rows of
different adapters run in one pass, and zeros are the base model (sdk/adapters.py). Projections
the export packed into one MatMul (q, k and v; gate and up) take one term whose A is the parts' A
side by side and whose B is block-diagonal. Each adapter is one small file, `adapter.NAME.npz`: for every target its A
[in, rank] and B [rank, out], the scale folded into B.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import GraphSpec, adapter_file, check_adapter_name, lora_graph_file

from .graphs import GRAPH_FILE
from .quantize import LAYER, matmul_role

_PROJECTIONS = ("MatMul", "MatMulNBits")


@dataclass(frozen=True)
class Target:
    """A projection of the export's graph that an adapter can change: its key (the graph's inputs
    are `lora.KEY.a` and `lora.KEY.b`), its layer, and the modules it computes, each as (module,
    first output column, width); `fan_in` and `fan_out` are its input and output widths."""

    key: str
    layer: int | None
    parts: tuple[tuple[str, int, int], ...]
    fan_in: int
    fan_out: int


@dataclass
class PeftAdapter:
    """A PEFT LoRA adapter: for each module it changes, (A [rank, in], B [out, rank], scale)."""

    folder: Path
    modules: dict[str, tuple[np.ndarray, np.ndarray, float]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.modules.values())


# The graph's side.


def _unquantized(node_name: str) -> str:
    """The MatMul's name before the quantizer suffixed its bits: /model/layers.0/mlp/down_proj/MatMul_Q4."""
    return re.sub(r"_Q\d+$", "", node_name)


def target_key(node_name: str) -> str:
    """/model/layers.0/mlp/gate_up_proj/MatMul_Q4 is model.layers.0.mlp.gate_up_proj."""
    return ".".join(part for part in _unquantized(node_name).split("/") if part and part != "MatMul")


def graph_targets(graph: onnx.GraphProto) -> dict[str, Target]:
    """Every projection of the graph (a MatMul or MatMulNBits by a constant weight), by key."""
    constants = {t.name: t for t in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    targets = {}
    for node in graph.node:
        if node.op_type not in _PROJECTIONS or len(node.input) < 2 or node.input[1] not in constants:
            continue
        fan_in, fan_out = _shape(node, constants[node.input[1]])
        key = target_key(node.name)
        layer, module = matmul_role(_unquantized(node.name))
        widths = _part_widths(consumers.get(node.output[0], []), constants, fan_out)
        modules = _part_modules(module, len(widths))
        if len(modules) != len(widths):
            modules, widths = [module], [fan_out]
        offsets = np.cumsum([0, *widths[:-1]]).tolist()
        targets[key] = Target(key, layer, tuple(zip(modules, offsets, widths)), fan_in, fan_out)
    return targets


def _shape(node, weight: onnx.TensorProto) -> tuple[int, int]:
    if node.op_type == "MatMulNBits":
        attributes = {a.name: a.i for a in node.attribute}
        return attributes["K"], attributes["N"]
    return int(weight.dims[0]), int(weight.dims[1])


def _part_widths(consumers: list, constants: dict, fan_out: int) -> list[int]:
    """The widths of the modules a packed projection computes: its Split's sizes, or
    GroupQueryAttention's query, key and value widths; one part otherwise."""
    for node in consumers:
        if node.op_type == "Split" and len(node.input) > 1 and node.input[1] in constants:
            return onnx.numpy_helper.to_array(constants[node.input[1]]).astype(int).tolist()
        if node.op_type == "GroupQueryAttention" and node.input[0] and len(consumers) == 1:
            attributes = {a.name: a.i for a in node.attribute}
            heads, kv_heads = attributes["num_heads"], attributes["kv_num_heads"]
            head = fan_out // (heads + 2 * kv_heads)
            if head * (heads + 2 * kv_heads) == fan_out:
                return [heads * head, kv_heads * head, kv_heads * head]
    return [fan_out]


def _part_modules(module: str, count: int) -> list[str]:
    """The modules a packed projection's name joins: gate_up_proj is gate_proj and up_proj, qkv_proj
    (of single letters) q_proj, k_proj and v_proj."""
    if count == 1 or not module.endswith("_proj"):
        return [module]
    stem = module.removesuffix("_proj")
    parts = stem.split("_") if "_" in stem else list(stem)
    return [f"{part}_proj" for part in parts]


# The adapter's side.


def read_peft(folder: str | Path) -> PeftAdapter:
    """A PEFT LoRA adapter folder (what `PeftModel.save_pretrained` writes); what edgeinfer cannot
    serve is refused with the reason."""
    folder = Path(folder).expanduser()
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise ExportError(
            f"{folder} is not a PEFT adapter folder (no adapter_config.json): pass the folder that `PeftModel.save_pretrained` wrote"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{config_path} is not valid JSON ({e}): save the adapter again") from None
    _check_config(folder, config)
    weights = _read_weights(folder)
    embedding = next((key for key in weights if ".lora_embedding_" in key), None)
    if embedding is not None:
        raise ExportError(
            f"adapter {folder} changes an embedding ({embedding.split('.lora_embedding')[0]}), which edgeinfer's graphs do not "
            "take as an input: train the adapter on the attention and MLP projections only"
        )
    modules = {}
    for key in weights:
        if ".lora_A." not in key:
            if ".lora_B." in key or ".lora_magnitude_vector" in key:
                continue
            raise ExportError(f"adapter {folder} holds {key}, which is not a LoRA weight: edgeinfer serves plain LoRA adapters")
        module = _module_name(key.split(".lora_A.")[0])
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in weights:
            raise ExportError(f"adapter {folder} has {key} but no {b_key}: the adapter file is damaged, save it again")
        a, b = weights[key].astype(np.float32), weights[b_key].astype(np.float32)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ExportError(
                f"adapter {folder}: {module}'s A {list(a.shape)} and B {list(b.shape)} do not make a LoRA pair "
                "(A [rank, in], B [out, rank]): save the adapter again"
            )
        modules[module] = (a, b, _scale(config, module, a.shape[0]))
    if not modules:
        raise ExportError(f"adapter {folder} holds no LoRA weights: save the adapter again after training it")
    return PeftAdapter(folder, modules)


def _check_config(folder: Path, config: dict) -> None:
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ExportError(f"adapter {folder} is a {kind} adapter: edgeinfer serves LoRA adapters (peft_type LORA)")
    if config.get("use_dora"):
        raise ExportError(f"adapter {folder} is DoRA (use_dora), whose weight norm the graphs do not compute: train a plain LoRA")
    if config.get("modules_to_save"):
        raise ExportError(
            f"adapter {folder} trains whole modules ({', '.join(config['modules_to_save'])}; modules_to_save), which cannot "
            "change per request on one copy of the base: train it without modules_to_save"
        )
    if config.get("bias", "none") != "none":
        raise ExportError(f"adapter {folder} trains biases (bias {config['bias']!r}): train it with bias='none'")


def _read_weights(folder: Path) -> dict[str, np.ndarray]:
    if (folder / "adapter_model.safetensors").is_file():
        from safetensors.numpy import load_file

        try:
            return load_file(str(folder / "adapter_model.safetensors"))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own kinds on a damaged file
            raise ExportError(f"{folder / 'adapter_model.safetensors'} cannot be read ({e}): save the adapter again") from None
    if (folder / "adapter_model.bin").is_file():
        import torch

        state = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise ExportError(f"{folder} has no adapter_model.safetensors or adapter_model.bin: save the adapter again")


def _module_name(path: str) -> str:
    """base_model.model.model.layers.0.self_attn.q_proj is model.layers.0.self_attn.q_proj."""
    return path.removeprefix("base_model.model.")


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling: alpha / rank (alpha / sqrt(rank) with use_rslora), alpha from alpha_pattern
    where a pattern names the module."""
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            alpha = float(value)
    return alpha / (rank**0.5 if config.get("use_rslora") else rank)


def adapter_arrays(adapter: PeftAdapter, targets: dict[str, Target]) -> dict[str, np.ndarray]:
    """The adapter as the graph takes it: for each target it changes, `KEY.a` [in, rank] (the parts'
    A side by side) and `KEY.b` [rank, out] (block-diagonal, the scale folded in)."""
    by_part = {}
    for target in targets.values():
        for module, first, width in target.parts:
            by_part[(target.layer, module)] = (target, first, width)
    chosen: dict[str, list] = {}
    for module, (a, b, scale) in adapter.modules.items():
        layer, leaf = _module_role(module)
        if (layer, leaf) not in by_part:
            known = sorted({m for t in targets.values() for m, _, _ in t.parts})
            raise ExportError(
                f"adapter {adapter.folder} changes {module}, a module this export cannot serve: adapters may target {', '.join(known)}"
            )
        target, first, width = by_part[(layer, leaf)]
        if a.shape[1] != target.fan_in or b.shape[0] != width:
            raise ExportError(
                f"adapter {adapter.folder} does not fit this base model: its {module} maps {a.shape[1]} to {b.shape[0]} "
                f"features, the base's {target.fan_in} to {width}; pass the adapter trained for this base"
            )
        chosen.setdefault(target.key, []).append((a, b * scale, first, width))
    arrays = {}
    for key, parts in chosen.items():
        target, rank = targets[key], sum(a.shape[0] for a, _, _, _ in parts)
        packed_a, packed_b, row = np.zeros((target.fan_in, rank), np.float32), np.zeros((rank, target.fan_out), np.float32), 0
        for a, b, first, width in parts:
            packed_a[:, row : row + a.shape[0]] = a.T
            packed_b[row : row + a.shape[0], first : first + width] = b.T
            row += a.shape[0]
        arrays[f"{key}.a"], arrays[f"{key}.b"] = packed_a, packed_b
    return arrays


def _module_role(module: str) -> tuple[int | None, str]:
    """(layer, last name) of a module path: model.layers.3.mlp.down_proj is (3, down_proj)."""
    found = re.search(rf"(?:^|\.){LAYER}\.", module)
    return (int(found.group(1)) if found else None), module.rsplit(".", 1)[-1]


def write_adapter(folder: Path, name: str, arrays: dict[str, np.ndarray]) -> str:
    """Write the adapter's file into the export folder; its name."""
    file = adapter_file(name)
    with open(folder / file, "wb") as f:
        np.savez(f, **arrays)
    return file


# The adapters' graph.


def write_lora_graph(folder: Path, keys: list[str], dtype: str, file: str) -> GraphSpec:
    """`file`: the export's graph (on its weights file) with a LoRA term on each target in `keys`,
    from inputs `lora.KEY.a` [rows, in, rank] and `lora.KEY.b` [rows, rank, out] (rows: the pass's
    rows, or 1 for all of them)."""
    model = onnx.load(str(folder / GRAPH_FILE), load_external_data=False)
    graph = model.graph
    element = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    targets = graph_targets(graph)
    by_key = {target_key(n.name): n for n in graph.node if n.op_type in _PROJECTIONS}
    nodes = []
    for node in graph.node:
        nodes.append(node)
        key = target_key(node.name) if node.op_type in _PROJECTIONS else None
        if key in keys and by_key.get(key) is node:
            nodes.extend(_lora_term(node, key))
            target = targets[key]
            graph.input.extend(
                [
                    helper.make_tensor_value_info(f"lora.{key}.a", element, ["adapter_rows", target.fan_in, f"rank_{key}"]),
                    helper.make_tensor_value_info(f"lora.{key}.b", element, ["adapter_rows", f"rank_{key}", target.fan_out]),
                ]
            )
    missing = sorted(set(keys) - {target_key(n.name) for n in nodes if n.op_type in _PROJECTIONS})
    if missing:
        raise ExportError(f"the export's graph has no projection {', '.join(missing)}: export the base model again")
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(folder / file))
    return GraphSpec(file, [i.name for i in graph.input], [o.name for o in graph.output])


def _lora_term(node, key: str) -> list:
    """Nodes that add the row's LoRA term to `node`'s output, under the output's own name."""
    x, out, base = node.input[0], node.output[0], f"{node.output[0]}_base"
    node.output[0] = base
    name = f"edgeinfer_lora_{key}"
    return [
        helper.make_node("MatMul", [x, f"lora.{key}.a"], [f"{name}_xa"], name=f"{name}_down"),
        helper.make_node("MatMul", [f"{name}_xa", f"lora.{key}.b"], [f"{name}_delta"], name=f"{name}_up"),
        helper.make_node("Add", [base, f"{name}_delta"], [out], name=f"{name}_add"),
    ]


# Adding adapters to an export.


def peft_reference(model, adapter_folder: Path, ids: list[int], new_tokens: int):
    """PEFT's Reference (validate.py) for `ids` with the adapter on `model`, which is left as it was."""
    from peft import PeftModel

    from .validate import torch_reference

    wrapped = PeftModel.from_pretrained(model, str(adapter_folder))
    try:
        return torch_reference(wrapped.eval(), ids, new_tokens)
    finally:
        wrapped.unload()  # the base modules back in place, the adapter's layers gone


def add_adapters(folder: Path, manifest, adapters: dict[str, PeftAdapter], references: dict) -> tuple:
    """Write `adapters` (by name) into the export `folder` beside those it has, rebuild its
    adapters' graph for all of them, and check each new one against its PEFT reference; returns
    the manifest to save (files not yet described) and each adapter's check."""
    import dataclasses

    from edgeinfer.sdk.manifest import ADAPTERS_FORMAT_VERSION

    if manifest.prefill is not None:
        raise ExportError("the split layout (--graphs split) takes no adapters: export the base with the default layout")
    taken = sorted(set(adapters) & set(manifest.adapters))
    if taken:
        raise ExportError(f"the export already has an adapter named {taken[0]}: pick another --name, or export the base again")
    targets = graph_targets(onnx.load(str(folder / GRAPH_FILE), load_external_data=False).graph)
    entries = dict(manifest.adapters)
    for name, adapter in adapters.items():
        checked_name(name)
        arrays = adapter_arrays(adapter, targets)
        entries[name] = {
            "file": write_adapter(folder, name, arrays),
            "source": str(adapter.folder),
            "rank": adapter.rank,
            "modules": sorted(adapter.modules),
            # each target's [in, rank, out]
            "targets": {key: [targets[key].fan_in, arrays[f"{key}.a"].shape[1], targets[key].fan_out] for key in _keys(arrays)},
        }
    keys = sorted({key for entry in entries.values() for key in entry["targets"]})
    spec = write_lora_graph(folder, keys, manifest.dtype, lora_graph_file(len(entries)))
    version = max(manifest.format_version, ADAPTERS_FORMAT_VERSION)
    manifest = dataclasses.replace(manifest, lora=spec, adapters=entries, format_version=version)
    manifest.save(folder)
    checks = {name: _checked(folder, name, references[name], manifest) for name in adapters}
    for name, check in checks.items():
        entries[name]["check"] = check
    return manifest, checks


def _keys(arrays: dict[str, np.ndarray]) -> list[str]:
    """The targets an adapter's arrays (`KEY.a`, `KEY.b`) change."""
    return sorted(name.removesuffix(".a") for name in arrays if name.endswith(".a"))


def checked_name(name: str) -> str:
    """`name`, where it can name an adapter (an ExportError otherwise)."""
    from edgeinfer.sdk.errors import ManifestError

    try:
        return check_adapter_name(name)
    except ManifestError as e:
        raise ExportError(str(e)) from None


def _checked(folder: Path, name: str, reference, manifest) -> dict:
    """The adapter's greedy tokens and logits against PEFT's, and a batch against single prompts.
    An export of fp32 or fp16 weights must match within the base's own tolerance; a quantized
    base's figures are recorded (its logits differ from PEFT's fp32 ones by the quantization as much
    as by the adapter, and its 4-bit kernels round a batch's rows apart from a single row's)."""
    from .check import check_against

    result = check_against(folder, reference, adapter=name)
    check = {
        "max_abs_diff_prefill": result.max_abs_diff_prefill,
        "max_abs_diff_decode": result.max_abs_diff_decode,
        "max_abs_diff_extend": result.max_abs_diff_extend,
        "tolerance": result.tolerance,
        "tokens_equal": result.tokens_equal,
        "batch_rows_equal_single": result.batch_rows_equal_single,
        "gated": not manifest.quantization,
    }
    if check["gated"] and not result.passed:
        raise ExportError(
            f"adapter {name} on this export differs from PEFT's: largest logits difference {result.worst:.3g} "
            f"(tolerance {result.tolerance:.3g}), greedy tokens {'equal' if result.tokens_equal else 'differ'}, batch rows "
            f"{'equal' if result.batch_rows_equal_single else 'differ from'} single prompts: this is a bug in edgeinfer, please "
            "report it with the adapter's adapter_config.json"
        )
    return check


def check_fits(adapter: PeftAdapter, model) -> None:
    """Refuse, before any work, an adapter trained for another base: a module the PyTorch model
    lacks, or one whose input and output widths differ from the adapter's A and B."""
    modules = dict(model.named_modules())
    for module, (a, b, _) in adapter.modules.items():
        found = modules.get(module)
        if found is None:
            raise ExportError(
                f"adapter {adapter.folder} changes {module}, which this model does not have: pass the adapter trained for this base"
            )
        fan_in, fan_out = getattr(found, "in_features", None), getattr(found, "out_features", None)
        if (fan_in, fan_out) != (a.shape[1], b.shape[0]):
            raise ExportError(
                f"adapter {adapter.folder} does not fit this base model: its {module} maps {a.shape[1]} to {b.shape[0]} "
                f"features, the base's {fan_in} to {fan_out}; pass the adapter trained for this base"
            )
