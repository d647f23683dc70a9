"""What every drafter shares: stale noise-coupled guesses and best-first tree growth.

A drafter only reads the stale logits ``Z(s)`` of the last pass. For a commit made by rule step ``c`` the token
guess is the stale coupled token ``argmax_v Z(s)[j, v] / T + gumbel_c[j, v]`` (at T = 0 the stale argmax), so it is
exactly what the target would pick if its logits had not moved. Drafters differ only in how they score *which
position* commits next; ``grow_tree`` turns that score into a tree, best-first by path probability.
"""

from __future__ import annotations

import bisect
import functools
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from spot_dlm.decode import DraftContext
from spot_dlm.drafters.neighbours import (
    CANDIDATES,
    StalePass,
    TokenCorrection,
    is_active,
    rerank,
    rule_first,
    weighted_correction,
)
from spot_dlm.drafters.token_survival import SURVIVAL_RANKS, TokenSurvival
from spot_dlm.rules import Proposal, propose
from spot_dlm.tree import DraftTree, TreeBuilder

TOP_K_FEATURES = 32


def step_groups(steps: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Indices grouped by rule step, for work done once per step (each step has its own guess table).
    steps int64 [C] -> (step, indices int64 [c]) per distinct step, in increasing step order"""
    for step in np.unique(steps).tolist():
        yield step, np.flatnonzero(steps == step)


@dataclass(frozen=True)
class GuessTable:
    """The best stale coupled guesses of one rule step at every position masked in the stale state, on the host.

    Built in one go per step (one ``topk`` and one ``log_softmax`` over those rows), so every later question about
    guesses (a commit's candidates, their scores, their stale probabilities) is an array lookup.
    """

    row: np.ndarray  # int64 [L]: each position's row below (-1: committed in the stale state, no guesses)
    tokens: np.ndarray  # int64 [M, R]: best first, rank 0 the rule's own choice
    scores: np.ndarray  # float64 [M, R]: their coupled scores (``Z / T + gumbel``; ``Z`` at T = 0)
    logprob: np.ndarray  # float64 [M, R]: their stale log-probabilities

    @property
    def ranks(self) -> int:
        return self.tokens.shape[1]

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """Table rows of stale-masked positions. int64 [C] -> int64 [C]"""
        rows = self.row[positions]
        if (rows < 0).any():
            raise ValueError(f"positions {positions[rows < 0].tolist()} were committed in the stale state: no guesses")
        return rows


def stale_log_normaliser(stale_logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``log sum_v exp Z[j, v]`` over the vocabulary without the mask token, per position, in the logits' precision
    (at least float32). [L, V] -> [L]"""
    z = stale_logits.to(torch.promote_types(stale_logits.dtype, torch.float32), copy=True)
    z[..., mask_id] = float("-inf")
    return torch.logsumexp(z, dim=-1)


def largest_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest values of each row, largest first: ``x.topk(k).values``. [..., V] -> [..., k]

    On the host a partition is several times faster than ``topk`` at a vocabulary's width (numpy, 2048 wide: 80 us
    against 280 us for 32 rows)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return x.topk(k, dim=-1).values
    top = np.partition(x.numpy(), x.shape[-1] - k, axis=-1)[..., -k:]  # [..., k], unordered
    return torch.from_numpy(np.sort(top, axis=-1)[..., ::-1].copy())


def guess_table(
    context: DraftContext, step_index: int, rank0: torch.Tensor, count: int, log_normaliser: torch.Tensor
) -> GuessTable:
    """The ``count`` best coupled guesses at the stale-masked positions under the noise of ``step_index``, the
    rule's choice ``rank0`` (int64 [L]) first. log_normaliser [L]: ``stale_log_normaliser`` of the stale logits."""
    stale_masked = context.parent == context.mask_id  # [L]
    positions = torch.nonzero(stale_masked).flatten()  # [M]
    z = context.stale_logits[positions].to(torch.float64)  # [M, V], a copy
    z[:, context.mask_id] = float("-inf")
    coupled = z
    if context.rule.needs_noise:
        coupled = z / context.rule.temperature + context.gumbel(step_index, stale_masked)[positions]
    tokens = coupled.topk(min(count, z.shape[-1]), dim=-1).indices.cpu().numpy()  # [M, R]
    tokens = rule_first(tokens, rank0[positions].cpu().numpy())
    index = torch.from_numpy(tokens).to(z.device)
    row = np.full(stale_masked.shape[0], -1, dtype=np.int64)
    row[positions.cpu().numpy()] = np.arange(len(positions))
    logprob = z.gather(1, index) - log_normaliser[positions, None].to(torch.float64)  # [M, R]
    return GuessTable(
        row=row, tokens=tokens, scores=coupled.gather(1, index).cpu().numpy(), logprob=logprob.cpu().numpy()
    )


@dataclass
class StaleGuesses:
    """Stale coupled guesses per rule-step index, computed once per step index and reused across the tree.

    With ``neighbours`` a drafted commit's token is re-ranked by the tokens its branch filled since the stale pass
    (``child_guesses``): by a bigram of the target's text (``drafters/neighbours.py``) or by a small block-diffusion
    LM's change of belief (``drafters/token_lm.py``), so it depends on the node and not on the step alone.
    """

    context: DraftContext
    neighbours: TokenCorrection | None = None
    _cache: dict[int, Proposal] = field(default_factory=dict)
    _ranked: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _tables: dict[int, GuessTable] = field(default_factory=dict)

    def _key(self, step_index: int) -> int:
        """Without noise every step guesses alike: one entry serves them all."""
        return step_index if self.context.rule.needs_noise else 0

    def at(self, step_index: int) -> Proposal:
        """Tokens int64 [L] and confidence float64 [L] under the noise of ``step_index``, at the positions masked in
        the stale state (elsewhere: the stale state's token and confidence -inf)."""
        ctx = self.context
        step_index = self._key(step_index)
        if step_index in self._cache:
            return self._cache[step_index]
        if not ctx.rule.needs_noise and ctx.proposal is not None:  # the loop's own free-commit proposal
            proposal = ctx.proposal
        else:
            stale_masked = ctx.parent == ctx.mask_id  # every node of the tree commits among these positions
            noise = ctx.gumbel(step_index, stale_masked)[None] if ctx.rule.needs_noise else None
            full = propose(ctx.parent[None], ctx.stale_logits[None], noise, ctx.rule, ctx.mask_id)  # [1, L]
            proposal = Proposal(tokens=full.tokens[0], confidence=full.confidence[0])
        self._cache[step_index] = proposal
        return proposal

    def table(self, step_index: int, count: int = CANDIDATES) -> GuessTable:
        """The step's guess table with at least min(count, V) guesses per position."""
        key = self._key(step_index)
        table = self._tables.get(key)
        if table is None or table.ranks < min(count, self.context.stale_logits.shape[-1]):
            table = guess_table(self.context, key, self.at(key).tokens, max(count, CANDIDATES), self.log_normaliser)
            self._tables[key] = table
        return table

    def ranked(self, step_index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The n best coupled tokens per position (rank 0 is ``at(step).tokens``) and their stale log-probs.

        Returns tokens int64 [n, L] and log-probabilities float64 [n, L] on the host; rows of positions not masked
        in the stale state hold the stale state's token and 0 (no node commits them).
        """
        key = (self._key(step_index), n)
        if key not in self._ranked:
            table = self.table(step_index, n)
            masked = table.row >= 0  # [L]
            tokens = np.repeat(self.at(step_index).tokens.cpu().numpy()[None], n, axis=0)  # [n, L]
            logprob = np.zeros(tokens.shape)
            tokens[:, masked] = table.tokens[:, :n].T
            logprob[:, masked] = table.logprob[:, :n].T
            self._ranked[key] = (torch.from_numpy(tokens), torch.from_numpy(logprob))
        return self._ranked[key]

    def best_scores(self, step_index: int, positions: torch.Tensor, n: int) -> torch.Tensor:
        """The coupled scores of the n best guesses at some positions masked in the stale state, best first
        (what ``TokenSurvival`` reads). positions int64 [P] -> float64 [n, P] on the host"""
        table = self.table(step_index, n)
        return torch.from_numpy(table.scores[table.rows(positions.cpu().numpy()), :n].T)

    def child_guesses(
        self, step_index: int, parents: np.ndarray, positions: np.ndarray, n: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The n best guesses for commits at ``positions`` made from the ``parents`` states by rule step
        ``step_index``, best first, with the neighbour correction when there is one: tokens int64 [n, C] and their
        (corrected) coupled scores float64 [n, C]. parents int64 [C, L] on the host, positions int64 [C]."""
        table = self.table(step_index, n)
        rows, count = table.rows(positions), max(CANDIDATES, n)
        candidates, scores = table.tokens[rows, :count], table.scores[rows, :count]  # [C, R]
        if not is_active(self.neighbours, self.context.rule.temperature):
            return candidates[:, :n].T, scores[:, :n].T
        correction = weighted_correction(self.neighbours, self._stale_pass, parents, positions, candidates)  # [C, R]
        return rerank(scores, candidates, correction, self._score_scale(), n)

    def node_confidence(self, stale: torch.Tensor, steps: list[int], states: np.ndarray) -> torch.Tensor:
        """Each node's estimate of the rule's confidence at every position: ``stale`` (the stale coupled confidence
        of its step, float64 [B, L], -inf where stale-committed) and, where a neighbour was filled since the stale
        pass, the corrected guess's probability under the corrected distribution (``p(v) exp(c(v))`` over the
        ``CANDIDATES`` best guesses, the rest of the mass unchanged). states int64 [B, L] on the host -> a new
        float64 [B, L] on the host"""
        ctx = self.context
        confidence = stale.cpu().clone()  # [B, L]
        if not is_active(self.neighbours, ctx.rule.temperature):
            return confidence
        node, position = np.nonzero(states == ctx.mask_id)  # [M] each: the positions still to commit
        moved = self.neighbours.moved(self._stale_pass, states[node], position)
        node, position = node[moved], position[moved]
        node_step = np.asarray(steps)[node]
        for step, same in step_groups(node_step):
            table = self.table(step)
            index = table.rows(position[same])
            candidates = table.tokens[index, :CANDIDATES]  # [c, R]
            logp = table.logprob[index, :CANDIDATES]  # [c, R]
            correction = weighted_correction(
                self.neighbours, self._stale_pass, states[node[same]], position[same], candidates
            )  # [c, R], nats
            best = np.argmax(table.scores[index, :CANDIDATES] + self._score_scale() * correction, axis=1)  # [c]
            shifted = logp + correction  # log p(v) + c(v): the corrected logits, unnormalised
            tail = np.log1p(-np.minimum(np.exp(logp).sum(1), 1 - 1e-12))  # [c]: stale mass of the other tokens
            total = np.logaddexp(np.logaddexp.reduce(shifted, axis=1), tail)  # [c]
            chosen = np.take_along_axis(shifted, best[:, None], 1)[:, 0] - total
            rows, at = torch.from_numpy(node[same]), torch.from_numpy(position[same])
            confidence[rows, at] = torch.from_numpy(np.exp(chosen))
        return confidence

    def stale_logprobs(self, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Stale log-probabilities of tokens at positions. positions int64 [C], tokens int64 [C, A] -> [C, A]"""
        at = torch.from_numpy(positions).to(self.context.stale_logits.device)
        index = torch.from_numpy(tokens).to(at.device)
        logits = self.context.stale_logits[at].gather(1, index).to(torch.float64)  # [C, A]
        logits[index == self.context.mask_id] = float("-inf")  # never a guess (tiny vocabularies: a last rank)
        return (logits - self.log_normaliser[at, None].to(torch.float64)).cpu().numpy()

    @functools.cached_property
    def log_normaliser(self) -> torch.Tensor:
        """The stale pass's log-normaliser per position (``stale_log_normaliser``) [L]: computed once per round for
        every stale probability the drafter reads."""
        return stale_log_normaliser(self.context.stale_logits, self.context.mask_id)

    @functools.cached_property
    def _stale_pass(self) -> StalePass:
        """The round's stale pass as the token correction reads it (its memo: the loop's block memo when it keeps
        one, else this round's)."""
        ctx = self.context
        memo = {} if ctx.block_memo is None else ctx.block_memo
        return StalePass(ctx.parent, ctx.mask_id, ctx.prefix, ctx.rule.temperature, memo)

    def _score_scale(self) -> float:
        """What one nat of the correction adds to a coupled score (``Z / T + gumbel``; ``Z`` at T = 0)."""
        rule = self.context.rule
        return 1.0 / (rule.temperature if rule.needs_noise else 1.0)

    def tokens(self, step_index: int, rank: int) -> torch.Tensor:
        """Coupled token guesses of a given rank for every position. -> int64 [L]"""
        return self.at(step_index).tokens if rank == 0 else self.ranked(step_index, rank + 1)[0][rank]


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


def _record(best_per_state: dict[bytes, float], keys: list[bytes], logprobs: list[float], keep: int) -> list[bytes]:
    """Keep each distinct state's best path log-probability, children taken best first; returns the keys whose value
    was set or rose. Stops below the keep-th distinct state of the level: the bar cannot end below it, and a value
    below the bar never counts for it (bars only rise)."""
    changed, seen, floor = [], set(), float("-inf")
    for key, logprob in zip(keys, logprobs):
        if logprob < floor:
            break
        if key not in best_per_state or logprob > best_per_state[key]:
            best_per_state[key] = logprob
            changed.append(key)
        seen.add(key)
        if len(seen) == keep:
            floor = logprob
    return changed


def _row_keys(states: np.ndarray) -> list[bytes]:
    """The bytes of each row of an int64 [N, L] array (as ``row.tobytes()``)."""
    rows = np.ascontiguousarray(states)
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel().tolist()


@dataclass
class _Levels:
    """Every candidate node grown so far, level by level (level 0: the root alone), as host arrays."""

    states: list[np.ndarray]  # per level int64 [C_d, L]
    logprob: list[np.ndarray]  # per level float64 [C_d]: path log-probability from the root
    parent: list[np.ndarray]  # per level int64 [C_d]: candidate index of the parent (-1 for the root)
    complete: list[np.ndarray]  # per level bool [C_d]: no position left masked
    count: int = 1  # candidates in all; a candidate's index counts from the root's 0 in creation order


def grow_tree(
    context: DraftContext,
    budget: int,
    max_depth: int,
    position_logprobs: PositionScorer | None = None,
    guesses: StaleGuesses | None = None,
    children: ChildProposer | None = None,
    token_survival: TokenSurvival | None = None,
) -> DraftTree:
    """Best-first tree under a node budget (root included) and a depth limit.

    Every edge commits one position (``position_logprobs``) or a set of positions (``children``) with their stale
    coupled tokens; a node's score is its path log-probability (with ``token_survival``, the token's survival
    counts too: see ``one_commit_children``). The proposer runs once per depth on the (at most
    budget - 1) best nodes of that depth, batched; the tree keeps the budget - 1 best candidates overall (parents
    always score at least as high as their children).

    Candidate states live on the host, each level's children made in a few array ops: growing a tree is many tiny
    edits, each a kernel launch and a sync on a GPU. The proposer gets each level's states on the context's device
    (one copy per level) and the finished tree's states go back there in one copy.
    """
    guesses = guesses if guesses is not None else StaleGuesses(context)
    if children is None:
        children = one_commit_children(position_logprobs, budget - 1, guesses, token_survival)
    root = context.root.cpu()
    grown = _Levels([root.numpy()[None]], [np.zeros(1)], [np.full(1, -1)], [np.zeros(1, dtype=bool)])
    best_per_state: dict[bytes, float] = {}  # distinct non-root states -> best path log-probability so far
    top: list[bytes] = []  # the keys of the (budget - 1) best of them
    bar = float("-inf")
    level = np.zeros(1, dtype=np.int64)  # rows of the last level to expand, best first
    keep = budget - 1
    for depth in range(max_depth):
        if not len(level) or keep == 0:
            break
        states, logprob = grown.states[-1][level], grown.logprob[-1][level]  # [B, L], [B]
        step = context.root_step + depth  # every node of a level is ``depth`` rule steps below the root
        proposed = children(torch.from_numpy(states).to(context.root.device), [step] * len(level))
        path = logprob[proposed.node] + proposed.logprob  # [C]
        made = _commit(states, proposed, guesses, step)  # [C, L]
        grown.parent.append(grown.count - len(grown.logprob[-1]) + level[proposed.node])  # candidate indices
        grown.states.append(made)
        grown.logprob.append(path)
        grown.complete.append(~(made == context.mask_id).any(-1))
        grown.count += len(path)
        ranking = np.argsort(-path, kind="stable")  # [C], best first (ties: in proposal order)
        contenders = ranking[path[ranking] >= bar]  # a value below the bar can never count for it again
        changed = _record(best_per_state, _row_keys(made[contenders]), path[contenders].tolist(), keep)
        bar, top = _admission_bar(best_per_state, top + changed, keep)
        level = ranking[:keep][path[ranking[:keep]] > bar]
    return _assemble(context, grown, budget, root)


def _commit(states: np.ndarray, proposed: Children, guesses: StaleGuesses, step: int) -> np.ndarray:
    """Children states: each parent row with its committed positions set to the proposed tokens, or else to the
    coupled tokens of its rank under the noise of ``step``. states int64 [B, L] -> int64 [C, L]"""
    if proposed.commit_token is not None:
        made = states.take(proposed.node, axis=0)  # [C, L]
        made[proposed.commit_child, proposed.commit_position] = proposed.commit_token
        return made
    child, position = proposed.commit_child, proposed.commit_position  # [P] each
    made = states.take(proposed.node, axis=0)  # [C, L]
    made[child, position] = stale_tokens(guesses, step, proposed.rank[child], position)
    return made


def stale_tokens(guesses: StaleGuesses, step: int, rank: np.ndarray, position: np.ndarray) -> np.ndarray:
    """The step's stale coupled guess of the given rank at each position. rank, position int64 [P] -> int64 [P]"""
    n_ranks = int(rank.max()) + 1 if len(rank) else 1
    table = np.stack([guesses.tokens(step, r).cpu().numpy() for r in range(n_ranks)])  # [R, L]
    return table[rank, position]


def _assemble(context: DraftContext, grown: _Levels, budget: int, root: torch.Tensor) -> DraftTree:
    """The tree of the best candidates: best first (ties: shallower, then older), merged states kept once, complete
    states left out, and a candidate whose parent is not in the tree skipped."""
    logprob, parent = np.concatenate(grown.logprob), np.concatenate(grown.parent)  # [N], by depth then age
    complete = np.concatenate(grown.complete).tolist()  # [N]
    starts = np.cumsum([0] + [len(lp) for lp in grown.logprob]).tolist()  # first candidate index of each level
    builder = TreeBuilder(root, context.root_step, context.mask_id, budget, context.handoffs, context.stop_id)
    node_of = {0: 0}
    for index in _best_first(logprob[1:], 4 * budget):
        if builder.full:
            break
        index += 1  # the root is not a candidate
        parent_node = node_of.get(int(parent[index]))
        if parent_node is None:
            continue
        level = bisect.bisect_right(starts, index) - 1
        state = grown.states[level][index - starts[level]]  # int64 [L]
        node = builder.add_known(parent_node, torch.from_numpy(state), state.tobytes(), complete[index])
        if node is not None:
            node_of[index] = node
    return builder.build(context.root.device)


def _best_first(logprob: np.ndarray, head: int) -> Iterator[int]:
    """Indices by descending logprob, ties in index order (a stable sort), the ``head`` best sorted first and the
    rest only if asked for. float64 [N] -> N indices"""
    key = -logprob
    if len(key) <= head:
        yield from np.argsort(key, kind="stable").tolist()
        return
    in_head = key <= np.partition(key, head - 1)[head - 1]  # [N], >= head of them: every tie of the cut
    for part in (np.flatnonzero(in_head), np.flatnonzero(~in_head)):
        yield from part[np.argsort(key[part], kind="stable")].tolist()


def masked_log_normalise(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Log-softmax of scores over allowed positions; -inf elsewhere. [..., L] -> [..., L]"""
    return torch.log_softmax(scores.to(torch.float64).masked_fill(~allowed, float("-inf")), dim=-1)
