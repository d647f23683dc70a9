"""Configuration of the Dream stand-in: Qwen2.5-style sizes plus Dream's mask token."""

from .configuration_base import QwenStyleConfig


class DreamConfig(QwenStyleConfig):
    """A Qwen2.5-style decoder configuration (q/k/v biases) with ``mask_token_id``."""

    model_type = "Dream"

    def __init__(self, vocab_size: int = 152064, mask_token_id: int = 151666, pad_token_id: int = 151643, **kwargs):
        self.mask_token_id = mask_token_id
        super().__init__(vocab_size=vocab_size, pad_token_id=pad_token_id, **kwargs)
