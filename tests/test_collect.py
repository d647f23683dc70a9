"""Collecting trajectories for drafter training (``train/collect.py``): the shards, their consistency,
resuming, splitting and extending a folder, threshold and neighbour-corrected collections."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from spot_dlm.train.collect import SHARD_ARRAYS, CollectConfig, collect, collection_prompts, load_shards
from trajectories import BLOCK, DEPTH, run_collect

torch.set_num_threads(1)


def check_shard_arrays(data: dict[str, np.ndarray], n_positions: int, depth: int) -> None:
    n = len(data["block_id"])
    assert n > 0
    assert set(data) == set(SHARD_ARRAYS)
    assert data["top"].shape == (n, n_positions, 32)
    assert data["masked"].shape == data["committed"].shape == (n, n_positions)
    assert data["coupled"].shape == (n, depth, n_positions)
    assert data["masked"].dtype == data["committed"].dtype == np.bool_
    for name in ("block_id", "step", "prompt_id"):
        assert data[name].shape == (n,)
    top = data["top"].astype(np.float32)
    assert bool((top >= 0).all()) and bool((top.sum(-1) <= 1.01).all())
    assert bool((top[..., :-1] >= top[..., 1:]).all())  # sorted
    assert bool((data["committed"] <= data["masked"]).all())  # only masked positions get committed
    assert bool((data["committed"].sum(-1) >= 1).all())
    # rows of a block are consecutive, in step order, and each state follows from the previous commit
    for i in range(n):
        first = i == 0 or data["block_id"][i] != data["block_id"][i - 1]
        if first:
            assert data["step"][i] == 0
            assert bool(data["masked"][i].all())
        else:
            assert data["step"][i] == data["step"][i - 1] + 1
            assert np.array_equal(data["masked"][i], data["masked"][i - 1] & ~data["committed"][i - 1])
        last = i == n - 1 or data["block_id"][i + 1] != data["block_id"][i]
        if last:  # the block ends complete
            assert np.array_equal(data["committed"][i], data["masked"][i])


def test_collect_writes_shards(standard_shards) -> None:
    config, shards = standard_shards
    assert len(shards) == 4  # 2 temperatures x 2 prompts, one prompt per shard
    assert {p.name for p in shards} == {
        "shard_T0_tau0.9_00000.npz",
        "shard_T0_tau0.9_00001.npz",
        "shard_T1_tau0.9_00000.npz",
        "shard_T1_tau0.9_00001.npz",
    }
    assert all(p.is_file() for p in shards)
    assert not list(config.out_dir.glob("*.partial"))
    saved = json.loads((config.out_dir / "collect_config.json").read_text())
    assert saved["n_prompts"] == 2 and saved["block_length"] == BLOCK and saved["method"] == "standard"


def test_loaded_shards_are_consistent_one_commit_trajectories(standard_shards) -> None:
    _, shards = standard_shards
    data = load_shards(sorted(shards))
    check_shard_arrays(data, BLOCK, DEPTH)
    assert bool((data["committed"].sum(-1) == 1).all())  # standard decoding: one commit per rule step
    assert set(np.unique(data["step"]).tolist()) <= set(range(BLOCK))
    assert set(np.unique(data["prompt_id"]).tolist()) == {0, 1}
    n_blocks = len(np.unique(data["block_id"]))
    assert len(data["block_id"]) == n_blocks * BLOCK
    assert n_blocks >= 4  # at least one block per prompt and temperature
    # block ids stay unique across shards
    per_shard = [len(np.unique(load_shards([p])["block_id"])) for p in shards]
    assert sum(per_shard) == n_blocks


def test_t0_shard_coupled_confidence_is_the_stale_top_probability(standard_shards) -> None:
    """At T = 0 the coupled guess of every future step is the stale argmax, whose confidence is the top-1
    probability (mask token excluded) that ``top`` stores; positions already committed in the stale state (which
    no draft commits) store 0."""
    _, shards = standard_shards
    data = load_shards([p for p in shards if p.name.startswith("shard_T0_")])
    coupled = data["coupled"].astype(np.float32)  # [N, depth, L]
    top1 = data["top"][..., 0].astype(np.float32)  # [N, L]
    masked = data["masked"][:, None, :]  # [N, 1, L]
    assert np.allclose(np.where(masked, coupled, top1[:, None, :]), top1[:, None, :], atol=2e-3)
    assert not np.where(masked, 0.0, coupled).any()
    hot = load_shards([p for p in shards if p.name.startswith("shard_T1_")])["coupled"].astype(np.float32)
    assert not np.allclose(hot[:, :1], hot[:, 1:2])  # at T = 1 each step has its own noise


def test_collect_resumes_by_skipping_existing_shards(standard_shards, collect_target, tiny_codec) -> None:
    config, shards = standard_shards
    before = {p: os.stat(p).st_mtime_ns for p in shards}
    passes = collect_target.counter.passes
    again = collect(collect_target, tiny_codec, config)
    assert again == shards
    assert {p: os.stat(p).st_mtime_ns for p in shards} == before
    assert collect_target.counter.passes == passes  # nothing was decoded


def test_collect_workers_split_the_shards(standard_shards, collect_target, tiny_codec, tmp_path) -> None:
    config, shards = standard_shards
    out = tmp_path / "split"
    halves = [run_collect(collect_target, tiny_codec, out, worker=i, workers=2)[1] for i in range(2)]
    assert not set(halves[0]) & set(halves[1])
    assert sorted(p.name for p in halves[0] + halves[1]) == sorted(p.name for p in shards)
    for path in shards:
        with np.load(path) as one, np.load(out / path.name) as split:
            assert all(np.array_equal(one[name], split[name]) for name in SHARD_ARRAYS)


def test_collection_prompts_are_prefix_stable() -> None:
    longer = collection_prompts(12, seed=1)
    assert collection_prompts(7, seed=1) == longer[:7]
    assert len(set(longer)) == 12
    assert collection_prompts(7, seed=2) != longer[:7]


def test_collect_extends_a_folder_with_more_prompts(standard_shards, collect_target, tiny_codec, tmp_path) -> None:
    """A larger n_prompts adds shards for the new prompts only; the shards there are kept as they are."""
    config, shards = standard_shards
    out = tmp_path / "extend"
    shutil.copytree(config.out_dir, out)
    before = {p.name: os.stat(out / p.name).st_mtime_ns for p in shards}
    _, grown = run_collect(collect_target, tiny_codec, out, n_prompts=3)
    assert {p.name for p in grown} == set(before) | {"shard_T0_tau0.9_00002.npz", "shard_T1_tau0.9_00002.npz"}
    assert {name: os.stat(out / name).st_mtime_ns for name in before} == before
    assert set(np.unique(load_shards(sorted(grown))["prompt_id"]).tolist()) == {0, 1, 2}
    run_collect(collect_target, tiny_codec, out, n_prompts=1)  # a prefix: nothing new, the record keeps 3
    assert json.loads((out / "collect_config.json").read_text())["n_prompts"] == 3


def test_collect_records_what_the_shards_hold(standard_shards, collect_target, tiny_codec, tmp_path) -> None:
    """An interrupted larger run leaves a record that claims more prompts than the shards hold; the next completed
    run counts the shards instead."""
    config, _ = standard_shards
    out = tmp_path / "interrupted"
    shutil.copytree(config.out_dir, out)
    record = out / "collect_config.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "n_prompts": 10}))
    run_collect(collect_target, tiny_codec, out, n_prompts=2)
    assert json.loads(record.read_text())["n_prompts"] == 2


def test_collect_extends_past_a_short_last_shard(collect_target, tiny_codec, tmp_path) -> None:
    """3 prompts at 2 per shard leave a last shard holding one prompt; growing to 5 collects that shard again, whole,
    so no prompt is skipped."""
    out = tmp_path / "short"
    run_collect(collect_target, tiny_codec, out, n_prompts=3, prompts_per_shard=2, temperatures=(0.0,))
    _, grown = run_collect(collect_target, tiny_codec, out, n_prompts=5, prompts_per_shard=2, temperatures=(0.0,))
    assert set(np.unique(load_shards(sorted(grown))["prompt_id"]).tolist()) == {0, 1, 2, 3, 4}
    assert json.loads((out / "collect_config.json").read_text())["n_prompts"] == 5


@pytest.mark.parametrize("change", [{"block_length": 4}, {"seed": 5}, {"prompt_order": None}])
def test_collect_refuses_a_folder_made_with_other_settings(
    standard_shards, collect_target, tiny_codec, tmp_path, change
) -> None:
    config, _ = standard_shards
    out = tmp_path / "other"
    shutil.copytree(config.out_dir, out)
    record = out / "collect_config.json"
    if "prompt_order" in change:  # a folder from before the prompt order was prefix-stable
        record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "prompt_order"}))
        change = {}
    with pytest.raises(ValueError, match="other settings"):
        run_collect(collect_target, tiny_codec, out, **change)


@pytest.mark.parametrize("worker, workers", [(2, 2), (-1, 2), (0, 0)])
def test_collect_config_rejects_a_bad_worker_split(tmp_path, worker, workers) -> None:
    with pytest.raises(ValueError, match="worker"):
        CollectConfig(out_dir=tmp_path, worker=worker, workers=workers)


def test_load_shards_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_shards([])
    path = tmp_path / "shard_bad.npz"
    np.savez(path, top=np.zeros((1, 2, 32)))
    with pytest.raises(ValueError, match="lacks"):
        load_shards([path])


def test_threshold_shards(threshold_shards) -> None:
    config, shards = threshold_shards
    assert len(shards) == 4
    data = load_shards(sorted(shards))
    check_shard_arrays(data, BLOCK, DEPTH)
    assert int(data["committed"].sum(-1).max()) >= 2  # tau = 0.1 does commit several positions in one step


def test_collected_corrected_confidence_moves_only_where_a_neighbour_was_filled(corrected_shards) -> None:
    """Example (i, d) reads the confidence corrected for the neighbours filled between s_i and s_{i+d}: equal to the
    coupled confidence wherever neither neighbour of a still-masked position changed, a probability elsewhere, and
    different somewhere (a wrong state or step would move it where no neighbour did)."""
    _, shards = corrected_shards
    data = load_shards(sorted(shards))
    assert set(data) == {*SHARD_ARRAYS, "corrected"}
    assert data["corrected"].shape == data["coupled"].shape
    coupled, corrected = data["coupled"].astype(np.float32), data["corrected"].astype(np.float32)
    block, masked = data["block_id"], data["masked"]
    changed, checked = 0, 0
    for i in range(len(block)):
        for d in range(1, DEPTH + 1):
            if i + d >= len(block) or block[i + d] != block[i]:
                continue
            filled = masked[i] & ~masked[i + d]  # committed by steps i .. i+d-1
            left = np.concatenate([[False], filled[:-1]])
            right = np.concatenate([filled[1:], [False]])
            still = masked[i + d]
            calm = still & ~left & ~right
            assert np.array_equal(corrected[i, d - 1][calm], coupled[i, d - 1][calm])
            moved = still & (left | right)
            assert bool(((corrected[i, d - 1][moved] >= 0) & (corrected[i, d - 1][moved] <= 1)).all())
            changed += int((np.abs(corrected[i, d - 1] - coupled[i, d - 1]) > 1e-3).sum())
            checked += int(moved.sum())
    assert checked > 0 and changed > 0


def test_plain_collections_lack_the_corrected_confidence_and_mixed_folders_drop_it(
    standard_shards, corrected_shards
) -> None:
    assert "corrected" not in load_shards(sorted(standard_shards[1]))
    mixed = load_shards([standard_shards[1][0], corrected_shards[1][0]])
    assert set(mixed) == set(SHARD_ARRAYS)


def test_collect_refuses_a_neighbour_folder_without_a_fit(collect_target, tiny_codec, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        run_collect(collect_target, tiny_codec, tmp_path / "a", neighbours=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no bigram fit"):
        run_collect(collect_target, tiny_codec, tmp_path / "b", neighbours=str(tmp_path / "empty"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before the folder is made
