"""Qwen-style decoder sizes shared by the SDAR, Dream and Fast-dLLM v2 stand-in configurations.

Copied into those stand-in folders beside the family's configuration file, which imports it relatively.
"""

from transformers import PretrainedConfig


class QwenStyleConfig(PretrainedConfig):
    """Sizes of a Qwen2.5/Qwen3-style decoder; a family's configuration adds its own keys and defaults."""

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 32,
        intermediate_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1000000.0,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
