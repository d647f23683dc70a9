"""What every drafter shares: stale noise-coupled guesses and best-first tree growth.

A drafter only reads the stale logits ``Z(s)`` of the last pass. For a commit made by rule step ``c`` the token
guess is the stale coupled token ``argmax_v Z(s)[j, v] / T + gumbel_c[j, v]`` (at T = 0 the stale argmax), so it is
exactly what the target would pick if its logits had not moved. Drafters differ only in how they score *which
position* commits next; ``grow_tree`` turns that score into a tree, best-first by path probability.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spot_dlm.decode import DraftContext
from spot_dlm.rules import Proposal, propose
from spot_dlm.tree import DraftTree, TreeBuilder

TOP_K_FEATURES = 32


@dataclass
class StaleGuesses:
    """Stale coupled guesses per rule-step index, computed once per step index and reused across the tree."""

    context: DraftContext
    _cache: dict[int, Proposal] = field(default_factory=dict)

    def at(self, step_index: int) -> Proposal:
        """Tokens int64 [L] and confidence float64 [L] (for every position) under the noise of ``step_index``."""
        ctx = self.context
        step_index = step_index if ctx.rule.needs_noise else 0  # without noise every step guesses alike
        if step_index not in self._cache:
            length, vocab = ctx.stale_logits.shape
            all_masked = torch.full((1, length), ctx.mask_id, dtype=torch.int64, device=ctx.root.device)
            noise = None
            if ctx.rule.needs_noise:
                positions = torch.arange(length, device=ctx.root.device)
                noise = ctx.noise.gumbel(ctx.block_index, step_index, positions, vocab)[None]
            full = propose(all_masked, ctx.stale_logits[None], noise, ctx.rule, ctx.mask_id)  # [1, L]
            self._cache[step_index] = Proposal(tokens=full.tokens[0], confidence=full.confidence[0])
        return self._cache[step_index]


# (node state int64 [L], rule-step index applied to it) -> log-probability of committing next, float [L];
# -inf where a position may not commit (not masked in the node)
PositionScorer = Callable[[torch.Tensor, int], torch.Tensor]


def grow_tree(
    context: DraftContext,
    budget: int,
    max_depth: int,
    position_logprobs: PositionScorer,
    guesses: StaleGuesses | None = None,
) -> DraftTree:
    """Best-first one-commit tree under a node budget (root included) and a depth limit.

    Every edge commits one position with its stale coupled token; a child's score is its path log-probability.
    """
    guesses = guesses if guesses is not None else StaleGuesses(context)
    builder = TreeBuilder(root=context.root, root_step=context.root_step, mask_id=context.mask_id, max_nodes=budget)
    depth = {0: 0}
    frontier: list[tuple[float, int, int, int]] = []  # (-path log-prob, tie-break, parent node, position)
    counter = 0

    def expand(node: int, path_logprob: float) -> None:
        nonlocal counter
        if depth[node] >= max_depth:
            return
        scores = position_logprobs(builder.states[node], builder.steps[node])  # [L]
        finite = torch.isfinite(scores)
        n_children = min(int(finite.sum()), budget - 1)
        if n_children == 0:
            return
        values, positions = scores.masked_fill(~finite, float("-inf")).topk(n_children)
        for value, position in zip(values.tolist(), positions.tolist()):
            heapq.heappush(frontier, (-(path_logprob + value), counter, node, position))
            counter += 1

    expand(0, 0.0)
    while frontier and not builder.full:
        neg_logprob, _, parent, position = heapq.heappop(frontier)
        parent_state = builder.states[parent]
        child = parent_state.clone()
        child[position] = guesses.at(builder.steps[parent]).tokens[position]
        n_before = len(builder.states)
        node = builder.add(parent, child)
        if node is not None and len(builder.states) > n_before:
            depth[node] = depth[parent] + 1
            expand(node, -neg_logprob)
    return builder.build()


def masked_log_normalise(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Log-softmax of scores over allowed positions; -inf elsewhere. [L] -> [L]"""
    return torch.log_softmax(scores.to(torch.float64).masked_fill(~allowed, float("-inf")), dim=-1)
