"""Template files of the SDAR stand-in (configuration_sdar.py, modeling_sdar.py)."""
