"""Configuration of the Fast-dLLM v2 stand-in: Qwen2.5-style sizes plus the block size ``bd_size``."""

from .configuration_base import QwenStyleConfig


class Fast_dLLM_QwenConfig(QwenStyleConfig):
    """A Qwen2.5-style decoder configuration (q/k/v biases) with ``bd_size``, the block-causal block length."""

    model_type = "Fast_dLLM_Qwen"

    def __init__(self, vocab_size: int = 151936, bd_size: int = 32, **kwargs):
        self.bd_size = bd_size
        super().__init__(vocab_size=vocab_size, **kwargs)
