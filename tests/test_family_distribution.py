"""At T > 0 each family's rule, fed keyed Gumbel noise, samples the distribution its authors' sampler draws from.

The authors draw with torch's global RNG (``multinomial``, ``Categorical``, Gumbel-max with ``rand_like``); no loop can
follow those sample paths, so the claim is one of distribution. Expected probabilities are computed here by a plain
formula (temper, filter as the family filters, softmax) and compared by chi-square with what the rule commits over
many noise keys: one masked position (its token distribution), and two masked positions with one commit (which
position and token: the confidence of the drawn token decides, so the enumeration sums over joint draws).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy import stats

from spot_dlm.family_rules import DreamRule, FastDllmV2Rule, LladaRule, SdarRule
from spot_dlm.noise import NoiseKey

MASK, VOCAB, N_SAMPLES = 5, 6, 3000
LOGITS = torch.tensor([[1.2, 0.3, -0.4, 0.9, 0.0, 0.0], [0.1, 1.5, 0.2, -0.3, 0.6, 0.0]])  # [2, V]; 5 is the mask


def _filtered_probs(z: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, order="kp") -> list:
    """The authors' sampling distribution for one position: logits / T, top-k and top-p in the family's order."""
    z = z.double() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)

    def by_k(keep):
        if top_k:
            keep = keep & (z >= torch.sort(z[keep], descending=True).values[min(top_k, int(keep.sum())) - 1])
        return keep

    def by_p(keep):
        if top_p < 1.0:
            ordered = torch.sort(torch.where(keep, z, -torch.inf), descending=True)
            probs = torch.softmax(ordered.values, -1)
            above = (probs.cumsum(-1) - probs) < top_p  # the token that crosses p is kept
            keep = keep & torch.zeros_like(keep).scatter(0, ordered.indices, above)
        return keep

    keep = by_p(by_k(keep)) if order == "kp" else by_k(by_p(keep))
    return torch.softmax(torch.where(keep, z, -torch.inf), -1).tolist()


def _chisquare(counts: Counter, probs: dict) -> float:
    """The chi-square p-value of the counts under probs; 0 when something was drawn outside their support."""
    support = [key for key, p in probs.items() if p > 0]
    if not set(counts) <= set(support):
        return 0.0
    observed = [counts.get(key, 0) for key in support]
    expected = [probs[key] * sum(observed) for key in support]
    return float(stats.chisquare(observed, expected).pvalue)


def _draws(rule, tokens: torch.Tensor, logits: torch.Tensor, step: int = 0) -> Counter:
    """What the rule commits over N_SAMPLES noise keys: Counter of (position, token)."""
    counts = Counter()
    positions = torch.arange(tokens.shape[-1])
    for request in range(N_SAMPLES):
        gumbel = NoiseKey(11, request).gumbel(0, step, positions, VOCAB)[None]  # [1, L, V]
        result = rule.step(tokens, logits[None], gumbel, (step,))
        (position,) = result.committed[0].nonzero()[:, 0].tolist()
        counts[(position, int(result.tokens[0, position]))] += 1
    return counts


RULES = [
    ("sdar", SdarRule(MASK, (1, 1), temperature=0.7, top_k=3, top_p=0.8), {"top_k": 3, "top_p": 0.8, "order": "kp"}),
    ("llada", LladaRule(MASK, (1, 1), temperature=0.7), {}),
    (
        "dream",
        DreamRule(MASK, steps=2, temperature=0.7, top_k=4, top_p=0.9),
        {"top_k": 4, "top_p": 0.9, "order": "pk"},
    ),
    ("fast_dllm_v2", FastDllmV2Rule(MASK, temperature=0.7, top_p=0.9), {"top_p": 0.9}),
]


@pytest.mark.parametrize(("name", "rule", "filters"), RULES, ids=[r[0] for r in RULES])
def test_one_masked_position_draws_the_familys_distribution(name: str, rule, filters: dict) -> None:
    tokens = torch.tensor([[MASK, 1]])
    step = 1 if name == "dream" else 0  # Dream's first pass of two commits nothing; its last commits all
    counts = _draws(rule, tokens, LOGITS, step)
    probs = _filtered_probs(LOGITS[0], 0.7, **filters)
    assert _chisquare(counts, {(0, t): p for t, p in enumerate(probs)}) > 1e-3
    twice = _filtered_probs(LOGITS[0], 0.7**2, **filters)  # power: tempered twice is told apart
    assert _chisquare(counts, {(0, t): p for t, p in enumerate(twice)}) < 1e-3


def _joint(probs: list[list[float]], confidence) -> dict:
    """P(commit position j with token t) when each masked position draws independently and the most confident
    drawn token commits (ties: the lower position). confidence(j, t) -> float"""
    out: dict = {}
    for t0, t1 in itertools.product(range(VOCAB), repeat=2):
        p = probs[0][t0] * probs[1][t1]
        if p == 0:
            continue
        j = 0 if confidence(0, t0) >= confidence(1, t1) else 1
        key = (j, (t0, t1)[j])
        out[key] = out.get(key, 0.0) + p
    return out


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_the_committed_position_follows_the_drawn_tokens_confidence(family: str) -> None:
    tokens = torch.tensor([[MASK, MASK]])
    rule = SdarRule(MASK, (1, 1), temperature=1.3) if family == "sdar" else LladaRule(MASK, (1, 1), temperature=1.3)
    scale = 1.3 if family == "sdar" else 1.0  # SDAR: softmax(logits / T) at the token; LLaDA: untempered
    confidence = [torch.softmax(LOGITS[j] / scale, -1).tolist() for j in range(2)]
    probs = [_filtered_probs(LOGITS[j], 1.3) for j in range(2)]
    expected = _joint(probs, lambda j, t: confidence[j][t])
    assert _chisquare(_draws(rule, tokens, LOGITS), expected) > 1e-3
    wrong = _joint(probs, lambda j, t: -confidence[j][t])  # power: the least confident commits instead
    assert _chisquare(_draws(rule, tokens, LOGITS), wrong) < 1e-3
