"""Building blocks shared by the stand-ins' modeling files, copied into every stand-in folder beside them.

A family's modeling file imports them relatively (``from .layers import ...``), which transformers follows when it
copies a checkpoint's remote code into its module cache. What differs per family (the forward interface, the mask
rule, the cache rule, LLaDA's block layout) stays in the family's own file.
"""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMS normalisation over the last axis, computed in at least float32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin tables [B, 1, Q, D] for positions [B, Q] (angles computed in float64)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    angles = positions.to(torch.float64)[..., None] * theta**-exponents  # [B, Q, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, Q, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, Q, D] by the position angles (half-split convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def cached_length(cache) -> int:
    """C, the number of positions a ``DynamicCache`` holds (0 without one)."""
    return cache.get_seq_length() if cache is not None else 0


def keys_with_cache(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, store: bool):
    """Keys/values [B, Hkv, C+Q, D] of the cache and this pass; the cache is written only when ``store``."""
    if store:
        return cache.update(keys, values, layer_idx)
    if cache is None or layer_idx >= len(cache.layers) or cache.layers[layer_idx].get_seq_length() == 0:
        return keys, values
    layer = cache.layers[layer_idx]
    return torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2)


class Attention(nn.Module):
    """Rotary GQA attention over a ``DynamicCache``: q/k/v biases when ``qkv_bias`` (Qwen2.5), per-head q/k RMSNorm
    when ``qk_norm`` (Qwen3). ``mask`` goes to SDPA as it is (None = full attention)."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, hidden, cos, sin, mask, cache, store):
        batch, q_len, _ = hidden.shape
        shape = (batch, q_len, -1, self.head_dim)
        query, key = self.q_proj(hidden).view(shape), self.k_proj(hidden).view(shape)  # [B, Q, H or Hkv, D]
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query = apply_rotary(query.transpose(1, 2), cos, sin)  # [B, H, Q, D]
        key = apply_rotary(key.transpose(1, 2), cos, sin)  # [B, Hkv, Q, D]
        value = self.v_proj(hidden).view(shape).transpose(1, 2)  # [B, Hkv, Q, D]
        key, value = keys_with_cache(cache, self.layer_idx, key, value, store)  # [B, Hkv, C+Q, D]
        key, value = key.repeat_interleave(self.groups, 1), value.repeat_interleave(self.groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=False)  # [B, H, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class MLP(nn.Module):
    """SiLU-gated MLP."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention, then the MLP, each around a residual."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, mask, cache, store):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, cache, store)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def add_decoder(model: nn.Module, config, qkv_bias: bool, qk_norm: bool) -> None:
    """Give a base model its ``embed_tokens``, decoder ``layers`` and final ``norm`` (in this order)."""
    model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    model.layers = nn.ModuleList(DecoderLayer(config, i, qkv_bias, qk_norm) for i in range(config.num_hidden_layers))
    model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def run_decoder(model: nn.Module, input_ids, position_ids, mask, cache, store: bool) -> torch.Tensor:
    """The final hidden states [B, Q, d] of a base model made by ``add_decoder``; ``position_ids`` default to
    C + arange(Q), C = cached length."""
    batch, q_len = input_ids.shape
    if position_ids is None:
        cached = cached_length(cache)
        position_ids = torch.arange(cached, cached + q_len, device=input_ids.device).expand(batch, q_len)
    hidden = model.embed_tokens(input_ids)  # [B, Q, d]
    cos, sin = rotary_tables(position_ids, model.config.head_dim, model.config.rope_theta, hidden.dtype)
    for layer in model.layers:
        hidden = layer(hidden, cos, sin, mask, cache, store)
    return model.norm(hidden)
