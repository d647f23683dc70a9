"""The chain and calibrated drafters (``drafters/simple.py``) and the calibration they read: rank paths counted
on trajectories, selected prefix-closed, saved and loaded (``drafters/calibrated.py``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from draft_contexts import MASK, check_one_commit_tree, committed_positions, make_context
from spot_dlm.drafters.calibrated import load_rank_counts, rank_path_counts, save_rank_counts, select_rank_paths
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.simple import CalibratedDrafter, ChainDrafter, ranked_allowed
from trajectories import hand_trajectory

torch.set_num_threads(1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(("budget", "depth", "length"), [(16, 8, 6), (4, 8, 3), (16, 2, 2), (1, 8, 0), (3, 1, 1)])
def test_chain_drafter_single_path(temperature: float, budget: int, depth: int, length: int) -> None:
    """One path of min(budget - 1, depth) commits (the root has 7 masked positions; complete states are never
    drafted, so at most 6), each committing the most confident still-masked position under its step's guess."""
    context = make_context(temperature, seed=11)
    tree = ChainDrafter(budget=budget, depth=depth).propose(context)
    assert len(tree) == length + 1
    assert tree.parents == tuple(range(-1, length))
    assert tree.depths() == list(range(length + 1))
    check_one_commit_tree(tree, context)
    guesses = StaleGuesses(context)
    for node in range(1, len(tree)):
        parent = tree.states[node - 1]
        proposal = guesses.at(tree.steps[node - 1])
        best = ranked_allowed(proposal.confidence, parent == MASK)[0]
        assert committed_positions(parent, tree.states[node]) == [int(best)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_calibrated_drafter_shape(temperature: float) -> None:
    context = make_context(temperature, seed=5)
    guesses = StaleGuesses(context)
    tree = CalibratedDrafter(((0,), (1,), (0, 0)), budget=16).propose(context)
    assert len(tree) == 4
    assert tree.parents == (-1, 0, 0, 1)
    assert tree.depths() == [0, 1, 1, 2]
    check_one_commit_tree(tree, context)
    ranked_root = ranked_allowed(guesses.at(context.root_step).confidence, context.root == MASK)
    assert committed_positions(tree.states[0], tree.states[1]) == [int(ranked_root[0])]
    assert committed_positions(tree.states[0], tree.states[2]) == [int(ranked_root[1])]
    ranked_child = ranked_allowed(guesses.at(context.root_step + 1).confidence, tree.states[1] == MASK)
    assert committed_positions(tree.states[1], tree.states[3]) == [int(ranked_child[0])]

    small = CalibratedDrafter(((0,), (1,), (0, 0)), budget=3).propose(context)
    assert small.parents == (-1, 0, 0)
    orphan = CalibratedDrafter(((1, 1), (20,)), budget=16).propose(context)  # no parent path; rank beyond L
    assert len(orphan) == 1


def test_select_rank_paths_prefix_closed_most_frequent() -> None:
    counts = Counter({(0,): 50, (1,): 20, (2,): 4, (0, 0): 30, (0, 1): 12, (1, 0): 15, (0, 0, 0): 25, (5, 5): 99})
    for budget in range(1, 12):
        paths = select_rank_paths(counts, budget)
        assert len(paths) <= budget - 1
        assert len(set(paths)) == len(paths)
        chosen = set(paths)
        assert all(p[:-1] in chosen for p in paths if len(p) > 1), paths
        assert all(p[:-1] in chosen or len(p) == 1 for p in paths)
        for later, p in enumerate(paths):  # parents listed before their children
            assert all(q != p[:-1] for q in paths[later:])
    assert select_rank_paths(counts, 1) == []
    assert select_rank_paths(counts, 2) == [(0,)]
    assert set(select_rank_paths(counts, 4)) == {(0,), (0, 0), (0, 0, 0)}
    assert set(select_rank_paths(counts, 6)) == {(0,), (0, 0), (0, 0, 0), (1,), (1, 0)}
    assert (5, 5) not in select_rank_paths(counts, 100)  # its prefix (5,) was never seen
    assert len(select_rank_paths(counts, 100)) == 7


def test_rank_path_counts_on_hand_made_trajectory() -> None:
    data = hand_trajectory()
    # block 0, row 0 (branch {2}): commit 0 has rank 2 among {3, 1, 0}; then commit 3 has rank 0 among {3, 1},
    # then commit 1 rank 0 among {1}. row 1 (branch {0}): commit 3 rank 0 among {3, 1}, then commit 1 rank 0.
    # row 2: commit 1 rank 0.
    # block 1, row 4 (branch {1}): step 5 commits two positions, so no path starts there; row 5: commit 3 rank 0.
    expected = Counter({(2,): 1, (2, 0): 1, (2, 0, 0): 1, (0,): 3, (0, 0): 1})
    assert rank_path_counts(data, max_depth=3) == expected
    assert rank_path_counts(data, max_depth=1) == Counter({(2,): 1, (0,): 3})


def test_rank_counts_round_trip(tmp_path: Path) -> None:
    counts = Counter({(0,): 7, (1,): 3, (0, 0): 5, (2, 1, 0): 1})
    path = tmp_path / "calibration.json"
    save_rank_counts(counts, path)
    loaded = load_rank_counts(path)
    assert loaded == counts
    assert all(isinstance(k, tuple) for k in loaded)


@pytest.mark.parametrize("raw", ["not json", "{", '{"a": 1}', '[[[0], "x"]]', "null", "[1, 2]"])
def test_corrupt_calibration_file(tmp_path: Path, raw: str) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(raw)
    with pytest.raises(ValueError, match="calibration"):
        load_rank_counts(path)


def test_missing_calibration_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_rank_counts(tmp_path / "nowhere.json")
