"""Configuration of the Dream stand-in: Qwen2.5-style sizes plus Dream's mask token."""

from transformers import PretrainedConfig


class DreamConfig(PretrainedConfig):
    """A Qwen2.5-style decoder configuration (q/k/v biases) with ``mask_token_id``."""

    model_type = "Dream"

    def __init__(
        self,
        vocab_size: int = 152064,
        hidden_size: int = 32,
        intermediate_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1000000.0,
        mask_token_id: int = 151666,
        pad_token_id: int = 151643,
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
        self.mask_token_id = mask_token_id
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)
