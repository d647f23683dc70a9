"""Fast-dLLM v2 stand-in: a tiny Qwen2.5-style transformer (q/k/v biases, rotary, GQA, SiLU MLP) with v2's forward.

- ``attention_mask`` is ignored: the model builds its own block-causal mask. Query i (absolute position C+i, C =
  cached length) may attend key j (absolute index over cache + query) iff ``(C+i) // B >= j // B``, B =
  ``block_size`` when passed, else ``config.bd_size``.
- ``past_key_values`` is a ``DynamicCache`` of the same batch, written only with ``update_past_key_values=True``;
  otherwise cached keys/values are read, not stored.
- ``position_ids`` default to C + arange(Q). Logits are not shifted.
"""

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration import Fast_dLLM_QwenConfig
from .layers import add_decoder, cached_length, run_decoder


def block_causal_mask(q_len: int, cached: int, block: int, device) -> torch.Tensor:
    """[Q, C+Q] bool: query C+i sees key j iff (C+i) // block >= j // block."""
    query_blocks = torch.arange(cached, cached + q_len, device=device) // block
    key_blocks = torch.arange(cached + q_len, device=device) // block
    return query_blocks[:, None] >= key_blocks[None, :]


class Fast_dLLM_QwenPreTrainedModel(PreTrainedModel):
    config_class = Fast_dLLM_QwenConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]


class Fast_dLLM_QwenModel(Fast_dLLM_QwenPreTrainedModel):
    """Embeddings, decoder layers (q/k/v biases) under the block-causal mask and the final norm: ``last_hidden_state``
    [B, Q, d]."""

    def __init__(self, config: Fast_dLLM_QwenConfig):
        super().__init__(config)
        add_decoder(self, config, qkv_bias=True, qk_norm=False)
        self.post_init()

    def forward(self, input_ids, position_ids=None, past_key_values=None, store=False, block_size=None):
        q_len, cached = input_ids.shape[1], cached_length(past_key_values)
        mask = block_causal_mask(q_len, cached, block_size or self.config.bd_size, input_ids.device)  # [Q, C+Q]
        hidden = run_decoder(self, input_ids, position_ids, mask, past_key_values, store)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=past_key_values)


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
