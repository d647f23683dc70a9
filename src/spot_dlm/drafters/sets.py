"""SPOT-Sets: draft whole commit sets for threshold (multi-commit) decoding.

A drafter gives, per still-masked position, the probability ``q_j`` that it joins the next commit set. Candidate
sets come from a few cut-offs on ``q`` (each set always holds the most likely position), scored as independent
Bernoullis: ``log P(S) = sum_{j in S} log q_j + sum_{j not in S} log(1 - q_j)``. Tokens are the stale coupled
guesses; acceptance is exact state equality (same set, same tokens, same pass count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spot_dlm.decode import DraftContext
from spot_dlm.drafters.base import ChildProposer, Children, StaleGuesses, grow_tree
from spot_dlm.drafters.order_model import FrozenOrderModel, OrderModel, StaleView
from spot_dlm.tree import DraftTree

DEFAULT_CUTOFFS = (0.9, 0.7, 0.5, 0.3, 0.15)


def candidate_sets(join_prob: torch.Tensor, allowed: torch.Tensor, cutoffs: tuple[float, ...], keep: int):
    """Distinct candidate sets of one node with their log-probabilities, best first.

    join_prob float [L] in (0, 1); allowed bool [L]. Returns [(log-prob, positions)] (at most ``keep``).
    """
    if not bool(allowed.any()):
        return []
    q = join_prob.to(torch.float64).clamp(1e-6, 1 - 1e-6)
    order = torch.sort(q.masked_fill(~allowed, -1.0), descending=True, stable=True).indices
    order = order[: int(allowed.sum())]
    sizes = {1} | {max(1, int((q[order] >= c).sum())) for c in cutoffs}
    log_in, log_out = q.log(), (1 - q).log()
    base_out = float(log_out[allowed].sum())
    options = []
    for size in sorted(sizes):
        members = order[:size]
        score = base_out + float((log_in[members] - log_out[members]).sum())
        options.append((score, tuple(members.tolist()), 0))
    return sorted(options, key=lambda o: -o[0])[:keep]


def sets_children(join_probs, cutoffs: tuple[float, ...], keep: int, mask_id: int) -> ChildProposer:
    """ChildProposer from a function (states [B, L], steps) -> join probabilities [B, L]."""

    def children(states: torch.Tensor, steps: list[int]) -> Children:
        probs = join_probs(states, steps).cpu()  # [B, L]; sets are cut on the host (many tiny ops)
        allowed = states.cpu() == mask_id
        rows = [candidate_sets(p, a, cutoffs, keep) for p, a in zip(probs, allowed)]
        return Children.of_rows(rows)

    return children


@dataclass(frozen=True)
class StaleSetsDrafter:
    """Training-free: the join probability of a position is its stale coupled confidence (cut-offs at tau...)."""

    budget: int = 16
    depth: int = 8
    cutoffs: tuple[float, ...] = DEFAULT_CUTOFFS
    name: str = "stale-sets"

    def propose(self, context: DraftContext) -> DraftTree:
        guesses = StaleGuesses(context)

        def join_probs(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
            return torch.stack([guesses.at(s).confidence for s in steps]).clamp(0, 1)

        cutoffs = tuple(sorted({context.rule.tau, *self.cutoffs}, reverse=True))
        children = sets_children(join_probs, cutoffs, self.budget - 1, context.mask_id)
        return grow_tree(context, self.budget, self.depth, guesses=guesses, children=children)


@dataclass(frozen=True)
class SetsDrafter:
    """SPOT-Sets: the order-model architecture read as per-position join probabilities (sigmoid)."""

    model: OrderModel | FrozenOrderModel
    budget: int = 16
    depth: int = 8
    cutoffs: tuple[float, ...] = DEFAULT_CUTOFFS
    name: str = "spot-sets"

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        guesses = StaleGuesses(context)
        view = StaleView.of(context, self.model.config)

        def join_probs(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
            coupled = torch.stack([guesses.at(s).confidence for s in steps]).clamp_min(0)  # [B, L]
            features = view.features(states, coupled)  # [B, L, F]
            return torch.sigmoid(self.model(features.to(self.model.device))).to(states.device)

        children = sets_children(join_probs, self.cutoffs, self.budget - 1, context.mask_id)
        return grow_tree(context, self.budget, self.depth, guesses=guesses, children=children)
