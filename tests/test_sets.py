"""SPOT-Sets: candidate commit sets, the set drafters' trees, and exactness of threshold decoding with them."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from spot_dlm.decode import DecodeSettings, DraftContext, NoDrafter, decode_ids
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.drafters.sets import DEFAULT_CUTOFFS, SetsDrafter, StaleSetsDrafter, candidate_sets
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule

torch.set_num_threads(1)

CUTOFFS = (0.9, 0.7, 0.5, 0.3, 0.15)


def bernoulli_logprob(q: torch.Tensor, allowed: torch.Tensor, members: tuple[int, ...]) -> float:
    q = q.to(torch.float64).clamp(1e-6, 1 - 1e-6)
    inside = set(members)
    return sum(math.log(q[j]) if j in inside else math.log(1 - q[j]) for j in range(q.shape[0]) if bool(allowed[j]))


@pytest.mark.parametrize("seed", range(12))
def test_candidate_sets_properties(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    length = (4, 8, 16)[seed % 3]
    q = torch.rand(length, generator=generator, dtype=torch.float64) ** (0.3 + seed % 4)
    allowed = torch.rand(length, generator=generator) < 0.7
    allowed[seed % length] = True
    keep = (1, 3, 10)[seed % 3]
    options = candidate_sets(q, allowed, CUTOFFS, keep)
    assert 1 <= len(options) <= keep
    best_allowed = int(torch.where(allowed, q, torch.full_like(q, -1.0)).argmax())
    sets = [positions for _, positions, _ in options]
    assert len({frozenset(s) for s in sets}) == len(sets)  # distinct
    for logprob, positions, _ in options:
        assert len(positions) == len(set(positions)) >= 1
        assert best_allowed in positions
        assert all(bool(allowed[j]) for j in positions)
        assert logprob == pytest.approx(bernoulli_logprob(q, allowed, positions), abs=1e-9)
        # a set is the top of the allowed positions by q
        outside = [float(q[j]) for j in range(length) if bool(allowed[j]) and j not in positions]
        assert not outside or min(float(q[j]) for j in positions) >= max(outside)
    logprobs = [lp for lp, *_ in options]
    assert logprobs == sorted(logprobs, reverse=True)


def test_candidate_sets_cutoffs_define_the_sizes() -> None:
    q = torch.tensor([0.95, 0.1, 0.8, 0.6, 0.2, 0.05])
    allowed = torch.tensor([True, True, True, True, True, False])
    options = candidate_sets(q, allowed, (0.9, 0.7, 0.5), keep=10)
    assert {positions for _, positions, _ in options} == {(0,), (0, 2), (0, 2, 3)}
    only_top = candidate_sets(q, allowed, (0.99,), keep=10)
    assert [positions for _, positions, _ in only_top] == [(0,)]  # nothing passes: the most likely alone
    masked_best = candidate_sets(q, torch.tensor([False, True, False, True, True, True]), (0.5,), keep=10)
    assert [positions for _, positions, _ in masked_best] == [(3,)]  # 0 and 2 are not allowed


def test_candidate_sets_empty_allowed() -> None:
    assert candidate_sets(torch.rand(6), torch.zeros(6, dtype=torch.bool), CUTOFFS, keep=5) == []


# ------------------------------------------------------------------------------------------ drafter trees

MASK, L, V = 2, 8, 40


def make_context(temperature: float, seed: int, tau: float = 0.3) -> DraftContext:
    generator = torch.Generator().manual_seed(seed)
    stale = torch.randn(L, V, generator=generator, dtype=torch.float64) * 4  # peaked: several confident positions
    parent = torch.full((L,), MASK, dtype=torch.int64)
    root = parent.clone()
    root[0] = 7
    rule = CommitRule("threshold", temperature=temperature, tau=tau)
    return DraftContext(root, parent, stale, 1, 0, NoiseKey(seed, 1), rule, MASK)


def random_sets_model(seed: int) -> OrderModel:
    torch.manual_seed(seed)
    return OrderModel(OrderModelConfig(d_model=32, n_layers=1, n_heads=2)).eval()


def set_drafters(budget: int, depth: int, seed: int = 0):
    return (
        StaleSetsDrafter(budget=budget, depth=depth),
        SetsDrafter(random_sets_model(seed), budget=budget, depth=depth),
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(("budget", "depth"), [(1, 4), (4, 2), (12, 6)])
def test_set_drafter_trees_commit_only_masked_positions(temperature: float, budget: int, depth: int) -> None:
    multi = 0
    for seed in range(3):
        context = make_context(temperature, seed)
        guesses = StaleGuesses(context)
        for drafter in set_drafters(budget, depth, seed):
            tree = drafter.propose(context)
            assert 1 <= len(tree) <= budget
            assert max(tree.depths()) <= depth
            assert torch.equal(tree.states[0], context.root)
            assert bool((tree.states == MASK).any(-1).all())  # complete states are never drafted
            for node in range(1, len(tree)):
                parent = tree.parents[node]
                assert tree.steps[node] == tree.steps[parent] + 1
                changed = torch.nonzero(tree.states[parent] != tree.states[node]).flatten()
                assert changed.numel() >= 1
                assert bool((tree.states[parent][changed] == MASK).all())  # only masked positions change
                expected = guesses.at(tree.steps[parent]).tokens[changed]
                assert torch.equal(tree.states[node][changed], expected)  # with the stale coupled guesses
                multi += changed.numel() > 1
    if budget > 1:
        assert multi > 0  # some drafted edges commit a whole set


def test_stale_sets_first_child_is_the_stale_threshold_set() -> None:
    """At T = 0 the stale-sets drafter's best child commits exactly what the threshold rule would commit if the
    logits did not move (cut-off tau is always among its cut-offs)."""
    checked = 0
    for seed in range(8):
        context = make_context(0.0, seed, tau=0.5)
        proposal = StaleGuesses(context).at(context.root_step)
        confidence = proposal.confidence.masked_fill(context.root != MASK, float("-inf"))
        wanted = (confidence >= 0.5) & (context.root == MASK)
        wanted[int(confidence.argmax())] = True
        if bool(wanted.sum() == (context.root == MASK).sum()):
            continue  # that set would complete the block: complete states are never drafted
        tree = StaleSetsDrafter(budget=2, depth=1, cutoffs=DEFAULT_CUTOFFS).propose(context)
        assert len(tree) == 2
        # the best Bernoulli set is the set of positions with q >= 0.5, which is the threshold set at tau = 0.5
        assert torch.equal(tree.states[1] != tree.states[0], wanted)
        assert torch.equal(tree.states[1][wanted], proposal.tokens[wanted])
        checked += 1
    assert checked >= 2


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_set_drafters_decode_exactly_like_threshold_decoding(tiny_model, temperature: float) -> None:
    rule = CommitRule("threshold", temperature=temperature, tau=0.3)
    settings = DecodeSettings(rule=rule, block_length=8, gen_length=16, stop_at_eos=False)
    accepted: Counter = Counter()
    multi_commit = 0
    for seed in range(3):
        prompt = torch.randint(3, tiny_model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(seed))
        key = NoiseKey(seed, seed % 2)
        reference = decode_ids(BuiltinTarget(tiny_model), prompt, settings, NoDrafter(), key)
        assert set(reference.stats.accepted_lengths) == {1}
        multi_commit += int(reference.stats.rule_steps < reference.token_ids.shape[0])
        for budget, depth in ((4, 2), (8, 4)):
            for drafter in set_drafters(budget, depth, seed):
                out = decode_ids(BuiltinTarget(tiny_model), prompt, settings, drafter, key)
                where = f"seed={seed} T={temperature} drafter={drafter.name} budget={budget}"
                assert torch.equal(out.token_ids, reference.token_ids), where
                assert torch.equal(out.commit_step, reference.commit_step), where
                assert out.stats.rule_steps == reference.stats.rule_steps, where
                assert out.stats.target_passes <= reference.stats.target_passes, where
                accepted.update(out.stats.accepted_lengths)
    assert multi_commit > 0, "threshold decoding never committed a set: the check would be vacuous"
    assert max(accepted) >= 2, "no drafted node was ever accepted: the check would be vacuous"
