"""Drafters: best-first tree growth, the training-free and calibrated drafters, the order model and its pipeline
(collect trajectories -> train the order model)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from spot_dlm.decode import DraftContext
from spot_dlm.drafters.calibrated import load_rank_counts, rank_path_counts, save_rank_counts, select_rank_paths
from spot_dlm.drafters.children import masked_log_normalise
from spot_dlm.drafters.folder import load_order_model, save_order_model
from spot_dlm.drafters.growth import grow_tree
from spot_dlm.drafters.guesses import StaleGuesses, stale_log_normaliser
from spot_dlm.drafters.order_features import largest_values, order_features, stale_top_probs
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig, freeze_order_model, one_host_thread
from spot_dlm.drafters.simple import CalibratedDrafter, ChainDrafter, ranked_allowed
from spot_dlm.drafters.spot import SpotDrafter
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule
from spot_dlm.train.collect import SHARD_ARRAYS, CollectConfig, collect, collection_prompts, load_shards
from spot_dlm.train.drafter import Examples, batch_tensors, train_drafter, warm_start
from spot_dlm.tree import DraftTree

torch.set_num_threads(1)

MASK, L, V = 2, 8, 12
ROOT_COMMIT = 7  # the free commit of the root fills the last position


def make_context(temperature: float = 0.0, seed: int = 0, root_step: int = 1, kind: str = "one") -> DraftContext:
    """A hand-made draft context: random stale logits over V tokens, a root with one position committed."""
    generator = torch.Generator().manual_seed(seed)
    stale = torch.randn(L, V, generator=generator, dtype=torch.float64) * 3
    parent = torch.full((L,), MASK, dtype=torch.int64)
    root = parent.clone()
    root[ROOT_COMMIT] = 5
    rule = CommitRule(kind, temperature=temperature, tau=0.3)
    return DraftContext(root, parent, stale, root_step, 1, NoiseKey(seed, 3), rule, MASK)


def committed_positions(parent: torch.Tensor, child: torch.Tensor) -> list[int]:
    return torch.nonzero(parent != child).flatten().tolist()


def check_one_commit_tree(tree: DraftTree, context: DraftContext) -> None:
    """Each non-root node commits one position that its parent had masked, with the stale coupled guess of the
    parent's step; every node still has a masked position; no state is stored twice."""
    guesses = StaleGuesses(context)
    assert torch.equal(tree.states[0], context.root)
    assert tree.parents[0] == -1
    assert tree.steps[0] == context.root_step
    for node in range(1, len(tree)):
        parent = tree.parents[node]
        assert 0 <= parent < node
        assert tree.steps[node] == tree.steps[parent] + 1
        changed = committed_positions(tree.states[parent], tree.states[node])
        assert len(changed) == 1, (node, changed)
        (position,) = changed
        assert tree.states[parent][position] == MASK
        assert tree.states[node][position] == guesses.at(tree.steps[parent]).tokens[position]
    assert bool((tree.states == MASK).any(-1).all())
    assert len({(s, tuple(x.tolist())) for s, x in zip(tree.steps, tree.states)}) == len(tree)


def state_scorer(seed: int):
    """A random PositionScorer that is a pure function of the node's state (so path scores can be recomputed)."""
    generator = torch.Generator().manual_seed(seed)
    bias = torch.randn(L, generator=generator, dtype=torch.float64) * 2
    mixing = torch.randn(L, L, generator=generator, dtype=torch.float64)
    calls: list[list[int]] = []

    def scorer(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
        calls.append(list(steps))
        scores = bias + (states != MASK).to(torch.float64) @ mixing
        return masked_log_normalise(scores, states == MASK)

    scorer.calls = calls
    return scorer


def order_scorer(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """Strongly prefers committing the lowest masked position first: 0, 1, 2, ..."""
    scores = -20.0 * torch.arange(L, dtype=torch.float64).expand(states.shape[0], -1)
    return masked_log_normalise(scores, states == MASK)


# ------------------------------------------------------------------------------------------------- grow_tree


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(("budget", "depth"), [(1, 4), (2, 1), (5, 2), (8, 3), (16, 8), (40, 6)])
def test_grow_tree_invariants(temperature: float, budget: int, depth: int) -> None:
    context = make_context(temperature, seed=budget + depth)
    scorer = state_scorer(budget * depth)
    tree = grow_tree(context, budget, depth, scorer)
    assert 1 <= len(tree) <= budget
    assert max(tree.depths()) <= depth
    check_one_commit_tree(tree, context)
    if budget > 1:
        assert len(tree) > 1
    # the scorer is asked about nodes at consecutive step indices, one depth per call
    for level, steps in enumerate(scorer.calls):
        assert set(steps) == {context.root_step + level}


def path_logprob(tree: DraftTree, node: int, scorer) -> float:
    total = 0.0
    while tree.parents[node] >= 0:
        parent = tree.parents[node]
        (position,) = committed_positions(tree.states[parent], tree.states[node])
        total += float(scorer(tree.states[parent][None], [tree.steps[parent]])[0, position])
        node = parent
    return total


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("budget", "depth"), [(4, 3), (9, 4), (20, 3)])
def test_grow_tree_is_best_first(temperature: float, seed: int, budget: int, depth: int) -> None:
    """No child left out of the tree (within the depth limit) has a higher path probability than a node kept."""
    context = make_context(temperature, seed=seed)
    scorer = state_scorer(100 + seed)
    tree = grow_tree(context, budget, depth, scorer)
    assert len(tree) == budget  # plenty of candidates: the budget is used up
    guesses = StaleGuesses(context)
    kept = [path_logprob(tree, n, scorer) for n in range(len(tree))]
    depths = tree.depths()
    frontier = []
    for node in range(len(tree)):
        if depths[node] >= depth:
            continue
        scores = scorer(tree.states[node][None], [tree.steps[node]])[0]
        tokens = guesses.at(tree.steps[node]).tokens
        for position in torch.nonzero(tree.states[node] == MASK).flatten().tolist():
            child = tree.states[node].clone()
            child[position] = tokens[position]
            if not bool((child == MASK).any()) or tree.lookup(child, tree.steps[node] + 1) is not None:
                continue
            frontier.append(kept[node] + float(scores[position]))
    assert frontier
    assert max(frontier) <= min(kept[1:]) + 1e-9


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("budget", "depth"), [(3, 6), (4, 8), (8, 8), (16, 5)])
def test_admission_bar_prunes_calls_not_the_tree(monkeypatch, temperature, seed, budget, depth) -> None:
    """Growth that stops below the admission bar yields the tree of unpruned growth, with no more scorer rows."""
    import spot_dlm.drafters.growth as growth

    context = make_context(temperature, seed=seed)
    pruned_scorer, full_scorer = state_scorer(seed), state_scorer(seed)
    pruned = grow_tree(context, budget, depth, pruned_scorer)
    monkeypatch.setattr(growth, "_admission_bar", lambda best_per_state, top, keep: (float("-inf"), top))
    full = grow_tree(context, budget, depth, full_scorer)
    assert torch.equal(pruned.states, full.states)
    assert pruned.parents == full.parents
    assert sum(map(len, pruned_scorer.calls)) <= sum(map(len, full_scorer.calls))


def test_admission_bar_stops_a_confident_chain_early() -> None:
    """A scorer sure of the order makes a chain: after it, no level has a node that could still enter."""
    calls: list[int] = []

    def counting(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
        calls.append(states.shape[0])
        return order_scorer(states, steps)

    tree = grow_tree(make_context(), 4, 6, counting)
    assert tree.depths() == [0, 1, 2, 3]
    assert sum(calls) <= 8  # the unpruned growth asks about 1 + 3 * 5 = 16 rows


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_budget_two_asks_the_scorer_once(temperature: float, seed: int) -> None:
    """Root plus one child: once the best child is known nothing below it can enter, so one call per round."""
    scorer = state_scorer(seed)
    tree = grow_tree(make_context(temperature, seed=seed), 2, 8, scorer)
    assert len(tree) == 2
    assert [len(rows) for rows in scorer.calls] == [1]


def test_grow_tree_prefers_the_scored_order() -> None:
    context = make_context(0.0)
    tree = grow_tree(context, budget=5, max_depth=8, position_logprobs=order_scorer)
    assert tree.parents == (-1, 0, 1, 2, 3)  # the whole budget goes to the chain 0 -> 1 -> 2 -> 3
    for node in range(1, 5):
        assert committed_positions(tree.states[node - 1], tree.states[node]) == [node - 1]

    wide = grow_tree(context, budget=9, max_depth=3, position_logprobs=order_scorer)
    assert max(wide.depths()) == 3
    chain = [0]
    for position in range(3):
        child = wide.states[chain[-1]].clone()
        child[position] = StaleGuesses(context).at(wide.steps[chain[-1]]).tokens[position]
        node = wide.lookup(child, wide.steps[chain[-1]] + 1)
        assert node is not None, f"chain 0 -> 1 -> 2 broken at position {position}"
        assert wide.parents[node] == chain[-1]
        chain.append(node)


def test_grow_tree_merges_commit_orders_at_t0() -> None:
    """At T = 0 committing a then b or b then a gives one state: it is stored once."""
    context = make_context(0.0)

    def two_positions(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
        scores = torch.full(states.shape, -30.0, dtype=torch.float64)
        scores[:, :2] = 0.0
        return masked_log_normalise(scores, states == MASK)

    tree = grow_tree(context, budget=16, max_depth=2, position_logprobs=two_positions)
    check_one_commit_tree(tree, context)
    both = context.root.clone()
    both[:2] = StaleGuesses(context).at(0).tokens[:2]
    node = tree.lookup(both, context.root_step + 2)
    assert node is not None
    assert sum(bool(torch.equal(s, both)) for s in tree.states) == 1


def test_stale_guesses_follow_the_step_noise() -> None:
    """At T > 0 the guess for step c uses the Gumbel noise of step c; at T = 0 every step guesses the argmax."""
    cold = StaleGuesses(make_context(0.0, seed=3))
    stale = make_context(0.0, seed=3).stale_logits.clone()
    stale[:, MASK] = float("-inf")
    assert torch.equal(cold.at(1).tokens, stale.argmax(-1))
    assert torch.equal(cold.at(5).tokens, cold.at(1).tokens)
    context = make_context(1.0, seed=3)
    hot = StaleGuesses(context)
    for step_index in (1, 2, 6):
        noise = context.noise.gumbel(context.block_index, step_index, torch.arange(L), V)
        assert torch.equal(hot.at(step_index).tokens, (stale + noise).argmax(-1))
    assert any(not torch.equal(hot.at(1).tokens, hot.at(s).tokens) for s in range(2, 8))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("seed", range(3))
def test_guess_table_holds_the_best_coupled_guesses_of_stale_masked_positions(temperature: float, seed: int) -> None:
    """Per step: the R best coupled guesses (the rule's first), their scores ``Z / T + gumbel`` and stale
    log-probabilities, at exactly the positions masked in the stale state; others are refused."""
    context = make_context(temperature, seed=seed)
    parent = context.parent.clone()
    parent[seed] = 9  # committed before the stale pass: no guesses there
    context = dataclasses.replace(context, parent=parent, root=torch.where(parent != MASK, parent, context.root))
    guesses = StaleGuesses(context)
    z = context.stale_logits.clone()
    z[:, MASK] = float("-inf")
    coupled = z / temperature + context.gumbel(3) if temperature > 0 else z
    table = guesses.table(3, 5)
    masked = np.flatnonzero(parent.numpy() == MASK)
    assert np.array_equal(np.flatnonzero(table.row >= 0), masked)
    rows = table.rows(masked)
    assert np.array_equal(table.tokens[rows, 0], guesses.at(3).tokens.numpy()[masked])
    for position, row in zip(masked.tolist(), rows.tolist()):
        tokens = table.tokens[row]
        assert len(set(tokens.tolist())) == len(tokens) == min(16, V)
        assert np.all(table.scores[row][tokens == MASK] == float("-inf"))  # the mask token is never a guess
        assert np.array_equal(table.scores[row], coupled[position, tokens].numpy())
        assert np.all(np.diff(table.scores[row]) <= 0)  # best first
        np.testing.assert_allclose(table.logprob[row], torch.log_softmax(z[position], -1)[tokens].numpy(), atol=1e-12)
    with pytest.raises(ValueError, match="committed in the stale state"):
        table.rows(np.array([seed]))


# ------------------------------------------------------------------------------ chain and calibrated drafters


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


# ------------------------------------------------------------------------------------------- calibration


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


def hand_trajectory() -> dict[str, np.ndarray]:
    """Two blocks of a 4-position one-commit trajectory plus a row that commits two positions.

    Block 0 commits positions 2, 0, 3, 1; block 1 commits 1, then {0, 2} together, then 3. The coupled
    confidence ranks positions 2 > 3 > 1 > 0 at every step.
    """
    order_block0 = [[2], [0], [3], [1]]
    order_block1 = [[1], [0, 2], [3]]
    rows = {name: [] for name in SHARD_ARRAYS}
    for block, order in ((0, order_block0), (1, order_block1)):
        masked = np.ones(4, dtype=bool)
        for step_index, positions in enumerate(order):
            committed = np.zeros(4, dtype=bool)
            committed[positions] = True
            rows["top"].append(np.zeros((4, 32), np.float16))
            rows["masked"].append(masked.copy())
            rows["committed"].append(committed)
            rows["coupled"].append(np.tile(np.array([0.1, 0.2, 0.9, 0.5], np.float16), (3, 1)))
            rows["block_id"].append(block)
            rows["step"].append(step_index)
            rows["prompt_id"].append(0)
            rows["tau"].append(0.9)
            rows["temperature"].append(0.0)
            masked &= ~committed
    return {name: np.asarray(value) for name, value in rows.items()}


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


# ------------------------------------------------------------------------------------------- order model


def test_order_model_size_and_shape() -> None:
    torch.manual_seed(0)
    model = OrderModel(OrderModelConfig()).eval()
    n_params = sum(p.numel() for p in model.parameters())
    assert 500_000 <= n_params <= 700_000
    features = torch.rand(3, 16, OrderModelConfig().n_features)
    assert model(features).shape == (3, 16)
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.rand(1, 65, OrderModelConfig().n_features))


def test_order_model_equals_torch_transformer_encoder() -> None:
    """The written-out layers compute what nn.TransformerEncoder (pre-norm, GELU) computes with the same weights,
    so checkpoints trained with either load into the other."""
    torch.manual_seed(3)
    config = OrderModelConfig(top_k=8, d_model=32, n_layers=2, n_heads=4)
    model = OrderModel(config).eval()
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, 128, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    reference = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.3)
    model.encoder.load_state_dict(reference.state_dict())
    x = torch.randn(3, 16, 32)
    with torch.inference_mode():
        assert torch.allclose(model.encoder(x), reference(x), atol=1e-5)
    reference.train()  # the slow (non-fused) path too
    with torch.no_grad():
        assert torch.allclose(model.encoder(x), reference(x), atol=1e-5)


@pytest.fixture
def saved_order_model(tmp_path: Path) -> tuple[OrderModel, Path]:
    torch.manual_seed(1)
    config = OrderModelConfig(d_model=32, n_layers=2, n_heads=4, max_block_length=16)
    model = OrderModel(config).eval()
    folder = tmp_path / "drafter"
    save_order_model(model, folder, metrics={"note": "random"})
    return model, folder


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

    from spot_dlm.api import GenerateConfig, make_drafter, order_model_folder

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
    folder = tmp_path / "drafter"
    assert order_model_folder(GenerateConfig(method="spot"), on_gpu, folder) == folder
    assert order_model_folder(GenerateConfig(method="spot", order_model="small"), on_gpu, folder) == folder / "small"
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


def test_order_model_block_longer_than_max(saved_order_model: tuple[OrderModel, Path]) -> None:
    model, _ = saved_order_model
    with pytest.raises(ValueError, match="block length 17"):
        model(torch.rand(1, 17, model.config.n_features))


@pytest.mark.parametrize("shape", [(1, 16), (3, 16), (7, 5), (15, 1)])
def test_frozen_order_model_gives_the_same_logits_bit_for_bit(
    saved_order_model: tuple[OrderModel, Path], shape: tuple[int, int]
) -> None:
    """One trace (made at a 2-position block) serves every batch size and block length up to the maximum."""
    model, _ = saved_order_model
    frozen = freeze_order_model(model)
    assert frozen.config == model.config and frozen.device == model.device
    features = torch.rand(*shape, model.config.n_features)
    with torch.no_grad():
        assert torch.equal(frozen(features), model(features))
    with pytest.raises(ValueError, match="block length 17"):
        frozen(torch.rand(1, 17, model.config.n_features))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spot_drafter_without_an_order_model_ranks_positions_by_the_prior(temperature: float) -> None:
    """No order model: the position distribution is the coupled confidence to the power w, renormalised; its first
    level is the stale-confidence ranking."""
    context = make_context(temperature, seed=5)
    tree = SpotDrafter(None, budget=4, depth=1, confidence_prior=50.0).propose(context)
    confidence = StaleGuesses(context).at(context.root_step).confidence  # [L]
    allowed = context.root == MASK
    best = torch.where(allowed, confidence, torch.full_like(confidence, float("-inf"))).topk(3).indices
    drafted = [int(torch.nonzero(tree.states[i] != context.root)[0, 0]) for i in range(1, len(tree.parents))]
    assert drafted == best.tolist()
    deep = SpotDrafter(None, budget=12, depth=6).propose(context)
    assert len(deep.parents) == 12 and max(deep.steps) > context.root_step
    with pytest.raises(ValueError, match="must be > 0"):
        SpotDrafter(None, confidence_prior=0.0)


def test_one_host_thread_runs_on_one_thread_and_restores_the_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_host_thread(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), one_host_thread(torch.device("cpu")):
            raise RuntimeError("restored on the way out")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_freezing_leaves_the_trainable_model_alone(saved_order_model: tuple[OrderModel, Path]) -> None:
    model, _ = saved_order_model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    freeze_order_model(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spot_drafter_with_a_frozen_model_drafts_the_same_tree(temperature: float) -> None:
    torch.manual_seed(4)
    model = OrderModel(OrderModelConfig(top_k=8, d_model=32, n_layers=2, n_heads=2)).eval()
    frozen = freeze_order_model(model)
    for seed in range(3):
        context = make_context(temperature, seed=seed)
        eager = SpotDrafter(model, budget=8, depth=4).propose(context)
        fast = SpotDrafter(frozen, budget=8, depth=4).propose(context)
        assert torch.equal(eager.states, fast.states) and eager.parents == fast.parents


def test_order_features_layout() -> None:
    top = torch.rand(4, 32)
    stale_masked = torch.tensor([True, True, True, False])
    branch = torch.tensor([False, True, False, False])
    coupled = torch.tensor([0.5, 0.25, 0.75, 0.9], dtype=torch.float64)
    features = order_features(top, stale_masked, branch, coupled)
    assert features.shape == (4, 35)
    assert features.dtype == torch.float32
    assert torch.equal(features[:, :32], top)
    assert features[:, 32].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert features[:, 33].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert features[:, 34].tolist() == [0.5, 0.0, 0.75, 0.0]  # coupled confidence only where still open
    config = OrderModelConfig(threshold_feature=True, temperature_feature=True)
    with_rule = order_features(top, stale_masked, branch, coupled, config.extra_inputs(tau=0.8, temperature=1.5))
    assert with_rule.shape == (4, config.n_features) == (4, 37)
    assert torch.equal(with_rule[:, :35], features)
    assert with_rule[:, 35].tolist() == [0.800000011920929] * 4 and with_rule[:, 36].tolist() == [1.5] * 4
    names = config.feature_names  # the names warm starts map columns by
    assert (names[0], names[31], names[34], names.index("tau"), names.index("temperature")) == (
        "top1",
        "top32",
        "coupled_confidence",
        35,
        36,
    )
    assert OrderModelConfig(temperature_feature=True).extra_inputs(tau=0.8, temperature=0.0) == [0.0]


def test_drafter_config_without_the_temperature_key_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before ``temperature_feature`` existed load with it off."""
    model = OrderModel(OrderModelConfig(top_k=8, d_model=32, n_layers=1, n_heads=2))
    save_order_model(model, tmp_path)
    config_path = tmp_path / "drafter_config.json"
    old_config = {k: v for k, v in json.loads(config_path.read_text()).items() if k != "temperature_feature"}
    config_path.write_text(json.dumps(old_config))
    assert load_order_model(tmp_path).config == model.config


def test_stale_top_probs_excludes_mask_and_sorts() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[:, MASK] = 50.0  # the mask token would dominate if it were not excluded
    top = stale_top_probs(logits, MASK, top_k=8)
    assert top.shape == (5, 8)
    expected = torch.softmax(torch.cat([logits[:, :MASK], logits[:, MASK + 1 :]], -1), -1).topk(8).values
    assert torch.allclose(top, expected.float(), atol=1e-6)
    assert bool((top[:, :-1] >= top[:, 1:]).all())
    known = stale_top_probs(logits, MASK, top_k=8, log_normaliser=stale_log_normaliser(logits, MASK))
    assert torch.allclose(known, top, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_largest_values_are_topk_values(dtype: torch.dtype) -> None:
    """The host partition gives ``topk``'s values, largest first, ties and -inf included, for every k (dtypes numpy
    lacks take ``topk`` itself)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (3, 7, 12), generator=generator).to(dtype)  # many ties
    x[0, 0, :5] = float("-inf")
    for k in (1, 5, 12):
        top = largest_values(x, k)
        assert top.dtype == dtype and top.is_contiguous()
        assert torch.equal(top, x.topk(k, dim=-1).values)


def test_stale_log_normaliser_leaves_out_the_mask_token() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    without_mask = torch.cat([logits[:, :MASK], logits[:, MASK + 1 :]], -1)
    assert torch.allclose(stale_log_normaliser(logits, MASK), torch.logsumexp(without_mask, -1), atol=1e-12)
    assert stale_log_normaliser(logits.float(), MASK).dtype == torch.float32


@pytest.mark.parametrize("temperature_feature", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spot_drafter_tree_invariants(temperature: float, temperature_feature: bool) -> None:
    torch.manual_seed(2)
    config = OrderModelConfig(top_k=8, d_model=32, n_layers=1, n_heads=2, temperature_feature=temperature_feature)
    model = OrderModel(config).eval()
    context = make_context(temperature, seed=7)
    for budget, depth in ((1, 3), (6, 2), (12, 8)):
        tree = SpotDrafter(model, budget=budget, depth=depth).propose(context)
        assert len(tree) <= budget
        assert max(tree.depths()) <= depth
        check_one_commit_tree(tree, context)


# ----------------------------------------------------------------------------- collect -> train pipeline

GEN, BLOCK, DEPTH = 16, 8, 4


@pytest.fixture(scope="module")
def collect_target(tiny_codec, model_factory) -> BuiltinTarget:
    """A tiny random target whose vocabulary matches the conftest tokenizer, with room for GSM8K prompts."""
    model = model_factory(vocab_size=tiny_codec.vocab_size, seed=3, dtype=torch.float32, max_seq_len=512)
    return BuiltinTarget(model)


def run_collect(target, codec, out_dir: Path, **overrides) -> tuple[CollectConfig, list[Path]]:
    fields = {
        "out_dir": out_dir,
        "n_prompts": 2,
        "prompts_per_shard": 1,
        "temperatures": (0.0, 1.0),
        "block_length": BLOCK,
        "gen_length": GEN,
        "depth": DEPTH,
    }
    config = CollectConfig(**{**fields, **overrides})
    return config, collect(target, codec, config)


@pytest.fixture(scope="module")
def standard_shards(tmp_path_factory, collect_target, tiny_codec) -> tuple[CollectConfig, list[Path]]:
    return run_collect(collect_target, tiny_codec, tmp_path_factory.mktemp("traj") / "standard")


@pytest.fixture(scope="module")
def threshold_shards(tmp_path_factory, collect_target, tiny_codec) -> tuple[CollectConfig, list[Path]]:
    out = tmp_path_factory.mktemp("traj") / "threshold"
    return run_collect(collect_target, tiny_codec, out, method="threshold", taus=(0.1,))


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


# ----------------------------------------------------------------------------- neighbour-corrected confidence


def neighbour_fit_folder(vocab: int, folder: Path, weight: float = 4.0) -> Path:
    """A drafter folder holding a skewed made-up bigram fit (strong weights, so corrections show)."""
    from spot_dlm.drafters.neighbours import BigramTable, save_bigram, save_neighbour_fit
    from spot_dlm.drafters.token_survival import SurvivalBucket, TokenSurvival

    stream = np.random.default_rng(7).integers(0, vocab, 4000) ** 2 % vocab
    save_bigram(BigramTable.from_stream(stream, vocab), folder)
    survival = TokenSurvival(greedy=(SurvivalBucket(0.5, 0.05),), sampled=(SurvivalBucket(2.0, 0.2),))
    save_neighbour_fit((weight, weight), survival, folder)
    return folder


@pytest.fixture(scope="module")
def corrected_shards(tmp_path_factory, collect_target, tiny_codec) -> tuple[CollectConfig, list[Path]]:
    base = tmp_path_factory.mktemp("traj")
    folder = neighbour_fit_folder(collect_target.vocab_size, base / "fit")
    return run_collect(collect_target, tiny_codec, base / "corrected", neighbours=str(folder))


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


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_blocks_last_commit_is_handed_off_with_its_runner_up_tokens(temperature: float) -> None:
    """A root with one masked position left: every child completes the block, the order cannot miss, only the token
    can. With hand-offs SPOT drafts that commit's best guesses (rule's choice first) as hand-offs, as far as the
    budget goes; without token survival to score them, or without hand-offs, only the rule's choice or nothing."""
    from spot_dlm.drafters.token_survival import SURVIVAL_RANKS, SurvivalBucket, TokenSurvival

    base = make_context(temperature)
    root = torch.arange(3, 3 + L)  # no mask token (MASK = 2)
    root[3] = MASK
    parent = root.clone()
    parent[5] = MASK  # the free commit filled position 5
    context = dataclasses.replace(base, root=root, parent=parent, handoffs=True)
    survival = TokenSurvival(greedy=(SurvivalBucket(1.0, 0.01),), sampled=(SurvivalBucket(1.0, 0.01),))
    model = OrderModel(OrderModelConfig(top_k=8, d_model=16, n_layers=1, n_heads=2)).eval()
    tree = SpotDrafter(model, budget=8, token_survival=survival).propose(context)
    assert len(tree) == 1 and tree.n_handoffs == SURVIVAL_RANKS  # root + the last commit's best guesses
    guesses = StaleGuesses(context).table(context.root_step, SURVIVAL_RANKS)
    expected = guesses.tokens[guesses.rows(np.array([3])), :SURVIVAL_RANKS][0]  # best first, the rule's choice first
    assert tree.handoffs[:, 3].tolist() == expected.tolist()
    assert torch.equal(tree.handoffs[:, torch.arange(L) != 3], root[torch.arange(L) != 3].expand(SURVIVAL_RANKS, -1))
    assert SpotDrafter(model, budget=3, token_survival=survival).propose(context).n_handoffs == 2  # the budget binds
    assert SpotDrafter(model, budget=8).propose(context).n_handoffs == 1  # nothing scores runner-ups
    without = dataclasses.replace(context, handoffs=False)
    assert SpotDrafter(model, budget=8, token_survival=survival).propose(without).n_handoffs == 0
