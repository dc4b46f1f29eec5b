"""Weight quantization at export, with ONNX Runtime's MatMulNBits quantizer, and an honest
measure of what it costs: top-1 next-token agreement with the fp32 model and perplexity, both
over a fixed text of about 1,200 tokens (quality_text.txt), and perplexity as llama-perplexity
measures it (windows of 256 tokens, each scored on its second half), to set beside a GGUF's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from edgeinfer.sdk.engine import Engine
from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import load_manifest
from edgeinfer.sdk.tokenizer import Tokenizer

from .graphs import GRAPH_FILE, lm_head, save_graph, tied_embedding
from .patches import one_weight_at_a_time, one_weight_loaded

BITS = {"int4": 4, "int8": 8}
QUALITY_TEXT = Path(__file__).with_name("quality_text.txt")
_CHUNK = 256  # positions a pass, for both sides of the quality measure


ALGORITHMS = ("rtn", "hqq")
KEEPABLE = ("lm_head",)


@dataclass(frozen=True)
class Quantization:
    """`method` "int4" or "int8": every MatMul's weights (the lm_head too) in blocks of
    `block_size`, each with its own scale and zero point. `accuracy_level` 4 lets ONNX Runtime
    multiply in int8 on the CPU, its fastest kernel; 0 computes in the activations' type.

    Blocks have a zero point unless `symmetric` (no zero points to read: faster, less accurate;
    docs/benchmarks.md has the figures).

    `algorithm` "rtn" rounds each weight to its block's nearest level; "hqq" (half-quadratic
    quantization, no calibration data) fits each block's scale and zero point to its weights, and
    is slower to export; its zero points are floats, which ONNX Runtime's CPU kernel takes only on a
    slow path. The lm_head is rounded in a pass of its own where either applies (its blocks are
    shared with a tied embedding table), at 8 bits where `keep_int8` names it (docs/benchmarks.md
    has the figures)."""

    method: str
    block_size: int = 32
    accuracy_level: int = 4
    symmetric: bool = False
    algorithm: str = "rtn"
    keep_int8: tuple[str, ...] = ()

    def __post_init__(self):
        if self.method not in BITS:
            raise ExportError(f"unknown quantization {self.method!r}: use 'int4' or 'int8'")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ExportError(f"block size must be a power of two of at least 16, got {self.block_size}")
        if self.algorithm not in ALGORITHMS:
            raise ExportError(f"unknown quantization algorithm {self.algorithm!r}: use one of {', '.join(ALGORITHMS)}")
        unknown = [name for name in self.keep_int8 if name not in KEEPABLE]
        if unknown:
            raise ExportError(f"--keep-int8 takes {', '.join(KEEPABLE)}, got {', '.join(unknown)}")
        if self.algorithm == "hqq" and self.symmetric:
            raise ExportError("hqq fits a zero point to every block: leave out --symmetric, or use --algorithm rtn")

    @property
    def head_apart(self) -> bool:
        """Whether the lm_head is quantized in a pass of its own (rounded, at its own bits)."""
        return bool(self.keep_int8) or self.algorithm != "rtn"


def quantize_graph(folder: Path, quantization: Quantization) -> None:
    """Replace model.onnx and its weights in `folder` by the quantized graph: ONNX Runtime's
    MatMulNBitsQuantizer, given the graph without its weights, reads each MatMul's fp32 weight from
    the data file as it packs it (`patches.one_weight_at_a_time`, `patches.one_weight_loaded`), so
    one fp32 weight is in memory at a time, and the files written are the bytes of the quantizer's
    own run on the loaded graph. Tensors the quantizer leaves alone (the embedding table, norms)
    are copied from the old data file by `save_graph`. Where the lm_head goes apart, it is
    quantized first, then every other MatMul."""
    graph = onnx.load(str(folder / GRAPH_FILE), load_external_data=False)
    bits = BITS[quantization.method]
    if quantization.head_apart:
        head_bits = 8 if "lm_head" in quantization.keep_int8 else bits
        head = lm_head_node(graph.graph)
        graph = _quantized(graph, folder, quantization, head_bits, "rtn", exclude=[n for n in _matmuls(graph) if n != head])
    graph = _quantized(graph, folder, quantization, bits, quantization.algorithm)
    save_graph(graph, folder, weights_from=folder)


def _quantized(graph, folder: Path, quantization: Quantization, bits: int, algorithm: str, exclude=()):
    """The graph with its MatMuls (but `exclude`) quantized at `bits` by `algorithm`; a tied
    embedding table gathers from the lm_head's rounded blocks once the lm_head is quantized."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    block, symmetric, level = quantization.block_size, quantization.symmetric, quantization.accuracy_level
    if algorithm == "hqq":
        config = HQQWeightOnlyQuantConfig(block_size=block, bits=bits)
    else:
        config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric, accuracy_level=level, bits=bits)
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
    (one_weight_loaded if algorithm == "hqq" else one_weight_at_a_time)(quantizer.node_quantizer, folder)
    quantizer.process()
    if tied and algorithm == "rtn":  # HQQ's zero points are floats, which GatherBlockQuantized does not take
        quantized_embedding(quantizer.model.model.graph, *tied, bits, block)
    return quantizer.model.model


def _matmuls(graph) -> list[str]:
    return [n.name for n in graph.graph.node if n.op_type == "MatMul"]


def lm_head_node(graph) -> str | None:
    """The name of the lm_head's MatMul, or None once it is quantized."""
    try:
        return lm_head(graph).name
    except ExportError:
        return None


def quantized_embedding(graph, gather, weight: str, bits: int, block_size: int) -> bool:
    """Where the embedding table is the lm_head's weight transposed (tied weights), gather from the
    lm_head's quantized blocks instead: `GatherBlockQuantized` on the same bytes, scales and zero
    points, so no fp32 table is left. MatMulNBits lays its weight out as
    [vocab, blocks, bytes per block], which is the [vocab, hidden] table quantized along hidden;
    GatherBlockQuantized wants it as [vocab, bytes per row], a reshaped copy of the bytes alone (the
    scales and zero points are shared; without zero points both ops take the same default,
    2^(bits-1)). Returns whether it applied.

    fp32 exports keep both tables: the lm_head's MatMul weight is pre-packed at load, and ONNX
    Runtime keeps an initializer that another node reads resident after packing it, while the
    embedding table is memory-mapped and only the rows of the tokens seen are ever read. Sharing
    one fp32 tensor saves disk but costs resident memory (docs/manifest.md has the figures)."""
    from onnx import helper, numpy_helper

    lm_head = next((n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1] == f"{weight}_Q{bits}"), None)
    initializers = {t.name: t for t in graph.initializer}
    table = gather.input[0]
    if lm_head is None or table not in initializers or gather not in graph.node:
        return False
    hidden = initializers[table].dims[1]
    blocks = numpy_helper.to_array(initializers[lm_head.input[1]])
    if hidden % block_size or blocks.shape[1] * blocks.shape[2] * 8 // bits != hidden:
        return False
    data = f"{weight}_embedding_Q{bits}"
    graph.initializer.append(numpy_helper.from_array(blocks.reshape(blocks.shape[0], -1), data))
    position = list(graph.node).index(gather)
    graph.node.remove(gather)
    graph.node.insert(
        position,
        helper.make_node(
            "GatherBlockQuantized",
            [data, "input_ids", *lm_head.input[2:4]],
            [gather.output[0]],
            name="edgeinfer_quantized_embedding",
            domain="com.microsoft",
            gather_axis=0,
            quantize_axis=1,
            block_size=block_size,
            bits=bits,
        ),
    )
    if not any(table in n.input for n in graph.node):
        graph.initializer.remove(initializers[table])
    return True


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


def windows(ids: list[int], context: int) -> list[list[int]]:
    """The text cut as llama-perplexity cuts it: windows of WINDOW tokens (the context, where it is
    smaller), one after the other, each run from an empty cache."""
    size = min(WINDOW, context)
    return [ids[start : start + size] for start in range(0, len(ids) - size + 1, size)]


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
    targets, parts, past = np.array(ids[1:]), [], None
    with torch.no_grad():  # _CHUNK positions a pass on the model's own cache: one pass over the whole text
        for start in range(0, len(targets), _CHUNK):  # would hold all its logits and the activations behind them
            out = model(torch.tensor([ids[start : min(start + _CHUNK, len(targets))]]), past_key_values=past, use_cache=True)
            parts.append(_scores(out.logits[0].float().numpy(), targets[start : start + _CHUNK]))
            past = out.past_key_values
        windowed = [
            second_half(_scores(model(torch.tensor([w])).logits[0, :-1].float().numpy(), np.array(w[1:]))[1], len(w))
            for w in windows(ids, manifest.max_context)
        ]
    top, scores = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return QualityReference(ids, top, scores, np.concatenate(windowed))


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
    parts = [second_half(_teacher_forced_scores(engine, w, np.array(w[1:]))[1], len(w)) for w in windows(ids, engine.max_context)]
    return np.concatenate(parts)


def _teacher_forced_scores(engine: Engine, ids: list[int], targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_scores` of the export's logits after each prefix of `ids`: the first token as a prompt,
    then the rest a chunk per pass, with the logits of every position (as speculative decoding
    checks its guesses), not one decode step per token. Each chunk's logits are reduced as they
    come: all of them at once, in float64, would take text x vocabulary x 8 bytes, and as much again
    for each step of the softmax."""
    cache = engine.runner.new_batch(1, len(ids))
    parts = [_scores(engine.runner.prefill(cache, [ids[:1]]).numpy()[0, -1:], targets[:1])]
    rest, step = ids[1:-1], engine.prefill_chunk
    for start in range(0, len(rest), step):
        logits = engine.runner.verify(cache, 0, rest[start : start + step]).numpy()[0]
        parts.append(_scores(logits, targets[1 + start : 1 + start + len(logits)]))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


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
