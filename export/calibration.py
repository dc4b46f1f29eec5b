"""What a quantizer learns from a calibration text: the inputs each MatMul sees over it, their
channels' mean square (llama.cpp's importance matrix) for k_quant, their product X^T X (the Hessian
of the layer's error) for GPTQ. The rows are summed as they come into a file per input
(`Activations`): what is kept grows with the model's widths, not with the text's length, and a
large model's never sit in memory together. Two ways to take them, over windows of `WINDOW`
tokens each from an empty cache (as the quality measure runs):

- `collect`: the export's own graph runs the text, every MatMul's input added as an output (a
  model exported whole: the graph it ships, fp16 included).
- `collect_from_model`: PyTorch runs it on the loaded model, hooks on its `nn.Linear`s taking
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
    """What the calibration text's inputs to each MatMul sum to, by input name (or, taken from
    PyTorch, by parameter name), kept on disk in `folder` as they come (`add`), so that a large
    model's never sit in memory together: the sum of x x^T over the tokens, [K, K], where
    `hessian` (gptq), else of x * x, [K] (k_quant's importance); and how many tokens each saw.
    A Hessian's sum is symmetric: its file holds one triangle (`fold_into`), K (K + 1) / 2 floats.
    `aliases` maps other names to those kept: a MatMul input to the parameter its weight is made
    from, a parameter to the one whose input it shares."""

    def __init__(self, folder: Path, hessian: bool, aliases: dict[str, str] | None = None):
        self.folder, self.with_hessian, self.aliases = Path(folder), hessian, dict(aliases or {})
        self.counts: dict[str, int] = {}  # tokens seen, by name kept
        self.widths: dict[str, int] = {}  # K, by name kept

    @property
    def names(self) -> list[str]:
        return list(self.counts)

    def add(self, name: str, values) -> None:
        """Add the rows `values` [..., K] (numpy or torch, any float type) to input `name`'s sums,
        in their file (mapped: nothing of the sums but the part being added is held)."""
        import torch

        x = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.array(values, np.float32))
        x = x.reshape(-1, x.shape[-1]).float()
        path = self._path(name)
        if name not in self.counts:
            k = x.shape[1] + x.shape[1] % 2
            shape = (k + 1, k // 2) if self.with_hessian else (x.shape[1],)
            np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape).flush()  # zeros
            self.widths[name], self.counts[name] = x.shape[1], 0
        sums = np.load(path, mmap_mode="r+")
        if self.with_hessian:
            fold_into(torch.from_numpy(sums), x)
        else:
            sums += (x * x).sum(0).numpy()
        sums.flush()
        del sums
        self.counts[name] += len(x)

    def importance(self, name: str) -> np.ndarray | None:
        """Each channel's mean square [K] float32, or None for an input the text did not reach."""
        name = self._kept(name)
        if name is None:
            return None
        sums = np.load(self._path(name), mmap_mode="r")
        if self.with_hessian:  # the diagonal: A's from rows 1..m, C's from rows 0..m-1 (`fold_into`)
            m = sums.shape[1]
            sums = np.concatenate([np.diagonal(sums[1 : m + 1]), np.diagonal(sums[:m])])[: self.widths[name]]
        return sums / np.float32(self.counts[name])

    def hessian(self, name: str) -> np.ndarray | None:
        """X^T X / tokens [K, K] float32, or None for an input the text did not reach (or all
        inputs, where only their squares are kept)."""
        name = self._kept(name)
        if name is None or not self.with_hessian:
            return None
        return unfold(np.load(self._path(name)), self.widths[name]) / np.float32(self.counts[name])

    def with_sources(self, sources: dict[str, list[str]]) -> "Activations":
        """These sums read also under the MatMul input names `sources` maps to the parameters their
        weights are made from (a packed weight's parts share their input: the first kept is read)."""
        aliases = dict(self.aliases)
        for name, parameters in sources.items():
            kept = [p for p in parameters if self.aliases.get(p, p) in self.counts]
            if kept and name not in self.counts:
                aliases[name] = kept[0]
        other = Activations(self.folder, self.with_hessian, aliases)
        other.counts, other.widths = self.counts, self.widths
        return other

    def _kept(self, name: str) -> str | None:
        while name in self.aliases:
            name = self.aliases[name]
        return name if name in self.counts else None

    def _path(self, name: str) -> Path:
        return self.folder / f"{list(self.counts).index(name) if name in self.counts else len(self.counts):04d}.npy"


def fold_into(folded, x) -> None:
    """Add x^T x of rows `x` [tokens, K] (torch) to `folded`, one triangle of a [K', K'] sum kept
    as [K' + 1, K' / 2] (torch), K' = K rounded up to even (a zero channel added): split at
    m = K' / 2 into [[A, B^T], [B, C]], rows 1..m hold A's lower triangle, rows 0..m-1 C's upper
    one (the two fill the [m + 1, m] top without overlapping), rows m+1.. hold B. One [m, m]
    product is held at a time."""
    import torch

    if x.shape[1] % 2:
        x = torch.nn.functional.pad(x, (0, 1))
    m = x.shape[1] // 2
    left, right = x[:, :m], x[:, m:]
    folded[1 : m + 1] += (left.T @ left).tril_()
    folded[:m] += (right.T @ right).triu_()
    folded[m + 1 :] += right.T @ left


def unfold(folded: np.ndarray, width: int) -> np.ndarray:
    """The symmetric [width, width] float32 matrix `fold_into` kept."""
    m = folded.shape[1]
    a, c, b = np.tril(folded[1 : m + 1]), np.triu(folded[:m]), folded[m + 1 :]
    full = np.empty((2 * m, 2 * m), np.float32)
    full[:m, :m] = a + a.T
    full[m:, m:] = c + c.T
    full[:m, :m][np.diag_indices(m)] -= np.diagonal(a)
    full[m:, m:][np.diag_indices(m)] -= np.diagonal(c)
    full[m:, :m] = b
    full[:m, m:] = b.T
    return full[:width, :width]


def collect(export: Path, ids: list[int], scratch: Path, hessian: bool) -> Activations:
    """Run the fp32 export in `export` over `ids` and add each MatMul input's rows to its sums in
    `scratch`: as many windows a run as keep its outputs within `_RUN_BYTES`."""
    manifest = load_manifest(export)
    if len(ids) < 2:
        raise ExportError("the calibration text is empty: give --calibration a file of the text the model will see")
    element = onnx.TensorProto.FLOAT16 if manifest.kv.dtype == "float16" else onnx.TensorProto.FLOAT
    names, width = _matmul_inputs(export / GRAPH_FILE, export / _GRAPH, element)
    scratch.mkdir(parents=True, exist_ok=True)
    activations = Activations(scratch, hessian)
    try:
        graph = Graph(export / _GRAPH, "cpu", None, packed=False)
        for windows in _passes(ids, max(1, _RUN_BYTES // (4 * width * WINDOW))):
            _, outputs = graph.run(window_feeds(graph, manifest, windows), on_device=[], to_host=names)
            for name in names:
                activations.add(name, outputs.pop(name))
    finally:
        (export / _GRAPH).unlink(missing_ok=True)
    return activations


_RUN_BYTES = 64 * 2**20  # the MatMul inputs one run of `collect` returns, in float32, at most


def _matmul_inputs(source: Path, target: Path, element: int) -> tuple[list[str], int]:
    """The activations MatMuls with a constant weight read, written as outputs of a copy of the
    graph; and their widths' sum (the floats a token gives them)."""
    model = onnx.load(str(source), load_external_data=False)
    constants = {t.name: t for t in model.graph.initializer}
    widths = {n.input[0]: constants[n.input[1]].dims[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in constants}
    outputs = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_tensor_value_info(name, element, None) for name in widths if name not in outputs)
    onnx.save(model, str(target))
    return list(widths), sum(widths.values())


def window_feeds(graph: Graph, manifest, windows: list[list[int]], logits: int = 1) -> dict[str, np.ndarray]:
    """Windows of one length, a row each, from an empty cache, with the logits of their last
    `logits` positions: a slot cache (written in place) as long as a window, or a growing cache's
    empty past, and zero states."""
    kv, rows, length = manifest.kv, len(windows), len(windows[0])
    feeds = {
        "input_ids": np.array(windows, np.int64),
        "attention_mask": np.ones((rows, length), np.int64),
        "logits_to_keep": np.array(logits, np.int64),
    }
    feeds = {name: value for name, value in feeds.items() if name in graph.inputs}
    if "position_ids" in graph.inputs:  # [1, sequence], or [3, 1, sequence] for 3-D rotary (text: three equal rows)
        axes = len(graph.inputs["position_ids"].shape)
        feeds["position_ids"] = np.broadcast_to(np.arange(length, dtype=np.int64), (3,) * (axes - 2) + (rows, length)).copy()
    if "image_features" in graph.inputs:  # a vision-language model's text windows: no image features
        feeds["image_features"] = np.zeros((0, manifest.vision["hidden_size"]), graph.input_dtype("image_features"))
    capacity = length if kv.in_place else 0
    dtype = np.float16 if kv.dtype == "float16" else np.float32
    declared = {name: value.shape for name, value in graph.inputs.items()}
    for kind in cache_kinds(kv, capacity):  # every buffer empty, a recurrent state at zero, as the runtime's
        shapes = kind.buffer_shapes(rows, capacity, declared, kv.sequence_axis)
        feeds.update({name: np.zeros(shape, dtype) for name, shape in shapes.items()})
    return feeds


_PASS_TOKENS = 2048  # full windows batched into one PyTorch pass up to this many tokens


def collect_from_model(model, ids: list[int], scratch: Path, hessian: bool) -> Activations:
    """Run the PyTorch `model` over `ids` in windows and add each `nn.Linear`'s input rows to its
    sums in `scratch`, by its weight's parameter name; Linears fed the same tensor one after the
    other (q, k and v; gate and up) keep it once. Each module's own weights are let go of as it finishes
    (`stream.release_file_pages`: a checkpoint mapped in its own precision stays a file, read
    again where a later pass needs it), so the model is never resident whole."""
    import torch

    if len(ids) < 2:
        raise ExportError("the calibration text is empty: give --calibration a file of the text the model will see")
    scratch.mkdir(parents=True, exist_ok=True)
    keeper = _InputKeeper(model, Activations(scratch, hessian))
    accepts = "logits_to_keep" in inspect.signature(model.forward).parameters
    with keeper, torch.no_grad():
        for batch in _passes(ids):
            model(torch.tensor(batch), use_cache=False, **({"logits_to_keep": 1} if accepts else {}))
            keeper.next_pass()
    return keeper.activations


def _passes(ids: list[int], per_pass: int = _PASS_TOKENS // WINDOW) -> list[list[list[int]]]:
    """The text's windows in passes: `per_pass` full windows together, a shorter last one alone."""
    windows = [ids[start : start + WINDOW] for start in range(0, len(ids), WINDOW)]
    full = [w for w in windows if len(w) == WINDOW]
    return [full[i : i + per_pass] for i in range(0, len(full), per_pass)] + [[w] for w in windows if len(w) < WINDOW]


class _InputKeeper:
    """Meanwhile, hooks on `model`: each nn.Linear's input added to `activations` under its
    weight's name, and each module's own matrices let go of after its forward."""

    def __init__(self, model, activations: Activations):
        import torch

        from .stream import release_file_pages

        self.activations = activations
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
                self.activations.aliases[name] = self._last[1]
                return
            self.activations.add(name, x.detach())
            self._last = (x, name)

        return keep

    @staticmethod
    def _releaser(own: list, release):
        def let_go(*_):  # returns None: a forward hook's result would replace the module's output
            for parameter in own:
                release(parameter)

        return let_go

    def next_pass(self) -> None:
        self._last = (None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
