"""Block quantization by search, in the manner of llama.cpp's k-quants, written as ONNX Runtime's
MatMulNBits reads it: each block of `block` weights along K has a scale and an integer zero point,
w ~ scale * (level - zero). Where round-to-nearest takes the block's min and max, the search tries
a range of scales around max-min's, and for each rounds the zero point and the levels, then
refits the scale by least squares on those levels; the block keeps the pair with the least
weighted error. The error weights each weight by its size (llama.cpp's sqrt(mean x^2) + |x|) or,
given the mean square of each input channel over a calibration text (`importance`, llama.cpp's
imatrix), by that times sqrt(sigma^2 + x^2), so the channels that carry the most signal are
rounded best.

Zero points stay integers: ONNX Runtime 1.31's CPU kernel takes float zero points only on a slow
path (HQQ's, docs/benchmarks.md), so these blocks decode at round-to-nearest's speed."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from pathlib import Path

import numpy as np

# Scale candidates (levels - 1 + step) / (max - min): llama.cpp's range of steps, more coarsely, as
# the least-squares refits after each candidate close the gaps between them.
_STEPS = [step / 3 for step in range(-3, 4)]
_CHUNK = 1 << 14  # blocks fitted together: small enough for the temporaries to stay in cache
_THREADS = min(os.cpu_count() or 1, 8)
_COLUMNS = 128  # GPTQ's channels rounded before the rest are updated at once


def fit(weight: np.ndarray, bits: int, block: int, importance: np.ndarray | None = None):
    """`weight` [K, N] (K padded to whole blocks) as (levels [N, K / block, block] uint8, scales
    [N, K / block] float32, zero points [N, K / block] uint8)."""
    rows, cols = weight.shape
    x = np.ascontiguousarray(weight.T, dtype=np.float32).reshape(cols, rows // block, block)
    error_weights = _error_weights(x, importance, block).reshape(-1, block)
    x = x.reshape(-1, block)
    spans = [slice(start, start + _CHUNK) for start in range(0, len(x), _CHUNK)]
    with ThreadPoolExecutor(_THREADS) as pool:  # numpy's ufuncs let go of the GIL
        parts = list(pool.map(lambda span: _fit_blocks(x[span], error_weights[span], 2**bits - 1), spans))
    levels, scales, zeros = (np.concatenate(part) for part in zip(*parts))
    blocks = rows // block
    return levels.reshape(cols, blocks, block), scales.reshape(cols, blocks), zeros.reshape(cols, blocks)


def _error_weights(x: np.ndarray, importance: np.ndarray | None, block: int) -> np.ndarray:
    if importance is None:
        return np.sqrt(np.mean(x * x, -1, keepdims=True)) + np.abs(x)
    sigma2 = 2 * np.mean(x * x, -1, keepdims=True)
    per_channel = np.asarray(importance, np.float32)
    per_channel = np.pad(per_channel, (0, x.shape[1] * block - len(per_channel))).reshape(1, x.shape[1], block)
    return (per_channel + np.float32(1e-9)) * np.sqrt(sigma2 + x * x)


def _fit_blocks(x: np.ndarray, error_weights: np.ndarray, top: int):
    """The best (levels, scale, zero point) of each row of `x` [blocks, block] over the grid: for
    each candidate scale, the zero point rounded down and up, the levels rounded, the scale refitted
    by least squares twice (the levels re-rounded each time), its weighted error kept if least."""
    low, high = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    span = np.where(high > low, high - low, np.float32(1))
    best_error = np.full(low.shape, np.inf, np.float32)
    best_scale, best_zero = np.ones_like(low), np.zeros_like(low)
    for step in _STEPS:
        inverse = np.float32(top + step) / span
        rounded = np.round(x * inverse)
        for zero in (np.floor(-low * inverse).clip(0, top), np.ceil(-low * inverse).clip(0, top)):
            levels = np.clip(rounded + zero, 0, top)
            scale = 1 / inverse
            for _ in range(2):
                scale = _least_squares_scale(x, error_weights, levels - zero, scale)
                levels = np.clip(np.round(x / scale) + zero, 0, top)
            residual = scale * (levels - zero) - x
            error = (error_weights * residual * residual).sum(-1, keepdims=True)
            keep = error < best_error
            best_error = np.where(keep, error, best_error)
            best_scale, best_zero = np.where(keep, scale, best_scale), np.where(keep, zero, best_zero)
    levels = np.clip(np.round(x / best_scale) + best_zero, 0, top)
    return levels.astype(np.uint8), best_scale[:, 0], best_zero[:, 0].astype(np.uint8)


def _least_squares_scale(x, error_weights, centred, fallback):
    """The scale s minimising sum(w * (s * centred - x)^2), or `fallback` where it is degenerate."""
    weighted = error_weights * centred
    denominator = (weighted * centred).sum(-1, keepdims=True)
    scale = (weighted * x).sum(-1, keepdims=True) / np.where(denominator > 0, denominator, np.float32(1))
    return np.where((denominator > 0) & (np.abs(scale) > 1e-12), scale, fallback)


def pack(levels: np.ndarray, zeros: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' bytes: levels [N, blocks, block] and zero points [N, blocks] packed low nibble
    first at 4 bits (zero points padded to whole bytes per row), as they are at 8."""
    if bits == 8:
        return levels, zeros
    packed = levels[..., 0::2] | (levels[..., 1::2] << 4)
    if zeros.shape[1] % 2:
        zeros = np.pad(zeros, ((0, 0), (0, 1)))
    return packed.astype(np.uint8), (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).astype(np.uint8)


def dequantized(levels: np.ndarray, scales: np.ndarray, zeros: np.ndarray, columns: int = 1024) -> np.ndarray:
    """The [K, N] weight the blocks stand for (K padded to whole blocks), contiguous; made
    `columns` output columns at a time, so that it holds little besides itself."""
    n = levels.shape[0]
    out = np.empty((levels.shape[1] * levels.shape[2], n), np.float32)
    for start in range(0, n, columns):
        part = slice(start, start + columns)
        values = scales[part, :, None] * (levels[part].astype(np.float32) - zeros[part, :, None])
        out[:, part] = values.reshape(len(values), -1).T
    return out


def gptq(
    weight: np.ndarray,
    hessian: np.ndarray,
    bits: int,
    block: int,
    importance: np.ndarray | None = None,
    damp: float = 0.1,
    overwrite=False,
):
    """GPTQ (Frantar et al., 2022) on `weight` [K, N] (K padded to whole blocks) given the Hessian of
    its layer's error, `hessian` = X^T X / tokens [K, K] over the calibration text: the input
    channels are rounded one at a time, in blocks of `_COLUMNS`, and each one's error is spread over
    the channels not yet rounded by the inverse Hessian's Cholesky factor, so that what the layer
    outputs on the text moves least. Each block of `block` channels takes the scale and zero point
    that `fit`'s search finds for it as it is when its turn comes. Same outputs as `fit`. Where
    `overwrite`, a writable float32 `weight` is worked in, not copied."""
    channels, columns = weight.shape
    top = 2**bits - 1
    w = weight if overwrite and weight.dtype == np.float32 and weight.flags.writeable else np.array(weight, np.float32)
    factor = _inverse_factor(hessian, w, damp)
    levels = np.zeros((channels, columns), np.uint8)
    scales = np.zeros((channels // block, columns), np.float32)
    zeros = np.zeros((channels // block, columns), np.float32)
    for first in range(0, channels, _COLUMNS):
        last = min(first + _COLUMNS, channels)
        part, errors, u = w[first:last].copy(), np.zeros((last - first, columns), np.float32), factor[first:last, first:last]
        outer = np.empty_like(part)  # each channel's error spread over those after it (made once a block)
        for i in range(last - first):
            group = (first + i) // block
            if (first + i) % block == 0:
                x = part[i : i + block].T
                chosen = None if importance is None else importance[first + i : first + i + block]
                _, scale, zero = _fit_blocks(x, _error_weights(x[:, None], chosen, block)[:, 0], top)
                scales[group], zeros[group] = scale, zero
            level = np.clip(np.round(part[i] / scales[group]) + zeros[group], 0, top)
            levels[first + i] = level
            errors[i] = (part[i] - scales[group] * (level - zeros[group])) / u[i, i]
            spread = np.outer(u[i, i + 1 :], errors[i], out=outer[: last - first - i - 1])
            part[i + 1 :] -= spread
        for rest in range(last, channels, _rows_within(columns)):  # the channels left take the block's errors
            end = min(rest + _rows_within(columns), channels)
            w[rest:end] -= factor[first:last, rest:end].T @ errors
    return (
        levels.T.reshape(columns, channels // block, block),
        scales.T.copy(),
        zeros.T.astype(np.uint8),
    )


def _rows_within(columns: int, limit: int = 64 * 2**20) -> int:
    """How many rows of `columns` float32 values fit in `limit` bytes (at least one)."""
    return max(1, limit // (4 * columns))


def _inverse_factor(hessian: np.ndarray, w: np.ndarray, damp: float) -> np.ndarray:
    """The upper U with H^-1 = U^T U of the Hessian damped by `damp` of its mean diagonal, in
    float32 (the damping keeps it well conditioned), as GPTQ's reference takes it: H's Cholesky
    factor, the inverse from it, that inverse's upper factor. A channel the text never reached
    (diagonal 0) becomes independent and its row of `w` zero. At most two [K, K] float32 arrays
    are held besides `hessian`."""
    import torch

    h = torch.tensor(hessian, dtype=torch.float32)
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1
    w[dead.numpy()] = 0
    torch.diagonal(h).add_(damp * float(torch.diagonal(h).double().mean()))
    lower = torch.linalg.cholesky(h)
    del h
    inverse = torch.cholesky_inverse(lower)
    del lower
    return torch.linalg.cholesky(inverse, upper=True).numpy()


def fit_weight(weight: np.ndarray, bits: int, block: int, importance=None, hessian=None, overwrite: bool = False):
    """`weight` [K, N] (any K) fitted by `gptq` where a Hessian is given, else by `fit` (weighted by
    `importance` where given), as `fit` returns it (K padded to whole blocks). `overwrite`: the
    caller's `weight` (float32) may be worked in, not copied."""
    rows = -(-weight.shape[0] // block) * block
    if rows != weight.shape[0]:  # (a copy, worked in)
        weight, overwrite = np.pad(np.asarray(weight, np.float32), ((0, rows - weight.shape[0]), (0, 0))), True
    if hessian is not None:
        if rows > len(hessian):  # (a copy: only where K is not whole blocks)
            hessian = np.pad(hessian, ((0, rows - len(hessian)), (0, rows - len(hessian))))
        columns = weight.shape[1]
        step = max(_rows_within(rows), block)  # output columns are independent: a wide lm_head in parts
        if step >= columns:
            return gptq(weight, hessian, bits, block, _padded(importance, rows), overwrite=overwrite)
        parts = [
            gptq(weight[:, start : start + step], hessian, bits, block, _padded(importance, rows)) for start in range(0, columns, step)
        ]
        return tuple(np.concatenate(part) for part in zip(*parts))
    return fit(weight, bits, block, _padded(importance, rows))


class FittedBlocks:
    """Blocks fitted ahead of the pass that writes them, by weight name: each weight's `fit` result
    kept in a file of `folder` (a model's 4-bit levels would otherwise sit in memory beside the
    measure that fits them, and its weights)."""

    def __init__(self, folder: Path):
        self.folder, self._files, self._made = Path(folder), {}, 0

    def __setitem__(self, name: str, blocks: tuple) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self._made:05d}.npz"
        np.savez(path, *blocks)
        self._files[name], self._made = path, self._made + 1

    def __getitem__(self, name: str) -> tuple:
        with np.load(self._files[name]) as kept:
            return tuple(kept[f"arr_{i}"] for i in range(3))

    def pop(self, name: str, default=None):
        """The blocks of `name`, their file removed; `default` where none were fitted."""
        if name not in self._files:
            return default
        blocks = self[name]
        self._files.pop(name).unlink()
        return blocks


def statistics(activations, name: str, with_hessian: bool):
    """(importance, Hessian) of the MatMul input `name`: the Hessian only `with_hessian` (gptq);
    (None, None) without activations or where the text did not reach it."""
    if activations is None:
        return None, None
    hessian = activations.hessian(name) if with_hessian else None
    return (np.diag(hessian).copy() if hessian is not None else activations.importance(name)), hessian


def search_quantizer(config, activations=None, with_hessian: bool = False, fitted: dict | None = None):
    """ONNX Runtime's MatMulNBits node quantizer (the round-to-nearest one, `config` its
    DefaultWeightOnlyQuantConfig) with its blocks fitted by `fit_weight` (k_quant's search, or
    gptq's `with_hessian`) from `activations` (calibration.Activations); `fitted` holds blocks already fitted at
    `config.bits`, by weight name (what `--keep-int8 auto`'s measure fitted)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    class SearchQuantizer(DefaultWeightOnlyQuantizer):
        current = (None, None)  # (input name, weight name) of the MatMul being quantized
        known = (None, None)  # (input name, (importance, Hessian)): MatMuls that share an input share them

        def quantize(self, node, graph_stack):
            self.current = (node.input[0], node.input[1])
            return super().quantize(node, graph_stack)

        def qbits_block_quant(self, weight):
            bits, block = self.config.bits, self.config.block_size
            blocks = (fitted or {}).pop(self.current[1], None) or fit_weight(weight, bits, block, *self._statistics())
            levels, scales, zeros = blocks
            packed, zeros = pack(levels, zeros, bits)
            return packed, scales.astype(weight.dtype), zeros  # scales in the activations' type (fp16 exports)

        def _statistics(self):
            if self.known[0] != self.current[0]:
                self.known = (self.current[0], statistics(activations, self.current[0], with_hessian))
            return self.known[1]

    return SearchQuantizer(config)


def _padded(values: np.ndarray | None, length: int) -> np.ndarray | None:
    return None if values is None else np.pad(values, (0, length - len(values)))
