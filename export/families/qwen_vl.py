"""Qwen's vision encoders (Qwen2.5-VL's, Qwen 3.5's) as one graph of any picture size: pixels [1,
3, H, W] (H and W whole tokens, as the manifest's `fit_pixels` step makes them) -> features
[tokens, hidden], the picture's tokens row by row.

transformers' encoders take the processor's flattened patches with the grid size beside them, and
work out the patches' rotary positions (and Qwen2.5-VL's windows, Qwen 3.5's resampled learned
position table) with Python loops over that grid (`.tolist()`), which a trace would freeze at the
traced picture's size. Here each of those is made of tensor ops on the pixels' own shape, so the
graph serves every size:
- the patches: the processor's reshape and transpose (each patch repeated along time, as the
  processor repeats a still picture);
- Qwen2.5-VL's windows: each merged unit's window (row-major windows of `window` units a side,
  row-major within one), the units sorted by it: the order transformers' window index gives; its
  windowed blocks attend through a mask of the patches that share a window (full blocks: none),
  where transformers splits the sequence at the windows' bounds;
- Qwen 3.5's position table: its square grid of learned embeddings resampled bilinearly (corners
  aligned) to the picture's rows and columns, with transformers' own taps and weights."""

from __future__ import annotations

from typing import Callable

from .processor import RESAMPLE_NAMES, VisionEncoder, normalization


def encode(model, pixel_values):
    """Qwen2.5-VL's: windowed blocks, and full ones where the config says."""
    import torch

    visual = model.model.visual
    config = visual.config
    size, merge = config.patch_size, config.spatial_merge_size
    flat, rows, cols = patches(pixel_values, size, merge, config.temporal_patch_size)
    hidden = visual.patch_embed(flat)
    order, windows = _window_order(rows // merge, cols // merge, config.window_size // merge // size)
    unit = merge * merge
    cos, sin = visual.rotary_pos_emb(hidden, _positions(rows, cols, merge))
    hidden, cos, sin = (_in_order(t, order, unit) for t in (hidden, cos, sin))
    window = windows[:, None].expand(-1, unit).reshape(-1)
    same_window = window[:, None] == window[None, :]
    for index, block in enumerate(visual.blocks):
        mask = None if index in visual.fullatt_block_indexes else same_window
        hidden = hidden + _attention(block.attn, block.norm1(hidden), cos, sin, mask)
        hidden = hidden + block.mlp(block.norm2(hidden))
    merged = visual.merger(hidden)
    return merged[torch.argsort(order.float())]  # back to row by row


def encode_qwen3_5(model, pixel_values):
    """Qwen 3.5's: every block attends over the whole picture, after the learned position table
    resampled to its grid is added to the patches."""
    visual = model.model.visual
    config = visual.config
    flat, rows, cols = patches(pixel_values, config.patch_size, config.spatial_merge_size, config.temporal_patch_size)
    positions = _positions(rows, cols, config.spatial_merge_size)
    hidden = visual.patch_embed(flat) + _resampled_table(visual, positions)
    cos, sin = visual.rotary_pos_emb(hidden, positions)
    for block in visual.blocks:
        hidden = hidden + _attention(block.attn, block.norm1(hidden), cos, sin, None)
        hidden = hidden + block.mlp(block.norm2(hidden))
    return visual.merger(hidden)


def _resampled_table(visual, positions):
    """Each patch's learned position embedding: the model's square table resampled to the grid of
    `positions` [patches, 2] (its rows and columns counted from their largest)."""
    from transformers.vision_utils import _interpolation_axis_taps_weights

    side = visual.num_grid_per_side
    row, col = positions[:, 0], positions[:, 1]
    row_taps, row_weights = _interpolation_axis_taps_weights(row, row.max() + 1, side, "bilinear", align_corners=True)
    col_taps, col_weights = _interpolation_axis_taps_weights(col, col.max() + 1, side, "bilinear", align_corners=True)
    taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return (visual.pos_embed(taps) * weights[:, :, None]).sum(1)


def patches(pixel_values, size: int, merge: int, frames: int):
    """The processor's patches [rows * cols, channels * frames * size * size], merged units' patches
    together, and the patch grid's rows and columns."""
    channels = pixel_values.shape[1]
    rows, cols = pixel_values.shape[2] // size, pixel_values.shape[3] // size
    x = pixel_values[0].reshape(channels, rows // merge, merge, size, cols // merge, merge, size)
    x = x.permute(1, 4, 2, 5, 0, 3, 6).unsqueeze(5)  # (rows/m, cols/m, m, m, channels, 1, size, size)
    x = x.expand(-1, -1, -1, -1, -1, frames, -1, -1)
    return x.reshape(rows * cols, channels * frames * size * size), rows, cols


def _positions(rows, cols, merge: int):
    """Each patch's (row, column) [patches, 2], in the patches' order."""
    import torch

    def laid_out(grid):
        return grid.reshape(rows // merge, merge, cols // merge, merge).transpose(1, 2).reshape(-1)

    row = torch.arange(rows)[:, None].expand(rows, cols)
    col = torch.arange(cols)[None, :].expand(rows, cols)
    return torch.stack([laid_out(row), laid_out(col)], dim=-1)


def _window_order(rows, cols, window: int):
    """(order, windows): the merged units sorted by window, then row and column within it, and the
    window of each in that order."""
    import torch

    row = torch.arange(rows)[:, None].expand(rows, cols).reshape(-1)
    col = torch.arange(cols)[None, :].expand(rows, cols).reshape(-1)
    across = cols // window + 1  # windows a row: enough for the last, partial, one
    key = ((row // window) * across + col // window) * (window * window) + (row % window) * window + col % window
    order = torch.argsort(key.float())  # exact: keys stay far below 2**24
    return order, key[order] // (window * window)


def _in_order(tensor, order, unit: int):
    """The rows of `tensor` [patches, ...] with its merged units (`unit` patches each) in `order`."""
    width = tensor.shape[-1]
    return tensor.reshape(-1, unit, width)[order].reshape(-1, width)


def _attention(attention, hidden, cos, sin, mask):
    """The block's attention over all patches, or (`mask`) within each window."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision  # Qwen 3.5's is the same

    count = hidden.shape[0]
    query, key, value = attention.qkv(hidden).reshape(count, 3, attention.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    query, key = apply_rotary_pos_emb_vision(query, key, cos, sin)
    query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # [heads, patches, head size]
    scores = query @ key.transpose(1, 2) * attention.scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = (scores.softmax(-1) @ value).transpose(0, 1).reshape(count, -1)
    return attention.proj(out)


def describe(processor) -> dict:
    """Qwen2.5-VL and Qwen 3.5: each picture resized to whole tokens (a token is `grid` pixels square: patches
    merged 2x2) within the processor's pixel bounds, keeping its shape as near as that allows; its
    tokens in the place of the <|image_pad|> the chat template writes, placed by their row and
    column (rotary "3d")."""
    images = processor.image_processor
    grid = int(images.patch_size * images.merge_size)
    bounds = {"min_pixels": int(images.size["shortest_edge"]), "max_pixels": int(images.size["longest_edge"])}
    return {
        "steps": [{"op": "fit_pixels", "multiple": grid, **bounds}],
        "resample": RESAMPLE_NAMES[int(images.resample)],
        "image_token": processor.image_token,
        "grid": grid,
        "marker": processor.image_token,
        "expansion": "{image}",
        "rotary": "3d",
        **normalization(images),
    }


def layout(processor) -> Callable:
    import torch

    images = processor.image_processor
    sizes = (images.patch_size, images.merge_size, images.temporal_patch_size)
    return lambda pixels: patches(torch.from_numpy(pixels), *sizes)[0].numpy()


QWEN2_5_VL = VisionEncoder(encode, describe, layout)
QWEN3_5 = VisionEncoder(encode_qwen3_5, describe, layout)
