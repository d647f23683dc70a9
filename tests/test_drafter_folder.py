"""A drafter folder (``drafters/folder.py``): save and load round trip, the order model size it offers, and
the errors of corrupt, mismatched, malformed or missing files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spot_dlm.drafters.folder import load_order_model, save_order_model
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig

torch.set_num_threads(1)


def test_order_model_round_trip(saved_order_model: tuple[OrderModel, Path]) -> None:
    model, folder = saved_order_model
    assert {p.name for p in folder.iterdir()} == {"drafter.safetensors", "drafter_config.json", "drafter_metrics.json"}
    loaded = load_order_model(folder)
    assert loaded.config == model.config
    assert not loaded.training
    features = torch.rand(2, 12, model.config.n_features)
    with torch.no_grad():
        assert torch.equal(loaded(features), model(features))


def test_order_model_size_picks_the_folder_or_its_small_one(make_target, tmp_path: Path) -> None:
    """paper: the drafter folder's own model; small: its ``small/`` one (a clear error without it); auto: the small one
    for a target on the CPU when there is one, the paper's size on a GPU."""
    from types import SimpleNamespace

    from spot_dlm.api import GenerateConfig, make_drafter, uses_small_order_model
    from spot_dlm.drafters.folder import DrafterFolder

    def order_model(method: str = "spot", **options) -> OrderModelConfig:
        config = GenerateConfig(method=method, drafter=str(tmp_path / "drafter"), **options)
        return make_drafter(config, make_target()).model.config

    paper, small = OrderModelConfig(d_model=32, n_layers=2, n_heads=4), OrderModelConfig(d_model=16, n_heads=2)
    save_order_model(OrderModel(paper), tmp_path / "drafter")
    assert order_model(order_model="paper") == order_model(order_model="auto") == paper
    with pytest.raises(ValueError, match="no small order model"):
        order_model(order_model="small")
    save_order_model(OrderModel(small), tmp_path / "drafter" / "small")
    assert order_model(order_model="small") == order_model(order_model="auto") == small
    assert order_model(order_model="paper") == paper
    on_gpu = SimpleNamespace(device=torch.device("cuda"))
    folder = DrafterFolder.for_method(tmp_path / "drafter", "spot", on_gpu.device)
    assert not uses_small_order_model(GenerateConfig(method="spot"), on_gpu, folder)
    assert uses_small_order_model(GenerateConfig(method="spot", order_model="small"), on_gpu, folder)
    assert folder.small == tmp_path / "drafter" / "small"
    with pytest.raises(ValueError, match="unknown order model"):
        GenerateConfig(method="spot", order_model="huge")


def test_corrupt_order_model_weights(saved_order_model: tuple[OrderModel, Path]) -> None:
    _, folder = saved_order_model
    (folder / "drafter.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="drafter.safetensors"):
        load_order_model(folder)


@pytest.mark.parametrize("changes", [{"d_model": 64}, {"n_layers": 3}, {"top_k": 16}, {"max_block_length": 32}])
def test_order_model_config_not_matching_weights(saved_order_model: tuple[OrderModel, Path], changes: dict) -> None:
    _, folder = saved_order_model
    path = folder / "drafter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(ValueError, match="does not match"):
        load_order_model(folder)


@pytest.mark.parametrize("raw", ["{", "[1, 2]", '{"unknown_key": 3}'])
def test_malformed_order_model_config(saved_order_model: tuple[OrderModel, Path], raw: str) -> None:
    _, folder = saved_order_model
    (folder / "drafter_config.json").write_text(raw)
    with pytest.raises(ValueError, match="drafter config"):
        load_order_model(folder)


@pytest.mark.parametrize("changes", [{"n_heads": 5}, {"d_model": -32}, {"top_k": "many"}])
def test_invalid_order_model_config_values_give_value_error(
    saved_order_model: tuple[OrderModel, Path], changes: dict
) -> None:
    """Invalid values (heads not dividing the width, negative sizes, wrong types) must give a ValueError like
    every other bad drafter folder, not an AssertionError / RuntimeError / TypeError from torch."""
    _, folder = saved_order_model
    path = folder / "drafter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(ValueError):
        load_order_model(folder)


def test_missing_order_model(tmp_path: Path, saved_order_model: tuple[OrderModel, Path]) -> None:
    with pytest.raises(FileNotFoundError):
        load_order_model(tmp_path / "no-such-folder")
    _, folder = saved_order_model
    (folder / "drafter.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        load_order_model(folder)


def test_drafter_config_without_the_temperature_key_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before ``temperature_feature`` existed load with it off."""
    model = OrderModel(OrderModelConfig(top_k=8, d_model=32, n_layers=1, n_heads=2))
    save_order_model(model, tmp_path)
    config_path = tmp_path / "drafter_config.json"
    old_config = {k: v for k, v in json.loads(config_path.read_text()).items() if k != "temperature_feature"}
    config_path.write_text(json.dumps(old_config))
    assert load_order_model(tmp_path).config == model.config
