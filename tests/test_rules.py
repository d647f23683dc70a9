"""The commit rule ``step`` on hand-built logits, and seed-looped property tests."""

from __future__ import annotations

import math

import pytest
import torch

from spot_dlm.rules import CommitRule, propose, select_positions, step

MASK = 2  # the mask id sits inside the vocabulary, as in the real tokenizer
NEG = -1e9  # "impossible" logit for hand-built rows


def logits_row(*values: float) -> list[float]:
    return list(values)


def t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def masked_block(length: int, filled: dict[int, int] | None = None) -> torch.Tensor:
    block = torch.full((length,), MASK, dtype=torch.int64)
    for pos, tok in (filled or {}).items():
        block[pos] = tok
    return block


def two_token_logits(p: float) -> list[float]:
    """Logits over [0, 1, MASK, 3] whose real-token distribution is (p, 1 - p, 0, 0)."""
    return [math.log(p), math.log(1 - p), 0.0, NEG]


# --------------------------------------------------------------------------------------------- T = 0, ties, mask


def test_t0_commits_argmax_token_at_most_confident_position() -> None:
    tokens = masked_block(3)[None]
    logits = t([[[0.0, 1.0, 0.0, 0.5], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]]])
    result = step(tokens, logits, None, CommitRule(), MASK)
    assert result.proposal.tokens[0].tolist() == [1, 0, 3]
    # position 1 has the most peaked distribution (3 vs 0, 0 over the real tokens 0, 1, 3)
    assert result.committed[0].tolist() == [False, True, False]
    assert result.tokens[0].tolist() == [MASK, 0, MASK]


def test_token_tie_breaks_to_lowest_id() -> None:
    tokens = masked_block(1)[None]
    logits = t([[[0.0, 5.0, 0.0, 5.0, 5.0]]])
    assert step(tokens, logits, None, CommitRule(), MASK).tokens[0].tolist() == [1]
    # the same holds for Gumbel-max when the perturbed scores tie
    zero_noise = torch.zeros(1, 1, 5, dtype=torch.float64)
    assert step(tokens, logits, zero_noise, CommitRule(temperature=0.7), MASK).tokens[0].tolist() == [1]


def test_confidence_tie_breaks_to_lowest_masked_position() -> None:
    tokens = masked_block(4, {0: 1})[None]
    same = [0.0, 2.0, 0.0, 1.0]
    logits = t([[[9.0, 0.0, 0.0, 0.0], same, [0.0, 1.0, 0.0, 0.0], same]])
    result = step(tokens, logits, None, CommitRule(), MASK)
    assert result.committed[0].tolist() == [False, True, False, False]
    # tie between the two most confident of three, two to commit: the two lowest tied positions win
    tokens = masked_block(3)[None]
    logits = t([[same, same, same]])
    result = step(tokens, logits, None, CommitRule(kind="dynamic", k=2, tau=1.0), MASK)
    assert result.committed[0].tolist() == [True, True, False]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mask_token_never_chosen(temperature: float) -> None:
    tokens = masked_block(2)[None]
    logits = t([[[0.0, 1.0, 100.0, 0.5], [0.2, 0.1, 50.0, 0.0]]])
    noise = torch.zeros(1, 2, 4, dtype=torch.float64)
    noise[..., MASK] = 1000.0  # even huge noise on the mask entry cannot select it
    result = step(tokens, logits, noise if temperature else None, CommitRule(temperature=temperature), MASK)
    assert MASK not in result.proposal.tokens.flatten().tolist()
    assert result.tokens[result.committed].ne(MASK).all()
    # confidence is a probability over the real tokens only
    expected = torch.softmax(t([0.0, 1.0, 0.5]), -1).max().item()
    assert result.proposal.confidence[0, 0].item() == pytest.approx(expected, rel=1e-12)


def test_one_masked_position_is_the_one_committed() -> None:
    tokens = torch.tensor([[0, 1, MASK, 3]])
    logits = torch.randn(1, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits[0, :, 0] = 50.0  # unmasked positions would be far more confident, but they are not candidates
    logits[0, 2] = t([0.1, 0.3, 0.0, 0.2, 0.25])
    result = step(tokens, logits, None, CommitRule(), MASK)
    assert result.committed[0].tolist() == [False, False, True, False]
    assert result.tokens[0].tolist() == [0, 1, 1, 3]


def test_all_masked_commits_exactly_one_with_one_rule() -> None:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.full((3, 6), MASK)
    logits = torch.randn(3, 6, 7, dtype=torch.float64, generator=generator)
    result = step(tokens, logits, None, CommitRule(), MASK)
    assert result.committed.sum(-1).tolist() == [1, 1, 1]
    conf = result.proposal.confidence
    assert torch.equal(result.committed.float().argmax(-1), conf.argmax(-1))


def test_row_without_masks_is_unchanged() -> None:
    tokens = torch.tensor([[0, 1, 3], [MASK, MASK, 0]])
    logits = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for rule in (CommitRule(), CommitRule(kind="threshold", tau=0.0), CommitRule(kind="dynamic", k=3, tau=1.0)):
        result = step(tokens, logits, None, rule, MASK)
        assert not result.committed[0].any()
        assert result.tokens[0].tolist() == [0, 1, 3]
        assert result.committed[1].any()
        assert torch.isneginf(result.proposal.confidence[0]).all()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_gumbel_max_with_given_noise(temperature: float) -> None:
    for seed in range(5):
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.full((2, 4), MASK)
        logits = torch.randn(2, 4, 6, dtype=torch.float64, generator=generator) * 3
        noise = -torch.log(-torch.log(torch.rand(2, 4, 6, dtype=torch.float64, generator=generator)))
        result = step(tokens, logits.clone(), noise, CommitRule(temperature=temperature), MASK)
        scores = logits / temperature + noise
        scores[..., MASK] = float("-inf")
        assert torch.equal(result.proposal.tokens, scores.argmax(-1))
        committed_tokens = result.tokens[result.committed]
        assert torch.equal(committed_tokens, scores.argmax(-1)[result.committed])


def test_temperature_without_noise_raises() -> None:
    with pytest.raises(ValueError, match="noise"):
        step(masked_block(2)[None], torch.zeros(1, 2, 4), None, CommitRule(temperature=1.0), MASK)


def test_decisions_are_float64_for_low_precision_logits() -> None:
    logits = torch.randn(1, 3, 5, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    result = step(masked_block(3)[None], logits, None, CommitRule(), MASK)
    assert result.proposal.confidence.dtype == torch.float64
    assert result.tokens.dtype == torch.int64


# --------------------------------------------------------------------------------------------- threshold / dynamic


def confidences_of(probs: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-masked block whose position j has confidence max(p_j, 1 - p_j); returns (tokens, logits)."""
    tokens = masked_block(len(probs))[None]
    logits = t([[two_token_logits(p) for p in probs]])
    return tokens, logits


def test_threshold_commits_top_one_plus_all_at_or_above_tau() -> None:
    tokens, logits = confidences_of([0.6, 0.95, 0.97, 0.3, 0.91])
    result = step(tokens, logits, None, CommitRule(kind="threshold", tau=0.9), MASK)
    # confidences: 0.6, 0.95, 0.97, 0.7, 0.91
    assert result.committed[0].tolist() == [False, True, True, False, True]
    assert result.tokens[0].tolist() == [MASK, 0, 0, MASK, 0]


def test_threshold_includes_confidence_exactly_tau() -> None:
    tokens, logits = confidences_of([0.6, 0.8, 0.99])
    conf = propose(tokens, logits, None, CommitRule(), MASK).confidence[0]
    tau = conf[1].item()  # exactly the confidence of position 1
    result = step(tokens, logits, None, CommitRule(kind="threshold", tau=tau), MASK)
    assert result.committed[0].tolist() == [False, True, True]
    above = step(tokens, logits, None, CommitRule(kind="threshold", tau=math.nextafter(tau, 2.0)), MASK)
    assert above.committed[0].tolist() == [False, False, True]


def test_threshold_with_nothing_above_tau_commits_the_top_one() -> None:
    tokens, logits = confidences_of([0.6, 0.3, 0.75, 0.5])  # confidences 0.6, 0.7, 0.75, 0.5
    result = step(tokens, logits, None, CommitRule(kind="threshold", tau=0.99), MASK)
    assert result.committed[0].tolist() == [False, False, True, False]
    tokens, logits = confidences_of([0.6, 0.2, 0.75, 0.5])  # confidences 0.6, 0.8, 0.75, 0.5
    result = step(tokens, logits, None, CommitRule(kind="threshold", tau=0.99), MASK)
    assert result.committed[0].tolist() == [False, True, False, False]
    assert result.tokens[0].tolist() == [MASK, 1, MASK, MASK]


def test_dynamic_rule_commits_all_strictly_above_tau_when_at_least_k() -> None:
    tokens, logits = confidences_of([0.95, 0.6, 0.97, 0.92, 0.7])  # 0.95, 0.6, 0.97, 0.92, 0.7
    result = step(tokens, logits, None, CommitRule(kind="dynamic", tau=0.9, k=2), MASK)
    assert result.committed[0].tolist() == [True, False, True, True, False]


def test_dynamic_rule_falls_back_to_top_k() -> None:
    tokens, logits = confidences_of([0.95, 0.6, 0.85, 0.55, 0.7])  # 0.95, 0.6, 0.85, 0.55, 0.7
    result = step(tokens, logits, None, CommitRule(kind="dynamic", tau=0.9, k=2), MASK)
    assert result.committed[0].tolist() == [True, False, True, False, False]
    result = step(tokens, logits, None, CommitRule(kind="dynamic", tau=0.9, k=9), MASK)
    assert result.committed[0].all()  # k larger than the masked count: everything masked


def test_dynamic_rule_is_strict_at_tau() -> None:
    tokens, logits = confidences_of([0.95, 0.8, 0.85])
    conf = propose(tokens, logits, None, CommitRule(), MASK).confidence[0]
    tau = conf[2].item()  # 0.85: only position 0 is strictly above, so the top-2 fallback applies
    result = step(tokens, logits, None, CommitRule(kind="dynamic", tau=tau, k=2), MASK)
    assert result.committed[0].tolist() == [True, False, True]
    tau = conf[1].item()  # 0.8: positions 0 and 2 are strictly above (2 >= k)
    result = step(tokens, logits, None, CommitRule(kind="dynamic", tau=tau, k=2), MASK)
    assert result.committed[0].tolist() == [True, False, True]
    result = step(tokens, logits, None, CommitRule(kind="dynamic", tau=math.nextafter(tau, 0.0), k=2), MASK)
    assert result.committed[0].tolist() == [True, True, True]


def test_dynamic_rule_without_confident_positions_commits_the_k_most_confident() -> None:
    tokens, logits = confidences_of([0.6, 0.95, 0.7, 0.85])
    tokens[0, 1] = 0  # position 1 is already filled: it cannot be committed again
    result = step(tokens, logits, None, CommitRule(kind="dynamic", k=2, tau=1.0), MASK)
    assert result.committed[0].tolist() == [False, False, True, True]
    result = step(tokens, logits, None, CommitRule(kind="dynamic", k=5, tau=1.0), MASK)
    assert result.committed[0].tolist() == [True, False, True, True]


# --------------------------------------------------------------------------------------------- confidence kinds


def hand_softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def test_confidence_kinds_match_hand_computation() -> None:
    row = [0.5, -1.0, 7.0, 2.0, 0.25]  # index 2 is the mask
    noise_row = [0.1, 6.0, 0.0, -0.3, 0.4]  # makes the sampled token (1) differ from the argmax (3)
    real = [0, 1, 3, 4]
    probs = hand_softmax([row[i] for i in real])  # over the real tokens
    tokens = masked_block(1)[None]
    logits = t([[row]])
    noise = t([[noise_row]])

    prob = propose(tokens, logits, None, CommitRule(confidence="prob"), MASK)
    assert prob.tokens.item() == 3
    assert prob.confidence.item() == pytest.approx(max(probs), rel=1e-12)

    temperature = 0.5
    chosen = max(real, key=lambda v: row[v] / temperature + noise_row[v])
    tempered_probs = hand_softmax([row[i] / temperature for i in real])
    rule = CommitRule(temperature=temperature, confidence="tempered")
    tempered = propose(tokens, logits, noise, rule, MASK)
    assert chosen == 1
    assert tempered.tokens.item() == chosen
    assert tempered.confidence.item() == pytest.approx(tempered_probs[real.index(chosen)], rel=1e-12)
    # "prob" confidence of a sampled token uses the untempered distribution
    sampled_prob = propose(tokens, logits, noise, CommitRule(temperature=temperature), MASK)
    assert sampled_prob.confidence.item() == pytest.approx(probs[real.index(chosen)], rel=1e-12)

    top1, top2 = sorted(probs, reverse=True)[:2]
    margin = propose(tokens, logits, None, CommitRule(confidence="margin"), MASK)
    assert margin.confidence.item() == pytest.approx(top1 - top2, rel=1e-12)

    neg_entropy = propose(tokens, logits, None, CommitRule(confidence="neg_entropy"), MASK)
    assert neg_entropy.confidence.item() == pytest.approx(sum(p * math.log(p) for p in probs), rel=1e-12)


def test_tempered_confidence_at_t0_is_prob() -> None:
    tokens = masked_block(3)[None]
    logits = torch.randn(1, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    a = propose(tokens, logits, None, CommitRule(confidence="tempered"), MASK).confidence
    b = propose(tokens, logits, None, CommitRule(confidence="prob"), MASK).confidence
    assert torch.equal(a, b)


def test_neg_entropy_prefers_the_peaked_position() -> None:
    tokens = masked_block(2)[None]
    logits = t([[[1.0, 1.0, 0.0, 1.0], [4.0, 0.0, 0.0, 0.0]]])
    result = step(tokens, logits, None, CommitRule(confidence="neg_entropy"), MASK)
    assert result.committed[0].tolist() == [False, True]


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"kind": "greedy"}, "unknown commit rule"),
        ({"confidence": "entropy"}, "unknown confidence"),
        ({"k": 0}, "k"),
        ({"kind": "dynamic", "k": -1}, "k"),
        ({"kind": "threshold", "tau": 1.5}, "tau"),
        ({"kind": "dynamic", "tau": -0.1}, "tau"),
    ],
)
def test_commit_rule_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CommitRule(**kwargs)


def test_commit_rule_needs_noise_only_when_sampling() -> None:
    assert not CommitRule().needs_noise
    assert CommitRule(temperature=0.1).needs_noise


# --------------------------------------------------------------------------------------------- purity


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_step_does_not_modify_its_inputs(dtype: torch.dtype) -> None:
    """``step`` is documented as a pure function: the caller's logits (and tokens, noise) must be left intact."""
    generator = torch.Generator().manual_seed(5)
    tokens = torch.full((2, 3), MASK)
    logits = torch.randn(2, 3, 5, generator=generator).to(dtype)
    noise = torch.randn(2, 3, 5, dtype=torch.float64, generator=generator)
    logits_before, tokens_before, noise_before = logits.clone(), tokens.clone(), noise.clone()
    step(tokens, logits, noise, CommitRule(temperature=1.0), MASK)
    assert torch.equal(tokens, tokens_before)
    assert torch.equal(noise, noise_before)
    assert torch.equal(logits, logits_before)


# --------------------------------------------------------------------------------------------- properties


RULES = [
    CommitRule(),
    CommitRule(temperature=1.0),
    CommitRule(kind="dynamic", k=2, tau=1.0, temperature=0.5),  # nothing above tau: the two most confident
    CommitRule(kind="threshold", tau=0.5),
    CommitRule(kind="threshold", tau=0.3, temperature=1.5, confidence="margin"),
    CommitRule(kind="dynamic", tau=0.4, k=2, confidence="tempered", temperature=0.7),
    CommitRule(kind="one", confidence="neg_entropy", temperature=1.0),
]


def random_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    n_rows = int(torch.randint(1, 6, (1,), generator=generator))
    length = int(torch.randint(1, 7, (1,), generator=generator))
    vocab = int(torch.randint(3, 9, (1,), generator=generator))
    tokens = torch.randint(0, vocab, (n_rows, length), generator=generator)
    tokens[tokens == MASK] = 0
    masked = torch.rand(n_rows, length, generator=generator) < 0.6
    tokens[masked] = MASK
    logits = torch.randn(n_rows, length, vocab, dtype=torch.float64, generator=generator) * 2
    if seed % 3 == 0:  # many exact ties in logits and confidences
        logits = logits.round()
    noise = -torch.log(-torch.log(torch.rand(n_rows, length, vocab, dtype=torch.float64, generator=generator)))
    return tokens, logits, noise


def test_property_commits_only_masked_positions_and_at_least_one() -> None:
    for seed in range(60):
        tokens, logits, noise = random_case(seed)
        masked = tokens == MASK
        for rule in RULES:
            result = step(tokens, logits.clone(), noise, rule, MASK)
            assert not (result.committed & ~masked).any(), (seed, rule)
            assert torch.equal(result.tokens[~result.committed], tokens[~result.committed])
            assert result.tokens[result.committed].ne(MASK).all()
            counts = result.committed.sum(-1)
            assert torch.equal(counts >= 1, masked.any(-1)), (seed, rule)
            if rule.kind == "one":
                assert torch.equal(counts, masked.any(-1).long())
            if rule.kind == "dynamic" and rule.tau == 1.0:
                assert torch.equal(counts, masked.sum(-1).clamp(max=rule.k))


def test_property_committed_positions_are_the_most_confident() -> None:
    """Committed = the first n masked positions ordered by (confidence descending, position ascending)."""
    ties_seen = 0
    for seed in range(40):
        tokens, logits, noise = random_case(seed)
        for rule in RULES:
            result = step(tokens, logits.clone(), noise, rule, MASK)
            conf = result.proposal.confidence
            for row in range(tokens.shape[0]):
                masked = [j for j in range(tokens.shape[1]) if tokens[row, j] == MASK]
                ranked = sorted(masked, key=lambda j, row=row: (-conf[row, j].item(), j))
                n_committed = int(result.committed[row].sum())
                expected = sorted(ranked[:n_committed])
                assert result.committed[row].nonzero().flatten().tolist() == expected, (seed, rule, row)
                values = [conf[row, j].item() for j in masked]
                ties_seen += len(values) - len(set(values))
    assert ties_seen > 0  # the rounded-logit cases exercise the position tie-break


def test_property_rows_are_independent() -> None:
    for seed in range(40):
        tokens, logits, noise = random_case(seed)
        for rule in RULES:
            together = step(tokens, logits.clone(), noise, rule, MASK)
            for row in range(tokens.shape[0]):
                alone = step(tokens[row : row + 1], logits[row : row + 1].clone(), noise[row : row + 1], rule, MASK)
                assert torch.equal(alone.tokens[0], together.tokens[row]), (seed, rule, row)
                assert torch.equal(alone.committed[0], together.committed[row])


def test_select_positions_directly() -> None:
    inf = float("-inf")
    conf = t([[0.2, inf, 0.9, 0.9], [inf, inf, inf, inf]])
    assert select_positions(conf, CommitRule()).tolist() == [[False, False, True, False], [False] * 4]
    assert select_positions(conf, CommitRule(kind="dynamic", k=3, tau=1.0)).tolist() == [
        [True, False, True, True],
        [False] * 4,
    ]
