"""Remote-code templates of the stand-in checkpoints, copied into each folder: one package per family (its
configuration and modeling files, its forward interface) and the files they share, ``layers.py`` (norm, rotary
tables, cache merge, attention, MLP, decoder layer) and ``configuration_base.py`` (Qwen-style sizes), which the
family files import relatively (``from .layers import ...``) and the builder copies beside them."""
