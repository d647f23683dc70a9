"""Remote-code templates of the stand-in checkpoints, one package per family, copied into each folder."""
