"""Template files of the Dream stand-in (configuration_dream.py, modeling_dream.py)."""
