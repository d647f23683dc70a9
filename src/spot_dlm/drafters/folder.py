"""A drafter folder on disk: where each part a drafter reads lives (``DrafterFolder``), and the order model's
weights, config and metrics, saved, read, loaded and checked.

``save_order_model`` writes each file whole (a temporary name renamed into place); ``load_order_model`` refuses
weights that disagree with the config; ``check_drafter_folder`` checks what a method will read from a folder the
user gave, before any work.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from spot_dlm.drafters.order_net import FrozenOrderModel, OrderModel, OrderModelConfig
from spot_dlm.models.checkpoint import check_state_dict, load_weights

DRAFTER_WEIGHTS_FILE = "drafter.safetensors"
DRAFTER_CONFIG_FILE = "drafter_config.json"
DRAFTER_METRICS_FILE = "drafter_metrics.json"
SETS_METHODS = ("spot-sets", "spot-sets-dynamic")  # methods whose drafter folder holds a sets model (tau input)
SMALL_ORDER_MODEL = "small"  # the sub-folder of a drafter folder that holds its smaller order model, if any
CALIBRATION_FILE = "calibration.json"  # the calibrated drafter's rank-path counts
SHIPPED_SETS_FOLDER = "sets_drafter"  # beside the shipped drafter folder: the shipped SPOT-Sets model


def default_drafter_dir() -> Path:
    """The drafter folder shipped with the built-in target."""
    from spot_dlm.models.builtin import builtin_dir

    return builtin_dir() / "drafter"


@dataclass(frozen=True)
class DrafterFolder:
    """Where a drafter's parts live, and each part loaded for one device: paths and a device in, parts out.

    ``path`` holds the order model (or the sets model) and the calibrated drafter's rank paths; ``fits`` the token
    fits (token survival, bigram, neighbour fit, token LM): the same folder, except for the shipped sets model, which
    reads the shipped SPOT folder's fits. ``given``: named by the user, so a part that does not fit the target is an
    error (the shipped parts are left out with a warning instead)."""

    path: Path
    fits: Path
    device: torch.device = torch.device("cpu")
    given: bool = True

    @classmethod
    def for_method(cls, drafter: str | Path | None, method: str, device: torch.device) -> DrafterFolder:
        """The folder a method reads: ``drafter`` as given, else the shipped one for the method."""
        if drafter is not None:
            return cls(Path(drafter), Path(drafter), device, given=True)
        shipped = default_drafter_dir()
        path = shipped.parent / SHIPPED_SETS_FOLDER if method in SETS_METHODS else shipped
        return cls(path, shipped, device, given=False)

    @property
    def small(self) -> Path:
        return self.path / SMALL_ORDER_MODEL

    def has_small_order_model(self) -> bool:
        return (self.small / DRAFTER_CONFIG_FILE).is_file()

    def require_small_order_model(self) -> None:
        """A ValueError naming the file expected when the folder has no small order model."""
        if not self.has_small_order_model():
            raise ValueError(f"no small order model in {self.path} (expected {self.small / DRAFTER_CONFIG_FILE})")

    def order_model(self, small: bool = False) -> FrozenOrderModel:
        """The order model (or sets model), on the folder's device, frozen for drafting."""
        from spot_dlm.drafters.order_net import freeze_order_model

        return freeze_order_model(load_order_model(self.small if small else self.path).to(self.device))

    def token_survival(self):
        """The stale guesses' survival fit (``drafters/token_survival.py``), or None without one."""
        from spot_dlm.drafters.token_survival import load_token_survival

        return load_token_survival(self.fits)

    def rank_paths(self, budget: int, depth: int) -> tuple[tuple[int, ...], ...]:
        """The calibrated drafter's rank paths for a budget, up to ``depth`` long."""
        from spot_dlm.drafters.calibrated import load_rank_counts, select_rank_paths

        paths = select_rank_paths(load_rank_counts(self.path / CALIBRATION_FILE), budget)
        return tuple(p for p in paths if len(p) <= depth)


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
    for place in (folder, folder / SMALL_ORDER_MODEL):
        config = read_drafter_config(place)
        if config is not None:
            check_drafter_kind(config, sets, place)
    if order_model == "small":
        DrafterFolder(folder, folder).require_small_order_model()
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
