"""Best-first tree growth (``drafters/growth.py``): tree invariants, best-first order under the budget, the
admission bar that prunes scorer calls and never the tree, merged commit orders."""

from __future__ import annotations

import pytest
import torch

from draft_contexts import MASK, check_one_commit_tree, committed_positions, make_context, order_scorer, state_scorer
from spot_dlm.drafters.children import masked_log_normalise
from spot_dlm.drafters.growth import grow_tree
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.tree import DraftTree

torch.set_num_threads(1)


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
