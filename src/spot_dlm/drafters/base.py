"""What every drafter shares: stale noise-coupled guesses and best-first tree growth.

A drafter only reads the stale logits ``Z(s)`` of the last pass. For a commit made by rule step ``c`` the token
guess is the stale coupled token ``argmax_v Z(s)[j, v] / T + gumbel_c[j, v]`` (at T = 0 the stale argmax), so it is
exactly what the target would pick if its logits had not moved. Drafters differ only in how they score *which
position* commits next; ``grow_tree`` turns that score into a tree, best-first by path probability.
"""

from __future__ import annotations

import heapq
import math
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
    _ranked: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def at(self, step_index: int) -> Proposal:
        """Tokens int64 [L] and confidence float64 [L] under the noise of ``step_index``, at the positions masked in
        the stale state (elsewhere: the stale state's token and confidence -inf)."""
        ctx = self.context
        step_index = step_index if ctx.rule.needs_noise else 0  # without noise every step guesses alike
        if step_index not in self._cache:
            stale_masked = ctx.parent == ctx.mask_id  # every node of the tree commits among these positions
            noise = ctx.gumbel(step_index, stale_masked)[None] if ctx.rule.needs_noise else None
            full = propose(ctx.parent[None], ctx.stale_logits[None], noise, ctx.rule, ctx.mask_id)  # [1, L]
            self._cache[step_index] = Proposal(tokens=full.tokens[0], confidence=full.confidence[0])
        return self._cache[step_index]

    def ranked(self, step_index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The n best coupled tokens per position (rank 0 is ``at(step).tokens``) and their stale log-probs.

        Returns tokens int64 [n, L] and log-probabilities float64 [n, L] under the stale distribution.
        """
        ctx = self.context
        step_index = step_index if ctx.rule.needs_noise else 0
        if (step_index, n) not in self._ranked:
            z = ctx.stale_logits.to(torch.float64, copy=True)
            z[:, ctx.mask_id] = float("-inf")
            score = z
            if ctx.rule.needs_noise:
                score = z / ctx.rule.temperature + ctx.gumbel(step_index)
            tokens = score.topk(n, dim=-1).indices  # [L, n]; ties resolved like argmax for rank 0 below
            tokens[:, 0] = self.at(step_index).tokens
            logprob = torch.log_softmax(z, dim=-1).gather(-1, tokens)  # [L, n]
            self._ranked[(step_index, n)] = (tokens.T.contiguous(), logprob.T.contiguous())
        return self._ranked[(step_index, n)]

    def tokens(self, step_index: int, rank: int) -> torch.Tensor:
        """Coupled token guesses of a given rank for every position. -> int64 [L]"""
        return self.at(step_index).tokens if rank == 0 else self.ranked(step_index, rank + 1)[0][rank]


# (node states int64 [B, L], rule-step index applied to each) -> log-probability of each position committing
# next, float [B, L]; -inf where a position may not commit (not masked in the node)
PositionScorer = Callable[[torch.Tensor, list[int]], torch.Tensor]

# (node states int64 [B, L], rule-step indices) -> per node, its candidate children as
# (log-probability, positions committed together, token rank: 0 = the best coupled guess, 1 = the runner-up, ...)
Child = tuple[float, tuple[int, ...], int]
ChildProposer = Callable[[torch.Tensor, list[int]], list[list[Child]]]


def one_commit_children(
    scorer: PositionScorer, keep: int, guesses: StaleGuesses | None = None, alternatives: int = 1
) -> ChildProposer:
    """Children that each commit one position: the ``keep`` most likely positions of every node.

    With ``alternatives`` > 1 each position is also tried with its runner-up coupled tokens, scored by
    ``log q(position) + log p_stale(token)``; with 1, children carry the best guess and the position score only.
    """

    def children(states: torch.Tensor, steps: list[int]) -> list[list[Child]]:
        scores = scorer(states, steps).cpu()  # [B, L]; ranked on the host (many tiny ops)
        rows = []
        for row, step_index in zip(scores, steps):
            n_children = min(int(torch.isfinite(row).sum()), keep)
            if n_children == 0:
                rows.append([])
                continue
            values, positions = row.topk(n_children)
            if alternatives == 1:
                rows.append([(v, (p,), 0) for v, p in zip(values.tolist(), positions.tolist())])
                continue
            token_logprob = guesses.ranked(step_index, alternatives)[1][:, positions].tolist()  # [A, n]
            rows.append(
                [
                    (v + token_logprob[rank][i], (p,), rank)
                    for i, (v, p) in enumerate(zip(values.tolist(), positions.tolist()))
                    for rank in range(alternatives)
                ]
            )
        return rows

    return children


@dataclass(frozen=True)
class _Candidate:
    state: torch.Tensor  # int64 [L]
    step: int  # rule-step index applied to this state
    logprob: float  # path log-probability from the root
    parent: int  # candidate index of the parent (-1 for the root)
    depth: int


def grow_tree(
    context: DraftContext,
    budget: int,
    max_depth: int,
    position_logprobs: PositionScorer | None = None,
    guesses: StaleGuesses | None = None,
    children: ChildProposer | None = None,
    alternatives: int = 1,
    min_path_prob: float = 0.0,
) -> DraftTree:
    """Best-first tree under a node budget (root included) and a depth limit.

    ``min_path_prob`` admits only nodes whose path probability reaches it, so a round scores fewer nodes when the
    drafter is unsure: on hardware where every scored node costs (a CPU), a node worth less than its cost is left out.

    Every edge commits one position (``position_logprobs``) or a set of positions (``children``) with their stale
    coupled tokens; a node's score is its path log-probability. The proposer runs once per depth on the (at most
    budget - 1) best nodes of that depth, batched; the tree keeps the budget - 1 best candidates overall (parents
    always score at least as high as their children).

    Candidate states live on the host: growing a tree is many tiny edits, each a kernel launch and a sync on a GPU.
    The proposer gets each level's states on the context's device (one copy per level) and the finished tree's
    states go back there in one copy.
    """
    guesses = guesses if guesses is not None else StaleGuesses(context)
    if children is None:
        children = one_commit_children(position_logprobs, budget - 1, guesses, alternatives)
    device = context.root.device
    host_tokens: dict[tuple[int, int], torch.Tensor] = {}  # (step, rank) -> coupled guesses int64 [L] on the host

    def tokens_on_host(step_index: int, rank: int) -> torch.Tensor:
        if (step_index, rank) not in host_tokens:
            host_tokens[(step_index, rank)] = guesses.tokens(step_index, rank).cpu()
        return host_tokens[(step_index, rank)]

    min_logprob = math.log(min_path_prob) if min_path_prob > 0 else float("-inf")
    root = context.root.cpu()
    candidates = [_Candidate(root, context.root_step, 0.0, -1, 0)]
    best_per_state: dict[bytes, float] = {}  # distinct non-root states -> best path log-probability so far
    level = [0]
    keep = budget - 1
    for _ in range(max_depth):
        if not level or keep == 0:
            break
        states = torch.stack([candidates[i].state for i in level]).to(device)  # [B, L]
        proposals = children(states, [candidates[i].step for i in level])
        next_level = []
        for index, options in zip(level, proposals):
            parent = candidates[index]
            for value, positions, rank in options:
                if parent.logprob + value < min_logprob:
                    continue
                tokens = tokens_on_host(parent.step, rank)
                child = parent.state.clone()
                where = list(positions)
                child[where] = tokens[where]
                candidates.append(_Candidate(child, parent.step + 1, parent.logprob + value, index, parent.depth + 1))
                next_level.append(len(candidates) - 1)
                state_key = child.numpy().tobytes()
                best_per_state[state_key] = max(best_per_state.get(state_key, float("-inf")), candidates[-1].logprob)
        bar = _admission_bar(best_per_state, keep)
        level = [
            i for i in sorted(next_level, key=lambda i: -candidates[i].logprob)[:keep] if candidates[i].logprob > bar
        ]
    order = sorted(range(1, len(candidates)), key=lambda i: (-candidates[i].logprob, candidates[i].depth))
    builder = TreeBuilder(root=root, root_step=context.root_step, mask_id=context.mask_id, max_nodes=budget)
    node_of = {0: 0}
    for index in order:
        if builder.full:
            break
        cand = candidates[index]
        parent_node = node_of.get(cand.parent)
        if parent_node is None:
            continue
        node = builder.add(parent_node, cand.state)
        if node is not None:
            node_of[index] = node
    return builder.build(device)


def _admission_bar(best_per_state: dict[bytes, float], keep: int) -> float:
    """Path log-probability of the keep-th best distinct state so far (-inf while fewer exist).

    A child never scores above its parent, so the children of a node at or below the bar cannot beat the kept set:
    growth stops there. This prunes drafter calls, never the tree's scores (a child of a node exactly at the bar
    could at most tie it, through a probability-1 commit). At budget 2 it saves the second call per round.
    """
    if len(best_per_state) < keep:
        return float("-inf")
    return heapq.nlargest(keep, best_per_state.values())[-1]


def masked_log_normalise(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Log-softmax of scores over allowed positions; -inf elsewhere. [..., L] -> [..., L]"""
    return torch.log_softmax(scores.to(torch.float64).masked_fill(~allowed, float("-inf")), dim=-1)
