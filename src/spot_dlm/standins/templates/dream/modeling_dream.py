"""Dream stand-in: a tiny Qwen2.5-style transformer (q/k/v biases, rotary, GQA, SiLU MLP) with Dream's forward.

- ``attention_mask`` None or ``"full"``: full bidirectional attention with no mask. A 4-D mask [B, 1, Q, K] (bool,
  True = attend, or additive float) is passed to attention as it is.
- ``past_key_values``: a ``DynamicCache`` given is extended with this pass's keys/values (the usual transformers
  use; Dream's own loop runs without a cache). ``position_ids`` default to C + arange(N), C = cached length.
- ``DreamModel`` is the whole language model (loaded with AutoModel); its logits are not shifted.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, MaskedLMOutput

from .configuration_dream import DreamConfig


class DreamRMSNorm(nn.Module):
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


def sdpa_mask(attention_mask) -> torch.Tensor | None:
    """None for no mask or ``"full"``; a [B, Q, K] or [B, 1, Q, K] tensor as [B, 1, Q, K]."""
    if attention_mask is None or isinstance(attention_mask, str):
        if attention_mask not in (None, "full"):
            raise ValueError(f"attention_mask string must be 'full', got {attention_mask!r}")
        return None
    if attention_mask.dim() == 3:
        return attention_mask[:, None]
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be None, 'full' or 4-D, got shape {tuple(attention_mask.shape)}")
    return attention_mask


class DreamAttention(nn.Module):
    def __init__(self, config: DreamConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, hidden, cos, sin, mask, cache):
        batch, q_len, _ = hidden.shape
        shape = (batch, q_len, -1, self.head_dim)
        query = apply_rotary(self.q_proj(hidden).view(shape).transpose(1, 2), cos, sin)  # [B, H, Q, D]
        key = apply_rotary(self.k_proj(hidden).view(shape).transpose(1, 2), cos, sin)  # [B, Hkv, Q, D]
        value = self.v_proj(hidden).view(shape).transpose(1, 2)  # [B, Hkv, Q, D]
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # [B, Hkv, C+Q, D]
        key, value = key.repeat_interleave(self.groups, 1), value.repeat_interleave(self.groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=False)  # [B, H, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class DreamMLP(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DreamDecoderLayer(nn.Module):
    def __init__(self, config: DreamConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DreamAttention(config, layer_idx)
        self.post_attention_layernorm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DreamMLP(config)

    def forward(self, hidden, cos, sin, mask, cache):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules = ["DreamDecoderLayer"]


class DreamBaseModel(DreamPreTrainedModel):
    """Embeddings, decoder layers and the final norm: ``last_hidden_state`` [B, N, d]."""

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DreamDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None):
        batch, length = input_ids.shape
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(cached, cached + length, device=input_ids.device).expand(batch, length)
        hidden = self.embed_tokens(input_ids)  # [B, N, d]
        cos, sin = rotary_tables(position_ids, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        mask = sdpa_mask(attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask, past_key_values)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=past_key_values)


class DreamModel(DreamPreTrainedModel):
    """Dream language model: unshifted logits [B, N, V] in the model dtype (Dream's loop shifts them)."""

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None, **kwargs
    ):
        hidden = self.model(input_ids, attention_mask, position_ids, past_key_values).last_hidden_state
        return MaskedLMOutput(logits=self.lm_head(hidden))  # logits [B, N, V]
