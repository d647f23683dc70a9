"""Fit ``TokenSurvival`` from standard decoding on training prompts.

For every commit of standard decoding (rule step t, position j, token x) and every staleness d = 1..D we look at
the state d commits earlier: the coupled scores of its best guesses at j under step t's noise, and the rank of x
among them. That is exactly what a draft edge d levels below a stale pass bets on.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from spot_dlm.api import GenerateConfig, encode_prompt, settings_for
from spot_dlm.decode import NoDrafter, StepRecord, decode_ids
from spot_dlm.drafters.neighbours import CANDIDATES, StalePass, TokenCorrection, candidate_scores
from spot_dlm.drafters.token_survival import MAX_STALENESS, SURVIVAL_RANKS, TokenSurvival, fit_bucket
from spot_dlm.noise import NoiseKey

NEIGHBOUR_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)  # the grid ``fit_neighbour_weight`` chooses from


def coupled_scores(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float, mask_id: int) -> torch.Tensor:
    """The scores the coupled guess maximises at one position: ``Z / T + gumbel`` or ``Z`` at T = 0 (mask token
    excluded). logits [V], noise float64 [V] or None -> float64 [V]"""
    z = logits.to(torch.float64, copy=True)
    z[mask_id] = float("-inf")
    return z if temperature == 0 else z / temperature + noise


@dataclass
class SurvivalObservations:
    """Per observed commit: staleness d, the R best coupled scores at its position d commits earlier, the rank there
    of the token committed (R or more: outside the R best)."""

    temperature: float
    mask_id: int
    max_staleness: int = MAX_STALENESS
    ranks: int = SURVIVAL_RANKS
    corrector: TokenCorrection | None = None  # also record its correction of the CANDIDATES best guesses
    staleness: list[int] = field(default_factory=list)
    scores: list[np.ndarray] = field(default_factory=list)  # float64 [R] each
    rank: list[int] = field(default_factory=list)
    candidate_scores: list[np.ndarray] = field(default_factory=list)  # float64 [CANDIDATES] each, rule's guess first
    correction: list[np.ndarray] = field(default_factory=list)  # float64 [K, CANDIDATES]: each part's correction
    committed_candidate: list[int] = field(default_factory=list)  # index of the committed token there, or -1

    def observer(self, key: NoiseKey):
        """A decode observer recording every commit against the last ``max_staleness`` states of its block."""
        recent: deque[StepRecord] = deque(maxlen=self.max_staleness)
        block_memo: dict = {}  # what the corrector computes once per block (a small LM's prefix and states)

        def record(rec: StepRecord) -> None:
            if recent and recent[-1].block_index != rec.block_index:
                recent.clear()
                block_memo.clear()
            committed = ((rec.state == self.mask_id) & (rec.next_state != self.mask_id)).nonzero()[:, 0]
            vocab = rec.logits.shape[-1]
            for position in committed.tolist():
                token = int(rec.next_state[position])
                noise = None
                if self.temperature > 0:
                    noise = key.gumbel(rec.block_index, rec.step_index, torch.tensor([position]), vocab)[0]
                for staleness, stale in enumerate(reversed(recent), start=1):
                    scores = coupled_scores(stale.logits[position], noise, self.temperature, self.mask_id)
                    self.staleness.append(staleness)
                    self.scores.append(scores.topk(self.ranks).values.cpu().numpy())
                    self.rank.append(int((scores > scores[token]).sum()))
                    if self.corrector is not None:
                        self._record_candidates(scores, rec, stale, position, token, block_memo)
            recent.append(rec)

        return record

    def _record_candidates(
        self, scores: torch.Tensor, rec: StepRecord, stale: StepRecord, position: int, token: int, memo: dict
    ) -> None:
        """The best stale guesses at a committed position, the corrector's correction of them for the commits made
        since the stale pass (``rec.state`` is what a drafted node holds when it makes this commit), and where the
        token is. ``memo``: shared by the stale passes of one block."""
        at = np.asarray([position])
        rank0 = torch.full((rec.state.shape[0],), int(scores.argmax()), dtype=torch.int64)  # the rule's tie-break
        table = scores.cpu()[None].expand(rec.state.shape[0], -1)  # only row ``position`` is read
        values, candidates = candidate_scores(table, rank0, at, CANDIDATES)  # [1, R]
        stale_pass = StalePass(stale.state, self.mask_id, stale.prefix, self.temperature, memo)
        self.candidate_scores.append(values[0])
        self.correction.append(self.corrector.parts(stale_pass, rec.state.cpu().numpy()[None], at, candidates)[:, 0])
        hit = np.flatnonzero(candidates[0] == token)
        self.committed_candidate.append(int(hit[0]) if len(hit) else -1)

    def neighbour_arrays(self, weight: float, staleness: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """With the correction at ``weight``: the R best corrected scores per commit float64 [N, R] (best first) and
        the rank of the committed token among them int64 [N] (R: outside), at one staleness or all."""
        chosen = np.ones(len(self.staleness), dtype=bool)
        if staleness is not None:
            chosen = np.asarray(self.staleness) == staleness
        if not self.candidate_scores or not chosen.any():
            return np.zeros((0, self.ranks)), np.zeros(0, dtype=np.int64)
        parts = np.stack(self.correction)[chosen]  # [N, K, C] ([N, C]: one part)
        parts = parts[:, None] if parts.ndim == 2 else parts
        weights = np.broadcast_to(np.asarray(weight, dtype=np.float64), parts.shape[1:2])  # [K]
        scale = 1.0 / (self.temperature if self.temperature > 0 else 1.0)
        corrected = np.stack(self.candidate_scores)[chosen] + scale * np.einsum("k,nkc->nc", weights, parts)
        order = np.argsort(-corrected, axis=1, kind="stable")  # [N, C]
        committed = np.asarray(self.committed_candidate)[chosen]  # [N]
        rank = np.argmax(order == committed[:, None], axis=1)  # position of the committed candidate
        rank = np.where(committed < 0, self.ranks, np.minimum(rank, self.ranks))
        return np.take_along_axis(corrected, order, 1)[:, : self.ranks], rank

    def arrays(self, staleness: int) -> tuple[np.ndarray, np.ndarray]:
        """Scores float64 [N, R] and ranks int64 [N] of the commits seen at one staleness."""
        chosen = np.asarray(self.staleness) == staleness
        scores = np.stack(self.scores)[chosen] if self.scores else np.zeros((0, self.ranks))
        return scores, np.asarray(self.rank, dtype=np.int64)[chosen]

    def top_survival(self, staleness: int) -> float:
        """Fraction of commits whose token was the top stale guess."""
        _, rank = self.arrays(staleness)
        return float(np.mean(rank == 0)) if len(rank) else float("nan")


def observe(
    target,
    codec,
    prompts: list[str],
    temperature: float,
    seed: int,
    block_length: int | None = 32,
    gen_length: int = 256,
    progress: bool = True,
    corrector: TokenCorrection | None = None,
) -> SurvivalObservations:
    """Standard decoding of the prompts (request ids 0..n-1 under ``seed``) with survival observations (and the
    correction's, with a ``corrector``: the bigram's ``NeighbourTokens`` or a ``TokenLM``; its weight is not
    read)."""
    config = GenerateConfig(
        method="standard", temperature=temperature, seed=seed, block_length=block_length, gen_length=gen_length
    )
    observations = SurvivalObservations(temperature=temperature, mask_id=target.mask_id, corrector=corrector)
    for request, prompt in enumerate(tqdm(prompts, desc=f"token survival T={temperature:g}", disable=not progress)):
        key = NoiseKey(seed, request)
        ids = encode_prompt(prompt, codec, config, target)
        decode_ids(target, ids, settings_for(config, target), NoDrafter(), key, observations.observer(key))
    return observations


def fit_token_survival(greedy: SurvivalObservations, sampled: SurvivalObservations) -> TokenSurvival:
    """One bucket per staleness 1..max_staleness for each temperature kind."""

    def buckets(observations: SurvivalObservations):
        fitted = []
        for staleness in range(1, observations.max_staleness + 1):
            scores, rank = observations.arrays(staleness)
            if len(rank) == 0:
                raise ValueError(f"no commits observed at staleness {staleness}: decode more prompts")
            fitted.append(fit_bucket(scores, rank))
        return tuple(fitted)

    return TokenSurvival(greedy=buckets(greedy), sampled=buckets(sampled))


def fit_neighbour_weight(
    observations: SurvivalObservations, grid: tuple[float, ...] = NEIGHBOUR_WEIGHTS
) -> float | tuple[float, ...]:
    """The weight of the grid under which the top corrected guess is the committed token most often (all
    stalenesses together; ties: the smaller weights), one per part of the correction: a float for a single part
    (the bigram), a tuple over the grid's K-fold product for K parts."""
    if not observations.candidate_scores:
        raise ValueError("no correction observations: observe with a corrector")
    n_parts = np.atleast_2d(observations.correction[0]).shape[0]  # [K, C] ([C]: one part)
    choices = grid if n_parts == 1 else list(itertools.product(grid, repeat=n_parts))  # in increasing order
    kept = [float(np.mean(observations.neighbour_arrays(w)[1] == 0)) for w in choices]
    return choices[int(np.argmax(kept))]


def fit_neighbour_survival(
    greedy: SurvivalObservations, sampled: SurvivalObservations, weights: tuple
) -> TokenSurvival:
    """Survival of the corrected guesses at the chosen (greedy, sampled) weights: one bucket per staleness."""

    def buckets(observations: SurvivalObservations, weight):
        fitted = []
        for staleness in range(1, observations.max_staleness + 1):
            scores, rank = observations.neighbour_arrays(weight, staleness)
            if len(rank) == 0:
                raise ValueError(f"no commits observed at staleness {staleness}: decode more prompts")
            fitted.append(fit_bucket(scores, rank))
        return tuple(fitted)

    return TokenSurvival(greedy=buckets(greedy, weights[0]), sampled=buckets(sampled, weights[1]))
