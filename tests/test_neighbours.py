"""Neighbour-aware token guesses: the bigram table, its file, the correction, how trees and fits use it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from draft_contexts import MASK, ROOT_COMMIT, V, make_context, random_order_model
from neighbour_fits import SURVIVAL, copy_order_model, observations_at_weight_zero_are_the_stale_ranks
from spot_dlm import cli
from spot_dlm.api import GenerateConfig, generate, load_target, make_drafter
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.neighbours import (
    BIGRAM_FILE,
    NEIGHBOUR_FIT_FILE,
    BigramTable,
    NeighbourTokens,
    fresh_neighbours,
    load_bigram,
    load_neighbour_fit,
    save_bigram,
    save_neighbour_fit,
)
from spot_dlm.drafters.sets import SetsDrafter
from spot_dlm.drafters.spot import SpotDrafter
from spot_dlm.drafters.token_survival import load_token_survival
from spot_dlm.train.token_survival import SurvivalObservations, fit_neighbour_survival, fit_neighbour_weight

torch.set_num_threads(1)


def random_stream(vocab: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.mark.parametrize("seed", range(3))
def test_table_counts_and_pmi_match_a_dense_computation(seed: int) -> None:
    vocab = 7
    stream = random_stream(vocab, 300, seed) ** 2 % vocab  # skewed
    table = BigramTable.from_stream(stream, vocab, smoothing=0.5)
    dense = np.zeros((vocab, vocab))
    for (a, b), n in Counter(zip(stream[:-1].tolist(), stream[1:].tolist())).items():
        dense[a, b] = n
    a, b = np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij")
    assert np.array_equal(table.count(a, b), dense)
    smoothed = dense + 0.5
    joint = smoothed / smoothed.sum()
    expected = np.log(joint) - np.log(joint.sum(1, keepdims=True)) - np.log(joint.sum(0, keepdims=True))
    assert np.allclose(table.pmi(a, b), expected)


def test_table_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least two tokens"):
        BigramTable.from_stream(np.array([1]), 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        BigramTable.from_stream(np.array([1, 4]), 4)


def test_file_round_trip_and_clear_errors(tmp_path: Path) -> None:
    table = BigramTable.from_stream(random_stream(11, 500, 0), 11)
    assert load_bigram(tmp_path) is None
    save_bigram(table, tmp_path, {"corpus": "test"})
    loaded = load_bigram(tmp_path, vocab_size=11)
    assert np.array_equal(loaded.keys, table.keys) and np.array_equal(loaded.counts, table.counts)
    assert np.array_equal(loaded.pmi(3, np.arange(11)), table.pmi(3, np.arange(11)))
    with pytest.raises(ValueError, match="counted over 11 tokens; the target has 12"):
        load_bigram(tmp_path, vocab_size=12)
    (tmp_path / BIGRAM_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError):
        load_bigram(tmp_path)


def test_neighbour_fit_round_trip_and_refusals(tmp_path: Path) -> None:
    assert load_neighbour_fit(tmp_path) is None
    save_bigram(BigramTable.from_stream(random_stream(V, 500, 1), V), tmp_path)
    assert load_neighbour_fit(tmp_path) is None  # a table without its fitted weights is not used
    save_neighbour_fit((0.5, 1.25), SURVIVAL, tmp_path)
    neighbours, survival = load_neighbour_fit(tmp_path, V)
    assert (neighbours.weight(0.0), neighbours.weight(1.0)) == (0.5, 1.25)
    assert survival == SURVIVAL
    (tmp_path / NEIGHBOUR_FIT_FILE).write_text('{"weight_greedy": -1, "weight_sampled": 1, "greedy": []}')
    with pytest.raises(ValueError, match="invalid neighbour fit"):
        load_neighbour_fit(tmp_path, V)
    (tmp_path / NEIGHBOUR_FIT_FILE).write_text("{")
    with pytest.raises(ValueError, match="invalid neighbour fit"):
        load_neighbour_fit(tmp_path, V)


def test_fresh_neighbours_are_those_filled_since_the_stale_pass() -> None:
    stale_masked = np.array([False, True, True, True, True, False])
    parents = np.array([[9, 4, MASK, 5, MASK, 8], [9, MASK, MASK, 5, 6, 8], [9, 4, MASK, MASK, MASK, 8]])
    positions = np.array([2, 5, 4])
    left_fresh, left_token, right_fresh, right_token = fresh_neighbours(parents, positions, stale_masked, MASK)
    assert left_fresh.tolist() == [True, True, False]  # 4 filled since; 6 filled since; still masked
    assert right_fresh.tolist() == [True, False, False]  # 5 filled since; 5 is the last; 8 was clean already
    assert fresh_neighbours(parents[:1], np.array([0]), stale_masked, MASK)[0].tolist() == [False]  # no left of 0
    assert left_token[:2].tolist() == [4, 6] and right_token[0] == 5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_child_guesses_follow_a_fresh_left_neighbour_and_only_then(temperature: float) -> None:
    context = make_context(temperature, seed=2)  # the root's free commit put token 5 at ROOT_COMMIT (the last)
    guesses_plain = StaleGuesses(context)
    step = context.root_step
    position = ROOT_COMMIT - 1  # right neighbour fresh (the free commit)
    others = np.array([0, 2])  # positions with no fresh neighbour
    parents = np.repeat(context.root.numpy()[None], 3, axis=0)
    positions = np.array([position, *others])
    plain, _ = guesses_plain.child_guesses(step, parents, positions, 2)
    stale = guesses_plain.at(step).tokens.numpy()[positions]
    assert np.array_equal(plain[0], stale)  # no correction: rank 0 is the stale coupled guess
    runner_up = int(guesses_plain.ranked(step, 2)[0][1, position])
    # a corpus where the runner-up always precedes token 5: the free commit makes it the guess
    stream = []
    rng = np.random.default_rng(1)
    for _ in range(400):
        stream += [int(rng.integers(3, V)), runner_up, 5]
    strong = NeighbourTokens(BigramTable.from_stream(np.asarray(stream), V), 5.0, 5.0)
    corrected, scores = StaleGuesses(context, strong).child_guesses(step, parents, positions, 2)
    assert corrected[0, 0] == runner_up
    assert np.array_equal(corrected[0, 1:], stale[1:])  # no fresh neighbour, no change
    assert bool((np.diff(scores, axis=0) <= 0).all())  # best first
    zero = NeighbourTokens(strong.table, 0.0, 0.0)
    assert np.array_equal(StaleGuesses(context, zero).child_guesses(step, parents, positions, 2)[0], plain)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spot_trees_commit_the_corrected_tokens(temperature: float) -> None:
    """Every edge commits the best corrected guess for its own parent; with a strong correction some differ from
    the stale guess (so the exactness tests with neighbours are not vacuous)."""
    rng = np.random.default_rng(3)
    table = BigramTable.from_stream(rng.integers(3, V, 3000) ** 2 % V, V)
    neighbours = NeighbourTokens(table, 4.0, 4.0)
    differ = 0
    for seed in range(6):
        context = make_context(temperature, seed=seed)
        drafter = SpotDrafter(random_order_model(seed % 2), budget=12, depth=4, neighbours=neighbours)
        tree = drafter.propose(context)
        guesses = StaleGuesses(context, neighbours)
        for node in range(1, len(tree)):
            parent = tree.parents[node]
            (position,) = torch.nonzero(tree.states[parent] != tree.states[node]).flatten().tolist()
            parent_state = tree.states[parent].numpy()[None]
            best = guesses.child_guesses(tree.steps[parent], parent_state, np.array([position]), 1)[0][0, 0]
            assert tree.states[node][position] == best
            differ += int(best != guesses.at(tree.steps[parent]).tokens[position])
    assert differ > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_node_confidence_moves_only_where_a_neighbour_was_filled(temperature: float) -> None:
    context = make_context(temperature, seed=4)
    guesses_plain = StaleGuesses(context)
    rng = np.random.default_rng(5)
    table = BigramTable.from_stream(rng.integers(3, V, 3000) ** 2 % V, V)
    guesses = StaleGuesses(context, NeighbourTokens(table, 3.0, 3.0))
    states = np.repeat(context.root.numpy()[None], 2, axis=0)
    states[1, 2] = 9  # a branch commit: positions 1 and 3 now have a fresh neighbour, as has 6 (next to the root's)
    steps = [context.root_step, context.root_step + 1]
    stale = torch.stack([guesses_plain.at(s).confidence for s in steps])
    plain = guesses_plain.node_confidence(stale, steps, states)
    corrected = guesses.node_confidence(stale, steps, states)
    assert torch.equal(plain, stale)
    moved = torch.zeros_like(stale, dtype=torch.bool)
    moved[0, ROOT_COMMIT - 1] = moved[1, ROOT_COMMIT - 1] = moved[1, 1] = moved[1, 3] = True
    assert torch.equal(corrected[~moved], stale[~moved])
    assert bool(((corrected[moved] > 0) & (corrected[moved] <= 1)).all())
    assert not torch.equal(corrected[moved], stale[moved])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sets_trees_commit_each_members_corrected_token(temperature: float) -> None:
    """SPOT-Sets: every member of a drafted set gets the best corrected guess for the set's parent state (members of
    one set do not condition on each other); with a strong correction some differ from the stale guesses."""
    rng = np.random.default_rng(6)
    neighbours = NeighbourTokens(BigramTable.from_stream(rng.integers(3, V, 3000) ** 2 % V, V), 4.0, 4.0)
    differ = 0
    for seed in range(6):
        context = make_context(temperature, seed=seed, kind="threshold")
        tree = SetsDrafter(random_order_model(seed % 2), budget=12, depth=4, neighbours=neighbours).propose(context)
        guesses = StaleGuesses(context, neighbours)
        for node in range(1, len(tree)):
            parent = tree.parents[node]
            members = torch.nonzero(tree.states[parent] != tree.states[node]).flatten().numpy()
            parents = np.repeat(tree.states[parent].numpy()[None], len(members), axis=0)
            best = guesses.child_guesses(tree.steps[parent], parents, members, 1)[0][0]
            assert np.array_equal(tree.states[node].numpy()[members], best)
            differ += int((best != guesses.at(tree.steps[parent]).tokens.numpy()[members]).sum())
    assert differ > 0


def test_neighbour_observations_at_weight_zero_are_the_stale_ranks(make_target) -> None:
    target = make_target()
    table = BigramTable.from_stream(random_stream(target.vocab_size, 2000, 4), target.vocab_size)
    observations = observations_at_weight_zero_are_the_stale_ranks(target, NeighbourTokens(table, 1.0, 1.0))
    assert np.any(np.stack(observations.correction) != 0)  # some commits had a fresh neighbour


def synthetic_observations(helpful: bool) -> SurvivalObservations:
    """Commits where the correction points at the committed token (helpful) or away from it."""
    observations = SurvivalObservations(temperature=0.0, mask_id=MASK, max_staleness=1, ranks=2)
    for i in range(50):
        scores = np.array([1.0, 0.8, 0.1])
        committed = 1 if i % 2 else 0
        bonus = np.zeros(3)
        bonus[committed if helpful else 1 - committed] = 1.0
        observations.staleness.append(1)
        observations.candidate_scores.append(scores)
        observations.correction.append(bonus)
        observations.committed_candidate.append(committed)
    return observations


def test_weight_fit_uses_a_helpful_correction_and_ignores_a_harmful_one() -> None:
    assert fit_neighbour_weight(synthetic_observations(True)) > 0
    assert fit_neighbour_weight(synthetic_observations(False)) == 0
    helpful = synthetic_observations(True)
    survival = fit_neighbour_survival(helpful, helpful, (1.0, 1.0))
    assert len(survival.greedy) == 1
    _, rank = helpful.neighbour_arrays(1.0, 1)
    assert bool((rank == 0).all())


@pytest.mark.parametrize("enabled", [True, False])
def test_spot_drafter_reads_the_neighbour_fit_beside_the_order_model(make_target, tmp_path: Path, enabled) -> None:
    folder = tmp_path / "drafter"
    copy_order_model(folder)
    target = make_target()
    save_bigram(BigramTable.from_stream(random_stream(target.vocab_size, 500, 2), target.vocab_size), folder)
    save_neighbour_fit((0.75, 1.0), SURVIVAL, folder)
    drafter = make_drafter(GenerateConfig(method="spot", drafter=str(folder), neighbour_tokens=enabled), target)
    if enabled:
        assert drafter.neighbours.weight(1.0) == 1.0 and drafter.token_survival == SURVIVAL
    else:
        assert drafter.neighbours is None and drafter.token_survival == load_token_survival(folder)


def test_spot_drafter_refuses_a_bigram_of_another_vocabulary(make_target, tmp_path: Path) -> None:
    folder = tmp_path / "drafter"
    copy_order_model(folder)
    save_bigram(BigramTable.from_stream(random_stream(50, 500, 2), 50), folder)
    save_neighbour_fit((0.75, 1.0), SURVIVAL, folder)
    with pytest.raises(ValueError, match="counted over 50 tokens"):
        make_drafter(GenerateConfig(method="spot", drafter=str(folder)), make_target())


def test_shipped_drafter_uses_neighbours_by_default(make_target) -> None:
    from spot_dlm import load_target

    target, _ = load_target()
    drafter = make_drafter(GenerateConfig(method="spot"), target)
    assert drafter.neighbours is not None and drafter.neighbours.table.vocab_size == target.vocab_size
    assert drafter.neighbour_prior
    assert make_drafter(GenerateConfig(method="spot", neighbour_tokens=False), target).neighbours is None
    assert not make_drafter(GenerateConfig(method="spot", neighbour_prior=False), target).neighbour_prior


def test_generate_with_and_without_neighbours_is_the_same_text() -> None:
    """The switches change the drafts only: the generated tokens are standard decoding's."""
    target, codec = load_target()
    prompt = ["Tom has 3 apples and buys 5 more. How many apples does he have?"]
    common = {"gen_length": 64, "temperature": 1.0, "budget": 4}
    outputs = [
        generate(prompt, GenerateConfig(method=method, **common, **extra), target, codec)[0]
        for method, extra in (
            ("spot", {}),
            ("spot", {"neighbour_tokens": False}),
            ("spot", {"neighbour_prior": False}),
            ("standard", {}),
        )
    ]
    assert len({tuple(o.token_ids) for o in outputs}) == 1
    assert outputs[0].target_passes < outputs[3].target_passes


def test_cli_fit_bigram_then_fit_token_survival_writes_the_neighbour_fit(capsys, long_checkpoint, tmp_path) -> None:
    code = cli.main(["fit-bigram", "--model", str(long_checkpoint), "--out", str(tmp_path), "--n-symbolic", "0"])
    assert code == 0 and (tmp_path / BIGRAM_FILE).is_file()
    args = ["fit-token-survival", "--model", str(long_checkpoint), "--out", str(tmp_path), "--n-prompts", "2"]
    assert cli.main([*args, "--block-length", "8", "--gen-length", "32"]) == 0
    out = capsys.readouterr().out
    neighbours, survival = load_neighbour_fit(tmp_path)
    assert len(survival.greedy) == 4 and "neighbour weights" in out and NEIGHBOUR_FIT_FILE in out


def test_cli_fit_bigram_bad_input(capsys, tmp_path: Path) -> None:
    assert cli.main(["fit-bigram", "--out", "/nonexistent/drafter"]) == 2
    assert "drafter folder not found" in capsys.readouterr().err
    assert cli.main(["fit-bigram", "--out", str(tmp_path), "--n-symbolic", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
