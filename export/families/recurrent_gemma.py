"""RecurrentGemma's (Griffin's) recurrent blocks: a causal convolution, then the RG-LRU, a
diagonal linear recurrence h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t), reset at each text's
first position. transformers' own keep their states on the modules, not in the cache, decode
one token through another path than a prompt, and scan the prompt token by token in Python,
which a trace would unroll. Here each pass runs the convolution through CausalConvWithState and
the recurrence through LinearAttention's gated rule, a head per channel (key and query 1, the
value the normalized input, the decay log a_t), both states in the cache layer (`conv_states[0]`
[batch, width, K - 1], `recurrent_states[0]` [batch, width, 1, 1]).

The blocks do not keep their layer's index, which the cache needs: `number_blocks` gives it them.
The trace runs the forward inside `patches.traceable_recurrent_gemma`, its dummy prompt too
(Family.prompt_patched), so that the states it starts from are in the cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear_attention import CausalConv, GatedLinearRule

RESET_DECAY = -1e4  # log a at a text's first position: exp of it is 0, the state forgotten


def number_blocks(model) -> None:
    """Give each recurrent block its layer's index (`layer_idx`), as the attention blocks have."""
    for index, layer in enumerate(model.model.layers):
        layer.temporal_block.layer_idx = index


def recurrent_block_forward(self, input_states, position_ids, attention_mask=None, use_cache=True, cache=None, **kwargs):
    """[batch, sequence, hidden] -> ([batch, sequence, hidden], None)."""
    layer = cache.layers[self.layer_idx]
    batch = input_states.shape[0]
    y = self.act_fn(self.linear_y(input_states))
    x = self.linear_x(input_states).transpose(1, 2)
    if layer.conv_states[0] is None:  # the dummy prompt's first pass
        layer.conv_states[0] = x.new_zeros(batch, x.shape[1], self.conv1d_width - 1)
    x, layer.conv_states[0] = CausalConv.apply(x, self.conv_1d.weight, self.conv_1d.bias, layer.conv_states[0], "none")
    x = _recurrence(self.rg_lru, x.transpose(1, 2), position_ids, layer)
    return self.linear_out(x * y), None


def _recurrence(self, x, position_ids, layer):
    """The RG-LRU over x [batch, sequence, width] from the layer's state (updated)."""
    batch, length, _ = x.shape
    width = self.num_attention_heads * self.block_width  # a Python int: the op's head count is an attribute
    reset = position_ids[:, :, None] == 0
    blocks = x.reshape(batch * length, self.num_attention_heads, self.block_width).permute(1, 0, 2)

    def gate(weight, bias):
        return torch.sigmoid(torch.baddbmm(bias[:, None, :], blocks, weight).transpose(0, 1).reshape(batch, length, width))

    input_gate, recurrent_gate = (
        gate(self.input_gate_weight, self.input_gate_bias),
        gate(self.recurrent_gate_weight, self.recurrent_gate_bias),
    )
    log_a = -8.0 * recurrent_gate * F.softplus(self.recurrent_param)
    multiplier = torch.where(reset, torch.ones_like(log_a), torch.sqrt(1 - torch.exp(2 * log_a)))
    value = x * input_gate * multiplier
    decay = torch.where(reset, torch.full_like(log_a, RESET_DECAY), log_a)
    if layer.recurrent_states[0] is None:  # the dummy prompt's first pass
        layer.recurrent_states[0] = x.new_zeros(batch, width, 1, 1)
    query, key = torch.ones_like(value), torch.ones_like(value)
    out, layer.recurrent_states[0] = GatedLinearRule.apply(query, key, value, layer.recurrent_states[0], decay, width, width, 1.0)
    return out
