"""Token survival: the fit, its file, the observations it is fitted on, and how it weighs draft-tree edges."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from draft_contexts import MASK, L, make_context, state_scorer
from spot_dlm import cli
from spot_dlm.api import GenerateConfig, make_drafter
from spot_dlm.decode import DecodeSettings, DraftContext, NoDrafter, decode_ids
from spot_dlm.drafters.children import one_commit_children
from spot_dlm.drafters.folder import default_drafter_dir
from spot_dlm.drafters.growth import grow_tree
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.token_survival import (
    SURVIVAL_FILE,
    SURVIVAL_RANKS,
    SurvivalBucket,
    TokenSurvival,
    fit_bucket,
    load_token_survival,
    save_token_survival,
    survival_log_probs,
)
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.noise import BlockNoise, NoiseKey
from spot_dlm.rules import CommitRule
from spot_dlm.train.token_survival import SurvivalObservations, fit_token_survival

torch.set_num_threads(1)

SURVIVAL = TokenSurvival(
    greedy=(SurvivalBucket(0.5, 0.05), SurvivalBucket(1.0, 0.1)),
    sampled=(SurvivalBucket(2.0, 0.2), SurvivalBucket(3.0, 0.3)),
)


def sample_commits(n: int, scale: float, outside: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic observations drawn from the model itself: sorted scores [n, R] and ranks [n] (R = outside)."""
    rng = np.random.default_rng(seed)
    scores = -np.sort(-rng.normal(0, 2, size=(n, SURVIVAL_RANKS)), axis=1)
    probs = np.exp(scores / scale - np.logaddexp.reduce(scores / scale, axis=1, keepdims=True))
    rank = np.array([rng.choice(SURVIVAL_RANKS, p=p) for p in probs])
    rank[rng.random(n) < outside] = SURVIVAL_RANKS
    return scores, rank


@pytest.mark.parametrize("scale,outside", [(0.3, 0.0), (0.7, 0.1), (2.0, 0.3)])
def test_fit_bucket_recovers_the_model_it_was_sampled_from(scale: float, outside: float) -> None:
    scores, rank = sample_commits(4000, scale, outside, seed=int(scale * 10))
    fitted = fit_bucket(scores, rank)
    assert fitted.scale == pytest.approx(scale, rel=0.12)
    assert fitted.outside == pytest.approx(max(outside, 1e-4), abs=0.025)


def test_fit_bucket_with_every_commit_outside_and_bad_shapes() -> None:
    assert fit_bucket(np.zeros((3, SURVIVAL_RANKS)), np.full(3, SURVIVAL_RANKS)).outside > 0.99
    with pytest.raises(ValueError, match="N >= 1"):
        fit_bucket(np.zeros((0, SURVIVAL_RANKS)), np.zeros(0, dtype=int))
    with pytest.raises(ValueError, match="N >= 1"):
        fit_bucket(np.zeros((3, SURVIVAL_RANKS)), np.zeros(2, dtype=int))


@pytest.mark.parametrize("seed", range(4))
def test_survival_log_probs_are_a_sub_distribution_best_guess_first(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(SURVIVAL_RANKS, 6, generator=generator, dtype=torch.float64).sort(0, descending=True).values
    scores[-1, 0] = float("-inf")  # a position with fewer finite guesses
    bucket = SurvivalBucket(scale=0.4 + seed, outside=0.1 * seed)
    probs = survival_log_probs(scores, bucket).exp()
    assert torch.allclose(probs.sum(0), torch.full((6,), 1 - bucket.outside, dtype=torch.float64))
    assert bool((probs[:-1] >= probs[1:]).all())
    assert probs[-1, 0] == 0


def test_buckets_by_temperature_kind_and_staleness() -> None:
    assert SURVIVAL.bucket(0.0, 1) == SurvivalBucket(0.5, 0.05)
    assert SURVIVAL.bucket(0.0, 7) == SurvivalBucket(1.0, 0.1)  # beyond the last bucket: the last
    assert SURVIVAL.bucket(0.7, 2) == SurvivalBucket(3.0, 0.3)
    assert SURVIVAL.bucket(1.5, 0) == SurvivalBucket(2.0, 0.2)


def test_file_round_trip(tmp_path: Path) -> None:
    assert load_token_survival(tmp_path) is None  # a drafter folder without a fit
    save_token_survival(SURVIVAL, tmp_path)
    assert load_token_survival(tmp_path) == SURVIVAL


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "{}",
        '{"greedy": [], "sampled": []}',
        '{"greedy": [{"scale": 0, "outside": 0}], "sampled": [{"scale": 1, "outside": 0}]}',
        '{"greedy": [{"scale": 1, "outside": 1}], "sampled": [{"scale": 1, "outside": 0}]}',
        '{"greedy": [{"scale": 1}], "sampled": [{"scale": 1, "outside": 0}]}',
    ],
)
def test_corrupt_survival_file_is_a_clear_error(tmp_path: Path, raw: str) -> None:
    (tmp_path / SURVIVAL_FILE).write_text(raw)
    with pytest.raises(ValueError, match="invalid .*token_survival.json"):
        load_token_survival(tmp_path)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_edges_carry_position_plus_token_survival(temperature: float) -> None:
    """A child's log-probability is its position's plus the fitted survival of its token."""
    context = make_context(temperature, seed=2, root_step=3)
    guesses = StaleGuesses(context)
    scorer = state_scorer(1)
    children = one_commit_children(scorer, 4, guesses, SURVIVAL)
    proposed = children(context.root[None], [context.root_step])
    position_logprob = scorer(context.root[None], [context.root_step])[0]
    token_logprob = SURVIVAL.log_probs(
        guesses.best_scores(context.root_step, torch.arange(L), SURVIVAL_RANKS), temperature, 1
    )
    assert len(proposed.node) == 4 and not proposed.rank.any()
    for value, rank, position in zip(proposed.logprob, proposed.rank, proposed.commit_position):
        expected = position_logprob[position] + token_logprob[rank, position]
        assert value == pytest.approx(float(expected), abs=1e-12)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_survival_moves_the_budget_to_branches_whose_tokens_hold(temperature: float, seed: int) -> None:
    """With a survival fit whose scale is tiny, a guess with a clear margin survives with certainty and a near-tie
    with about half: at budget 2 the single child is the position maximising q(position) * P(token)."""
    context = make_context(temperature, seed=seed, root_step=1)
    guesses = StaleGuesses(context)
    scorer = state_scorer(seed + 10)
    survival = TokenSurvival(greedy=(SurvivalBucket(1.0, 0.0),), sampled=(SurvivalBucket(1.0, 0.0),))
    tree = grow_tree(context, 2, 1, scorer, guesses, token_survival=survival)
    position_logprob = scorer(context.root[None], [1])[0]
    token_logprob = survival.log_probs(guesses.best_scores(1, torch.arange(L), SURVIVAL_RANKS), temperature, 1)[0]
    (position,) = torch.nonzero(tree.states[1] != context.root).flatten().tolist()
    assert position == int(torch.argmax(position_logprob + token_logprob))
    assert tree.states[1][position] == guesses.at(1).tokens[position]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_observations_rank_the_drafters_guess_first(make_target, temperature: float) -> None:
    """What the fit is trained on is what the tree bets on: at staleness 1 the committed token has rank 0 exactly
    when it equals the drafter's stale coupled guess for that step, and ranks count better-scored tokens."""
    target: BuiltinTarget = make_target()
    rule = CommitRule("one", temperature=temperature)
    settings = DecodeSettings(rule, block_length=6, gen_length=12, stop_at_eos=False)
    key = NoiseKey(4, 0)
    observations = SurvivalObservations(temperature=temperature, mask_id=target.mask_id, max_staleness=3)
    records = []

    def both(rec):
        records.append(rec)
        observe(rec)

    observe = observations.observer(key)
    prompt = torch.tensor([5, 6, 7, 8], dtype=torch.int64)
    decode_ids(target, prompt, settings, NoDrafter(), key, both)
    scores, rank = observations.arrays(1)
    assert len(rank) == sum(1 for a, b in zip(records, records[1:]) if a.block_index == b.block_index)
    assert set(observations.staleness) == {1, 2, 3}
    assert bool((np.diff(scores, axis=1) <= 0).all())
    agree = []
    for before, now in zip(records, records[1:]):
        if before.block_index != now.block_index:
            continue
        noise = BlockNoise(key, now.block_index, 6, target.vocab_size, torch.device("cpu"))
        context = DraftContext(
            now.state, before.state, before.logits, now.step_index, now.block_index, key, rule, MASK, noise
        )
        (position,) = ((now.state == MASK) & (now.next_state != MASK)).nonzero()[:, 0].tolist()
        agree.append(bool(StaleGuesses(context).at(now.step_index).tokens[position] == now.next_state[position]))
    assert agree == (rank == 0).tolist()
    assert 0 < sum(agree) < len(agree)  # the tiny target both keeps and changes guesses


def test_fit_token_survival_needs_every_staleness() -> None:
    empty = SurvivalObservations(temperature=0.0, mask_id=MASK)
    with pytest.raises(ValueError, match="no commits observed at staleness 1"):
        fit_token_survival(empty, empty)


def test_fit_on_a_real_decode_is_calibrated(make_target) -> None:
    """Fitted on the tiny target's own T = 1 decodes, the model's mean probability that the top guess survives one
    commit matches how often it did."""
    target: BuiltinTarget = make_target()
    rule = CommitRule("one", temperature=1.0)
    settings = DecodeSettings(rule, block_length=8, gen_length=32, stop_at_eos=False)
    observations = SurvivalObservations(temperature=1.0, mask_id=target.mask_id, max_staleness=1)
    for request in range(6):
        key = NoiseKey(0, request)
        prompt = torch.tensor([5 + request, 6, 7], dtype=torch.int64)
        decode_ids(target, prompt, settings, NoDrafter(), key, observations.observer(key))
    scores, rank = observations.arrays(1)
    fitted = fit_bucket(scores, rank)
    predicted = survival_log_probs(torch.from_numpy(scores).T, fitted)[0].exp().mean()
    assert len(rank) > 100
    assert float(predicted) == pytest.approx(observations.top_survival(1), abs=0.05)


def test_cli_fit_token_survival_writes_a_loadable_fit(capsys, long_checkpoint: Path, tmp_path: Path) -> None:
    args = ["fit-token-survival", "--model", str(long_checkpoint), "--out", str(tmp_path), "--n-prompts", "2"]
    code = cli.main([*args, "--block-length", "8", "--gen-length", "32"])
    out = capsys.readouterr().out
    assert code == 0
    survival = load_token_survival(tmp_path)
    assert len(survival.greedy) == len(survival.sampled) == 4
    assert "sampled          4" in out and str(tmp_path / SURVIVAL_FILE) in out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--temperature", "0"], "must be > 0"),
        (["--n-prompts", "0"], "must be >= 1"),
        (["--out", "/nonexistent/drafter"], "drafter folder not found"),
    ],
)
def test_cli_fit_token_survival_bad_input(capsys, tmp_path: Path, extra: list[str], message: str) -> None:
    code = cli.main(["fit-token-survival", "--out", str(tmp_path), *extra])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("with_file", [True, False])
@pytest.mark.parametrize("enabled", [True, False])
def test_spot_drafter_reads_the_fit_beside_the_order_model(make_target, tmp_path: Path, with_file, enabled) -> None:
    folder = tmp_path / "drafter"
    folder.mkdir()
    for name in ("drafter.safetensors", "drafter_config.json"):
        (folder / name).write_bytes((default_drafter_dir() / name).read_bytes())
    if with_file:
        save_token_survival(SURVIVAL, folder)
    config = GenerateConfig(method="spot", drafter=str(folder), token_survival=enabled)
    drafter = make_drafter(config, make_target())
    assert drafter.token_survival == (SURVIVAL if with_file and enabled else None)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_best_scores_are_the_coupled_scores_of_the_ranked_guesses(temperature: float, seed: int) -> None:
    """best_scores at any subset of positions, in any order, are the scores ``Z / T + gumbel`` of the guesses that
    ``ranked`` returns there, best first (rank 0 = the drafter's guess)."""
    context = make_context(temperature, seed=seed, root_step=2)
    guesses = StaleGuesses(context)
    positions = torch.tensor([5, 0, 3, 5])
    z = context.stale_logits.to(torch.float64).clone()
    z[:, MASK] = float("-inf")
    if temperature > 0:
        z = z / temperature + context.gumbel(2)
    tokens = guesses.ranked(2, 3)[0]  # [3, L]
    expected = torch.stack([z[p, tokens[:, p]] for p in positions.tolist()], dim=1)  # [3, P]
    assert torch.equal(guesses.best_scores(2, positions, 3), expected)
