"""Dream stand-in: a tiny Qwen2.5-style transformer (q/k/v biases, rotary, GQA, SiLU MLP) with Dream's forward.

- ``attention_mask`` None or ``"full"``: full bidirectional attention with no mask. A 4-D mask [B, 1, Q, K] (bool,
  True = attend, or additive float) is passed to attention as it is.
- ``past_key_values``: a ``DynamicCache`` given is extended with this pass's keys/values (the usual transformers
  use; Dream's own loop runs without a cache). ``position_ids`` default to C + arange(N), C = cached length.
- ``DreamModel`` is the whole language model (loaded with AutoModel); its logits are not shifted.
"""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, MaskedLMOutput

from .configuration_dream import DreamConfig
from .layers import add_decoder, run_decoder


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


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]


class DreamBaseModel(DreamPreTrainedModel):
    """Embeddings, decoder layers (q/k/v biases) and the final norm: ``last_hidden_state`` [B, N, d]."""

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        add_decoder(self, config, qkv_bias=True, qk_norm=False)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None):
        mask = sdpa_mask(attention_mask)
        store = past_key_values is not None  # a cache given is always extended
        hidden = run_decoder(self, input_ids, position_ids, mask, past_key_values, store)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=past_key_values)


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
