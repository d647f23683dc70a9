"""Stale noise-coupled guesses (``drafters/guesses.py``): per-step noise, the guess table, the stale
log-normaliser."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from draft_contexts import MASK, L, V, make_context
from spot_dlm.drafters.guesses import StaleGuesses, stale_log_normaliser

torch.set_num_threads(1)


def test_stale_guesses_follow_the_step_noise() -> None:
    """At T > 0 the guess for step c uses the Gumbel noise of step c; at T = 0 every step guesses the argmax."""
    cold = StaleGuesses(make_context(0.0, seed=3))
    stale = make_context(0.0, seed=3).stale_logits.clone()
    stale[:, MASK] = float("-inf")
    assert torch.equal(cold.at(1).tokens, stale.argmax(-1))
    assert torch.equal(cold.at(5).tokens, cold.at(1).tokens)
    context = make_context(1.0, seed=3)
    hot = StaleGuesses(context)
    for step_index in (1, 2, 6):
        noise = context.noise.gumbel(context.block_index, step_index, torch.arange(L), V)
        assert torch.equal(hot.at(step_index).tokens, (stale + noise).argmax(-1))
    assert any(not torch.equal(hot.at(1).tokens, hot.at(s).tokens) for s in range(2, 8))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("seed", range(3))
def test_guess_table_holds_the_best_coupled_guesses_of_stale_masked_positions(temperature: float, seed: int) -> None:
    """Per step: the R best coupled guesses (the rule's first), their scores ``Z / T + gumbel`` and stale
    log-probabilities, at exactly the positions masked in the stale state; others are refused."""
    context = make_context(temperature, seed=seed)
    parent = context.parent.clone()
    parent[seed] = 9  # committed before the stale pass: no guesses there
    context = dataclasses.replace(context, parent=parent, root=torch.where(parent != MASK, parent, context.root))
    guesses = StaleGuesses(context)
    z = context.stale_logits.clone()
    z[:, MASK] = float("-inf")
    coupled = z / temperature + context.gumbel(3) if temperature > 0 else z
    table = guesses.table(3, 5)
    masked = np.flatnonzero(parent.numpy() == MASK)
    assert np.array_equal(np.flatnonzero(table.row >= 0), masked)
    rows = table.rows(masked)
    assert np.array_equal(table.tokens[rows, 0], guesses.at(3).tokens.numpy()[masked])
    for position, row in zip(masked.tolist(), rows.tolist()):
        tokens = table.tokens[row]
        assert len(set(tokens.tolist())) == len(tokens) == min(16, V)
        assert np.all(table.scores[row][tokens == MASK] == float("-inf"))  # the mask token is never a guess
        assert np.array_equal(table.scores[row], coupled[position, tokens].numpy())
        assert np.all(np.diff(table.scores[row]) <= 0)  # best first
        np.testing.assert_allclose(table.logprob[row], torch.log_softmax(z[position], -1)[tokens].numpy(), atol=1e-12)
    with pytest.raises(ValueError, match="committed in the stale state"):
        table.rows(np.array([seed]))


def test_stale_log_normaliser_leaves_out_the_mask_token() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    without_mask = torch.cat([logits[:, :MASK], logits[:, MASK + 1 :]], -1)
    assert torch.allclose(stale_log_normaliser(logits, MASK), torch.logsumexp(without_mask, -1), atol=1e-12)
    assert stale_log_normaliser(logits.float(), MASK).dtype == torch.float32
