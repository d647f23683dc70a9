"""Template files of the LLaDA stand-in (configuration_llada.py, modeling_llada.py)."""
