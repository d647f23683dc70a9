"""Helpers shared by the neighbour-token and token-LM tests: a made-up survival fit, a copy of the shipped order
model, and standard decoding observed with a token corrector whose corrected ranks at weight 0 are the stale ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from spot_dlm.decode import DecodeSettings, NoDrafter, decode_ids
from spot_dlm.drafters.folder import default_drafter_dir
from spot_dlm.drafters.token_survival import SurvivalBucket, TokenSurvival
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule
from spot_dlm.train.token_survival import SurvivalObservations

SURVIVAL = TokenSurvival(greedy=(SurvivalBucket(0.5, 0.05),), sampled=(SurvivalBucket(2.0, 0.2),))


def observations_at_weight_zero_are_the_stale_ranks(target, corrector) -> SurvivalObservations:
    """Standard decoding observed with a corrector: at weight 0 its corrected ranks are the stale ranks."""
    settings = DecodeSettings(CommitRule("one", temperature=1.0), block_length=8, gen_length=24, stop_at_eos=False)
    observations = SurvivalObservations(temperature=1.0, mask_id=target.mask_id, max_staleness=2, corrector=corrector)
    for request in range(2):
        key = NoiseKey(0, request)
        prompt = torch.tensor([5 + request, 6, 7], dtype=torch.int64)
        decode_ids(target, prompt, settings, NoDrafter(), key, observations.observer(key))
    for staleness in (1, 2):
        scores, rank = observations.arrays(staleness)
        corrected, corrected_rank = observations.neighbour_arrays(0.0, staleness)
        assert np.allclose(corrected, scores)
        assert np.array_equal(corrected_rank, np.minimum(rank, observations.ranks))
    return observations


def copy_order_model(folder: Path) -> None:
    folder.mkdir()
    for name in ("drafter.safetensors", "drafter_config.json", "token_survival.json"):
        (folder / name).write_bytes((default_drafter_dir() / name).read_bytes())
