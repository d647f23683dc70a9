"""Template files of the Fast-dLLM v2 stand-in (configuration.py, modeling.py)."""
