"""SPOT's drafter (``drafters/spot.py``): trees with and without an order model, eager and frozen models
alike, and a block's last commit drafted as hand-offs with its runner-up tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from draft_contexts import MASK, L, check_one_commit_tree, make_context
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig, freeze_order_model
from spot_dlm.drafters.spot import SpotDrafter

torch.set_num_threads(1)


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
