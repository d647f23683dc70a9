"""Fit ``TokenSurvival`` from standard decoding on training prompts.

For every commit of standard decoding (rule step t, position j, token x) and every staleness d = 1..D we look at
the state d commits earlier: the coupled scores of its best guesses at j under step t's noise, and the rank of x
among them. That is exactly what a draft edge d levels below a stale pass bets on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from spot_dlm.api import GenerateConfig, encode_prompt
from spot_dlm.decode import NoDrafter, StepRecord, decode_ids
from spot_dlm.drafters.token_survival import MAX_STALENESS, SURVIVAL_RANKS, TokenSurvival, fit_bucket
from spot_dlm.noise import NoiseKey


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
    staleness: list[int] = field(default_factory=list)
    scores: list[np.ndarray] = field(default_factory=list)  # float64 [R] each
    rank: list[int] = field(default_factory=list)

    def observer(self, key: NoiseKey):
        """A decode observer recording every commit against the last ``max_staleness`` states of its block."""
        recent: deque[StepRecord] = deque(maxlen=self.max_staleness)

        def record(rec: StepRecord) -> None:
            if recent and recent[-1].block_index != rec.block_index:
                recent.clear()
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
            recent.append(rec)

        return record

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
    block_length: int = 32,
    gen_length: int = 256,
    progress: bool = True,
) -> SurvivalObservations:
    """Standard decoding of the prompts (request ids 0..n-1 under ``seed``) with survival observations."""
    config = GenerateConfig(
        method="standard", temperature=temperature, seed=seed, block_length=block_length, gen_length=gen_length
    )
    observations = SurvivalObservations(temperature=temperature, mask_id=target.mask_id)
    for request, prompt in enumerate(tqdm(prompts, desc=f"token survival T={temperature:g}", disable=not progress)):
        key = NoiseKey(seed, request)
        ids = encode_prompt(prompt, codec, config, target)
        decode_ids(target, ids, config.settings(), NoDrafter(), key, observations.observer(key))
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
