"""Fast-dLLM v2 stand-in: a tiny Qwen2.5-style transformer (q/k/v biases, rotary, GQA, SiLU MLP) with v2's forward.

- ``attention_mask`` is ignored: the model builds its own block-causal mask. Query i (absolute position C+i, C =
  cached length) may attend key j (absolute index over cache + query) iff ``(C+i) // B >= j // B``, B =
  ``block_size`` when passed, else ``config.bd_size``.
- ``past_key_values`` is a ``DynamicCache`` of the same batch, written only with ``update_past_key_values=True``;
  otherwise cached keys/values are read, not stored.
- ``position_ids`` default to C + arange(Q). Logits are not shifted.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration import Fast_dLLM_QwenConfig


class Fast_dLLM_QwenRMSNorm(nn.Module):
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


def block_causal_mask(q_len: int, cached: int, block: int, device) -> torch.Tensor:
    """[Q, C+Q] bool: query C+i sees key j iff (C+i) // block >= j // block."""
    query_blocks = torch.arange(cached, cached + q_len, device=device) // block
    key_blocks = torch.arange(cached + q_len, device=device) // block
    return query_blocks[:, None] >= key_blocks[None, :]


def keys_with_cache(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, store: bool):
    """Keys/values [B, Hkv, C+Q, D] of the cache and this pass; the cache is written only when ``store``."""
    if store:
        return cache.update(keys, values, layer_idx)
    if cache is None or layer_idx >= len(cache.layers) or cache.layers[layer_idx].get_seq_length() == 0:
        return keys, values
    layer = cache.layers[layer_idx]
    return torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2)


class Fast_dLLM_QwenAttention(nn.Module):
    def __init__(self, config: Fast_dLLM_QwenConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, hidden, cos, sin, mask, cache, store):
        batch, q_len, _ = hidden.shape
        shape = (batch, q_len, -1, self.head_dim)
        query = apply_rotary(self.q_proj(hidden).view(shape).transpose(1, 2), cos, sin)  # [B, H, Q, D]
        key = apply_rotary(self.k_proj(hidden).view(shape).transpose(1, 2), cos, sin)  # [B, Hkv, Q, D]
        value = self.v_proj(hidden).view(shape).transpose(1, 2)  # [B, Hkv, Q, D]
        key, value = keys_with_cache(cache, self.layer_idx, key, value, store)  # [B, Hkv, C+Q, D]
        key, value = key.repeat_interleave(self.groups, 1), value.repeat_interleave(self.groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=False)  # [B, H, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class Fast_dLLM_QwenMLP(nn.Module):
    def __init__(self, config: Fast_dLLM_QwenConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Fast_dLLM_QwenDecoderLayer(nn.Module):
    def __init__(self, config: Fast_dLLM_QwenConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = Fast_dLLM_QwenRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Fast_dLLM_QwenAttention(config, layer_idx)
        self.post_attention_layernorm = Fast_dLLM_QwenRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Fast_dLLM_QwenMLP(config)

    def forward(self, hidden, cos, sin, mask, cache, store):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask, cache, store)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Fast_dLLM_QwenPreTrainedModel(PreTrainedModel):
    config_class = Fast_dLLM_QwenConfig
    base_model_prefix = "model"
    _no_split_modules = ["Fast_dLLM_QwenDecoderLayer"]


class Fast_dLLM_QwenModel(Fast_dLLM_QwenPreTrainedModel):
    """Embeddings, decoder layers under the block-causal mask and the final norm: ``last_hidden_state`` [B, Q, d]."""

    def __init__(self, config: Fast_dLLM_QwenConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Fast_dLLM_QwenDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Fast_dLLM_QwenRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids, position_ids=None, past_key_values=None, store=False, block_size=None):
        batch, q_len = input_ids.shape
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(cached, cached + q_len, device=input_ids.device).expand(batch, q_len)
        hidden = self.embed_tokens(input_ids)  # [B, Q, d]
        cos, sin = rotary_tables(position_ids, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        mask = block_causal_mask(q_len, cached, block_size or self.config.bd_size, input_ids.device)  # [Q, C+Q]
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask, past_key_values, store)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=past_key_values)


class Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenPreTrainedModel, GenerationMixin):
    """Fast-dLLM v2 language model: unshifted logits [B, Q, V] in the model dtype."""

    def __init__(self, config: Fast_dLLM_QwenConfig):
        super().__init__(config)
        self.model = Fast_dLLM_QwenModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        update_past_key_values=False,
        block_size=None,
        **kwargs,
    ):
        if update_past_key_values and past_key_values is None:
            past_key_values = DynamicCache()
        hidden = self.model(
            input_ids, position_ids, past_key_values, bool(update_past_key_values), block_size
        ).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), cache=past_key_values)  # logits [B, Q, V]
