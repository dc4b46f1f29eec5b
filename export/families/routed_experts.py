"""Experts routed in Python: DBRX's, JetMoE's and LongCat-Flash's experts find each expert's tokens
with data-dependent Python (a loop over the experts hit, a split by per-expert counts), which a
trace freezes at the traced tokens. Here each (token, choice) pair gathers its expert's matrices
and multiplies them batched, as transformers' `batched_mm` experts do for the families that take
`_experts_implementation` (export/trace.py): a decode step reads only the chosen experts. The
trace runs them inside `patches.traceable_routed_experts`."""

from __future__ import annotations

import torch


def _pairs(hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token repeated once per choice [tokens * k, hidden], and the experts chosen [tokens * k]."""
    k = top_k_index.shape[-1]
    return hidden_states[:, None, :].expand(-1, k, -1).reshape(-1, hidden_states.shape[-1]), top_k_index.reshape(-1)


def _apply(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weights [pairs, out, in] times x [pairs, in]: [pairs, out]."""
    return torch.bmm(weights, x[..., None])[..., 0]


def _weighted_sum(out: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The pairs' outputs [tokens * k, hidden] weighted by their routing weights, summed per token."""
    k = top_k_weights.shape[-1]
    return (out * top_k_weights.reshape(-1, 1).to(out.dtype)).view(-1, k, out.shape[-1]).sum(1)


def dbrx_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """DbrxExperts: w1, v1 and w2 are [experts * ffn, hidden]; the expert is gate(w1) * v1, then w2."""
    batch = hidden_states.shape[0]
    x, chosen = _pairs(hidden_states.reshape(-1, self.hidden_size), top_k_index)
    shape = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    w1, v1, w2 = (getattr(self.mlp, name).view(shape)[chosen] for name in ("w1", "v1", "w2"))
    inner = self.mlp.activation_fn(_apply(w1, x)) * _apply(v1, x)
    out = _apply(w2.transpose(1, 2), inner)
    return _weighted_sum(out, top_k_weights).view(batch, -1, self.hidden_size)


def longcat_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """LongcatFlashExperts: the routed experts' gate_up_proj [experts, 2 * ffn, hidden] and down_proj
    [experts, hidden, ffn]; a choice past the routed experts is a zero-compute expert, the identity."""
    x, chosen = _pairs(hidden_states, top_k_index)
    routed = chosen.clamp(max=self.num_routed_experts - 1)
    gate, up = _apply(self.gate_up_proj[routed], x).chunk(2, dim=-1)
    out = _apply(self.down_proj[routed], self.act_fn(gate) * up)
    out = torch.where((chosen >= self.num_routed_experts)[:, None], x, out)
    return _weighted_sum(out, top_k_weights).to(hidden_states.dtype)


def jetmoe_gating_forward(self, hidden_states):
    """JetMoeTopKGating's routing with the (token, choice) pairs left in their order, not sorted by
    expert: the "sorted" order is the identity, the token of each pair, its gate, and the expert of
    each pair (a tensor) where transformers gives the per-expert counts as a Python list."""
    logits = self.layer(hidden_states).float()
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states).flatten()
    experts = top_k_indices.flatten()
    pairs = torch.ones_like(experts).cumsum(0) - 1  # an arange as long as the pairs, traced as such
    return pairs, pairs.div(self.top_k, rounding_mode="trunc"), gates, experts, logits


def jetmoe_experts_forward(self, inputs, experts):
    """JetMoeParallelExperts: weight [experts, out, in]; each row of `inputs` through its own expert."""
    return _apply(self.weight[experts], inputs)


def jetmoe_moe_forward(self, layer_input):
    """JetMoeMoE: each pair's expert MLP, the pairs of a token summed (no index_add: torch.onnx writes
    one with repeated indices as a scatter that keeps one of them)."""
    bsz, length, hidden = layer_input.size()
    x = layer_input.reshape(-1, hidden)
    _, _, gates, experts, _ = self.router(x)
    pairs, _ = _pairs(x, experts.view(x.shape[0], -1))
    gate, up = self.input_linear(pairs, experts).chunk(2, dim=-1)
    out = self.output_linear(self.activation(gate) * up, experts)
    return _weighted_sum(out, gates.view(x.shape[0], -1)).view(bsz, length, hidden) + self.bias


def jetmoe_moa_reduce(self, layer_input, topo_info):
    """JetMoeMoA.reduce over pairs in their order (`jetmoe_gating_forward`): each head group's output
    projection, the pairs of a token summed."""
    bsz, length, k, hidden = layer_input.size()
    _, _, gates, experts = topo_info
    out = self.output_linear(layer_input.reshape(-1, hidden), experts)
    return _weighted_sum(out, gates.view(-1, k)).view(bsz, length, self.input_size) + self.bias
