"""Small trajectory collections shared by the collect and train tests (and the fixtures in conftest.py): the
collection settings, a collect call with overrides, a made-up bigram fit and a hand-made trajectory."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spot_dlm.train.collect import SHARD_ARRAYS, CollectConfig, collect

GEN, BLOCK, DEPTH = 16, 8, 4


def run_collect(target, codec, out_dir: Path, **overrides) -> tuple[CollectConfig, list[Path]]:
    fields = {
        "out_dir": out_dir,
        "n_prompts": 2,
        "prompts_per_shard": 1,
        "temperatures": (0.0, 1.0),
        "block_length": BLOCK,
        "gen_length": GEN,
        "depth": DEPTH,
    }
    config = CollectConfig(**{**fields, **overrides})
    return config, collect(target, codec, config)


def neighbour_fit_folder(vocab: int, folder: Path, weight: float = 4.0) -> Path:
    """A drafter folder holding a skewed made-up bigram fit (strong weights, so corrections show)."""
    from spot_dlm.drafters.neighbours import BigramTable, save_bigram, save_neighbour_fit
    from spot_dlm.drafters.token_survival import SurvivalBucket, TokenSurvival

    stream = np.random.default_rng(7).integers(0, vocab, 4000) ** 2 % vocab
    save_bigram(BigramTable.from_stream(stream, vocab), folder)
    survival = TokenSurvival(greedy=(SurvivalBucket(0.5, 0.05),), sampled=(SurvivalBucket(2.0, 0.2),))
    save_neighbour_fit((weight, weight), survival, folder)
    return folder


def hand_trajectory() -> dict[str, np.ndarray]:
    """Two blocks of a 4-position one-commit trajectory plus a row that commits two positions.

    Block 0 commits positions 2, 0, 3, 1; block 1 commits 1, then {0, 2} together, then 3. The coupled
    confidence ranks positions 2 > 3 > 1 > 0 at every step.
    """
    order_block0 = [[2], [0], [3], [1]]
    order_block1 = [[1], [0, 2], [3]]
    rows = {name: [] for name in SHARD_ARRAYS}
    for block, order in ((0, order_block0), (1, order_block1)):
        masked = np.ones(4, dtype=bool)
        for step_index, positions in enumerate(order):
            committed = np.zeros(4, dtype=bool)
            committed[positions] = True
            rows["top"].append(np.zeros((4, 32), np.float16))
            rows["masked"].append(masked.copy())
            rows["committed"].append(committed)
            rows["coupled"].append(np.tile(np.array([0.1, 0.2, 0.9, 0.5], np.float16), (3, 1)))
            rows["block_id"].append(block)
            rows["step"].append(step_index)
            rows["prompt_id"].append(0)
            rows["tau"].append(0.9)
            rows["temperature"].append(0.0)
            masked &= ~committed
    return {name: np.asarray(value) for name, value in rows.items()}
