"""Weight quantization at export, with ONNX Runtime's MatMulNBits quantizer, and an honest
measure of what it costs: top-1 next-token agreement with the fp32 model and perplexity, both
over a fixed text of about 1,200 tokens (quality_text.txt), and perplexity as llama-perplexity
measures it (windows of 256 tokens, each scored on its second half), to set beside a GGUF's."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from edgeinfer.sdk.engine import Engine
from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import Manifest, load_manifest
from edgeinfer.sdk.tokenizer import Tokenizer

from .algorithms import ALGORITHMS, Algorithm
from .calibration import CALIBRATION_TEXT, collect
from .graphs import GRAPH_FILE, lm_head, save_graph, tied_embedding
from .kquant import FittedBlocks, dequantized, fit_weight, search_quantizer, statistics
from .patches import one_weight_at_a_time, one_weight_loaded, write_as_made
from .stream import is_deferred, sources_of
from .table import quantized_embedding, quantized_table
from .sensitivity import chosen, modules_by_cost, rounded_to_nearest

BITS = {"int4": 4, "int8": 8}
# An untied embedding table's blocks, under int4 and int8 alike: the table's rounding goes
# straight into the residual stream, and at 4 bits it cost more agreement with fp32 than all the
# MatMuls' 4 bits did (docs/benchmarks.md, "An untied embedding table in blocks").
TABLE_BITS = 8
QUALITY_TEXT = Path(__file__).with_name("quality_text.txt")
_CHUNK = 256  # positions a pass, for both sides of the quality measure


AUTO = "auto"  # --keep-int8's word for the modules export/sensitivity.py measures and chooses


@dataclass(frozen=True)
class Quantization:
    """`method` "int4" or "int8": every MatMul's weights (the lm_head too) in blocks of
    `block_size`, each with its own scale and zero point. `accuracy_level` 4 lets ONNX Runtime
    multiply in int8 on the CPU, its fastest kernel; 0 computes in the activations' type.

    Blocks have a zero point unless `symmetric` (no zero points to read: faster, less accurate;
    docs/benchmarks.md has the figures).

    `algorithm` "rtn" rounds each weight to its block's nearest level; "k_quant" searches each
    block's scale (export/kquant.py), weighted by the activations over `calibration` (a text file)
    where given; "gptq" rounds one input channel at a time and spreads its error over the rest, from
    the activations over `calibration` (default: export/calibration_text.txt); "hqq" (half-quadratic
    quantization, no calibration data) fits each block's scale and zero point to its weights, and
    is slower to export; its zero points are floats, which ONNX Runtime's CPU kernel takes only on a
    slow path. The lm_head is rounded in a pass of its own where either applies (its blocks are
    shared with a tied embedding table). `keep_int8` names MatMuls kept at 8 bits (`kept_int8`), or
    is ("auto",): the modules export/sensitivity.py measures as costing most per byte at 4 bits.
    `embedding_bits` (8 or 4) are an untied embedding table's (a tied one gathers from the lm_head's
    blocks).

    Left out, `algorithm` is gptq and `keep_int8` auto for int4 (the closest to fp32 at a 4-bit
    size: docs/benchmarks.md has the table), rtn and none for int8 (8-bit rounding loses almost
    nothing) and for `symmetric` int4 (its blocks have no zero point for gptq to fit)."""

    method: str
    block_size: int = 32
    accuracy_level: int = 4
    symmetric: bool = False
    algorithm: str | None = None
    keep_int8: tuple[str, ...] | None = None
    calibration: str | None = None
    embedding_bits: int = TABLE_BITS

    def __post_init__(self):
        if self.method not in BITS:
            raise ExportError(f"unknown quantization {self.method!r}: use 'int4' or 'int8'")
        if self.embedding_bits not in (4, 8):
            raise ExportError(f"an untied embedding table is kept in 4- or 8-bit blocks, not {self.embedding_bits}: use 4 or 8")
        searched = self.method == "int4" and not self.symmetric
        if self.algorithm is None:
            object.__setattr__(self, "algorithm", "gptq" if searched else "rtn")
        if self.keep_int8 is None:
            object.__setattr__(self, "keep_int8", (AUTO,) if searched else ())
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ExportError(f"block size must be a power of two of at least 16, got {self.block_size}")
        if self.algorithm not in ALGORITHMS:
            raise ExportError(f"unknown quantization algorithm {self.algorithm!r}: use one of {', '.join(ALGORITHMS)}")
        if AUTO in self.keep_int8 and len(self.keep_int8) > 1:
            raise ExportError("--keep-int8 auto chooses the modules itself: give auto alone, or module names without it")
        for item in self.keep_int8:
            _kept_pattern(item)
        if self.calibration is not None and self.rule.calibration == "never" and self.keep_int8 != (AUTO,):
            readers = " or ".join(a.name for a in ALGORITHMS.values() if a.calibration != "never")
            raise ExportError(f"--calibration is for --algorithm {readers}, or --keep-int8 auto; not {self.algorithm} alone")
        if self.calibration is not None and not Path(self.calibration).is_file():
            raise ExportError(f"calibration text {self.calibration} is not a file: give --calibration a text file")
        if self.symmetric and not self.rule.takes_symmetric:
            raise ExportError(f"{self.algorithm} fits a zero point to every block: leave out --symmetric, or use --algorithm rtn")

    @property
    def rule(self) -> Algorithm:
        """The algorithm's entry in ALGORITHMS."""
        return ALGORITHMS[self.algorithm]

    @property
    def calibrated(self) -> bool:
        """Whether the export runs its fp32 graph over a calibration text (for the algorithm's search)."""
        return self.rule.calibration == "always" or (self.rule.calibration == "given" and self.calibration is not None)

    def passes(self, graph, head_first: bool = False) -> list[tuple[int, str, list[str]]]:
        """(bits, algorithm, MatMul names) in the order they are quantized: the MatMuls `keep_int8`
        names at 8 bits; under hqq the lm_head rounded (its blocks are shared with a tied embedding
        table, and GatherBlockQuantized takes only integer zero points), or with `head_first` (a
        streamed export: the largest weight made while the least else is held); then the rest."""
        bits, names = BITS[self.method], _matmuls(graph)
        rounded = "rtn" if self.rule.float_zeros else self.algorithm  # integer zero points: the tied table gathers them
        kept = kept_int8(graph.graph, self.keep_int8) if bits == 4 else []
        head = lm_head_node(graph.graph)
        passes = [(8, rounded, kept)] if kept else []
        if head and head not in kept and (head_first or self.rule.float_zeros):
            passes.append((bits, rounded, [head]))
        done = {name for _, _, group in passes for name in group}
        return [*passes, (bits, self.algorithm, [n for n in names if n not in done])]


def kept_int8(graph, items) -> list[str]:
    """The MatMuls `items` name: `lm_head`, or a module name (the last part of a MatMul's name before
    /MatMul: o_proj, down_proj, ...; a fused attention input projection is qkv_proj, a packed gate and
    up projection gate_up_proj), optionally
    with layers: `down_proj:0-3` (0 to 3), `qkv_proj:0,29` is written `qkv_proj:0+29`."""
    roles = {node.name: matmul_role(node.name) for node in graph.node if node.op_type == "MatMul"}
    chosen = []
    for item in items:
        module, layers = _kept_pattern(item)
        found = [n for n, (layer, name) in roles.items() if name == module and (layers is None or layer in layers)]
        if not found:
            known = sorted({name for _, name in roles.values()})
            raise ExportError(f"--keep-int8 {item!r} names no MatMul of this model: its modules are {', '.join(known)}")
        chosen += [n for n in found if n not in chosen]
    return _with_shared_readers(graph, chosen)


def _with_shared_readers(graph, chosen: list[str]) -> list[str]:
    """`chosen` and every other MatMul that reads one of their weights: a weight has one precision.
    A looped model runs its layers' modules again on the same weights (torch.onnx names the second
    call q_proj_1), and one weight quantized at both 8 and 4 bits would write two sets of scales
    under one name."""
    matmuls = [node for node in graph.node if node.op_type == "MatMul"]
    weights = {node.input[1] for node in matmuls if node.name in chosen}
    return chosen + [node.name for node in matmuls if node.input[1] in weights and node.name not in chosen]


def _kept_pattern(item: str) -> tuple[str, set[int] | None]:
    module, _, layers = item.partition(":")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", module) or (layers and not re.fullmatch(r"\d+(-\d+)?(\+\d+(-\d+)?)*", layers)):
        raise ExportError(f"--keep-int8 takes module names with optional layers (lm_head,down_proj:0-3+29), got {item!r}")
    if not layers:
        return module, None
    chosen = set()
    for span in layers.split("+"):
        first, _, last = span.partition("-")
        chosen.update(range(int(first), int(last or first) + 1))
    return module, chosen


LAYER = r"(?:layers|h|blocks|layer)\.(\d+)"  # a layer's place in a module path: layers.3, h.3, ...


def matmul_role(name: str) -> tuple[int | None, str]:
    """(layer, module) of a MatMul by its name: /model/layers.3/mlp/down_proj/MatMul is (3,
    down_proj), edgeinfer_gqa_3_qkv_proj (3, qkv_proj), /lm_head/MatMul (None, lm_head)."""
    fused = re.fullmatch(r"edgeinfer_gqa_(\d+)_(\w+)", name)
    if fused:
        return int(fused.group(1)), fused.group(2)
    parts = [part for part in name.split("/") if part and part != "MatMul"]
    layer = next((int(m.group(1)) for part in parts if (m := re.fullmatch(LAYER, part))), None)
    return layer, (parts[-1] if parts else name)


def quantize_graph(folder: Path, quantization: Quantization, head_first: bool = False, activations=None) -> Quantization:
    """Replace model.onnx and its weights in `folder` by the quantized graph: ONNX Runtime's
    MatMulNBitsQuantizer, given the graph without its weights, reads each MatMul's fp32 weight from
    the data file as it packs it (`patches.one_weight_at_a_time`, `patches.one_weight_loaded`), so
    one fp32 weight is in memory at a time, and the files written are the bytes of the quantizer's
    own run on the loaded graph. Tensors the quantizer leaves alone (the embedding table, norms)
    are copied from the old data file by `save_graph`. The MatMuls go in `Quantization.passes`.
    Returns `quantization` with `keep_int8` "auto" replaced by the modules chosen. `head_first`:
    the lm_head in a pass of its own before the others (`Quantization.passes`). `activations`:
    the calibration's, taken from PyTorch by parameter name (a streamed export, whose weights are
    deferred: `calibration.collect_from_model`), else taken here from the fp32 graph where the
    algorithm needs them; their folder is removed once done."""
    graph = onnx.load(str(folder / GRAPH_FILE), load_external_data=False)
    scratch = activations.folder if activations is not None else folder / "calibration"
    try:
        if activations is None:
            activations = _calibrated(folder, quantization, scratch)
        else:
            activations = activations.with_sources(_weight_sources(graph))
        fitted = FittedBlocks(scratch / "fitted")  # 4-bit blocks the auto choice fitted, for the pass that writes them
        if quantization.keep_int8 == (AUTO,):
            quantization = replace(quantization, keep_int8=tuple(_auto_kept(folder, quantization, activations, fitted)))
        for bits, algorithm, names in quantization.passes(graph, head_first):
            included = set(names)
            exclude = [n for n in _matmuls(graph) if n not in included]
            graph = _quantized(graph, folder, quantization, bits, algorithm, exclude, activations, fitted if bits == 4 else None)
        quantized_table(graph.graph, folder, _MADE, quantization.embedding_bits, quantization.block_size, quantization.symmetric)
        shutil.rmtree(scratch, ignore_errors=True)  # (before the data file is written beside the blocks made)
        save_graph(graph, folder, weights_from=folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        (folder / _MADE).unlink(missing_ok=True)
    return quantization


def _auto_kept(folder: Path, quantization: Quantization, activations, fitted: FittedBlocks) -> list[str]:
    """The modules `--keep-int8 auto` keeps at 8 bits (export/sensitivity.py), each weight rounded
    as the export rounds it: by k_quant or gptq from the calibration text's activations (their
    blocks kept in `fitted` for the 4-bit pass), else to nearest."""
    block, rule = quantization.block_size, quantization.rule
    if BITS[quantization.method] != 4:
        return []

    def fit(weight, input_name, weight_name):
        fitted[weight_name] = fit_weight(weight, 4, block, *statistics(activations, input_name, rule.hessian), overwrite=True)

    def rounded(weight, input_name, weight_name):
        return dequantized(*fitted[weight_name])[: len(weight)] if rule.searches else rounded_to_nearest(weight, block)

    ids = calibration_ids(folder, quantization)
    return chosen(modules_by_cost(folder, ids, matmul_role, rounded, fit if rule.searches else None), block)


def _calibrated(folder: Path, quantization: Quantization, scratch: Path):
    """The fp32 graph's MatMul inputs over the calibration text, where the algorithm uses them
    (`Algorithm.calibration`: gptq always, the built-in text unless one is given; k_quant when given
    a text). `--keep-int8 auto` reads a given text as tokens alone."""
    if not quantization.calibrated:
        return None
    return collect(folder, calibration_ids(folder, quantization), scratch, quantization.rule.hessian)


def calibration_ids(folder: Path, quantization: Quantization) -> list[int]:
    """The calibration text (--calibration's, else the built-in one) as the export's tokenizer in `folder` reads it."""
    text = Path(quantization.calibration or CALIBRATION_TEXT).read_text(errors="replace")
    return Tokenizer(folder, load_manifest(folder).tokenizer).encode(text)


def _quantized(graph, folder: Path, quantization: Quantization, bits: int, algorithm: str, exclude=(), activations=None, fitted=None):
    """The graph with its MatMuls (but `exclude`) quantized at `bits` by `algorithm`; a tied
    embedding table gathers from the lm_head's rounded blocks once the lm_head is quantized."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    block, symmetric, level, rule = quantization.block_size, quantization.symmetric, quantization.accuracy_level, ALGORITHMS[algorithm]
    config = rule.config(bits, block, symmetric, level)
    tied = tied_embedding(graph.graph, folder) if lm_head_node(graph.graph) in _matmuls(graph) else None
    quantizer = MatMulNBitsQuantizer(
        graph,
        bits=bits,
        block_size=block,
        is_symmetric=symmetric,
        accuracy_level=level,
        algo_config=config,
        nodes_to_exclude=list(exclude),
    )
    if rule.searches:
        quantizer.node_quantizer = search_quantizer(config, activations, rule.hessian, fitted)
    (one_weight_loaded if rule.float_zeros else one_weight_at_a_time)(quantizer.node_quantizer, folder)
    write_as_made(quantizer.node_quantizer, folder / _MADE)
    quantizer.process()
    if tied and not rule.float_zeros:  # GatherBlockQuantized takes integer zero points only
        quantized_embedding(quantizer.model.model.graph, *tied, bits, block)
    return quantizer.model.model


_MADE = "quantized.partial"  # each quantized weight's bytes as it is made, until the graph is saved


def _weight_sources(graph) -> dict[str, list[str]]:
    """Each MatMul input read by a deferred weight: the parameters that weight is made from."""
    initializers = {t.name: t for t in graph.graph.initializer}
    found = {}
    for node in graph.graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is not None and is_deferred(weight):
            found.setdefault(node.input[0], []).extend(sources_of(weight))
    return found


def _matmuls(graph) -> list[str]:
    return [n.name for n in graph.graph.node if n.op_type == "MatMul"]


def lm_head_node(graph) -> str | None:
    """The name of the lm_head's MatMul, or None once it is quantized."""
    try:
        return lm_head(graph).name
    except ExportError:
        return None


@dataclass(frozen=True)
class QualityReference:
    """The fp32 PyTorch model over the quality text: its tokens, and at each position the top token
    and the log-probability of the next token (`_scores`); `windowed`, the log-probabilities
    llama-perplexity's way (`windows`)."""

    ids: list[int]
    top: np.ndarray
    scores: np.ndarray
    windowed: np.ndarray


WINDOW = 256  # llama-perplexity's --ctx-size for the side-by-side: each window alone, its second half scored


def windows(ids: list[int], context: int, bos: int | None = None) -> list[list[int]]:
    """The text cut as llama-perplexity cuts it: windows of WINDOW tokens (the context, where it is
    smaller), one after the other, each run from an empty cache; with `bos` (the tokenizer starts a
    text with it: `leading_bos`), each window's first token replaced by it."""
    size = min(WINDOW, context)
    cut = [ids[start : start + size] for start in range(0, len(ids) - size + 1, size)]
    return cut if bos is None else [[bos, *window[1:]] for window in cut]


def leading_bos(ids: list[int], manifest: Manifest) -> int | None:
    """The BOS id where the tokenizer started the text `ids` with it, else None."""
    return ids[0] if ids and ids[0] == manifest.bos_token_id else None


def second_half(scores: np.ndarray, size: int) -> np.ndarray:
    """Of a window's log-probabilities (position j predicting token j + 1), those llama-perplexity
    scores: the predictions from the window's middle on, each with half a window of context."""
    return scores[size // 2 :]


def quality_reference(model, folder: Path) -> QualityReference:
    """The PyTorch model's side of `quality`, taken right after the graph is traced so that the
    model (its fp32 weights) can be let go before the checks and the quantizer run."""
    import torch

    manifest = load_manifest(folder)
    ids = Tokenizer(Path(folder), manifest.tokenizer).encode(QUALITY_TEXT.read_text())[: manifest.max_context]
    targets = np.array(ids[1:])
    with torch.no_grad():
        parts = _chunked_scores(model, ids, targets)
        windowed = [
            second_half(_scores(model(torch.tensor([w])).logits[0, :-1].float().numpy(), np.array(w[1:]))[1], len(w))
            for w in windows(ids, manifest.max_context, leading_bos(ids, manifest))
        ]
    top, scores = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return QualityReference(ids, top, scores, np.concatenate(windowed))


def _chunked_scores(model, ids: list[int], targets: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The model's (top token, score) parts over the text, _CHUNK positions a pass on its own cache
    (one pass over the whole text would hold all its logits and the activations behind them); one
    pass where the model's output carries no cache (RecurrentGemma's keeps its states on its
    modules)."""
    import torch

    parts, past = [], None
    for start in range(0, len(targets), _CHUNK):
        out = model(torch.tensor([ids[start : min(start + _CHUNK, len(targets))]]), cache=past, use_cache=True)
        past = getattr(out, "cache", None)
        if past is None and start + _CHUNK < len(targets):
            return [_scores(model(torch.tensor([ids[: len(targets)]])).logits[0].float().numpy(), targets)]
        parts.append(_scores(out.logits[0].float().numpy(), targets[start : start + _CHUNK]))
    return parts


def quality(reference: QualityReference, folder: Path) -> dict:
    """Next-token quality of the export in `folder` against the fp32 model's `reference` over the
    fixed text: the share of positions where both pick the same top token, and both perplexities."""
    engine = Engine.load(folder, provider="cpu")
    top, scores = _teacher_forced_scores(engine, reference.ids, np.array(reference.ids[1:]))
    windowed = windowed_scores(engine, reference.ids)
    return {
        "text_tokens": len(reference.ids),
        "top1_agreement": float(np.mean(top == reference.top)),
        "perplexity": float(np.exp(-scores.mean())),
        "perplexity_fp32": float(np.exp(-reference.scores.mean())),
        "perplexity_windowed": float(np.exp(-windowed.mean())),
        "perplexity_windowed_fp32": float(np.exp(-reference.windowed.mean())),
        "window": min(WINDOW, engine.max_context),
    }


def windowed_scores(engine: Engine, ids: list[int]) -> np.ndarray:
    """The export's log-probabilities llama-perplexity's way: each window from an empty cache, its
    second half scored."""
    cut = windows(ids, engine.max_context, leading_bos(ids, engine.manifest))
    return np.concatenate([second_half(_teacher_forced_scores(engine, w, np.array(w[1:]))[1], len(w)) for w in cut])


def _teacher_forced_scores(engine: Engine, ids: list[int], targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_scores` of the export's logits after each prefix of `ids` (`teacher_forced_logits`), each
    chunk reduced as it comes: all of them at once, in float64, would take text x vocabulary x 8
    bytes, and as much again for each step of the softmax."""
    parts = [_scores(logits, targets[start : start + len(logits)]) for start, logits in teacher_forced_logits(engine, ids)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def teacher_forced_logits(engine: Engine, ids: list[int]):
    """(position, logits [positions, vocabulary]) for the predictions after each prefix of `ids` but
    the whole: the first token as a prompt, then the rest a chunk per pass, with the logits of
    every position (as speculative decoding checks its guesses), not one decode step per token."""
    cache = engine.runner.new_batch(1, len(ids))
    yield 0, engine.runner.prefill(cache, [ids[:1]]).numpy()[0, -1:]
    rest, step = ids[1:-1], engine.prefill_chunk
    for start in range(0, len(rest), step):
        yield 1 + start, engine.runner.verify(cache, 0, rest[start : start + step]).numpy()[0]


def _scores(logits: np.ndarray, targets: np.ndarray, rows: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Each position's top token and the log-probability it gives its target, in float64, `rows`
    positions at a time (a large vocabulary makes each row's float64 copy large)."""
    top, scores = [], []
    for start in range(0, len(logits), rows):
        block = logits[start : start + rows].astype(np.float64)
        block -= block.max(-1, keepdims=True)
        picked = block[np.arange(len(block)), targets[start : start + rows]]
        scores.append(picked - np.log(np.exp(block).sum(-1)))
        top.append(block.argmax(-1))
    return np.concatenate(top), np.concatenate(scores)
