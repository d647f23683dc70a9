"""Hand-made draft contexts and position scorers shared by the drafter tests: one block of L = 8 positions
over V = 12 tokens (mask token 2) whose root has its last position committed, random stale logits, and checks
of one-commit trees; a small random order model."""

from __future__ import annotations

import torch

from spot_dlm.decode import DraftContext
from spot_dlm.drafters.children import masked_log_normalise
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule
from spot_dlm.tree import DraftTree

MASK, L, V = 2, 8, 12
ROOT_COMMIT = 7  # the free commit of the root fills the last position
ORDER_TOP_K = 8  # the order models read the top-8 stale probabilities, so they work for any vocabulary >= 8


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


def random_order_model(seed: int = 0) -> OrderModel:
    torch.manual_seed(seed)
    return OrderModel(OrderModelConfig(top_k=ORDER_TOP_K, d_model=32, n_layers=1, n_heads=2)).eval()
