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

import numpy as np
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

# one candidate child: (log-probability, positions committed together, token rank: 0 = the best coupled guess, ...)
Child = tuple[float, tuple[int, ...], int]


@dataclass(frozen=True)
class Children:
    """The candidate children of a batch of B nodes, C in all, on the host: grouped by node, each node's children
    in proposal order (that order breaks ties between equally likely children)."""

    node: torch.Tensor  # int64 [C], non-decreasing: the row of the child's parent in the batch
    logprob: torch.Tensor  # float64 [C]: log-probability of the edge
    commits: torch.Tensor  # bool [C, L]: the positions committed together
    rank: torch.Tensor  # int64 [C]: token rank, 0 = the best coupled guess, 1 = the runner-up, ...

    @staticmethod
    def of_rows(rows: list[list[Child]], length: int) -> Children:
        """From per-node lists of children (node b's list is ``rows[b]``); ``length`` is L."""
        flat = [(b, *child) for b, options in enumerate(rows) for child in options]
        commits = torch.zeros(len(flat), length, dtype=torch.bool)
        for c, (_, _, positions, _) in enumerate(flat):
            commits[c, list(positions)] = True
        return Children(
            node=torch.tensor([f[0] for f in flat], dtype=torch.int64),
            logprob=torch.tensor([f[1] for f in flat], dtype=torch.float64),
            commits=commits,
            rank=torch.tensor([f[3] for f in flat], dtype=torch.int64),
        )

    def select(self, chosen: torch.Tensor) -> Children:
        """The children where ``chosen`` (bool [C]) holds, in order."""
        return Children(self.node[chosen], self.logprob[chosen], self.commits[chosen], self.rank[chosen])


# (node states int64 [B, L], rule-step indices) -> the candidate children of every node
ChildProposer = Callable[[torch.Tensor, list[int]], Children]


def top_positions(scores: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The min(keep, #finite) best positions of every row, rows in order, each row best first.

    scores float [B, L] -> (row int64 [C], score [C], position int64 [C]). Rows with the same count share one
    ``topk`` call, which orders each row (ties included) exactly as ``row.topk(count)`` does.
    """
    counts = torch.isfinite(scores).sum(-1).clamp(max=keep)  # [B]
    rows, values, positions = (
        [torch.zeros(0, dtype=torch.int64)],
        [scores.new_zeros(0)],
        [torch.zeros(0, dtype=torch.int64)],
    )
    for count in counts.unique().tolist():
        if count == 0:
            continue
        group = torch.nonzero(counts == count).flatten()  # [b]
        top = scores[group].topk(count, dim=-1)  # [b, count]
        rows.append(group.repeat_interleave(count))
        values.append(top.values.flatten())
        positions.append(top.indices.flatten())
    row, order = torch.sort(torch.cat(rows), stable=True)  # back to row order, each row's order kept
    return row, torch.cat(values)[order], torch.cat(positions)[order]


def one_commit_children(
    scorer: PositionScorer, keep: int, guesses: StaleGuesses | None = None, alternatives: int = 1
) -> ChildProposer:
    """Children that each commit one position: the ``keep`` most likely positions of every node.

    With ``alternatives`` > 1 each position is also tried with its runner-up coupled tokens, scored by
    ``log q(position) + log p_stale(token)``; with 1, children carry the best guess and the position score only.
    """

    def children(states: torch.Tensor, steps: list[int]) -> Children:
        scores = scorer(states, steps).cpu()  # [B, L]; ranked on the host
        node, values, positions = top_positions(scores, keep)  # [C] each
        values, rank = values.to(torch.float64), torch.zeros_like(node)
        if alternatives > 1:
            table = {s: guesses.ranked(s, alternatives)[1].cpu() for s in set(steps)}  # step -> float64 [A, L]
            token_logprob = torch.stack([table[s] for s in steps])[node, :, positions]  # [C, A]
            values = (values[:, None] + token_logprob).flatten()  # [C * A]: each position's ranks in turn
            node, positions = node.repeat_interleave(alternatives), positions.repeat_interleave(alternatives)
            rank = torch.arange(alternatives).repeat(token_logprob.shape[0])
        commits = torch.nn.functional.one_hot(positions, states.shape[-1]).bool()  # [C, L]
        return Children(node, values, commits, rank)

    return children


@dataclass
class _Candidates:
    """Every candidate node grown so far, in creation order (index 0: the root), on the host."""

    states: list[torch.Tensor]  # per level int64 [C_d, L]
    logprob: list[np.ndarray]  # per level float64 [C_d]: path log-probability from the root
    parent: list[np.ndarray]  # per level int64 [C_d]: candidate index of the parent

    @property
    def count(self) -> int:
        return sum(len(lp) for lp in self.logprob)


def _admission_bar(best_per_state: dict[bytes, float], top: list[bytes], keep: int) -> tuple[float, list[bytes]]:
    """Path log-probability of the keep-th best distinct state so far (-inf while fewer exist), and the keys of the
    keep best states. ``top`` holds the keep best keys of an earlier call and those whose value rose since: values
    only grow, so a state outside both can never climb back.

    A child never scores above its parent, so the children of a node at or below the bar cannot beat the kept set:
    growth stops there. This prunes drafter calls, never the tree's scores (a child of a node exactly at the bar
    could at most tie it, through a probability-1 commit). At budget 2 it saves the second call per round.
    """
    top = heapq.nlargest(keep, set(top), key=best_per_state.__getitem__)
    if len(best_per_state) < keep:
        return float("-inf"), top
    return best_per_state[top[-1]], top


def _record(best_per_state: dict[bytes, float], keys: list[bytes], logprobs: list[float]) -> list[bytes]:
    """Keep each distinct state's best path log-probability; returns the keys whose value was set or rose."""
    changed = []
    for key, logprob in zip(keys, logprobs):
        if key not in best_per_state or logprob > best_per_state[key]:
            best_per_state[key] = logprob
            changed.append(key)
    return changed


def _row_keys(states: torch.Tensor) -> list[bytes]:
    """The bytes of each row of a contiguous int64 [N, L] host tensor (as ``row.numpy().tobytes()``)."""
    rows = states.contiguous().numpy()
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel().tolist()


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

    Candidate states live on the host, each level's children made in a few batched ops: growing a tree is many tiny
    edits, each a kernel launch and a sync on a GPU. The proposer gets each level's states on the context's device
    (one copy per level) and the finished tree's states go back there in one copy.
    """
    guesses = guesses if guesses is not None else StaleGuesses(context)
    if children is None:
        children = one_commit_children(position_logprobs, budget - 1, guesses, alternatives)
    device = context.root.device
    min_logprob = math.log(min_path_prob) if min_path_prob > 0 else float("-inf")
    root = context.root.cpu()
    grown = _Candidates(states=[root[None]], logprob=[np.zeros(1)], parent=[np.full(1, -1)])
    best_per_state: dict[bytes, float] = {}  # distinct non-root states -> best path log-probability so far
    top: list[bytes] = []  # the keys of the (budget - 1) best of them
    bar = float("-inf")
    level = np.zeros(1, dtype=np.int64)  # candidate indices of the nodes to expand, best first
    keep = budget - 1
    for depth in range(max_depth):
        if not len(level) or keep == 0:
            break
        step = context.root_step + depth  # every node of a level is ``depth`` steps below the root
        states, logprob = _level_states(grown, level), _level_logprobs(grown, level)  # [B, L], [B]
        proposed = children(states.to(device), [step] * len(level))
        path = torch.from_numpy(logprob)[proposed.node] + proposed.logprob  # [C]
        proposed = proposed.select(~(path < min_logprob))
        path = path[~(path < min_logprob)].numpy()
        made = _commit(states, proposed, guesses, step)  # [C, L]
        first = grown.count
        grown.states.append(made)
        grown.logprob.append(path)
        grown.parent.append(level[proposed.node.numpy()])
        contenders = np.flatnonzero(path >= bar)  # a value below the bar can never count for it again
        changed = _record(best_per_state, _row_keys(made[contenders]), path[contenders].tolist())
        bar, top = _admission_bar(best_per_state, top + changed, keep)
        best = np.argsort(-path, kind="stable")[:keep]
        level = first + best[path[best] > bar]
    return _assemble(context, grown, budget, root, device)


def _level_states(grown: _Candidates, level: np.ndarray) -> torch.Tensor:
    """States of the chosen candidates (all of the last level, or the root) int64 [B, L]."""
    first = grown.count - len(grown.logprob[-1])
    return grown.states[-1][torch.from_numpy(level - first)]


def _level_logprobs(grown: _Candidates, level: np.ndarray) -> np.ndarray:
    first = grown.count - len(grown.logprob[-1])
    return grown.logprob[-1][level - first]


def _commit(states: torch.Tensor, proposed: Children, guesses: StaleGuesses, step: int) -> torch.Tensor:
    """Children states: each parent row with its committed positions set to the coupled tokens of its rank under the
    noise of ``step``. states int64 [B, L] on the host -> int64 [C, L] on the host"""
    n_ranks = int(proposed.rank.max()) + 1 if len(proposed.rank) else 1
    table = torch.stack([guesses.tokens(step, rank).cpu() for rank in range(n_ranks)])  # [R, L]
    return torch.where(proposed.commits, table[proposed.rank], states[proposed.node])


def _assemble(
    context: DraftContext, grown: _Candidates, budget: int, root: torch.Tensor, device: torch.device
) -> DraftTree:
    """The tree of the best candidates: best first (ties: shallower, then older), merged states kept once, complete
    states left out, and a candidate whose parent is not in the tree skipped."""
    logprob, parent = np.concatenate(grown.logprob), np.concatenate(grown.parent)  # [N], candidates by depth
    states = torch.cat(grown.states)  # [N, L]
    order = np.argsort(-logprob[1:], kind="stable") + 1  # depth and then age break ties: creation order
    builder = TreeBuilder(root=root, root_step=context.root_step, mask_id=context.mask_id, max_nodes=budget)
    node_of = {0: 0}
    for index in order.tolist():
        if builder.full:
            break
        parent_node = node_of.get(int(parent[index]))
        if parent_node is None:
            continue
        node = builder.add(parent_node, states[index])
        if node is not None:
            node_of[index] = node
    return builder.build(device)


def masked_log_normalise(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Log-softmax of scores over allowed positions; -inf elsewhere. [..., L] -> [..., L]"""
    return torch.log_softmax(scores.to(torch.float64).masked_fill(~allowed, float("-inf")), dim=-1)
