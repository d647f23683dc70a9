"""A tree node's candidate children: the positions each commits, their tokens, the edge's log-probability.

Drafters differ only in how they score *which position* commits next (a ``PositionScorer``).
``one_commit_children`` turns that score into the children of a batch of nodes: the most likely positions, each
with its stale coupled guess (``drafters/guesses.py``), weighted by the guess's fitted survival when there is a fit;
``last_commit_alternatives`` adds the runner-up tokens of a block's last commit as hand-off candidates. SPOT-Sets
proposes children that commit whole sets (``drafters/sets.py``). ``drafters/growth.py`` grows the tree from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from spot_dlm.drafters.guesses import StaleGuesses, stale_tokens, step_groups
from spot_dlm.drafters.token_survival import SURVIVAL_RANKS, TokenSurvival

# (node states int64 [B, L], rule-step index applied to each) -> log-probability of each position committing
# next, float [B, L]; -inf where a position may not commit (not masked in the node)
PositionScorer = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class Children:
    """The candidate children of a batch of B nodes, C in all, as host arrays: grouped by node, each node's children
    in proposal order (that order breaks ties between equally likely children). Child c commits the positions
    ``commit_position[commit_child == c]`` together."""

    node: np.ndarray  # int64 [C], non-decreasing: the row of the child's parent in the batch
    logprob: np.ndarray  # float64 [C]: log-probability of the edge
    rank: np.ndarray  # int64 [C]: token rank, 0 = the best coupled guess, 1 = the runner-up, ...
    commit_child: np.ndarray  # int64 [P]: the child of each committed position
    commit_position: np.ndarray  # int64 [P]
    commit_token: np.ndarray | None = None  # int64 [P]: the token of each commit (None: the step's stale guess)


# (node states int64 [B, L], rule-step indices) -> the candidate children of every node
ChildProposer = Callable[[torch.Tensor, list[int]], Children]


def top_positions(scores: torch.Tensor, keep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The min(keep, #finite) best positions of every row, rows in order, each row best first.

    scores float [B, L] on the host -> (row int64 [C], score float64 [C], position int64 [C]). Rows with the same
    count share one ``topk`` call, which orders each row (ties included) exactly as ``row.topk(count)`` does.
    """
    host = scores.to(torch.float64).numpy()  # [B, L]
    counts = np.minimum(np.isfinite(host).sum(-1), keep)  # [B]
    if counts.min() == counts.max():  # the usual case: one call
        row, position = _top_of_rows(scores, np.arange(len(counts)), int(counts[0]))
    else:
        parts = [_top_of_rows(scores, np.flatnonzero(counts == count), int(count)) for count in np.unique(counts)]
        row, position = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        order = np.argsort(row, kind="stable")  # back to row order, each row's order kept
        row, position = row[order], position[order]
    return row, host[row, position], position


def _top_of_rows(scores: torch.Tensor, rows: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` best positions of the given rows: (row int64 [b * count], position int64 [b * count])."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    chosen = scores if len(rows) == scores.shape[0] else scores[torch.from_numpy(rows)]  # [b, L]
    return np.repeat(rows, count), chosen.topk(count, dim=-1).indices.numpy().ravel()


def one_commit_children(
    scorer: PositionScorer,
    keep: int,
    guesses: StaleGuesses | None = None,
    token_survival: TokenSurvival | None = None,
) -> ChildProposer:
    """Children that each commit one position: the ``keep`` most likely positions of every node.

    A child's log-probability is its position's plus, with ``token_survival``, the fitted log-probability that its
    coupled guess is still the target's token (see ``drafters/token_survival.py``). When ``guesses`` carry a
    neighbour correction, each child's token is chosen for its own parent (``StaleGuesses.child_guesses``).
    """
    if token_survival is not None and guesses is None:
        raise ValueError("scoring tokens by survival needs the stale guesses")
    per_node = guesses is not None and guesses.neighbours is not None

    def survival_logprobs(step: int, positions: np.ndarray, scores: np.ndarray | None = None) -> np.ndarray:
        """log P(the best guess is the committed token) for commits at ``step`` at the given positions.
        ``scores`` float64 [R, P]: the guesses' coupled scores, best first (default: the stale ones). -> float64 [P]"""
        context = guesses.context
        if scores is None:
            scores = guesses.best_scores(step, torch.from_numpy(positions), SURVIVAL_RANKS).cpu().numpy()  # [R, P]
        staleness = step - context.root_step + 1  # commits since the stale pass
        log_probs = token_survival.log_probs(torch.from_numpy(scores), context.rule.temperature, staleness)
        return log_probs[0].cpu().numpy()

    def per_parent(states: np.ndarray, child_step: np.ndarray, node: np.ndarray, positions: np.ndarray):
        """Tokens chosen for each child's own parent (neighbour correction), with their survival log-probabilities:
        int64 [C] and float64 [C] (zeros without a survival fit). states int64 [B, L] on the host"""
        parents = states[node]  # [C, L]
        tokens = np.empty(len(node), dtype=np.int64)
        token_logprob = np.zeros(len(node))
        for step, same in step_groups(child_step):
            ranked, ranked_scores = guesses.child_guesses(step, parents[same], positions[same], SURVIVAL_RANKS)
            tokens[same] = ranked[0]  # ranked, ranked_scores: [R, c]
            if token_survival is not None:
                token_logprob[same] = survival_logprobs(step, positions[same], ranked_scores)
        return tokens, token_logprob

    def per_step(child_step: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Survival log-probabilities float64 [C] of the step's stale guesses."""
        token_logprob = np.empty(len(positions))
        for step, same in step_groups(child_step):
            token_logprob[same] = survival_logprobs(step, positions[same])
        return token_logprob

    def children(states: torch.Tensor, steps: list[int]) -> Children:
        scores = scorer(states, steps).detach().cpu()  # [B, L]; ranked on the host
        host = states.cpu().numpy()  # [B, L]
        node, values, positions = top_positions(scores, keep)  # [C] each
        child_step = np.asarray(steps)[node]  # [C]
        tokens = None  # int64 [C] when chosen per parent; None: the step's stale guesses
        if per_node:
            tokens, token_logprob = per_parent(host, child_step, node, positions)
        elif token_survival is not None:
            token_logprob = per_step(child_step, positions)
        if token_survival is not None:
            values = values + token_logprob
        rank = np.zeros_like(node)
        proposed = Children(node, values, rank, np.arange(len(node)), positions, tokens)
        if guesses is not None and guesses.context.handoffs and token_survival is not None:
            proposed = last_commit_alternatives(proposed, host, steps, guesses, token_survival)
        return proposed

    return children


def last_commit_alternatives(
    proposed: Children, states: np.ndarray, steps: list[int], guesses: StaleGuesses, survival: TokenSurvival
) -> Children:
    """One-commit children plus, for each commit that completes the block (a hand-off candidate), its runner-up
    guesses up to ``SURVIVAL_RANKS``, each scored by its survival probability. A block's last commit has one position
    to choose, so the order cannot miss there; only its token can, and a missed hand-off costs the next block a pass
    of its own. Best-first growth then spends budget on them only where they beat other nodes.
    states int64 [B, L] on the host (the parents), steps [B]"""
    context = guesses.context
    last = (states == context.mask_id).sum(-1)[proposed.node] == 1  # [C]: the parent has one masked position left
    last &= proposed.rank == 0
    if not last.any():
        return proposed
    tokens = proposed.commit_token
    if tokens is None:  # the step's stale guesses of each rank: spell them out, the new children carry their own
        tokens = np.empty(len(proposed.node), dtype=np.int64)
        for step, same in step_groups(np.asarray(steps)[proposed.node]):
            tokens[same] = stale_tokens(guesses, step, proposed.rank[same], proposed.commit_position[same])
    children = np.flatnonzero(last)  # [F]
    node, position = proposed.node[children], proposed.commit_position[children]  # [F] each
    extra_node, extra_logprob, extra_rank, extra_position, extra_token = [], [], [], [], []
    for step, same in step_groups(np.asarray(steps)[node]):
        ranked, scores = guesses.child_guesses(step, states[node[same]], position[same], SURVIVAL_RANKS)  # [R, f]
        staleness = step - context.root_step + 1
        log_probs = survival.log_probs(torch.from_numpy(scores), context.rule.temperature, staleness).numpy()
        for r in range(int(proposed.rank.max()) + 1, ranked.shape[0]):  # ranks not proposed yet
            keep = np.isfinite(scores[r])  # tiny vocabularies: fewer guesses than ranks
            extra_node.append(node[same][keep])
            extra_logprob.append(log_probs[r][keep])
            extra_rank.append(np.full(int(keep.sum()), r))
            extra_position.append(position[same][keep])
            extra_token.append(ranked[r][keep])
    node_all = np.concatenate([proposed.node, *extra_node])
    order = np.argsort(node_all, kind="stable")  # grouped by parent again, the new children after their siblings
    return Children(
        node_all[order],
        np.concatenate([proposed.logprob, *extra_logprob])[order],
        np.concatenate([proposed.rank, *extra_rank])[order],
        np.arange(len(order)),
        np.concatenate([proposed.commit_position, *extra_position])[order],
        np.concatenate([tokens, *extra_token])[order],
    )


def masked_log_normalise(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Log-softmax of scores over allowed positions; -inf elsewhere. [..., L] -> [..., L]"""
    return torch.log_softmax(scores.to(torch.float64).masked_fill(~allowed, float("-inf")), dim=-1)
