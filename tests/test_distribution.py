"""Standard decoding with keyed noise samples the exact distribution of the sampler it implements (DESIGN.md §7).

A fake target gives fixed pseudo-random logits for every block state (vocabulary: 3 real tokens + the mask, block of
3). The exact distribution over final blocks of one-commit decoding is computed by enumeration: at a state, every
masked position j draws token t_j ~ softmax(z_j / T) independently (Gumbel-max with fresh noise per pass), and the
committed position is the masked position with the largest confidence softmax(z_j)[t_j] (ties: lowest position).
Since the committed position depends on the tokens drawn at all masked positions jointly, the transition
probabilities sum over every joint outcome.
"""

from __future__ import annotations

import itertools
from collections import Counter
from functools import cache

import pytest
import torch
from scipy import stats

import spot_dlm.decode as decode_module
from spot_dlm.decode import DecodeSettings, NoDrafter, decode_ids
from spot_dlm.models.base import PassCounter, ScoreResult
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule

REAL = (0, 1, 2)
MASK_ID = 3
VOCAB = 4
LENGTH = 3
N_SAMPLES = 3000

State = tuple[int, ...]


def state_logits(state: State) -> torch.Tensor:
    """Fixed pseudo-random logits [L, V] for one block state (seeded by the state's base-V code)."""
    code = sum(tok * VOCAB**i for i, tok in enumerate(state))
    generator = torch.Generator().manual_seed(1000 + code)
    return torch.randn(LENGTH, VOCAB, dtype=torch.float64, generator=generator)


class TableTarget:
    """A Target whose logits are a deterministic function of each candidate state (the prefix is ignored)."""

    name = "table"
    vocab_size = VOCAB
    mask_id = MASK_ID
    eos_id = 0
    max_length = 64
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.counter = PassCounter()

    def prefill(self, prompt_ids: torch.Tensor) -> object:
        self.counter.record(prompt_ids.numel())
        return "cache"

    def score(self, cache: object, blocks: torch.Tensor, finished: torch.Tensor | None = None) -> ScoreResult:
        self.counter.record(blocks.numel() + (0 if finished is None else finished.numel()))
        logits = torch.stack([state_logits(tuple(row.tolist())) for row in blocks])
        return ScoreResult(logits=logits, cache=cache)

    def write(self, cache: object, finished: torch.Tensor) -> object:
        self.counter.record(finished.numel())
        return cache


def real_softmax(logits: torch.Tensor, temperature: float) -> list[float]:
    """softmax over the real tokens of one position's logits [V]."""
    return torch.softmax(logits[list(REAL)] / temperature, dim=-1).tolist()


def exact_distribution(sample_temperature: float, confidence_from_sample: bool = True) -> dict[State, float]:
    """Distribution over final blocks of one-commit decoding from the all-mask block, by enumeration.

    ``confidence_from_sample=False`` gives a deliberately wrong sampler (the position is chosen by each position's
    top probability, ignoring which token was drawn) for the power check.
    """

    @cache
    def finals(state: State) -> tuple[tuple[State, float], ...]:
        masked = [j for j, tok in enumerate(state) if tok == MASK_ID]
        if not masked:
            return ((state, 1.0),)
        z = state_logits(state)
        sample_probs = {j: real_softmax(z[j], sample_temperature) for j in masked}
        conf_probs = {j: real_softmax(z[j], 1.0) for j in masked}
        out: Counter = Counter()
        for combo in itertools.product(range(len(REAL)), repeat=len(masked)):
            prob = 1.0
            for j, t in zip(masked, combo):
                prob *= sample_probs[j][t]
            if confidence_from_sample:
                confs = [conf_probs[j][t] for j, t in zip(masked, combo)]
            else:
                confs = [max(conf_probs[j]) for j in masked]
            best = confs.index(max(confs))  # first maximum = lowest position
            position, token = masked[best], REAL[combo[best]]
            nxt = list(state)
            nxt[position] = token
            for final, p in finals(tuple(nxt)):
                out[final] += prob * p
        return tuple(out.items())

    return dict(finals((MASK_ID,) * LENGTH))


def sample_finals(temperature: float, n_samples: int) -> Counter:
    target = TableTarget()
    settings = DecodeSettings(CommitRule(temperature=temperature), LENGTH, LENGTH, stop_at_eos=False)
    drafter = NoDrafter()
    prompt = torch.tensor([0])
    counts: Counter = Counter()
    for seed in range(n_samples):
        raw = decode_ids(target, prompt, settings, drafter, NoiseKey(seed=seed, request=0))
        counts[tuple(raw.token_ids.tolist())] += 1
    return counts


def chisquare_pvalue(counts: Counter, probs: dict[State, float]) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are merged into one."""
    n = sum(counts.values())
    assert set(counts) <= {s for s, p in probs.items() if p > 0}, "a sampled block has probability 0"
    observed, expected = [], []
    rest_obs, rest_exp = 0.0, 0.0
    for state, p in sorted(probs.items()):
        if n * p >= 5:
            observed.append(counts.get(state, 0))
            expected.append(n * p)
        else:
            rest_obs += counts.get(state, 0)
            rest_exp += n * p
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    assert len(observed) >= 5
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def samples_t1() -> Counter:
    return sample_finals(1.0, N_SAMPLES)


def test_exact_distribution_is_a_distribution() -> None:
    for temperature in (1.0, 0.5):
        probs = exact_distribution(temperature)
        assert sum(probs.values()) == pytest.approx(1.0, abs=1e-12)
        assert all(MASK_ID not in state for state in probs)
        assert len(probs) == len(REAL) ** LENGTH


def test_standard_decoding_matches_exact_distribution(samples_t1: Counter) -> None:
    assert sum(samples_t1.values()) == N_SAMPLES
    pvalue = chisquare_pvalue(samples_t1, exact_distribution(1.0))
    assert pvalue > 1e-3, pvalue


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param({"sample_temperature": 0.5}, id="wrong-temperature"),
        pytest.param({"sample_temperature": 1.0, "confidence_from_sample": False}, id="position-ignores-sample"),
    ],
)
def test_chisquare_has_power_against_wrong_distributions(samples_t1: Counter, wrong: dict) -> None:
    pvalue = chisquare_pvalue(samples_t1, exact_distribution(**wrong))
    assert pvalue < 1e-3, pvalue


def test_chisquare_detects_noise_reused_across_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN.md §2: re-using one noise tensor for every pass of a block is not a correct sampler; the test sees it."""
    fresh_noise = decode_module.step_noise

    def reused_noise(block_noise, steps, rule, states, mask_id):
        return fresh_noise(block_noise, tuple(0 for _ in steps), rule, states, mask_id)

    monkeypatch.setattr(decode_module, "step_noise", reused_noise)
    pvalue = chisquare_pvalue(sample_finals(1.0, 500), exact_distribution(1.0))
    assert pvalue < 1e-3, pvalue


def test_temperature_zero_follows_the_greedy_path() -> None:
    state = [MASK_ID] * LENGTH
    while MASK_ID in state:
        z = state_logits(tuple(state))
        masked = [j for j, tok in enumerate(state) if tok == MASK_ID]
        confs = [max(real_softmax(z[j], 1.0)) for j in masked]
        position = masked[confs.index(max(confs))]
        probs = real_softmax(z[position], 1.0)
        state[position] = REAL[probs.index(max(probs))]
    assert sample_finals(0.0, 3) == Counter({tuple(state): 3})
