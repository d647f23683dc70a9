"""Configuration of the SDAR stand-in: Qwen3-style sizes plus SDAR's block size and mask token."""

from .configuration_base import QwenStyleConfig


class SDARConfig(QwenStyleConfig):
    """A Qwen3-style decoder configuration with ``block_size`` (the training block length) and ``mask_token_id``."""

    model_type = "sdar"

    def __init__(self, vocab_size: int = 151936, block_size: int = 4, mask_token_id: int = 151669, **kwargs):
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        super().__init__(vocab_size=vocab_size, **kwargs)
