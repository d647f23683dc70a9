"""Tiny random-weight stand-ins of real diffusion-LM checkpoints (SDAR, LLaDA, Dream, Fast-dLLM v2).

``build_standin(family, folder)`` writes a folder that loads like the real checkpoint, from disk, with
``trust_remote_code=True, local_files_only=True``: config.json with ``auto_map``, the family's own configuration and
modeling files (small pre-norm transformers with the real forward interfaces) beside the shared ``layers.py`` and
``configuration_base.py`` they import relatively, safetensors weights, generation_config.json and a tokenizer whose
special tokens sit at the real ids.
"""

from spot_dlm.standins.builder import FAMILIES, build_standin

__all__ = ["FAMILIES", "build_standin"]
