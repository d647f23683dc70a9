"""Training the order model on collected trajectories (``train/drafter.py``): its inputs, metrics, warm starts,
other shapes and features, SPOT-Sets training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from draft_contexts import L, check_one_commit_tree, make_context
from spot_dlm.drafters.folder import load_order_model, save_order_model
from spot_dlm.drafters.order_net import OrderModelConfig
from spot_dlm.drafters.spot import SpotDrafter
from spot_dlm.train.drafter import Examples, batch_tensors, train_drafter, warm_start
from trajectories import DEPTH, hand_trajectory

torch.set_num_threads(1)


def test_previous_feature_reads_the_row_one_commit_earlier_in_the_same_block() -> None:
    data = hand_trajectory()
    n = len(data["step"])
    data["top"] = np.arange(n * 4 * 32, dtype=np.float16).reshape(n, 4, 32) / (n * 4 * 32)  # distinct per row
    cum = np.concatenate([np.zeros((1, 4), np.int32), np.cumsum(data["committed"], 0)])
    rows = np.array([0, 1, 2, 4, 5])  # rows 0 and 4 open their block
    ex = Examples(row=rows, depth=np.ones(len(rows), dtype=np.int64))
    config = OrderModelConfig(top_k=32, previous_feature=True)
    features, _, _ = batch_tensors(data, cum, ex, np.arange(len(rows)), config)
    assert features.shape == (len(rows), 4, config.n_features)
    previous, has_previous = features[..., -2], features[..., -1]
    assert has_previous[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]
    for k, row in enumerate(rows.tolist()):
        expected = data["top"][row - 1, :, 0].astype(np.float32) if row not in (0, 4) else np.zeros(4, np.float32)
        assert np.array_equal(previous[k].numpy(), expected)


def check_metrics(metrics: dict, key: str, folder: Path) -> None:
    accuracy = metrics[key]
    assert accuracy, metrics
    assert set(accuracy) <= set(range(1, DEPTH + 1))
    assert all(0.0 <= a <= 1.0 for a in accuracy.values())
    assert metrics["heldout_examples"] > 0 and metrics["train_examples"] > 0
    assert metrics["steps"] >= 1
    assert {p.name for p in folder.iterdir()} >= {"drafter.safetensors", "drafter_config.json", "drafter_metrics.json"}
    on_disk = json.loads((folder / "drafter_metrics.json").read_text())
    assert {int(k): v for k, v in on_disk[key].items()} == accuracy
    model = load_order_model(folder)
    assert sum(p.numel() for p in model.parameters()) == metrics["parameters"]


def test_train_drafter_on_standard_shards(standard_shards, tmp_path: Path) -> None:
    config, _ = standard_shards
    out = tmp_path / "drafter"
    metrics = train_drafter(config.out_dir, out, minutes=0.05, max_depth=DEPTH)
    assert metrics["objective"] == "order"
    check_metrics(metrics, "heldout_next_commit_accuracy_by_depth", out)
    naive = metrics["heldout_naive_stale_confidence_accuracy_by_depth"]
    assert set(naive) == set(metrics["heldout_next_commit_accuracy_by_depth"])
    per_temperature = metrics["heldout_accuracy_by_temperature_and_depth"]
    assert set(per_temperature) == set(metrics["heldout_naive_accuracy_by_temperature_and_depth"]) == {"0", "1"}
    overall = metrics["heldout_next_commit_accuracy_by_depth"]
    for depth, accuracy in overall.items():  # the overall figure is a weighted mean of the per-temperature ones
        slices = [by_depth[depth] for by_depth in per_temperature.values() if depth in by_depth]
        assert min(slices) - 1e-9 <= accuracy <= max(slices) + 1e-9
    assert all(0.0 <= a <= 1.0 for a in naive.values())


def test_train_drafter_continues_from_a_trained_drafter(standard_shards, tmp_path: Path) -> None:
    config, _ = standard_shards
    first = tmp_path / "first"
    train_drafter(config.out_dir, first, minutes=0.02, max_depth=DEPTH)
    still = tmp_path / "still"  # lr 0: the saved weights are exactly the ones it started from
    train_drafter(config.out_dir, still, minutes=0.02, max_depth=DEPTH, lr=0.0, init=first)
    before, after = load_order_model(first).state_dict(), load_order_model(still).state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    with pytest.raises(ValueError, match="config"):  # it reads fewer inputs than the model it starts from
        train_drafter(
            config.out_dir, tmp_path / "x", minutes=0.02, max_depth=DEPTH, init=widened_folder(first, tmp_path)
        )


def test_train_drafter_of_another_shape(standard_shards, tmp_path: Path) -> None:
    """``shape`` sets the order model's width, layers and heads; a warm start of another shape and heads that do not
    divide the width are refused before any data is read."""
    config, _ = standard_shards
    out = tmp_path / "small"
    metrics = train_drafter(config.out_dir, out, minutes=0.02, max_depth=DEPTH, shape=(16, 1, 2))
    model = load_order_model(out)
    assert (model.config.d_model, model.config.n_layers, model.config.n_heads) == (16, 1, 2)
    assert metrics["parameters"] == sum(p.numel() for p in model.parameters()) < 10_000
    with pytest.raises(ValueError, match="config"):
        train_drafter(config.out_dir, tmp_path / "x", minutes=0.02, max_depth=DEPTH, shape=(32, 1, 2), init=out)
    with pytest.raises(ValueError, match="not divisible"):
        train_drafter(tmp_path / "no-shards", tmp_path / "y", minutes=0.02, shape=(30, 1, 4))


def widened_folder(folder: Path, tmp_path: Path) -> Path:
    """A drafter with the temperature input, started from ``folder``'s drafter (which lacks it)."""
    trained = load_order_model(folder)
    wide = warm_start(folder, dataclasses.replace(trained.config, temperature_feature=True))
    save_order_model(wide, tmp_path / "wide")
    return tmp_path / "wide"


def test_warm_start_with_a_new_input_starts_from_the_same_function(saved_order_model, tmp_path: Path) -> None:
    """The new input's weights start at zero: logits equal the old model's whatever the new column holds."""
    model, folder = saved_order_model
    wide = load_order_model(widened_folder(folder, tmp_path))
    assert wide.config.feature_names == (*model.config.feature_names, "temperature")
    features = torch.rand(3, 10, model.config.n_features)
    column = wide.config.feature_names.index("temperature")
    for temperature in (0.0, 1.0, 1.5):
        wider = torch.cat([features[..., :column], torch.full((3, 10, 1), temperature), features[..., column:]], -1)
        with torch.no_grad():
            assert torch.allclose(wide(wider), model(features), atol=1e-6)
    with pytest.raises(ValueError, match="config"):  # other sizes are never widened
        warm_start(folder, dataclasses.replace(model.config, d_model=64, temperature_feature=True))


def test_train_drafter_with_temperature_and_previous_features(standard_shards, tmp_path: Path) -> None:
    """A drafter that also reads T and the confidence trend trains, loads, and drafts valid trees."""
    config, _ = standard_shards
    out = tmp_path / "drafter_tp"
    metrics = train_drafter(
        config.out_dir, out, minutes=0.05, max_depth=DEPTH, temperature_feature=True, previous_feature=True
    )
    check_metrics(metrics, "heldout_next_commit_accuracy_by_depth", out)
    model = load_order_model(out)
    assert model.config.temperature_feature and model.config.previous_feature
    assert model.config.n_features == OrderModelConfig().n_features + 3
    for temperature in (0.0, 1.0):
        wide = torch.randn(L, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # V >= top-k
        context = dataclasses.replace(make_context(temperature, seed=3), stale_logits=wide)
        with_previous = dataclasses.replace(context, previous_logits=wide.flip(0))
        for ctx in (context, with_previous):
            tree = SpotDrafter(model, budget=6, depth=3).propose(ctx)
            check_one_commit_tree(tree, ctx)


def test_train_drafter_sets_on_threshold_shards(threshold_shards, tmp_path: Path) -> None:
    config, _ = threshold_shards
    out = tmp_path / "sets_drafter"
    metrics = train_drafter(config.out_dir, out, minutes=0.05, max_depth=DEPTH, sets=True)
    assert metrics["objective"] == "sets"
    check_metrics(metrics, "heldout_exact_set_accuracy_by_depth", out)
    assert "heldout_naive_stale_confidence_accuracy_by_depth" not in metrics


def test_train_drafter_with_the_corrected_feature(standard_shards, corrected_shards, tmp_path: Path) -> None:
    """The corrected confidence is a new input column: training needs shards that hold it, a warm start from a model
    without it keeps its function (zero weights), and the trained model drafts only beside a bigram fit."""
    from spot_dlm.drafters.neighbours import load_neighbour_fit

    config, _ = corrected_shards
    with pytest.raises(ValueError, match="no corrected confidence"):
        train_drafter(standard_shards[0].out_dir, tmp_path / "x", minutes=0.02, corrected_feature=True)
    plain = tmp_path / "plain"
    train_drafter(config.out_dir, plain, minutes=0.02, max_depth=DEPTH)
    out = tmp_path / "corrected"
    metrics = train_drafter(
        config.out_dir, out, minutes=0.02, max_depth=DEPTH, corrected_feature=True, init=plain, lr=0.0
    )
    check_metrics(metrics, "heldout_next_commit_accuracy_by_depth", out)
    model = load_order_model(out)
    assert model.config.feature_names[-1] == "corrected_confidence"
    assert model.config.n_features == load_order_model(plain).config.n_features + 1
    before = json.loads((plain / "drafter_metrics.json").read_text())["heldout_next_commit_accuracy_by_depth"]
    after = {str(depth): accuracy for depth, accuracy in metrics["heldout_next_commit_accuracy_by_depth"].items()}
    assert after == before  # lr 0 from the plain model: the new column changes nothing yet
    with pytest.raises(ValueError, match="bigram fit"):
        SpotDrafter(model, budget=6, depth=3)
    with pytest.raises(ValueError, match="none was given"):
        model.config.extra_inputs(0.9, 0.0)
    neighbours, _ = load_neighbour_fit(Path(str(config.neighbours)))
    for temperature in (0.0, 1.0):
        wide = torch.randn(L, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # V >= top-k
        context = dataclasses.replace(make_context(temperature, seed=3), stale_logits=wide)
        plain_tokens = dataclasses.replace(neighbours, weight_greedy=0.0, weight_sampled=0.0)  # stale guesses
        check_one_commit_tree(SpotDrafter(model, budget=6, depth=3, neighbours=plain_tokens).propose(context), context)
        assert len(SpotDrafter(model, budget=6, depth=3, neighbours=neighbours).propose(context)) == 6
