"""SDAR stand-in: a tiny Qwen3-style transformer (q/k RMSNorm, rotary, GQA, SiLU MLP) with SDAR's forward interface.

- ``attention_mask`` [B, 1, Q, C+Q] or [B, Q, C+Q] is cast with ``.bool()``: True = may attend. An all-True mask
  runs with no mask at all; None is full bidirectional attention.
- ``past_key_values`` is a caller-made ``DynamicCache``. A layer appends its keys/values only when ``store_kv=True``;
  otherwise cached keys/values are put in front of the current ones for this pass and not stored.
- ``position_ids`` default to C + arange(Q), C = cached length. Logits are not shifted.
"""

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_sdar import SDARConfig
from .layers import add_decoder, run_decoder


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


class SDARPreTrainedModel(PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]


class SDARModel(SDARPreTrainedModel):
    """Embeddings, decoder layers (q/k RMSNorm, no q/k/v biases) and the final norm: ``last_hidden_state``
    [B, Q, d]."""

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        add_decoder(self, config, qkv_bias=False, qk_norm=True)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, store_kv=False):
        mask = sdpa_mask(attention_mask)
        hidden = run_decoder(self, input_ids, position_ids, mask, past_key_values, store_kv)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=past_key_values)


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
