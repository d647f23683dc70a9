"""The commit rule: one pure function that every decoder and the verifier call.

``step(tokens, logits, gumbel, rule, mask_id)`` maps K block states and the target's logits on them to the K next
states. Decisions are made in float64. Ties break to the lowest token id and to the lowest block position.
Because the baseline loop and the speculative verifier share this function (and the keyed noise), a draft is
accepted exactly when it equals what standard decoding would do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ConfidenceKind = Literal["prob", "tempered", "margin", "neg_entropy"]
RULE_KINDS: tuple[str, ...] = ("one", "threshold", "dynamic")
CONFIDENCE_KINDS: tuple[str, ...] = ("prob", "tempered", "margin", "neg_entropy")


@dataclass(frozen=True)
class CommitRule:
    """Which positions a pass commits and how tokens are chosen.

    kind: ``one`` commits the most confident masked position (standard exact decoding); ``threshold`` (Fast-dLLM)
        the most confident plus every position with confidence >= ``tau``; ``dynamic`` (SDAR
        ``low_confidence_dynamic``) every position with confidence > ``tau`` when there are at least ``k`` of them,
        else the ``k`` most confident.
    temperature: 0 is argmax; > 0 is Gumbel-max sampling of ``softmax(logits / temperature)``.
    confidence: ``prob`` = p(token) under softmax(logits); ``tempered`` = p(token) under softmax(logits / T);
        ``margin`` = p1 - p2; ``neg_entropy`` = -H(softmax(logits)).
    """

    kind: str = "one"
    temperature: float = 0.0
    confidence: str = "prob"
    k: int = 1
    tau: float = 0.9

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"unknown commit rule {self.kind!r}; choose one of {', '.join(RULE_KINDS)}")
        if self.confidence not in CONFIDENCE_KINDS:
            raise ValueError(f"unknown confidence {self.confidence!r}; choose one of {', '.join(CONFIDENCE_KINDS)}")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.k < 1:
            raise ValueError(f"k (commits per pass) must be >= 1, got {self.k}")
        if not 0.0 <= self.tau <= 1.0 and self.kind in ("threshold", "dynamic"):
            raise ValueError(f"tau must lie in [0, 1], got {self.tau}")

    @property
    def needs_noise(self) -> bool:
        return self.temperature > 0.0


@dataclass(frozen=True)
class Proposal:
    """Per-position token choice and confidence for K states (before choosing which positions commit)."""

    tokens: torch.Tensor  # int64 [K, L]: the (noise-coupled) token each masked position would take; others as given
    confidence: torch.Tensor  # float64 [K, L]: -inf where the position is not masked


@dataclass(frozen=True)
class StepResult:
    tokens: torch.Tensor  # int64 [K, L]: the next states
    committed: torch.Tensor  # bool [K, L]: positions filled by this pass
    proposal: Proposal


def _decision_logits(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """float64 logits with the mask token removed from the choice. [..., V] -> [..., V]"""
    z = logits.to(torch.float64, copy=True)
    z[..., mask_id] = float("-inf")
    return z


def _confidence(z: torch.Tensor, tokens: torch.Tensor, rule: CommitRule) -> torch.Tensor:
    """Confidence of each position's chosen token. z float64 [..., V], tokens [...] -> float64 [...]"""
    if rule.confidence == "tempered" and rule.temperature > 0.0:
        return torch.softmax(z / rule.temperature, dim=-1).gather(-1, tokens[..., None])[..., 0]
    probs = torch.softmax(z, dim=-1)
    if rule.confidence in ("prob", "tempered"):
        return probs.gather(-1, tokens[..., None])[..., 0]
    if rule.confidence == "margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    log_probs = torch.log_softmax(z, dim=-1)
    return (probs * torch.nan_to_num(log_probs, neginf=0.0)).sum(-1)  # neg_entropy = sum p log p


def propose(
    tokens: torch.Tensor, logits: torch.Tensor, gumbel: torch.Tensor | None, rule: CommitRule, mask_id: int
) -> Proposal:
    """Token and confidence per position, as the commit rule sees them.

    tokens: int64 [K, L] current states; logits: [K, L, V]; gumbel: float64 [K, L, V] (needed when T > 0; only
    its rows at masked positions are read). Decisions are computed at masked positions only: elsewhere the token
    is the current one and the confidence -inf.
    """
    if rule.temperature > 0.0 and gumbel is None:
        raise ValueError("temperature > 0 needs keyed Gumbel noise")
    where = (tokens == mask_id).nonzero(as_tuple=True)  # M masked (row, position) pairs
    z = _decision_logits(logits[where], mask_id)  # [M, V]
    score = z / rule.temperature + gumbel[where].to(z.device) if rule.temperature > 0.0 else z
    chosen = score.argmax(-1)  # [M]; the first maximum, i.e. the lowest token id, wins ties
    proposal_tokens = tokens.clone()
    proposal_tokens[where] = chosen
    confidence = torch.full(tokens.shape, float("-inf"), dtype=torch.float64, device=tokens.device)
    confidence[where] = _confidence(z, chosen, rule)
    return Proposal(tokens=proposal_tokens, confidence=confidence)


def _commit_counts(confidence: torch.Tensor, n_masked: torch.Tensor, rule: CommitRule) -> torch.Tensor:
    """How many of the most confident masked positions each row commits. -> int64 [K]"""
    if rule.kind == "one":
        wanted = torch.ones_like(n_masked)
    elif rule.kind == "threshold":
        wanted = (confidence >= rule.tau).sum(-1).clamp(min=1)
    else:  # dynamic
        above = (confidence > rule.tau).sum(-1)
        wanted = torch.where(above >= rule.k, above, torch.full_like(above, rule.k))
    return torch.minimum(wanted, n_masked)


def select_positions(confidence: torch.Tensor, rule: CommitRule) -> torch.Tensor:
    """Which masked positions commit. confidence float64 [K, L] (-inf = not masked) -> bool [K, L].

    Every rule commits a prefix of the positions sorted by confidence (ties: lowest position first), so one
    stable sort decides all of them.
    """
    masked = confidence > float("-inf")
    n_masked = masked.sum(-1)  # [K]
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices  # [K, L]
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    counts = _commit_counts(confidence, n_masked, rule)  # [K]
    return (ranks < counts[:, None]) & masked


def step(
    tokens: torch.Tensor, logits: torch.Tensor, gumbel: torch.Tensor | None, rule: CommitRule, mask_id: int
) -> StepResult:
    """Apply one pass of the commit rule to K block states.

    tokens: int64 [K, L]; logits: [K, L, V] (target output at those states); gumbel: float64 [K, L, V] or None.
    Rows without masked positions are returned unchanged.
    """
    proposal = propose(tokens, logits, gumbel, rule, mask_id)
    committed = select_positions(proposal.confidence, rule)
    next_tokens = torch.where(committed, proposal.tokens, tokens)
    return StepResult(tokens=next_tokens, committed=committed, proposal=proposal)
