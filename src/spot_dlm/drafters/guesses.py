"""Stale noise-coupled guesses: the token every drafted commit carries.

A drafter only reads the stale logits ``Z(s)`` of the last pass. For a commit made by rule step ``c`` the token
guess is the stale coupled token ``argmax_v Z(s)[j, v] / T + gumbel_c[j, v]`` (at T = 0 the stale argmax), so it is
exactly what the target would pick if its logits had not moved. ``StaleGuesses`` computes them once per rule step
(a ``GuessTable``: the best guesses of every stale-masked position, their coupled scores and stale
log-probabilities) and serves every node of a round's tree; with a neighbour correction it re-ranks them per node.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
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
from spot_dlm.rules import Proposal, propose


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


def stale_tokens(guesses: StaleGuesses, step: int, rank: np.ndarray, position: np.ndarray) -> np.ndarray:
    """The step's stale coupled guess of the given rank at each position. rank, position int64 [P] -> int64 [P]"""
    n_ranks = int(rank.max()) + 1 if len(rank) else 1
    table = np.stack([guesses.tokens(step, r).cpu().numpy() for r in range(n_ranks)])  # [R, L]
    return table[rank, position]
