"""Token guesses re-ranked by a small LM's change of belief: the correction, its memo and window, how fits, the API
and the CLI use it. (Exactness with it: ``test_exactness.test_neighbour_tokens_equal_standard``.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from neighbour_fits import SURVIVAL, copy_order_model, observations_at_weight_zero_are_the_stale_ranks
from spot_dlm import cli
from spot_dlm.api import GenerateConfig, load_target, make_drafter
from spot_dlm.bench.rows import parse_row
from spot_dlm.drafters import token_lm
from spot_dlm.drafters.folder import default_drafter_dir
from spot_dlm.drafters.neighbours import BigramTable, NeighbourTokens, StalePass, save_bigram, weighted_correction
from spot_dlm.drafters.token_lm import TOKEN_LM_DIR, TOKEN_LM_FIT_FILE, TokenLM, load_token_lm, save_token_lm_fit
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.models.checkpoint import TOKENIZER_FILE, save_checkpoint

torch.set_num_threads(1)
L = 8


@pytest.fixture
def small_lm(model_factory) -> TokenLM:
    """Another random model over the tiny target's vocabulary, in float64."""
    model = model_factory(seed=7).to(torch.float64)
    return TokenLM(BuiltinTarget(model=model), weight_greedy=1.0, weight_sampled=1.0, window=6)


def random_states(vocab: int, mask: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    states = rng.integers(3, vocab, (n, L))
    states[rng.random((n, L)) < 0.5] = mask
    return states


def direct_log_probs(lm: TokenLM, prefix: torch.Tensor, state: np.ndarray) -> np.ndarray:
    """log q over the vocabulary at every position of one state, scored alone (no memo, no batch). -> [L, V]"""
    model = lm.model
    logits = model.score(model.prefill(prefix[-lm.window :]), torch.from_numpy(state)[None]).logits[0].double()
    logits[:, model.mask_id] = float("-inf")
    return torch.log_softmax(logits, -1).numpy()


def test_correction_is_the_change_of_belief_of_each_state_scored_alone(small_lm: TokenLM) -> None:
    model = small_lm.model
    vocab, mask = model.vocab_size, model.mask_id
    prefix = torch.randint(3, vocab, (11,), generator=torch.Generator().manual_seed(0))
    stale_state = np.full(L, mask)
    stale_state[[1, 4]] = [5, 9]
    parents = random_states(vocab, mask, 6, 1)
    parents[3] = parents[0]  # a repeated parent is scored once
    parents[5] = stale_state  # the stale state itself: no evidence
    positions = np.array([0, 2, 3, 5, 6, 7])
    candidates = np.random.default_rng(2).integers(3, vocab, (6, 4))
    stale = StalePass(torch.from_numpy(stale_state), mask, prefix)
    correction = small_lm.parts(stale, parents, positions, candidates)[0]  # [6, 4]
    before = direct_log_probs(small_lm, prefix, stale_state)
    for row in range(6):
        now = direct_log_probs(small_lm, prefix, parents[row])
        expected = now[positions[row], candidates[row]] - before[positions[row], candidates[row]]
        assert np.allclose(correction[row], expected, atol=1e-5)  # the memo keeps float32
    assert np.allclose(correction[5], 0)
    assert np.abs(correction[:5]).max() > 1e-3
    assert len(stale.memo["token_lm"]) == 5  # 4 distinct parents + the stale state
    assert np.array_equal(small_lm.moved(stale, parents, positions), np.ones(6, dtype=bool))


def test_stale_passes_sharing_a_block_memo_prefill_once_and_reuse_scored_states(small_lm: TokenLM) -> None:
    model = small_lm.model
    vocab, mask = model.vocab_size, model.mask_id
    prefix = torch.randint(3, vocab, (10,), generator=torch.Generator().manual_seed(8))
    parents, positions = random_states(vocab, mask, 4, 9), np.array([0, 2, 5, 7])
    candidates = np.random.default_rng(10).integers(3, vocab, (4, 3))
    memo: dict = {}
    small_lm.parts(StalePass(torch.full((L,), mask), mask, prefix, memo=memo), parents, positions, candidates)
    passes = model.counter.passes
    next_round = StalePass(torch.from_numpy(parents[0]), mask, prefix, memo=memo)  # a node became the stale state
    again = small_lm.parts(next_round, parents, positions, candidates)[0]
    assert model.counter.passes == passes  # no prefill, nothing rescored
    before = direct_log_probs(small_lm, prefix, parents[0])
    for row in range(4):
        now = direct_log_probs(small_lm, prefix, parents[row])
        expected = now[positions[row], candidates[row]] - before[positions[row], candidates[row]]
        assert np.allclose(again[row], expected, atol=1e-5)


def test_a_window_longer_than_the_small_lms_context_reads_what_fits_before_the_block(model_factory) -> None:
    lm = BuiltinTarget(model=model_factory(seed=7).to(torch.float64))
    vocab, mask = lm.vocab_size, lm.mask_id
    prefix = torch.randint(3, vocab, (30,), generator=torch.Generator().manual_seed(3))
    args = random_states(vocab, mask, 3, 4), np.array([0, 3, 6]), np.random.default_rng(5).integers(3, vocab, (3, 4))

    def parts(window: int) -> np.ndarray:
        return TokenLM(lm, 1.0, 1.0, window=window).parts(StalePass(torch.full((L,), mask), mask, prefix), *args)

    lm.max_length = L + 5  # room for 5 clean tokens before a block
    assert np.array_equal(parts(100), parts(5))
    assert not np.allclose(parts(5), parts(4))  # the cut is what changed the first result
    lm.max_length = L
    with pytest.raises(ValueError, match="leaves no context"):
        parts(5)


def test_a_bounded_memo_drops_the_least_recently_used_states_and_rescores_them_alike(small_lm, monkeypatch) -> None:
    model = small_lm.model
    vocab, mask = model.vocab_size, model.mask_id
    monkeypatch.setattr(token_lm, "MEMO_BYTES", 3 * L * vocab * 4)  # three float32 [L, V] tables
    prefix = torch.randint(3, vocab, (7,), generator=torch.Generator().manual_seed(11))
    parents, others = random_states(vocab, mask, 5, 12), random_states(vocab, mask, 2, 14)
    candidates = np.random.default_rng(13).integers(3, vocab, (5, 4))
    stale = StalePass(torch.full((L,), mask), mask, prefix)
    first = small_lm.parts(stale, parents, np.arange(5), candidates)
    kept = stale.memo["token_lm"]
    assert len(kept) == 6  # a call keeps every state it reads, however small the budget
    small_lm.parts(stale, others, np.arange(2), candidates[:2])
    assert list(kept) == [stale.state.numpy().tobytes(), others[0].tobytes(), others[1].tobytes()]
    passes = model.counter.passes
    assert np.allclose(small_lm.parts(stale, parents, np.arange(5), candidates), first)
    assert model.counter.passes == passes + 1  # the dropped states, rescored in one batch


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_with_a_bigram_the_correction_adds_both_parts_at_their_weights(small_lm: TokenLM, temperature) -> None:
    model = small_lm.model
    vocab, mask = model.vocab_size, model.mask_id
    table = BigramTable.from_stream(np.random.default_rng(0).integers(0, vocab, 3000), vocab)
    bigram = NeighbourTokens(table, weight_greedy=0.25, weight_sampled=1.5)
    joint = TokenLM(model, weight_greedy=0.5, weight_sampled=0.75, window=6, bigram=bigram)
    assert joint.weights(temperature) == ((0.5, 0.25) if temperature == 0 else (0.75, 1.5))
    prefix = torch.randint(3, vocab, (9,), generator=torch.Generator().manual_seed(1))
    stale = StalePass(torch.full((L,), mask), mask, prefix, temperature)
    parents, positions = random_states(vocab, mask, 5, 6), np.array([0, 1, 3, 4, 7])
    candidates = np.random.default_rng(7).integers(3, vocab, (5, 3))
    parts = joint.parts(stale, parents, positions, candidates)  # [2, 5, 3]
    assert parts.shape == (2, 5, 3)
    assert np.allclose(parts[0], small_lm.parts(stale, parents, positions, candidates)[0])
    assert np.array_equal(parts[1], bigram.parts(stale, parents, positions, candidates)[0])
    w_lm, w_bigram = joint.weights(temperature)
    expected = w_lm * parts[0] + w_bigram * parts[1]
    assert np.allclose(weighted_correction(joint, stale, parents, positions, candidates), expected)


def test_the_lm_reads_only_its_window_of_the_prefix(small_lm: TokenLM) -> None:
    model = small_lm.model
    vocab, mask = model.vocab_size, model.mask_id
    prefix = torch.randint(3, vocab, (12,), generator=torch.Generator().manual_seed(3))
    parents, positions = random_states(vocab, mask, 3, 4), np.array([1, 2, 3])
    candidates = np.random.default_rng(5).integers(3, vocab, (3, 4))
    stale_state = torch.full((L,), mask)

    def correction(prefix: torch.Tensor) -> np.ndarray:
        return small_lm.parts(StalePass(stale_state, mask, prefix), parents, positions, candidates)[0]

    far, near = prefix.clone(), prefix.clone()
    far[0] = (far[0] + 1 - 3) % (vocab - 3) + 3  # outside the last 6 tokens
    near[-1] = (near[-1] + 1 - 3) % (vocab - 3) + 3
    assert np.array_equal(correction(prefix), correction(far))
    assert not np.allclose(correction(prefix), correction(near))


def test_a_round_without_its_prefix_is_a_clear_error(small_lm: TokenLM) -> None:
    stale = StalePass(torch.full((L,), small_lm.model.mask_id), small_lm.model.mask_id, prefix=None)
    with pytest.raises(ValueError, match="no prefix"):
        small_lm.parts(stale, np.full((1, L), 3), np.array([0]), np.array([[4, 5]]))
    with pytest.raises(ValueError, match="window"):
        TokenLM(small_lm.model, 1.0, 1.0, window=0)


def test_lm_observations_at_weight_zero_are_the_stale_ranks(make_target, small_lm: TokenLM) -> None:
    observations = observations_at_weight_zero_are_the_stale_ranks(make_target(), small_lm)
    corrections = np.stack(observations.correction)
    assert np.isfinite(corrections).all() and np.abs(corrections).max() > 1e-3


def install_made_up_fit(folder: Path, checkpoint: Path, window: int = 32) -> None:
    (folder / TOKEN_LM_DIR).mkdir(parents=True)
    for name in ("config.json", "model.safetensors", TOKENIZER_FILE):
        (folder / TOKEN_LM_DIR / name).write_bytes((checkpoint / name).read_bytes())
    save_token_lm_fit((0.5, 0.75), SURVIVAL, window, folder)


def tiny_checkpoint(folder: Path, model, tokenizer_from: Path) -> Path:
    """A built-in-architecture checkpoint of ``model`` with the tokenizer of another folder (same vocabulary)."""
    save_checkpoint(model.to(torch.float32), folder)
    (folder / TOKENIZER_FILE).write_bytes((tokenizer_from / TOKENIZER_FILE).read_bytes())
    return folder


def test_spot_drafter_prefers_the_folders_token_lm_unless_told(long_checkpoint, model_factory, tmp_path) -> None:
    target, _ = load_target(str(long_checkpoint))
    folder = tmp_path / "drafter"
    copy_order_model(folder)
    lm = model_factory(vocab_size=target.vocab_size, seed=8, max_seq_len=1024)
    install_made_up_fit(folder, tiny_checkpoint(tmp_path / "lm", lm, long_checkpoint), window=32)
    drafter = make_drafter(GenerateConfig(method="spot", drafter=str(folder), token_lm=True), target)
    assert isinstance(drafter.neighbours, TokenLM) and drafter.neighbours.window == 32
    assert drafter.neighbours.weight(0.0) == 0.5 and drafter.token_survival == SURVIVAL
    plain = make_drafter(GenerateConfig(method="spot", drafter=str(folder)), target)  # opt-in
    assert plain.neighbours is None  # no bigram in this folder
    config = GenerateConfig(method="spot", drafter=str(folder), neighbour_tokens=False, token_lm=True)
    assert make_drafter(config, target).neighbours is None
    for name in ("drafter.safetensors", "drafter_config.json"):  # spot-sets reads a sets model beside the LM
        (folder / name).write_bytes((default_drafter_dir().parent / "sets_drafter" / name).read_bytes())
    sets = make_drafter(GenerateConfig(method="spot-sets", drafter=str(folder), token_lm=True), target)
    assert isinstance(sets.neighbours, TokenLM)


def test_a_fit_with_bigram_weights_loads_the_folders_bigram(long_checkpoint, model_factory, tmp_path) -> None:
    target, _ = load_target(str(long_checkpoint))
    folder = tmp_path / "drafter"
    copy_order_model(folder)
    lm = model_factory(vocab_size=target.vocab_size, seed=8, max_seq_len=1024)
    install_made_up_fit(folder, tiny_checkpoint(tmp_path / "lm", lm, long_checkpoint))
    save_token_lm_fit(((0.5, 0.25), (0.75, 1.0)), SURVIVAL, 16, folder)
    with pytest.raises(ValueError, match="no bigram table"):
        load_token_lm(folder, target)
    table = BigramTable.from_stream(np.random.default_rng(0).integers(0, target.vocab_size, 500), target.vocab_size)
    save_bigram(table, folder)
    loaded, survival = load_token_lm(folder, target)
    assert loaded.weights(0.0) == (0.5, 0.25) and loaded.weights(1.0) == (0.75, 1.0) and loaded.window == 16
    assert loaded.bigram.table.vocab_size == target.vocab_size and survival == SURVIVAL


def test_token_lm_of_another_vocabulary_or_a_corrupt_fit_is_refused(long_checkpoint, model_factory, tmp_path) -> None:
    from spot_dlm.models.builtin import builtin_dir

    target, _ = load_target(str(long_checkpoint))
    folder = tmp_path / "drafter"
    copy_order_model(folder)
    other = model_factory(vocab_size=2048, seed=9)  # the shipped tokenizer's vocabulary, not the target's
    install_made_up_fit(folder, tiny_checkpoint(tmp_path / "lm", other, builtin_dir()))
    with pytest.raises(ValueError, match="vocabulary"):
        make_drafter(GenerateConfig(method="spot", drafter=str(folder), token_lm=True), target)
    (folder / TOKEN_LM_FIT_FILE).write_text(json.dumps({"weight_greedy": 1.0}))
    with pytest.raises(ValueError, match="invalid token LM fit"):
        load_token_lm(folder, target)


def test_a_bench_row_turns_the_token_lm_on() -> None:
    assert parse_row("spot:token_lm=on") == ("spot", {"token_lm": True})
    assert parse_row("spot:neighbour_tokens=on:token_lm=on:neighbour_prior=off") == (
        "spot",
        {"neighbour_prior": False, "token_lm": True, "neighbour_tokens": True},
    )


def test_cli_fit_token_survival_installs_and_fits_a_token_lm(capsys, long_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    copy_order_model(out)
    args = ["fit-token-survival", "--model", str(long_checkpoint), "--out", str(out), "--n-prompts", "2"]
    before = (out / "token_survival.json").read_text()
    assert cli.main([*args, "--token-lm", str(long_checkpoint), "--token-lm-window", "64"]) == 0
    printed = capsys.readouterr().out
    assert "token LM weights: greedy" in printed and TOKEN_LM_FIT_FILE in printed
    assert (out / TOKEN_LM_DIR / "model.safetensors").is_file()
    assert (out / "token_survival.json").read_text() == before  # the other fits stay as they are
    target, _ = load_target(str(long_checkpoint))
    lm, survival = load_token_lm(out, target)
    assert lm.window == 64 and len(survival.greedy) == len(survival.sampled) > 0


def test_installing_a_token_lm_replaces_the_previous_one_and_its_training_record(model_factory, tmp_path) -> None:
    from spot_dlm.models.builtin import builtin_dir

    old = tiny_checkpoint(tmp_path / "old", model_factory(vocab_size=2048, seed=1), builtin_dir())
    (old / "training_state.json").write_text('{"runs": 7}')
    new = tiny_checkpoint(tmp_path / "new", model_factory(vocab_size=2048, seed=2), builtin_dir())
    drafter = tmp_path / "drafter"
    installed = token_lm.install_token_lm(old, drafter)
    assert (installed / "training_state.json").read_text() == '{"runs": 7}'
    assert token_lm.install_token_lm(new, drafter) == installed
    assert sorted(p.name for p in installed.iterdir()) == sorted(token_lm.LM_FILES)  # nothing of the old one left
    assert (installed / "model.safetensors").read_bytes() == (new / "model.safetensors").read_bytes()
    (new / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        token_lm.install_token_lm(new, drafter)
    assert (installed / "model.safetensors").is_file()  # a refused install leaves the installed LM alone


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--token-lm", "/nonexistent/lm"], "token LM checkpoint not found"),
        (["--token-lm", "WRONG_VOCAB"], "vocabulary"),
    ],
)
def test_cli_fit_token_lm_bad_input(capsys, long_checkpoint, model_factory, tmp_path, extra, message) -> None:
    out = tmp_path / "drafter"
    copy_order_model(out)
    if extra[1] == "WRONG_VOCAB":
        from spot_dlm.models.builtin import builtin_dir

        lm = tiny_checkpoint(tmp_path / "lm", model_factory(vocab_size=2048, seed=3), builtin_dir())
        extra = ["--token-lm", str(lm)]
    args = ["fit-token-survival", "--model", str(long_checkpoint), "--out", str(out), "--n-prompts", "1", *extra]
    assert cli.main(args) != 0
    assert message in capsys.readouterr().err
    assert not (out / TOKEN_LM_DIR).exists()


def test_the_shipped_drafter_carries_a_token_lm_for_the_builtin_target() -> None:
    """The built-in drafter folder ships a small LM with its joint fit; SPOT uses it only when asked, and the tokens
    it decodes with it are standard decoding's."""
    from spot_dlm.api import generate

    target, codec = load_target()
    lm, survival = load_token_lm(default_drafter_dir(), target)
    assert lm.bigram is not None and lm.window >= 1 and len(survival.greedy) > 0
    assert lm.model.vocab_size == target.vocab_size
    assert not isinstance(make_drafter(GenerateConfig(method="spot"), target).neighbours, TokenLM)
    assert isinstance(make_drafter(GenerateConfig(method="spot", token_lm=True), target).neighbours, TokenLM)
    prompts = ["Tom has 3 apples and buys 5 more. How many apples does he have?", "A box holds 12 pens. How many?"]
    for temperature in (0.0, 1.0):
        common = {"temperature": temperature, "gen_length": 64, "budget": 16}
        spot = generate(prompts, GenerateConfig(method="spot", token_lm=True, **common), target, codec)
        standard = generate(prompts, GenerateConfig(method="standard", **common), target, codec)
        assert [g.token_ids for g in spot] == [g.token_ids for g in standard]
