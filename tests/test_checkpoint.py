"""Checkpoint folders: round trip, and every way a folder can be wrong gives a clear error naming the file."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spot_dlm.models.builtin import load_builtin_target
from spot_dlm.models.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    check_state_dict,
    load_model,
    load_training_state,
    save_checkpoint,
)
from spot_dlm.models.tokenizer import TextCodec
from spot_dlm.models.transformer import BlockDiffusionLM


@pytest.fixture
def model(model_factory: Callable[..., BlockDiffusionLM]) -> BlockDiffusionLM:
    return model_factory(seed=3, dtype=torch.float32)


@pytest.fixture
def saved(tmp_path: Path, model: BlockDiffusionLM) -> Path:
    folder = tmp_path / "ckpt"
    save_checkpoint(model, folder)
    return folder


def causal_logits(model: BlockDiffusionLM, ids: torch.Tensor) -> torch.Tensor:
    n = ids.shape[0]
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]
    with torch.no_grad():
        hidden, _ = model(ids[None], torch.arange(n)[None], mask)
        return model.logits(hidden)[0]


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_round_trip_stores_float16_and_reloads(saved: Path, model: BlockDiffusionLM) -> None:
    assert sorted(p.name for p in saved.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]  # no temporary files left
    stored = load_file(str(saved / WEIGHTS_FILE))
    assert stored.keys() == model.state_dict().keys()
    assert {t.dtype for t in stored.values()} == {torch.float16}

    loaded = load_model(saved, dtype=torch.float64)
    assert not loaded.training
    assert loaded.config == model.config
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    for name, param in model.state_dict().items():  # exactly the float16 rounding of the original weights
        assert torch.equal(loaded.state_dict()[name], param.to(torch.float16).to(torch.float64)), name

    ids = torch.randint(3, 40, (12,), generator=torch.Generator().manual_seed(0))
    original = causal_logits(model, ids).double()
    reloaded = causal_logits(loaded, ids)
    torch.testing.assert_close(reloaded, original, atol=2e-2, rtol=1e-2)
    assert (reloaded - original).abs().max() > 0  # the float16 rounding is real


def test_round_trip_in_float32_is_exact(tmp_path: Path, model: BlockDiffusionLM) -> None:
    save_checkpoint(model, tmp_path / "f32", dtype=torch.float32)
    loaded = load_model(tmp_path / "f32")
    for name, param in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], param), name


def test_training_state_round_trip(tmp_path: Path, model: BlockDiffusionLM) -> None:
    folder = tmp_path / "with-state"
    save_checkpoint(model, folder, training_state={"step": 12, "lr": 0.5})
    assert load_training_state(folder) == {"step": 12, "lr": 0.5}
    assert load_training_state(tmp_path) == {}
    (folder / "training_state.json").write_text("{not json")
    with pytest.raises(ValueError, match="training_state.json"):
        load_training_state(folder)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")


def test_missing_config(saved: Path) -> None:
    (saved / CONFIG_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=CONFIG_FILE):
        load_model(saved)


def test_missing_weights(saved: Path) -> None:
    (saved / WEIGHTS_FILE).unlink()
    with pytest.raises((FileNotFoundError, ValueError), match="not found"):
        load_model(saved)


def test_corrupt_weights_name_the_file(saved: Path) -> None:
    (saved / WEIGHTS_FILE).write_bytes(b"this is not a safetensors file at all \x00\x01\x02")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(saved)


def test_truncated_weights_name_the_file(saved: Path) -> None:
    path = saved / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(saved)


@pytest.mark.parametrize(("changes", "match"), [({"d_model": 48}, "shape mismatch"), ({"n_layers": 3}, "missing")])
def test_config_not_matching_weights(saved: Path, changes: dict, match: str) -> None:
    edit_config(saved, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(saved)


def test_unknown_config_key(saved: Path) -> None:
    edit_config(saved, n_experts=4)
    with pytest.raises(ValueError, match="n_experts"):
        load_model(saved)


def test_unknown_config_key_error_names_the_file(saved: Path) -> None:
    """checkpoint.py promises errors that name the file; the unknown-key error does not."""
    edit_config(saved, n_experts=4)
    with pytest.raises(ValueError, match=CONFIG_FILE):
        load_model(saved)


@pytest.mark.parametrize("raw", ["[1, 2, 3]", "{broken", ""])
def test_malformed_config_json(saved: Path, raw: str) -> None:
    (saved / CONFIG_FILE).write_text(raw)
    with pytest.raises(ValueError, match=CONFIG_FILE):
        load_model(saved)


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"d_model": "32"}, id="d_model-string"),
        pytest.param({"n_heads": 0}, id="zero-heads"),
        pytest.param({"vocab_size": -5}, id="negative-vocab"),
        pytest.param({"mlp_ratio": 2.5}, id="float-mlp-ratio"),
        pytest.param({"d_model": 33}, id="d_model-not-divisible"),
        pytest.param({"mask_id": 99}, id="mask-id-outside-vocab"),
    ],
)
def test_invalid_config_values_give_value_error_naming_the_file(saved: Path, changes: dict) -> None:
    """A config with wrong types or impossible values must fail as ValueError naming config.json.

    (Today: TypeError, ZeroDivisionError or RuntimeError escape from the constructor, a d_model that does not
    split into heads gives a ValueError without the file name, and a mask id outside the vocabulary loads and
    fails later with an IndexError while decoding.)
    """
    edit_config(saved, **changes)
    with pytest.raises(ValueError, match=CONFIG_FILE):
        load_model(saved)


def test_check_state_dict_reports_problems(tmp_path: Path, model: BlockDiffusionLM) -> None:
    expected = model.state_dict()
    found = dict(expected)
    found.pop("embed.weight")
    found["extra.weight"] = torch.zeros(1)
    found["final_norm.weight"] = torch.zeros(5)
    with pytest.raises(ValueError, match="missing.*embed.weight.*unexpected.*extra.weight.*shape mismatch") as info:
        check_state_dict(expected, found, tmp_path / "w.safetensors")
    assert "w.safetensors" in str(info.value)
    check_state_dict(expected, dict(expected), tmp_path / "w.safetensors")  # no error when they match


def test_load_builtin_target_from_folder(checkpoint_dir: Path, tiny_codec: TextCodec) -> None:
    target, codec = load_builtin_target(checkpoint_dir, scoring="packed")
    assert target.name == checkpoint_dir.name
    assert target.scoring == "packed"
    assert codec.vocab_size == tiny_codec.vocab_size == target.vocab_size
    assert (target.mask_id, target.eos_id) == (codec.mask_id, codec.eos_id)


def test_tokenizer_vocab_mismatch(tmp_path: Path, saved: Path, tiny_codec: TextCodec) -> None:
    tiny_codec.save(saved / TOKENIZER_FILE)  # ~300 tokens for a 40-token model
    with pytest.raises(ValueError, match="tokenizer.*tokens but the model expects 40"):
        load_builtin_target(saved)


def test_missing_tokenizer(tmp_path: Path, checkpoint_dir: Path) -> None:
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoint_dir, folder)
    (folder / TOKENIZER_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=TOKENIZER_FILE):
        load_builtin_target(folder)
