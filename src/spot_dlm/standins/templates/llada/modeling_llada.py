"""LLaDA stand-in: a tiny pre-norm transformer (RMSNorm, rotary, GQA, SiLU MLP) with LLaDA's forward interface.

- The forward takes no ``position_ids`` and no other keywords than LLaDA's: positions are 0..N-1, offset by the
  past length.
- Attention is always full and bidirectional: ``attention_mask`` and ``attention_bias`` are accepted and ignored.
- ``past_key_values`` is a list of (keys, values) tuples, one per block; with ``use_cache`` the output's ``cache``
  holds the keys/values of past and present. Logits are not shifted.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_llada import LLaDAConfig
from .layers import RMSNorm, apply_rotary, rotary_tables


class LLaDABlock(nn.Module):
    """Pre-norm block: full attention (no mask), then a SiLU-gated MLP."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        d_model, heads, kv_heads = config.d_model, config.n_heads, config.n_kv_heads
        self.head_dim = d_model // heads
        self.groups = heads // kv_heads
        self.attn_norm = RMSNorm(d_model, config.rms_norm_eps)
        self.q_proj = nn.Linear(d_model, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.attn_out = nn.Linear(heads * self.head_dim, d_model, bias=False)
        self.ff_norm = RMSNorm(d_model, config.rms_norm_eps)
        self.ff_proj = nn.Linear(d_model, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d_model, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d_model, bias=False)

    def attention(self, x, cos, sin, layer_past):
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        query = apply_rotary(self.q_proj(x).view(shape).transpose(1, 2), cos, sin)  # [B, H, N, D]
        key = apply_rotary(self.k_proj(x).view(shape).transpose(1, 2), cos, sin)  # [B, Hkv, N, D]
        value = self.v_proj(x).view(shape).transpose(1, 2)  # [B, Hkv, N, D]
        if layer_past is not None:
            key, value = torch.cat([layer_past[0], key], dim=-2), torch.cat([layer_past[1], value], dim=-2)
        present = (key, value)  # [B, Hkv, past+N, D] each
        key, value = key.repeat_interleave(self.groups, 1), value.repeat_interleave(self.groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False)  # [B, H, N, D]
        return self.attn_out(out.transpose(1, 2).reshape(batch, length, -1)), present

    def forward(self, x, cos, sin, layer_past=None):
        attended, present = self.attention(self.attn_norm(x), cos, sin, layer_past)
        x = x + attended
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h)), present


class LLaDAModel(nn.Module):
    """Token embedding ``wte``, blocks, final norm ``ln_f`` and output projection ``ff_out`` (untied)."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        if config.weight_tying:
            raise ValueError("the LLaDA stand-in has an untied output projection (weight_tying must be false)")
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.embedding_size, config.d_model),
                "blocks": nn.ModuleList(LLaDABlock(config) for _ in range(config.n_layers)),
                "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
                "ff_out": nn.Linear(config.d_model, config.embedding_size, bias=False),
            }
        )

    def forward(self, input_ids, inputs_embeds, past_key_values, last_logits_only, output_hidden_states):
        """Logits [B, N, V] (or [B, 1, V]), per-block (keys, values) and the hidden states when asked."""
        x = self.transformer.wte(input_ids) if inputs_embeds is None else inputs_embeds  # [B, N, d]
        batch, length = x.shape[:2]
        past = past_key_values[0][0].shape[-2] if past_key_values else 0
        positions = torch.arange(past, past + length, device=x.device).expand(batch, length)
        cos, sin = rotary_tables(
            positions, self.config.d_model // self.config.n_heads, self.config.rope_theta, x.dtype
        )
        presents, hidden_states = [], [x]
        for index, block in enumerate(self.transformer.blocks):
            x, present = block(x, cos, sin, past_key_values[index] if past_key_values else None)
            presents.append(present)
            hidden_states.append(x)
        if last_logits_only:
            x = x[:, -1:]
        logits = self.transformer.ff_out(self.transformer.ln_f(x))  # [B, N, V]
        return logits, presents, tuple(hidden_states) if output_hidden_states else None


class LLaDAPreTrainedModel(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDABlock"]


class LLaDAModelLM(LLaDAPreTrainedModel):
    """LLaDA language model: unshifted logits [B, N, V] in the model dtype."""

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        inputs_embeds=None,
        attention_mask=None,
        attention_bias=None,
        past_key_values=None,
        use_cache=False,
        last_logits_only=False,
        output_hidden_states=None,
        return_dict=None,
    ):
        logits, presents, hidden_states = self.model(
            input_ids, inputs_embeds, past_key_values, last_logits_only, output_hidden_states
        )
        output = CausalLMOutputWithPast(
            logits=logits, cache=presents if use_cache else None, hidden_states=hidden_states
        )
        return output.to_tuple() if return_dict is False else output
