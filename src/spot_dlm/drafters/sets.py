"""SPOT-Sets: draft whole commit sets for threshold (multi-commit) decoding.

A drafter gives, per still-masked position, the probability ``q_j`` that it joins the next commit set. Candidate
sets come from a few cut-offs on ``q`` (each set always holds the most likely position), scored as independent
Bernoullis: ``log P(S) = sum_{j in S} log q_j + sum_{j not in S} log(1 - q_j)``. Tokens are the stale coupled
guesses (with ``neighbours``, re-ranked by the neighbours the parent filled since the stale pass: members of one set
are chosen together from the parent's logits, so they never condition on each other); acceptance is exact state
equality (same set, same tokens, same pass count).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from spot_dlm.decode import DraftContext
from spot_dlm.drafters.children import ChildProposer, Children
from spot_dlm.drafters.growth import grow_tree
from spot_dlm.drafters.guesses import StaleGuesses, step_groups
from spot_dlm.drafters.neighbours import NeighbourTokens
from spot_dlm.drafters.order_features import StaleView
from spot_dlm.drafters.order_net import FrozenOrderModel, OrderModel
from spot_dlm.tree import DEFAULT_DEPTH, DraftTree

DEFAULT_CUTOFFS = (0.9, 0.7, 0.5, 0.3, 0.15)


def candidate_sets(join_prob: torch.Tensor, allowed: torch.Tensor, cutoffs: tuple[float, ...], keep: int):
    """Distinct candidate sets of one node with their log-probabilities, best first.

    join_prob float [L] in (0, 1); allowed bool [L]. Returns [(log-prob, positions)] (at most ``keep``).
    """
    children = batch_candidate_sets(join_prob[None], allowed[None], cutoffs, keep)
    positions = np.split(children.commit_position, np.cumsum(np.bincount(children.commit_child))[:-1])
    return [(score, tuple(p.tolist()), 0) for score, p in zip(children.logprob.tolist(), positions)]


def batch_candidate_sets(
    join_probs: torch.Tensor, allowed: torch.Tensor, cutoffs: tuple[float, ...], keep: int
) -> Children:
    """``candidate_sets`` of every node of a batch, as Children (rank 0: the best coupled guesses).

    join_probs float [B, L] in (0, 1), allowed bool [B, L], on the host. Each node's sets are its most likely
    positions, as many as reach each cut-off (and one), distinct sizes only, scored as independent Bernoullis.
    Every sum adds the same numbers in the same order as a node alone would (rows are summed in groups of equal
    length), so the scores do not depend on the batch.
    """
    q = join_probs.detach().to(torch.float64).clamp(1e-6, 1 - 1e-6)  # [B, L]
    q_host, allowed_host = q.numpy(), allowed.numpy()
    order = np.argsort(np.where(allowed_host, -q_host, 1.0), axis=-1, kind="stable")  # [B, L], likeliest first
    reach = (q_host[:, None] >= np.array(cutoffs)[:, None]) & allowed_host[:, None]  # [B, S - 1, L]
    sizes = np.concatenate([np.ones_like(order[:, :1]), np.maximum(reach.sum(-1), 1)], -1)  # [B, S]
    sizes.sort(-1)  # ascending: ties between sets go to the smaller
    distinct = np.concatenate([np.ones_like(sizes[:, :1], dtype=bool), sizes[:, 1:] != sizes[:, :-1]], -1)
    distinct &= allowed_host.any(-1)[:, None]  # [B, S]
    log_in, log_out = q.log(), (1 - q).log()  # [B, L]
    gain = (log_in - log_out).numpy()[np.arange(len(order))[:, None], order]  # [B, L], likeliest first
    score = _outside_sums(log_out.numpy(), allowed_host)[:, None] + _prefix_sums(gain, sizes)  # [B, S]
    ranked = np.argsort(np.where(distinct, -score, np.inf), axis=-1, kind="stable")  # [B, S], best first
    taken = np.arange(sizes.shape[1]) < np.minimum(distinct.sum(-1), keep)[:, None]  # [B, S]
    node, column = np.nonzero(taken)  # [C], node by node
    column = ranked[node, column]
    size = sizes[node, column]  # [C]
    commit_child = np.repeat(np.arange(len(node)), size)  # [P]
    offset = np.arange(len(commit_child)) - np.repeat(np.cumsum(size) - size, size)  # [P]: rank among the members
    return Children(
        node=node,
        logprob=score[node, column],
        rank=np.zeros_like(node),
        commit_child=commit_child,
        commit_position=order[node[commit_child], offset],
    )


def _outside_sums(log_out: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Per row, the sum of log_out over the allowed positions (summed by torch, as one row alone would be).
    float64 [B, L], bool [B, L] -> float64 [B]"""
    counts = allowed.sum(-1)  # [B]
    sums = np.zeros(len(counts))
    for count in np.unique(counts).tolist():
        rows = np.flatnonzero(counts == count)
        packed = log_out[rows][allowed[rows]].reshape(len(rows), count)  # [b, count]
        sums[rows] = torch.from_numpy(packed).sum(-1).numpy()
    return sums


def _prefix_sums(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """sums[b, j] = values[b, :sizes[b, j]].sum(), summed by torch as one row alone would be.
    float64 [B, L], int [B, S] -> float64 [B, S]"""
    sums = np.zeros(sizes.shape)
    for size in np.unique(sizes).tolist():
        rows = np.flatnonzero((sizes == size).any(-1))
        row_sums = torch.from_numpy(values[rows, :size]).sum(-1).numpy()  # [b]
        sums[rows] = np.where(sizes[rows] == size, row_sums[:, None], sums[rows])
    return sums


def sets_children(
    join_probs, cutoffs: tuple[float, ...], keep: int, mask_id: int, guesses: StaleGuesses | None = None
) -> ChildProposer:
    """ChildProposer from a function (states [B, L], steps) -> join probabilities [B, L]. With ``guesses`` that
    carry a neighbour correction, each member's token is chosen for its own parent."""

    def children(states: torch.Tensor, steps: list[int]) -> Children:
        probs = join_probs(states, steps).detach().cpu()  # [B, L]; sets are cut on the host
        sets = batch_candidate_sets(probs, states.cpu() == mask_id, cutoffs, keep)
        if guesses is None or guesses.neighbours is None:
            return sets
        return with_parent_tokens(sets, states.cpu().numpy(), steps, guesses)

    return children


def with_parent_tokens(sets: Children, states: np.ndarray, steps: list[int], guesses: StaleGuesses) -> Children:
    """The same sets with every member's best guess for its own parent state (``StaleGuesses.child_guesses``).
    states int64 [B, L] on the host, one rule-step index per row."""
    parent = sets.node[sets.commit_child]  # [P]
    parent_step = np.asarray(steps)[parent]  # [P]
    tokens = np.empty(len(parent), dtype=np.int64)
    for step, same in step_groups(parent_step):
        tokens[same] = guesses.child_guesses(step, states[parent[same]], sets.commit_position[same], 1)[0][0]
    return dataclasses.replace(sets, commit_token=tokens)


@dataclass(frozen=True)
class StaleSetsDrafter:
    """Training-free: the join probability of a position is its stale coupled confidence (cut-offs at tau...)."""

    budget: int = 16
    depth: int = DEFAULT_DEPTH
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
    depth: int = DEFAULT_DEPTH
    cutoffs: tuple[float, ...] = DEFAULT_CUTOFFS
    neighbours: NeighbourTokens | None = None  # re-ranks members' tokens by the parent's fresh neighbours
    name: str = "spot-sets"

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        guesses = StaleGuesses(context, self.neighbours)
        view = StaleView.of(context, self.model.config, guesses.log_normaliser)  # one normaliser per round

        def join_probs(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
            coupled = torch.stack([guesses.at(s).confidence for s in steps]).clamp_min(0)  # [B, L]
            features = view.features(states, coupled)  # [B, L, F]
            return torch.sigmoid(self.model(features.to(self.model.device))).to(states.device)

        children = sets_children(join_probs, self.cutoffs, self.budget - 1, context.mask_id, guesses)
        return grow_tree(context, self.budget, self.depth, guesses=guesses, children=children)
