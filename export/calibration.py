"""What a quantizer learns from a calibration text: the inputs each MatMul sees over it, their
channels' mean square (llama.cpp's importance matrix) for k_quant, their product X^T X (the Hessian
of the layer's error) for GPTQ. Each input's rows are kept on disk (a file per input and pass,
float16 where it holds them) so that a large model's activations never sit in memory together,
and read back when its MatMuls are quantized. Two ways to take them, over windows of `WINDOW`
tokens each from an empty cache (as the quality measure runs):

- `collect`: the export's own graph runs the text, every MatMul's input added as an output (a
  model exported whole: the graph it ships, fp16 included).
- `collect_from_model`: PyTorch runs it on the loaded model, hooks on its `nn.Linear`s keeping
  their inputs by parameter name (a streamed export, which never writes the fp32 graph). The
  quantizer reads them under the graph's MatMul input names (`with_sources`).

"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import onnx

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.cache_kinds import cache_kinds
from edgeinfer.sdk.manifest import load_manifest
from edgeinfer.sdk.runtime import Graph

from .graphs import GRAPH_FILE

# The default calibration text: chat turns, tool calls, code, prose, lists and worked problems, in
# several languages (about 4,800 tokens for SmolLM2). Neither text the quality is scored on
# (quality_text.txt, held_text.txt) is in it.
CALIBRATION_TEXT = Path(__file__).with_name("calibration_text.txt")
WINDOW = 256
_GRAPH = "calibration.onnx"  # the export's graph with the MatMuls' inputs as outputs, while it runs


class Activations:
    """The rows each MatMul input took over the calibration text, by input name (or, taken from
    PyTorch, by parameter name), in `folder`; `aliases` maps other names to those: a MatMul input
    to the parameter its weight is made from, a parameter to the one whose input it shares."""

    def __init__(self, folder: Path, names: list[str], aliases: dict[str, str] | None = None):
        self.folder, self.names, self.aliases = Path(folder), names, dict(aliases or {})

    def rows(self, name: str) -> np.ndarray | None:
        """[tokens, channels] float32, or None for an input the text did not reach."""
        while name in self.aliases:
            name = self.aliases[name]
        if name not in self.names:
            return None
        parts = sorted(self.folder.glob(f"{self.names.index(name):04d}-*.npy"))
        return np.concatenate([_read_rows(p) for p in parts]) if parts else None

    def with_sources(self, sources: dict[str, list[str]]) -> "Activations":
        """These rows read also under the MatMul input names `sources` maps to the parameters their
        weights are made from (a packed weight's parts share their input: the first kept is read)."""
        aliases = dict(self.aliases)
        for name, parameters in sources.items():
            kept = [p for p in parameters if self.aliases.get(p, p) in self.names]
            if kept and name not in self.names:
                aliases[name] = kept[0]
        return Activations(self.folder, self.names, aliases)

    def importance(self, name: str) -> np.ndarray | None:
        rows = self.rows(name)
        return None if rows is None else np.mean(rows * rows, axis=0)

    def hessian(self, name: str) -> np.ndarray | None:
        rows = self.rows(name)
        return None if rows is None else (rows.T @ rows) / len(rows)


def collect(export: Path, ids: list[int], scratch: Path) -> Activations:
    """Run the fp32 export in `export` over `ids` and keep each MatMul input's rows in `scratch`."""
    manifest = load_manifest(export)
    if len(ids) < 2:
        raise ExportError("the calibration text is empty: give --calibration a file of the text the model will see")
    element = onnx.TensorProto.FLOAT16 if manifest.kv.dtype == "float16" else onnx.TensorProto.FLOAT
    names = _matmul_inputs(export / GRAPH_FILE, export / _GRAPH, element)
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        graph = Graph(export / _GRAPH, "cpu", None)
        for part, start in enumerate(range(0, len(ids), WINDOW)):
            window = ids[start : start + WINDOW]
            _, outputs = graph.run(window_feeds(graph, manifest, window), on_device=[], to_host=names)
            for index, name in enumerate(names):
                save_rows(scratch, index, part, outputs[name])
    finally:
        (export / _GRAPH).unlink(missing_ok=True)
    return Activations(scratch, names)


def _matmul_inputs(source: Path, target: Path, element: int) -> list[str]:
    """The activations MatMuls with a constant weight read, written as outputs of a copy of the graph."""
    model = onnx.load(str(source), load_external_data=False)
    constants = {t.name for t in model.graph.initializer}
    names = list(dict.fromkeys(n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in constants))
    outputs = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_tensor_value_info(name, element, None) for name in names if name not in outputs)
    onnx.save(model, str(target))
    return names


def window_feeds(graph: Graph, manifest, window: list[int], logits: int = 1) -> dict[str, np.ndarray]:
    """One window from an empty cache, with the logits of its last `logits` positions: a slot cache
    (written in place) as long as the window, or a growing cache's empty past, and zero states."""
    kv = manifest.kv
    feeds = {
        "input_ids": np.array([window], np.int64),
        "attention_mask": np.ones((1, len(window)), np.int64),
        "logits_to_keep": np.array(logits, np.int64),
    }
    feeds = {name: value for name, value in feeds.items() if name in graph.inputs}
    if "position_ids" in graph.inputs:  # [1, sequence], or [3, 1, sequence] for 3-D rotary (text: three equal rows)
        axes = len(graph.inputs["position_ids"].shape)
        feeds["position_ids"] = np.broadcast_to(np.arange(len(window), dtype=np.int64), (3,) * (axes - 2) + (1, len(window))).copy()
    if "image_features" in graph.inputs:  # a vision-language model's text windows: no image features
        feeds["image_features"] = np.zeros((0, manifest.vision["hidden_size"]), graph.input_dtype("image_features"))
    length = len(window) if kv.in_place else 0
    dtype = np.float16 if kv.dtype == "float16" else np.float32
    declared = {name: value.shape for name, value in graph.inputs.items()}
    for kind in cache_kinds(kv, length):  # every buffer empty, a recurrent state at zero, as the runtime's
        feeds.update(
            {name: np.zeros(shape, dtype) for name, shape in kind.buffer_shapes(1, length, declared, kv.sequence_axis).items()}
        )
    return feeds


def save_rows(folder: Path, index: int, part: int, values) -> None:
    """Input `index`'s rows of one pass as the file INDEX-PART.npy: [tokens, channels], float16
    where it holds the values (half the disk), else bfloat16's bits as int16 where the rows are
    bfloat16 (a model run in its checkpoint's precision: as exact, in as little), else float32."""
    if not isinstance(values, np.ndarray):  # a torch tensor
        import torch

        if values.dtype == torch.bfloat16 and values.abs().max() >= _FLOAT16_MAX:
            np.save(folder / f"{index:04d}-{part:04d}.npy", values.reshape(-1, values.shape[-1]).view(torch.int16).numpy())
            return
        values = values.float().numpy()
    rows = np.asarray(values, np.float32).reshape(-1, values.shape[-1])
    np.save(folder / f"{index:04d}-{part:04d}.npy", rows.astype(np.float16) if np.abs(rows).max(initial=0) < _FLOAT16_MAX else rows)


_FLOAT16_MAX = 6e4  # rows below this are kept in float16


def _read_rows(path: Path) -> np.ndarray:
    """A file of `save_rows` as float32."""
    rows = np.load(path)
    if rows.dtype == np.int16:  # bfloat16's bits: the high half of a float32's
        return (rows.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return rows.astype(np.float32)


_PASS_TOKENS = 2048  # full windows batched into one PyTorch pass up to this many tokens


def collect_from_model(model, ids: list[int], scratch: Path) -> Activations:
    """Run the PyTorch `model` over `ids` in windows and keep each `nn.Linear`'s input rows in
    `scratch`, by its weight's parameter name; Linears fed the same tensor one after the other (q,
    k and v; gate and up) keep it once. Each module's own weights are let go of as it finishes
    (`stream.release_file_pages`: a checkpoint mapped in its own precision stays a file, read
    again where a later pass needs it), so the model is never resident whole."""
    import torch

    if len(ids) < 2:
        raise ExportError("the calibration text is empty: give --calibration a file of the text the model will see")
    scratch.mkdir(parents=True, exist_ok=True)
    keeper = _InputKeeper(model, scratch)
    accepts = "logits_to_keep" in inspect.signature(model.forward).parameters
    with keeper, torch.no_grad():
        for batch in _passes(ids):
            model(torch.tensor(batch), use_cache=False, **({"logits_to_keep": 1} if accepts else {}))
            keeper.next_pass()
    return Activations(scratch, keeper.names, keeper.aliases)


def _passes(ids: list[int]) -> list[list[list[int]]]:
    """The text's windows in passes: full windows together up to `_PASS_TOKENS`, a shorter last one alone."""
    windows = [ids[start : start + WINDOW] for start in range(0, len(ids), WINDOW)]
    full = [w for w in windows if len(w) == WINDOW]
    per_pass = max(1, _PASS_TOKENS // WINDOW)
    return [full[i : i + per_pass] for i in range(0, len(full), per_pass)] + [[w] for w in windows if len(w) < WINDOW]


class _InputKeeper:
    """Meanwhile, hooks on `model`: each nn.Linear's input saved (`save_rows`) under its weight's
    name, and each module's own matrices let go of after its forward."""

    def __init__(self, model, scratch: Path):
        import torch

        from .stream import release_file_pages

        self.scratch, self.names, self.aliases, self.part = scratch, [], {}, 0
        self._last = (None, None)  # (the last input kept, its name): a sibling fed the same tensor is an alias
        named = {id(p): name for name, p in model.named_parameters()}
        self._handles = []
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
            if isinstance(module, torch.nn.Linear) and id(module.weight) in named:
                self._handles.append(module.register_forward_pre_hook(self._keeper(named[id(module.weight)])))
            if own:
                self._handles.append(module.register_forward_hook(self._releaser(own, release_file_pages)))

    def _keeper(self, name: str):
        def keep(module, args):
            x = args[0]
            if self._last[0] is x and self._last[1] != name:
                self.aliases[name] = self._last[1]
                return
            if name not in self.names:
                self.names.append(name)
            save_rows(self.scratch, self.names.index(name), self.part, x.detach())
            self._last = (x, name)

        return keep

    @staticmethod
    def _releaser(own: list, release):
        def let_go(*_):  # returns None: a forward hook's result would replace the module's output
            for parameter in own:
                release(parameter)

        return let_go

    def next_pass(self) -> None:
        self.part, self._last = self.part + 1, (None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
