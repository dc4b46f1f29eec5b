"""MiniMax's lightning attention: linear attention with a fixed decay per head, the state S [B,
heads, key size, value size] after each token exp(-slope) S + k v^T and the output q S (no
scale). transformers' own runs a prompt in Python blocks and a decode step token by token, which
a trace would unroll for the traced length; here every pass is one LinearAttention (its gated
rule, the decay -slope for every token), its state in the cache layer's `recurrent_states[0]`.
MiniMax's model takes only its own cache class, which the trace builds (Family.own_cache). The
trace runs it inside `patches.traceable_minimax`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear_attention import GatedLinearRule


def lightning_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """[batch, sequence, hidden] -> ([batch, sequence, hidden], the new state). Every position is
    taken as a real token (the runtime passes no padding to state layers)."""
    batch, length, _ = hidden_states.shape
    heads, size = self.num_attention_heads, self.head_dim
    layer = cache.layers[self.layer_idx]
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(batch, length, heads, 3 * size)
    query, key, value = (t.reshape(batch, length, heads * size) for t in torch.split(qkv, size, dim=3))
    decay = (-self.slope_rate.reshape(1, 1, heads)).expand(batch, length, heads).to(query.dtype)
    out, layer.recurrent_states[0] = GatedLinearRule.apply(query, key, value, layer.recurrent_states[0], decay, heads, heads, 1.0)
    out = F.sigmoid(self.output_gate(hidden_states)) * self.norm(out)
    return self.out_proj(out), layer.recurrent_states[0]
