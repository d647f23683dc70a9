"""Token survival: how likely a stale coupled guess is still the target's token when its position commits.

A drafted edge is accepted only if the order model picked the right position *and* the stale coupled token is the
one the target commits there. The stale softmax is a poor estimate of the second: the noise is shared, so the
coupled argmax only flips when the logits move by more than its margin over the runner-up (on the built-in target
the top guess survives one commit 86% of the time at T = 0 while its stale probability averages 0.40).

The model: with the coupled scores ``y_0 >= y_1 >= ...`` of a position's best guesses (``Z / T + gumbel`` of the
stale logits, or ``Z`` at T = 0),

    P(the committed token is guess r) = (1 - outside) * softmax(y / scale)_r

one (scale, outside) pair per staleness (commits since the stale pass: 1, 2, ..., the last bucket and beyond) and
per temperature kind (greedy T = 0, sampled T > 0). Fitted by maximum likelihood on standard-decoding trajectories
of training prompts (``spot-dlm fit-token-survival``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

SURVIVAL_FILE = "token_survival.json"
SURVIVAL_RANKS = 4  # guesses a fit looks at per position; a true token ranked lower counts as "outside"
MAX_STALENESS = 4  # buckets 1, 2, 3 and 4-or-more commits since the stale pass
_MIN_OUTSIDE = 1e-4


@dataclass(frozen=True)
class SurvivalBucket:
    scale: float  # > 0: temperature of the softmax over the guesses' coupled scores
    outside: float  # in [0, 1): probability the committed token is none of the top SURVIVAL_RANKS guesses

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"token survival scale must be a positive number, got {self.scale!r}")
        if not 0 <= self.outside < 1:
            raise ValueError(f"token survival outside must be in [0, 1), got {self.outside!r}")


@dataclass(frozen=True)
class TokenSurvival:
    greedy: tuple[SurvivalBucket, ...]  # T = 0; index d - 1 for staleness d, the last for d and beyond
    sampled: tuple[SurvivalBucket, ...]  # T > 0, same buckets

    def __post_init__(self) -> None:
        if not self.greedy or not self.sampled:
            raise ValueError("token survival needs at least one bucket per temperature kind")

    def bucket(self, temperature: float, staleness: int) -> SurvivalBucket:
        buckets = self.sampled if temperature > 0 else self.greedy
        return buckets[min(max(staleness, 1), len(buckets)) - 1]

    def log_probs(self, scores: torch.Tensor, temperature: float, staleness: int) -> torch.Tensor:
        """log P(the committed token is guess r). scores float64 [R, L] (coupled scores, best first) -> [R, L]"""
        return survival_log_probs(scores, self.bucket(temperature, staleness))

    def to_json(self) -> str:
        return json.dumps({kind: [asdict(b) for b in getattr(self, kind)] for kind in ("greedy", "sampled")}, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "token survival") -> TokenSurvival:
        try:
            raw = json.loads(text)
            return cls(**{kind: tuple(SurvivalBucket(**b) for b in raw[kind]) for kind in ("greedy", "sampled")})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"invalid {source}: {err}") from err


def survival_log_probs(scores: torch.Tensor, bucket: SurvivalBucket) -> torch.Tensor:
    """scores float [R, L] (best first; -inf allowed below rank 0) -> log P(guess r is committed) float64 [R, L]"""
    scaled = scores.to(torch.float64) / bucket.scale
    return math.log1p(-bucket.outside) + torch.log_softmax(scaled, dim=0)


def load_token_survival(folder: Path) -> TokenSurvival | None:
    """The fit stored beside a drafter, or None when the folder has none."""
    path = Path(folder) / SURVIVAL_FILE
    return TokenSurvival.from_json(path.read_text(), str(path)) if path.is_file() else None


def save_token_survival(survival: TokenSurvival, folder: Path) -> Path:
    path = Path(folder) / SURVIVAL_FILE
    path.write_text(survival.to_json())
    return path


def fit_bucket(scores: np.ndarray, rank: np.ndarray) -> SurvivalBucket:
    """Maximum-likelihood (scale, outside) from N observed commits.

    scores float [N, R]: the coupled scores of the R best stale guesses at the committed position, best first;
    rank int [N]: the rank of the committed token among them (R or more: outside).
    """
    scores, rank = np.asarray(scores, dtype=np.float64), np.asarray(rank)
    if scores.ndim != 2 or scores.shape[0] != rank.shape[0] or scores.shape[0] == 0:
        raise ValueError(f"fit_bucket needs [N, R] scores and [N] ranks with N >= 1, got {scores.shape}, {rank.shape}")
    inside = rank < scores.shape[1]
    outside = float(np.clip(1 - inside.mean(), _MIN_OUTSIDE, 1 - _MIN_OUTSIDE))
    if not inside.any():
        return SurvivalBucket(scale=1.0, outside=outside)
    chosen, candidates = scores[inside, rank[inside]], scores[inside]  # [n], [n, R]

    def loglik(log_scale: float) -> float:
        scaled = candidates / math.exp(log_scale)
        top = np.max(scaled, axis=1)
        finite = np.where(np.isfinite(scaled), np.exp(scaled - top[:, None]), 0.0)
        return float(np.sum(chosen / math.exp(log_scale) - top - np.log(finite.sum(axis=1))))

    return SurvivalBucket(scale=math.exp(_maximise(loglik, -6.0, 4.0)), outside=outside)


def _maximise(f, lo: float, hi: float, grid: int = 41, rounds: int = 40) -> float:
    """The argmax of a unimodal-ish f on [lo, hi]: a grid, then golden-section search around the best point."""
    xs = np.linspace(lo, hi, grid)
    best = int(np.argmax([f(x) for x in xs]))
    a, b = xs[max(best - 1, 0)], xs[min(best + 1, grid - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(rounds):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) >= f(d):
            b = d
        else:
            a = c
    return (a + b) / 2
