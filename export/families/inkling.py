"""Inkling's and Inkling 2's short convolutions: four per layer (on the keys, on the values, after
the attention, after the MLP), each with its own state in the layer's cache (`conv_states[i]`,
export/trace.py's `conv`, `conv1`, `conv2`, `conv3`). transformers' own decode one token through
another path than a prompt (a fused update kernel), which a trace would freeze at the traced
length; here every pass runs the same code on a state of the kernel's last K - 1 inputs:

- a static convolution (per-channel taps) through CausalConvWithState (export/linear_attention.py),
  plus the residual, times 1 / sqrt(K + 1) in Inkling 2;
- Inkling 2's dynamic convolution (static taps plus taps projected from the layer's input per
  token and head) in plain ops over the K - 1 past inputs and the pass's.

The trace runs them inside `patches.traceable_inkling`.
"""

from __future__ import annotations

import math

import torch

from ..linear_attention import CausalConv


def _state_layer(self, cache, cache_offset: int):
    return cache.layers[self.layer_idx + cache_offset]


def _masked(hidden_states: torch.Tensor, conv_mask) -> torch.Tensor:
    """Padding tokens zeroed (conv_mask [batch, sequence], 1 for a token), as transformers does."""
    return hidden_states if conv_mask is None else hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)


def _static(scaled: bool):
    def forward(self, hidden_states, dynamic_input=None, cache=None, conv_mask=None, cache_offset=0, **kwargs):
        """[batch, sequence, channels] -> the same: the causal depthwise convolution from the
        layer's state (updated), plus the input, scaled by 1 / sqrt(K + 1) where `scaled`."""
        dtype = hidden_states.dtype
        residual = hidden_states.float()
        layer = _state_layer(self, cache, cache_offset)
        weight = self.conv1d.weight.float()
        bias = self.conv1d.bias.float() if self.conv1d.bias is not None else torch.zeros(weight.shape[0])
        x = _masked(residual, conv_mask).transpose(1, 2)
        out, layer.conv_states[self.conv_idx] = CausalConv.apply(x, weight, bias, layer.conv_states[self.conv_idx], "none")
        out = out.transpose(1, 2) + residual
        return (out / math.sqrt(self.conv_kernel_size + 1) if scaled else out).to(dtype)

    return forward


inkling_short_conv_forward = _static(scaled=False)
inkling2_short_conv_forward = _static(scaled=True)


def inkling2_dynamic_conv_forward(self, hidden_states, dynamic_input, cache=None, conv_mask=None, cache_offset=0, **kwargs):
    """Inkling 2's dynamic short convolution: each token's taps [heads, K] are the static taps plus
    `weight_proj(dynamic_input)`, over the K - 1 past inputs (the state) and the pass's own."""
    dtype = hidden_states.dtype
    batch, length, channels = hidden_states.shape
    taps = self.conv_kernel_size
    layer = _state_layer(self, cache, cache_offset)
    dynamic = self.weight_proj(dynamic_input).float().view(batch, length, self.num_heads, 1, taps)
    weights = self.static_weight.float().T.view(self.num_heads, -1, taps) + dynamic
    residual = hidden_states.float()
    context = torch.cat([layer.conv_states[self.conv_idx], _masked(residual, conv_mask).transpose(1, 2)], dim=-1)
    layer.conv_states[self.conv_idx] = context[..., -(taps - 1) :]
    # windows[..., lag] is the token `lag` steps back: [batch, sequence, heads, channels / heads, K]
    # (shifted slices, not unfold, which torch.onnx cannot write for a length known only at run time)
    lagged = [context[..., taps - 1 - lag : (-lag or None)] for lag in range(taps)]
    windows = torch.stack(lagged, dim=-1).transpose(1, 2).reshape(batch, length, self.num_heads, -1, taps)
    out = (windows * weights).sum(-1).reshape(batch, length, channels)
    return ((out + residual) / math.sqrt(2 * taps + 1)).to(dtype)
