"""The token fits of a drafter folder: the corpus bigram, the survival of stale guesses, and a small token LM's
correction, each written into the folder with a report of what was fitted (``say``: where lines go)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

SURVIVAL_HEADER = "guesses     kind     staleness  commits  top guess kept  scale  outside"


def fit_bigram_into(folder: Path, target, codec, n_symbolic: int, say: Callable[[str], None] = print) -> Path:
    """Count the training corpus's bigrams into ``folder``; fits made with an earlier bigram are removed."""
    from spot_dlm.drafters.neighbours import NEIGHBOUR_FIT_FILE, BigramTable, save_bigram
    from spot_dlm.drafters.token_lm import TOKEN_LM_FIT_FILE
    from spot_dlm.train.data import build_token_stream, train_items

    stream = build_token_stream(train_items(n_symbolic), codec, dtype=np.int64)
    table = BigramTable.from_stream(stream, target.vocab_size)  # the model's vocabulary (may exceed the tokenizer's)
    source = {"corpus": "GSM8K train + gsm_symbolic (train seed)", "n_symbolic": n_symbolic}
    path = save_bigram(table, folder, {**source, "tokens": int(len(stream))})
    say(f"{len(stream):,} tokens, {len(table.keys):,} distinct bigrams; wrote {path}")
    for name in (NEIGHBOUR_FIT_FILE, TOKEN_LM_FIT_FILE):  # fitted with the bigram replaced: stale now
        if (folder / name).is_file():
            (folder / name).unlink()
            say(f"removed {folder / name} (fitted with the replaced bigram; spot-dlm fit-token-survival refits it)")
    return path


def survival_fits(folder: Path, token_lm: bool) -> tuple[str, ...]:
    """What a survival fit writes into a drafter folder: the token LM and its fit, or the stale guesses' survival
    (and the neighbour fit where the folder has a bigram)."""
    from spot_dlm.drafters.neighbours import BIGRAM_FILE, NEIGHBOUR_FIT_FILE
    from spot_dlm.drafters.token_lm import TOKEN_LM_DIR, TOKEN_LM_FIT_FILE
    from spot_dlm.drafters.token_survival import SURVIVAL_FILE

    if token_lm:
        return TOKEN_LM_DIR, TOKEN_LM_FIT_FILE
    return (SURVIVAL_FILE, NEIGHBOUR_FIT_FILE) if (folder / BIGRAM_FILE).is_file() else (SURVIVAL_FILE,)


def _bigram_corrector(folder: Path, vocab_size: int):
    """The folder's bigram as a NeighbourTokens with unit weights (its weights are fitted), or None without one."""
    from spot_dlm.drafters.neighbours import NeighbourTokens, load_bigram

    bigram = load_bigram(folder, vocab_size)
    return None if bigram is None else NeighbourTokens(bigram, 1.0, 1.0)


def fit_survival_into(
    folder: Path, target, codec, prompts, shape: dict, temperature: float, seed: int, say=print
) -> None:
    """Fit how often the stale guesses survive at T = 0 and at ``temperature`` (and, where the folder has a bigram,
    the neighbour correction's weights and survival). ``shape``: block_length and gen_length."""
    from spot_dlm.drafters.neighbours import save_neighbour_fit
    from spot_dlm.drafters.token_survival import save_token_survival
    from spot_dlm.train.token_survival import fit_token_survival, observe

    corrector = _bigram_corrector(folder, target.vocab_size)
    greedy = observe(target, codec, prompts, 0.0, seed, corrector=corrector, **shape)
    sampled = observe(target, codec, prompts, temperature, seed, corrector=corrector, **shape)
    survival = fit_token_survival(greedy, sampled)
    say(SURVIVAL_HEADER)
    _say_survival(say, "stale", survival, greedy, sampled, lambda obs, d: obs.arrays(d)[1])
    say(f"wrote {save_token_survival(survival, folder)}")
    if corrector is not None:
        weights, corrected = _fit_correction(say, "neighbour", greedy, sampled)
        say(f"wrote {save_neighbour_fit(weights, corrected, folder)}")


def fit_token_lm_into(
    folder: Path,
    source: Path,
    target,
    codec,
    prompts,
    shape: dict,
    temperature: float,
    seed: int,
    window: int,
    device: str = "cpu",
    say=print,
) -> None:
    """Install the small LM in ``source`` into the drafter folder and fit its correction, with the folder's bigram
    (if any) as a second part; the other fits stay as they are."""
    from spot_dlm.drafters.token_lm import TokenLM, install_token_lm, load_small_lm, save_token_lm_fit
    from spot_dlm.train.token_survival import observe

    if not (source / "config.json").is_file():
        raise ValueError(f"token LM checkpoint not found: {source} (a folder of the built-in architecture)")
    small = load_small_lm(source, target, device)
    bigram = _bigram_corrector(folder, target.vocab_size)
    lm = TokenLM(small, 1.0, 1.0, window=window, bigram=bigram)  # weights fitted below
    greedy = observe(target, codec, prompts, 0.0, seed, corrector=lm, **shape)
    sampled = observe(target, codec, prompts, temperature, seed, corrector=lm, **shape)
    say(SURVIVAL_HEADER)
    weights, corrected = _fit_correction(say, "token LM", greedy, sampled)
    say(f"installed {install_token_lm(source, folder)}")
    say(f"wrote {save_token_lm_fit(weights, corrected, window, folder)}")


def _fit_correction(say, name: str, greedy, sampled):
    """The corrector's (greedy, sampled) weights and the survival of its corrected guesses, reported."""
    from spot_dlm.train.token_survival import fit_neighbour_survival, fit_neighbour_weight

    weights = fit_neighbour_weight(greedy), fit_neighbour_weight(sampled)
    corrected = fit_neighbour_survival(greedy, sampled, weights)
    weight_of = {greedy.temperature: weights[0], sampled.temperature: weights[1]}
    ranks_of = lambda obs, d: obs.neighbour_arrays(weight_of[obs.temperature], d)[1]  # noqa: E731
    _say_survival(say, name, corrected, greedy, sampled, ranks_of)
    say(f"{name} weights: greedy {weights[0]}, sampled {weights[1]}")
    return weights, corrected


def _say_survival(say, guesses: str, survival, greedy, sampled, ranks_of) -> None:
    """One line per (temperature kind, staleness): commits seen, top-guess survival, fitted bucket."""
    for kind, observations in (("greedy", greedy), ("sampled", sampled)):
        for staleness, bucket in enumerate(getattr(survival, kind), start=1):
            rank = ranks_of(observations, staleness)
            line = f"{guesses:10s}  {kind:8s} {staleness:9d} {len(rank):8d} {float((rank == 0).mean()):15.3f}"
            say(f"{line} {bucket.scale:6.3f} {bucket.outside:8.3f}")
