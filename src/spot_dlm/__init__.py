"""spot-dlm: exact speculative decoding for diffusion language models (SPOT)."""

from spot_dlm.api import GenerateConfig, Generation, generate, load_target
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule, step

__all__ = ["CommitRule", "GenerateConfig", "Generation", "NoiseKey", "generate", "load_target", "step"]
__version__ = "0.1.0"
