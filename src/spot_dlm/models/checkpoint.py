"""Checkpoints: a folder with ``model.safetensors`` (16-bit), ``config.json`` and ``tokenizer.json``.

Loading never runs code (safetensors, JSON), and every way a checkpoint can be wrong gives a ValueError or
FileNotFoundError that names the file and what is wrong with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from spot_dlm.models.transformer import BlockDiffusionLM, ModelConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TRAINING_STATE_FILE = "training_state.json"
TRAIN_LOG_FILE = "train_log.jsonl"  # one JSON line per training snapshot


def save_checkpoint(
    model: BlockDiffusionLM, folder: Path, training_state: dict | None = None, dtype: torch.dtype = torch.float16
) -> None:
    """Write weights (``dtype``, default float16), config and optional training state; atomically per file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in model.state_dict().items()}
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS_FILE)
    _write_text(folder / CONFIG_FILE, model.config.to_json())
    if training_state is not None:
        _write_text(folder / TRAINING_STATE_FILE, json.dumps(training_state, indent=2))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file, turning any corruption into a ValueError that names the file."""
    _require(Path(path), "checkpoint weights")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"corrupt checkpoint weights {path}: {err}") from err


def check_state_dict(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], source: Path) -> None:
    """Raise ValueError when names or shapes differ between a model and a checkpoint."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong_shape = [
        f"{name}: checkpoint {tuple(found[name].shape)} vs model {tuple(expected[name].shape)}"
        for name in sorted(set(expected) & set(found))
        if found[name].shape != expected[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if wrong_shape:
        problems.append("shape mismatch " + "; ".join(wrong_shape[:5]))
    if problems:
        raise ValueError(f"checkpoint {source} does not match its config: " + ", ".join(problems))


def load_model(
    folder: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> BlockDiffusionLM:
    """Build the model from ``config.json`` and load ``model.safetensors`` into it (validated)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    config = ModelConfig.from_file(_require(folder / CONFIG_FILE, "checkpoint config"))
    weights = load_weights(folder / WEIGHTS_FILE)
    model = BlockDiffusionLM(config)
    check_state_dict(model.state_dict(), weights, folder / WEIGHTS_FILE)
    model.load_state_dict({name: t.to(torch.float32) for name, t in weights.items()})
    return model.to(device=device, dtype=dtype).eval()


def load_training_state(folder: Path) -> dict:
    path = Path(folder) / TRAINING_STATE_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"corrupt training state {path}: {err}") from err
