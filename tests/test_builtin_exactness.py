"""On the shipped built-in target and drafter: SPOT equals standard decoding token for token (20+ prompts).

The shipped checkpoint and drafter are part of the package; these tests fail (not skip) if they are missing.
"""

from __future__ import annotations

import pytest
import torch

from spot_dlm.api import GenerateConfig, generate, load_target
from spot_dlm.train.data import heldout_items

N_PROMPTS = 20
_STANDARD: dict[float, list] = {}  # temperature -> standard decoding of the prompts


@pytest.fixture(scope="module")
def builtin():
    return load_target()


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [item["question"] for item in heldout_items("gsm8k", N_PROMPTS)]


@pytest.mark.parametrize("order_model", ["small", "paper"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spot_equals_standard_on_builtin_target(builtin, prompts, temperature, order_model):
    """Both shipped order models: the paper-sized one (GPU default) and the small one (CPU default)."""
    target, codec = builtin
    common = {"block_length": 32, "gen_length": 64, "temperature": temperature, "seed": 3}
    if temperature not in _STANDARD:  # the reference is the same for both order models
        _STANDARD[temperature] = generate(prompts, GenerateConfig(method="standard", **common), target, codec)
    standard = _STANDARD[temperature]
    config = GenerateConfig(method="spot", budget=8, depth=6, order_model=order_model, **common)
    spot = generate(prompts, config, target, codec)
    assert [g.raw_token_ids for g in spot] == [g.raw_token_ids for g in standard]
    assert [g.commit_step for g in spot] == [g.commit_step for g in standard]
    spot_passes = sum(g.target_passes for g in spot)
    standard_passes = sum(g.target_passes for g in standard)
    assert spot_passes < standard_passes  # the shipped drafter accepts something on a trained target
    assert sum(g.stats["handoff_blocks"] for g in spot) > 0  # and some second blocks open by a hand-off


def test_spot_sets_equals_threshold_on_builtin_target(builtin, prompts):
    target, codec = builtin
    common = {"block_length": 32, "gen_length": 64, "temperature": 1.0, "seed": 5, "tau": 0.8}
    threshold = generate(prompts[:10], GenerateConfig(method="threshold", **common), target, codec)
    sets = generate(prompts[:10], GenerateConfig(method="spot-sets", budget=8, **common), target, codec)
    assert [g.raw_token_ids for g in sets] == [g.raw_token_ids for g in threshold]


def test_builtin_checkpoint_is_trained_and_16_bit():
    from safetensors import safe_open

    from spot_dlm.models.builtin import builtin_dir
    from spot_dlm.models.checkpoint import load_training_state

    state = load_training_state(builtin_dir())
    assert state["tokens_seen"]["ar"] > 0 and state["tokens_seen"]["bd"] > 0
    with safe_open(str(builtin_dir() / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())  # noqa: SIM118 (safe_open is not a dict)
