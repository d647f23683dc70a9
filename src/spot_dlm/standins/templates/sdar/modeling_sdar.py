"""SDAR stand-in: a tiny Qwen3-style transformer (q/k RMSNorm, rotary, GQA, SiLU MLP) with SDAR's forward interface.

- ``attention_mask`` [B, 1, Q, C+Q] or [B, Q, C+Q] is cast with ``.bool()``: True = may attend. An all-True mask
  runs with no mask at all; None is full bidirectional attention.
- ``past_key_values`` is a caller-made ``DynamicCache``. A layer appends its keys/values only when ``store_kv=True``;
  otherwise cached keys/values are put in front of the current ones for this pass and not stored.
- ``position_ids`` default to C + arange(Q), C = cached length. Logits are not shifted.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_sdar import SDARConfig


class SDARRMSNorm(nn.Module):
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


def sdpa_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """SDAR's mask rule: ``.bool()`` (True = may attend) as [B, 1, Q, K]; None when absent or all True."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    if mask.dim() == 3:
        mask = mask[:, None]
    if mask.dim() != 4:
        raise ValueError(f"attention_mask must be [B, 1, Q, K] or [B, Q, K], got shape {tuple(attention_mask.shape)}")
    return None if bool(mask.all()) else mask


def keys_with_cache(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, store: bool):
    """Keys/values [B, Hkv, C+Q, D] of the cache and this pass; the cache is written only when ``store``."""
    if store:
        return cache.update(keys, values, layer_idx)
    if cache is None or layer_idx >= len(cache.layers) or cache.layers[layer_idx].get_seq_length() == 0:
        return keys, values
    layer = cache.layers[layer_idx]
    return torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2)


class SDARAttention(nn.Module):
    def __init__(self, config: SDARConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.q_norm = SDARRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = SDARRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, mask, cache, store_kv):
        batch, q_len, _ = hidden.shape
        shape = (batch, q_len, -1, self.head_dim)
        query = apply_rotary(self.q_norm(self.q_proj(hidden).view(shape)).transpose(1, 2), cos, sin)  # [B, H, Q, D]
        key = apply_rotary(self.k_norm(self.k_proj(hidden).view(shape)).transpose(1, 2), cos, sin)  # [B, Hkv, Q, D]
        value = self.v_proj(hidden).view(shape).transpose(1, 2)  # [B, Hkv, Q, D]
        key, value = keys_with_cache(cache, self.layer_idx, key, value, store_kv)  # [B, Hkv, C+Q, D]
        key, value = key.repeat_interleave(self.groups, 1), value.repeat_interleave(self.groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=False)  # [B, H, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class SDARMLP(nn.Module):
    def __init__(self, config: SDARConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SDARDecoderLayer(nn.Module):
    def __init__(self, config: SDARConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SDARAttention(config, layer_idx)
        self.post_attention_layernorm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SDARMLP(config)

    def forward(self, hidden, cos, sin, mask, cache, store_kv):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, cache, store_kv)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class SDARPreTrainedModel(PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    _no_split_modules = ["SDARDecoderLayer"]


class SDARModel(SDARPreTrainedModel):
    """Embeddings, decoder layers and the final norm: ``last_hidden_state`` [B, Q, d]."""

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SDARDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = SDARRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, store_kv=False):
        batch, q_len = input_ids.shape
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(cached, cached + q_len, device=input_ids.device).expand(batch, q_len)
        hidden = self.embed_tokens(input_ids)  # [B, Q, d]
        cos, sin = rotary_tables(position_ids, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        mask = sdpa_mask(attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask, past_key_values, store_kv)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=past_key_values)


class SDARForCausalLM(SDARPreTrainedModel, GenerationMixin):
    """SDAR language model: unshifted logits [B, Q, V] in the model dtype."""

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        self.model = SDARModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        store_kv=None,
        **kwargs,
    ):
        if store_kv and past_key_values is None:
            past_key_values = DynamicCache()
        hidden = self.model(input_ids, attention_mask, position_ids, past_key_values, bool(store_kv)).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), cache=past_key_values)  # logits [B, Q, V]
