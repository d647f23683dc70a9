"""A drafter folder on disk: the order model's weights, config and metrics, saved, read, loaded and checked.

``save_order_model`` writes each file whole (a temporary name renamed into place); ``load_order_model`` refuses
weights that disagree with the config; ``check_drafter_folder`` checks what a method will read from a folder the
user gave, before any work.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.models.checkpoint import check_state_dict, load_weights

DRAFTER_WEIGHTS_FILE = "drafter.safetensors"
DRAFTER_CONFIG_FILE = "drafter_config.json"
DRAFTER_METRICS_FILE = "drafter_metrics.json"
SETS_METHODS = ("spot-sets", "spot-sets-dynamic")  # methods whose drafter folder holds a sets model (tau input)


def save_order_model(model: OrderModel, folder: Path, metrics: dict | None = None) -> None:
    """Write weights, config and metrics, each to a temporary name renamed into place (an interrupted save leaves
    every file whole)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    metadata = {"config": json.dumps(asdict(model.config))}
    weights = folder / DRAFTER_WEIGHTS_FILE
    save_file(tensors, str(weights) + ".tmp", metadata=metadata)
    os.replace(str(weights) + ".tmp", weights)
    _write_text(folder / DRAFTER_CONFIG_FILE, json.dumps(asdict(model.config), indent=2))
    if metrics is not None:
        _write_text(folder / DRAFTER_METRICS_FILE, json.dumps(metrics, indent=2))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def is_sets_model(config: OrderModelConfig) -> bool:
    """A SPOT-Sets model reads the threshold rule's tau; SPOT's order model does not."""
    return config.threshold_feature


def read_drafter_config(folder: Path) -> OrderModelConfig | None:
    """The order model config a folder holds (None: no drafter_config.json there)."""
    path = Path(folder) / DRAFTER_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return OrderModelConfig(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"invalid drafter config {path}: {err}") from err


def check_drafter_kind(config: OrderModelConfig, sets: bool, source: Path | str) -> None:
    """A SPOT-Sets model where SPOT's order model is wanted (or the reverse) is a ValueError naming both."""
    if is_sets_model(config) != sets:
        found = "a SPOT-Sets model (spot-sets)" if is_sets_model(config) else "a SPOT order model (spot)"
        wanted = "a SPOT-Sets model (train-drafter --sets)" if sets else "a SPOT order model (train-drafter)"
        raise ValueError(f"{source} holds {found}; this needs {wanted}")


def check_drafter_folder(method: str, folder: str | Path | None, order_model: str = "auto", token_lm: bool = False):
    """The parts a speculative method reads from a drafter folder given by the user, checked before any work: the
    folder exists, holds the model kind the method needs, and the small order model or token LM asked for.
    ``folder`` None (the shipped drafters) and methods without a drafter folder pass."""
    from spot_dlm.drafters.token_lm import TOKEN_LM_FIT_FILE

    if folder is None or method not in ("spot", "calibrated", *SETS_METHODS):
        return
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {folder}")
    if method == "calibrated":
        return
    sets = method in SETS_METHODS
    for place in (folder, folder / "small"):
        config = read_drafter_config(place)
        if config is not None:
            check_drafter_kind(config, sets, place)
    if order_model == "small" and not (folder / "small" / DRAFTER_CONFIG_FILE).is_file():
        raise ValueError(f"no small order model in {folder} (expected {folder / 'small' / DRAFTER_CONFIG_FILE})")
    if token_lm and not (folder / TOKEN_LM_FIT_FILE).is_file():
        raise ValueError(
            f"--token-lm: {folder} has no token LM ({TOKEN_LM_FIT_FILE}; spot-dlm fit-token-survival --token-lm "
            "installs one)"
        )


def _check_config_metadata(path: Path, config: OrderModelConfig) -> None:
    """The weights record the config they were trained with; a config file that disagrees is rejected."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        recorded = (handle.metadata() or {}).get("config")
    if recorded is not None and OrderModelConfig(**json.loads(recorded)) != config:  # absent keys: defaults
        raise ValueError(f"drafter config does not match the config recorded in {path}: {recorded}")


def load_order_model(folder: Path) -> OrderModel:
    folder = Path(folder)
    config = read_drafter_config(folder)
    if config is None:
        raise FileNotFoundError(f"drafter config not found: {folder / DRAFTER_CONFIG_FILE}")
    weights = load_weights(folder / DRAFTER_WEIGHTS_FILE)
    _check_config_metadata(folder / DRAFTER_WEIGHTS_FILE, config)
    model = OrderModel(config)
    check_state_dict(model.state_dict(), weights, folder / DRAFTER_WEIGHTS_FILE)
    model.load_state_dict(weights)
    return model.eval()
