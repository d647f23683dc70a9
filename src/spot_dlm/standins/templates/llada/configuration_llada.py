"""Configuration of the LLaDA stand-in, with LLaDA's (OLMo-style) key names."""

from transformers import PretrainedConfig


class LLaDAConfig(PretrainedConfig):
    """OLMo-style sizes (``d_model``, ``n_layers``, ...), also readable under the usual transformers names."""

    model_type = "llada"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "max_sequence_length",
    }

    def __init__(
        self,
        vocab_size: int = 126464,
        embedding_size: int = 126464,
        d_model: int = 32,
        mlp_hidden_size: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        max_sequence_length: int = 2048,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 500000.0,
        weight_tying: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.d_model = d_model
        self.mlp_hidden_size = mlp_hidden_size
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.max_sequence_length = max_sequence_length
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.weight_tying = weight_tying
        kwargs.setdefault("tie_word_embeddings", weight_tying)
        super().__init__(**kwargs)
