"""Linear-attention layers traced into ONNX Runtime's fused ops.

A gated DeltaNet layer (Qwen 3.5's `linear_attention` layers) keeps a fixed-size state instead of a
KV cache: a convolution state (the last kernel - 1 inputs of its causal depthwise convolution) and a
recurrent state (one [key, value] matrix per value head). transformers computes them with Python
loops over chunks and tokens, which a trace would unroll for the traced length alone. Here each
becomes one op of ONNX Runtime's `com.microsoft` domain, which runs a prompt of any length in one
pass (fused CPU kernels since ONNX Runtime 1.30):

- `CausalConvWithState(input [B, C, T], weight [C, 1, K], past_state [B, C, K - 1], activation=silu)`
  -> (output [B, C, T], present_state [B, C, K - 1]) (LFM's short convolutions: no activation, and
  no recurrent state);
- `LinearAttention(query [B, T, Hk * dk], key [B, T, Hk * dk], value [B, T, Hv * dv], past_state
  [B, Hv, dk, dv], decay [B, T, Hv], beta [B, T, Hv], update_rule=gated_delta)` -> (output [B, T,
  Hv * dv], present_state [B, Hv, dk, dv]).

Each is a `torch.autograd.Function` whose forward computes the same values in PyTorch (the trace
runs it) and whose `symbolic` writes the op. `gated_deltanet_forward` is Qwen 3.5's layer with them;
export/patches.py puts it in place of transformers' while a model is traced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalConv(torch.autograd.Function):
    """The depthwise causal convolution of `x` [B, C, T] continued from `state` [B, C, K - 1],
    through `activation` ("silu" or "none")."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, activation: str):
        full = torch.cat([state, x], dim=-1)
        out = F.conv1d(full, weight, bias, groups=weight.shape[0])
        return F.silu(out) if activation == "silu" else out, full[:, :, -state.shape[-1] :]

    @staticmethod
    def symbolic(g, x, weight, bias, state, activation: str):
        out, present = g.op("com.microsoft::CausalConvWithState", x, weight, bias, state, activation_s=activation, outputs=2)
        return _typed(out, x), _typed(present, state)


class GatedDeltaRule(torch.autograd.Function):
    """The gated delta rule over T tokens from `state` [B, Hv, dk, dv]: query and key [B, T, Hk *
    dk] (L2-normalized), value [B, T, Hv * dv], decay (log-space) [B, T, Hv] or [B, T, Hv * dk], and beta [B, T, Hv]; each of the
    `key_heads` key and query heads serves Hv / Hk consecutive value heads of the `heads`. Returns the output [B, T, Hv * dv] and the
    state after the last token."""

    @staticmethod
    def forward(ctx, query, key, value, state, decay, beta, key_heads: int, heads: int):
        batch, length = query.shape[:2]
        key_size, value_size = state.shape[2:]
        q, k = (t.reshape(batch, length, -1, key_size) for t in (query, key))
        q, k = (t.repeat_interleave(heads // t.shape[2], dim=2).transpose(1, 2) for t in (q, k))
        v = value.reshape(batch, length, heads, value_size).transpose(1, 2)
        q = q * key_size**-0.5
        out, state = torch.empty_like(v), state.clone()
        # a decay per head [B, T, Hv], or per head and key channel [B, T, Hv * dk] (Kimi's)
        decay = decay.reshape(batch, length, heads, -1, 1)
        for t in range(length):
            state = state * decay[:, t].exp()
            update = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, t, :, None]
            state = state + k[:, :, t, :, None] * update[:, :, None, :]
            out[:, :, t] = (state * q[:, :, t, :, None]).sum(-2)
        return out.transpose(1, 2).reshape(batch, length, heads * value_size), state

    @staticmethod
    def symbolic(g, query, key, value, state, decay, beta, key_heads: int, heads: int):
        out, present = g.op(
            "com.microsoft::LinearAttention",
            query,
            key,
            value,
            state,
            decay,
            beta,
            q_num_heads_i=key_heads,
            kv_num_heads_i=heads,
            scale_f=0.0,  # 1 / sqrt(key head size), the op's default
            update_rule_s="gated_delta",
            outputs=2,
        )
        return _typed(out, value), _typed(present, state)


class KeepLeading(torch.autograd.Function):
    """`x` reshaped to its first two axes (batch, sequence) and then `tail`: one Reshape to a
    constant shape [0, 0, *tail] (ONNX's 0 copies the input's axis), where a reshape to the traced
    x.shape[:2] costs Shape, Gather, Unsqueeze and Concat nodes, which every decode step runs."""

    @staticmethod
    def forward(ctx, x, tail: tuple[int, ...]):
        return x.reshape(*x.shape[:2], *tail)

    @staticmethod
    def symbolic(g, x, tail: tuple[int, ...]):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([0, 0, *tail], dtype=torch.int64)))


def _kept(x, *tail: int):
    """`x` as [batch, sequence, *tail] (KeepLeading)."""
    return KeepLeading.apply(x, tuple(tail))


def _gated_norm(norm, x, gate):
    """A Mamba-2 mixer's gated RMS norm over groups (transformers' `*RMSNormGated` with a
    `group_size`), with constant-shape reshapes; another kind of norm (Falcon-H1's) as the module has it."""
    if not hasattr(norm, "group_size"):
        return norm(x, gate)
    gated = x * F.silu(gate)
    groups = _kept(gated, -1, norm.group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * _kept(groups, -1)


def _typed(output, like):
    """`output` given the type (and shape) of `like`, for torch.onnx's shape inference, which knows no contrib op."""
    output.setType(like.type())
    return output


def _l2_normalized(x, size: int, eps: float = 1e-6):
    """Each head of `x` [B, T, H * size] divided by its L2 norm, as transformers' l2norm does."""
    heads = x.reshape(*x.shape[:2], -1, size)
    return (heads * torch.rsqrt((heads * heads).sum(-1, keepdim=True) + eps)).reshape(x.shape)


def gated_deltanet_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """A gated DeltaNet layer's forward (Qwen 3.5's, Qwen3-Next's, OLMo Hybrid's) through the two ops, its state
    read from and written to the cache layer's `conv_states[0]` and `recurrent_states[0]`. Every
    position is taken as a real token (the runtime passes no padding to these layers)."""
    batch, length, _ = hidden_states.shape
    layer = cache.layers[self.layer_idx]
    mixed, a, beta, gate, norm, out_proj = _projections(self, hidden_states)
    mixed, layer.conv_states[0] = _convolved(self.conv1d, mixed, layer.conv_states[0], "silu")
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    out, layer.recurrent_states[0] = _delta_rule(
        query, key, value, layer, decay, beta, self.head_k_dim, self.num_k_heads, self.num_v_heads
    )
    out = norm(out.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim)).reshape(batch, length, -1)
    return out_proj(out)


def _delta_rule(query, key, value, layer, decay, beta, key_size: int, key_heads: int, heads: int):
    """The gated delta rule on the layer's recurrent state, query and key L2-normalized per head: (output, new state)."""
    q, k = _l2_normalized(query, key_size), _l2_normalized(key, key_size)
    return GatedDeltaRule.apply(q, k, value, layer.recurrent_states[0], decay, beta, key_heads, heads)


def kimi_delta_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Kimi Linear's delta attention (the gated delta rule with a decay per key channel) through
    the two ops, as `gated_deltanet_forward`; Bailing's hybrid too (its output gate one projection)."""
    batch, length, _ = hidden_states.shape
    layer = cache.layers[self.layer_idx]
    mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
    mixed, layer.conv_states[0] = _convolved(self.conv1d, mixed, layer.conv_states[0], "silu")
    query, key, value = torch.split(mixed, [self.qkv_dim] * 3, dim=-1)
    decay = self.forget_gate(hidden_states).reshape(batch, length, -1)
    beta = torch.sigmoid(self.b_proj(hidden_states))
    out, layer.recurrent_states[0] = _delta_rule(query, key, value, layer, decay, beta, self.head_dim, self.num_heads, self.num_heads)
    gate = self.g_proj(hidden_states) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(hidden_states))
    gate = gate.reshape(batch, length, -1, self.head_dim)
    out = self.o_norm(out.reshape(batch, length, -1, self.head_dim), gate).reshape(batch, length, -1)
    return self.o_proj(out)


def _projections(self, hidden_states):
    """(query, key and value before the convolution, the decay's input, beta, the output gate, the
    gated norm, the output projection), by each family's module names."""
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: query, key, value and gate interleaved per key head
        query, key, value, gate, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        )
        mixed = torch.cat([t.reshape(*t.shape[:2], -1) for t in (query, key, value)], dim=-1)
        return mixed, a, b.sigmoid(), gate, self.norm, self.out_proj
    if hasattr(self, "in_proj_qkv"):  # Qwen 3.5
        beta = self.in_proj_b(hidden_states).sigmoid()
        mixed = self.in_proj_qkv(hidden_states)
        return mixed, self.in_proj_a(hidden_states), beta, self.in_proj_z(hidden_states), self.norm, self.out_proj
    beta = self.b_proj(hidden_states).sigmoid() * (2.0 if self.allow_neg_eigval else 1.0)  # OLMo Hybrid
    mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
    return mixed, self.a_proj(hidden_states), beta, self.g_proj(hidden_states), self.o_norm, self.o_proj


def short_conv_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """LFM 2's and LFM 3's `ShortConv.forward` (a gated depthwise convolution, no activation)
    through CausalConvWithState, its state read from and written to the cache layer's
    `conv_states[0]`."""
    layer = cache.layers[self.layer_idx]
    gate_in, gate_out, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
    weight = self.conv.weight
    bias = self.conv.bias if self.conv.bias is not None else torch.zeros(weight.shape[0], dtype=weight.dtype)
    out, layer.conv_states[0] = CausalConv.apply(gate_in * x, weight, bias, layer.conv_states[0], "none")
    return self.out_proj((gate_out * out).transpose(-1, -2).contiguous())


class GatedLinearRule(torch.autograd.Function):
    """The gated linear rule over T tokens from `state` [B, H, dk, dv]: S = exp(g) S + k ⊗ v, output
    scale * q^T S, with query and key [B, T, Hk * dk] (each of the `key_heads` serving H / Hk
    consecutive heads), value [B, T, H * dv] and decay g (log-space) [B, T, H], or per key channel
    [B, T, H * dk]. A Mamba-2 scan: key B, query C (a group a key head), value x dt, decay A dt per
    head. A Mamba-1 scan: one key head, a head per channel with dv 1, decay A dt per channel and
    state entry."""

    @staticmethod
    def forward(ctx, query, key, value, state, decay, key_heads: int, heads: int, scale: float):
        batch, length = query.shape[:2]
        key_size, value_size = state.shape[2:]
        q, k = (
            t.reshape(batch, length, key_heads, key_size).repeat_interleave(heads // key_heads, dim=2).transpose(1, 2)
            for t in (query, key)
        )
        v = value.reshape(batch, length, heads, value_size).transpose(1, 2)
        decay = decay.reshape(batch, length, heads, -1, 1)
        out, state = torch.empty_like(v), state.clone()
        for t in range(length):
            state = state * decay[:, t].exp() + k[:, :, t, :, None] * v[:, :, t, None, :]
            out[:, :, t] = scale * (state * q[:, :, t, :, None]).sum(-2)
        return out.transpose(1, 2).reshape(batch, length, heads * value_size), state

    @staticmethod
    def symbolic(g, query, key, value, state, decay, key_heads: int, heads: int, scale: float):
        out, present = g.op(
            "com.microsoft::LinearAttention",
            query,
            key,
            value,
            state,
            decay,
            q_num_heads_i=key_heads,
            kv_num_heads_i=heads,
            scale_f=scale,
            update_rule_s="gated",
            outputs=2,
        )
        return _typed(out, value), _typed(present, state)


def mamba2_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """A Mamba-2 mixer's forward (Bamba's, Granite 4.0-H's) through the two ops: the convolution of
    x, B and C through CausalConvWithState, the selective scan through LinearAttention's gated rule.
    Its state is read from and written to the cache layer's `conv_states[0]` and
    `recurrent_states[0]`, the latter [B, heads, state size, head size]: transformers' [B, heads,
    head size, state size] transposed (export/trace.py), the op's key-by-value layout. Every
    position is taken as a real token (the runtime passes no padding to these layers)."""
    layer = cache.layers[self.layer_idx]
    projected = self.in_proj(hidden_states * getattr(self, "ssm_in_multiplier", 1.0))
    if hasattr(self, "mup_vector"):  # Falcon-H1's multipliers
        projected = projected * self.mup_vector
    gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    xbc, layer.conv_states[0] = _convolved(self.conv1d, xbc, layer.conv_states[0], self.activation)
    groups = self.n_groups * self.ssm_state_size
    x, b, c = torch.split(xbc, [self.intermediate_size, groups, groups], dim=-1)
    scan, layer.recurrent_states[0] = _scanned(self, x, b, c, dt, layer.recurrent_states[0])
    if getattr(self, "mamba_rms_norm", True):
        return self.out_proj(_gated_norm(self.norm, scan, gate))
    return self.out_proj(scan * F.silu(gate))  # Falcon-H1 without its norm


def mamba_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """A Mamba-1 mixer's forward (Mamba's, Falcon Mamba's, Jamba's) through the two ops: the
    convolution of x through CausalConvWithState, the selective scan through LinearAttention's
    gated rule with a head per channel (its state [state size, 1], transformers' [B, channels, state
    size] with an axis more), one key head (B) and query head (C) for all, and a decay per channel
    and state entry. Falcon Mamba and Jamba normalize dt, B and C first (their `*_layernorm`)."""
    layer = cache.layers[self.layer_idx]
    x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)
    x, layer.conv_states[0] = _convolved(self.conv1d, x, layer.conv_states[0], self.activation)
    dt, b, c = torch.split(self.x_proj(x), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
    if hasattr(self, "b_layernorm"):
        dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
    dt = F.softplus(self.dt_proj(dt))  # [B, T, channels]
    decay = _kept(dt[..., None] * -torch.exp(self.A_log.float()), -1)
    state = layer.recurrent_states[0]
    out, state = GatedLinearRule.apply(c, b, x * dt, state[..., None], decay, 1, self.intermediate_size, 1.0)
    layer.recurrent_states[0] = state[..., 0]
    return self.out_proj((out + x * self.D) * F.silu(gate))


def zamba_mamba_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Zamba's Mamba-1 mixer through the same two ops as `mamba_forward`, its channels in
    `n_mamba_heads` heads, each with its own x_proj, dt_proj and so its own B and C (a key head each
    in LinearAttention, serving that head's channels). Its in_proj interleaves x and the gate
    channel by channel; its state is [B, heads, head size, state size], the channels' [B, channels,
    state size] cut by head."""
    layer = cache.layers[self.layer_idx]
    heads, head_size, channels, size = self.n_mamba_heads, self.mamba_head_dim, self.intermediate_size, self.ssm_state_size
    pairs = _kept(self.in_proj(hidden_states), -1, 2)  # x and the gate interleaved, channel by channel
    x, gate = pairs[..., 0], pairs[..., 1]
    x, layer.conv_states[0] = _convolved(self.conv1d, x, layer.conv_states[0], self.activation)
    by_head = _kept(x, heads, -1)
    parameters = torch.einsum("bthd,hpd->bthp", by_head, self.x_proj_weight)
    dt, b, c = torch.split(parameters, [self.time_step_rank, size, size], dim=-1)
    dt = _kept(F.softplus(torch.einsum("bthr,hdr->bthd", dt, self.dt_proj_weight) + self.dt_proj_bias), -1)
    decay = _kept(dt[..., None] * -torch.exp(self.A_log.float()).reshape(channels, size), -1)
    state = layer.recurrent_states[0].reshape(-1, channels, size, 1)  # [B, heads, head size, state size] by channel
    out, state = GatedLinearRule.apply(_kept(c, -1), _kept(b, -1), x * dt, state, decay, heads, channels, 1.0)
    layer.recurrent_states[0] = state.reshape(-1, heads, head_size, size)
    return self.out_proj((out + x * self.D.flatten()) * F.silu(gate))


def _convolved(conv, x, state, activation: str):
    """`x` [B, T, C] through the depthwise causal convolution `conv` from `state`: ([B, T, C], the new state)."""
    if activation not in ("silu", "swish"):
        raise NotImplementedError(f"a convolution with activation {activation!r}: CausalConvWithState takes silu or none")
    bias = conv.bias if conv.bias is not None else torch.zeros(conv.weight.shape[0], dtype=conv.weight.dtype)
    out, state = CausalConv.apply(x.transpose(1, 2), conv.weight, bias, state, "silu")
    return out.transpose(1, 2), state


def _scanned(self, x, b, c, dt, state):
    """The selective scan of x [B, T, heads * head size] with B and C [B, T, groups * state size]
    (each group serving heads / groups consecutive heads) and the step dt [B, T, heads] before its
    bias and softplus; plus D x. Returns ([B, T, heads * head size], the new state)."""
    heads = self.num_heads
    dt = _limited(F.softplus(dt + self.dt_bias), *self.time_step_limit)
    by_head = _kept(x, heads, -1)
    value = _kept(by_head * dt[..., None], -1)
    decay = -torch.exp(self.A_log.float()) * dt
    out, state = GatedLinearRule.apply(c, b, value, state, decay, self.n_groups, heads, 1.0)
    return out + _kept(by_head * self.D[:, None], -1), state


def _limited(dt, low: float, high: float):
    """The step `dt` [B, T, heads] within the mixer's time-step limits where a pass has several
    tokens, as transformers' chunked scan has it; its one-token step (decode) takes none."""
    if (low, high) == (0.0, float("inf")):
        return dt  # softplus is never below 0
    several = torch.ones_like(dt[0, :, 0]).sum() > 1.5  # the pass's length, traced (not a Python int)
    return torch.where(several, torch.clamp(dt, min=low, max=high), dt)
