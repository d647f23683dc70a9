"""Keyed Gumbel noise: determinism, key separation, lazy draws, distribution."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from spot_dlm.noise import BlockNoise, NoiseKey, fold_key, gumbel, uniform

MASK64 = (1 << 64) - 1


def reference_mix(value: int) -> int:
    """SplitMix64 finaliser, written independently in Python integers."""
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def reference_uniform(key: int, position: int, v: int) -> float:
    """The documented hash in exact unsigned 64-bit arithmetic: u = (mix(mix(pos ^ key) + v) >> 11 + 0.5) / 2**53."""
    pos_key = reference_mix((position ^ key) & MASK64)
    bits = reference_mix((pos_key + v) & MASK64) >> 11
    return (bits + 0.5) * 2.0**-53


def test_uniform_matches_unsigned_64_bit_reference() -> None:
    """The int64 tensor arithmetic (wrapping multiply, logical shifts) equals the uint64 definition."""
    keys = [0, 1, fold_key(3), fold_key(0, 0, 0, 0), fold_key(123456789, 7, 3, 11), (1 << 64) - 1, 1 << 63]
    positions = torch.tensor([0, 1, 2, 31, 1000])
    for key in keys:
        got = uniform(key, positions, 7)
        for row, position in enumerate(positions.tolist()):
            for v in range(7):
                assert got[row, v].item() == reference_uniform(key, position, v), (key, position, v)


def test_fold_key_matches_reference() -> None:
    key = 0
    for field in (5, 0, 2, 9):
        key = reference_mix(key ^ reference_mix(field))
    assert fold_key(5, 0, 2, 9) == key


def test_same_key_same_values() -> None:
    positions = torch.arange(8)
    a = NoiseKey(seed=3, request=2).gumbel(block=1, pass_index=4, positions=positions, vocab_size=50)
    b = NoiseKey(seed=3, request=2).gumbel(block=1, pass_index=4, positions=positions, vocab_size=50)
    assert a.dtype == torch.float64
    assert a.shape == (8, 50)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "other",
    [
        (NoiseKey(4, 2), 1, 4),  # seed
        (NoiseKey(3, 3), 1, 4),  # request
        (NoiseKey(3, 2), 2, 4),  # block
        (NoiseKey(3, 2), 1, 5),  # pass
        (NoiseKey(2, 3), 1, 4),  # seed and request swapped
        (NoiseKey(3, 2), 4, 1),  # block and pass swapped
    ],
)
def test_different_key_fields_give_different_values(other: tuple[NoiseKey, int, int]) -> None:
    positions = torch.arange(6)
    base = NoiseKey(3, 2).gumbel(1, 4, positions, 40)
    key, block, pass_index = other
    different = key.gumbel(block, pass_index, positions, 40)
    # independent streams: no value (let alone row) coincides
    assert not torch.isclose(base, different).any()


def test_positions_and_vocab_entries_differ() -> None:
    values = NoiseKey(0).gumbel(0, 0, torch.arange(64), 64)
    assert values.flatten().unique().numel() == values.numel()


def test_lazy_draw_equals_rows_of_full_draw() -> None:
    key = NoiseKey(seed=11, request=5)
    full = key.gumbel(2, 3, torch.arange(16), 30)
    subset = torch.tensor([9, 0, 15, 4, 4])
    assert torch.equal(key.gumbel(2, 3, subset, 30), full[subset])
    # a narrower vocabulary is a prefix of the wider one
    assert torch.equal(key.gumbel(2, 3, subset, 7), full[subset, :7])


def test_block_noise_memo_equals_fresh_draws_and_forgets_passed_steps() -> None:
    key = NoiseKey(seed=2, request=1)
    memo = BlockNoise(key, block=4, block_length=5, vocab_size=9, device=torch.device("cpu"))
    passes = (0, 3, 3, 1)
    table = memo.tables(passes)
    assert table.shape == (4, 5, 9)
    for row, pass_index in enumerate(passes):
        assert torch.equal(table[row], key.gumbel(4, pass_index, torch.arange(5), 9))
    assert not torch.equal(table[0], table[1])
    assert memo.table(3) is memo.table(3)  # drawn once
    memo.forget_before(2)
    assert sorted(memo._tables) == [3]
    assert torch.equal(memo.table(0), key.gumbel(4, 0, torch.arange(5), 9))  # redrawn identically on demand


def test_block_noise_draws_only_the_rows_asked_for_and_completes_them_later() -> None:
    key = NoiseKey(seed=5, request=0)
    memo = BlockNoise(key, block=1, block_length=6, vocab_size=11, device=torch.device("cpu"))
    full = key.gumbel(1, 2, torch.arange(6), 11)
    first = torch.tensor([True, False, True, False, False, True])
    table = memo.table(2, first)
    assert torch.equal(table[first], full[first])
    assert not bool(table[~first].any())  # rows nobody asked for are not drawn
    later = torch.tensor([False, True, True, False, False, False])
    assert torch.equal(memo.table(2, later)[first | later], full[first | later])
    assert torch.equal(memo.table(2), full)  # no positions: the whole table
    stacked = memo.tables((2, 4), torch.stack([first, later]))
    assert torch.equal(stacked[0], full) and torch.equal(
        stacked[1][later], key.gumbel(1, 4, torch.arange(6), 11)[later]
    )


def test_uniforms_in_open_unit_interval_and_uniform() -> None:
    values = uniform(fold_key(7, 0, 0, 0), torch.arange(400), 250).flatten()
    assert values.min() > 0.0
    assert values.max() < 1.0
    assert stats.kstest(values.numpy(), "uniform").pvalue > 1e-3
    # the low-order structure of the counter (consecutive vocabulary entries) does not leak into the values
    pairs = uniform(fold_key(8), torch.arange(400), 250)
    corr = torch.corrcoef(torch.stack([pairs[:, :-1].flatten(), pairs[:, 1:].flatten()]))[0, 1]
    assert abs(corr.item()) < 0.02


def test_uniforms_across_keys_are_uniform() -> None:
    """One value per key, across many folded keys (what a position sees over seeds)."""
    values = torch.cat([uniform(fold_key(seed, 0, 0, 0), torch.tensor([3]), 1)[:, 0] for seed in range(3000)])
    assert stats.kstest(values.numpy(), "uniform").pvalue > 1e-3


def unxorshift(value: int, shift: int) -> int:
    """Inverse of ``x ^ (x >> shift)`` on 64-bit integers."""
    result = value
    for _ in range(64 // shift + 1):
        result = value ^ (result >> shift)
    return result & MASK64


def reference_unmix(value: int) -> int:
    """Inverse of the SplitMix64 finaliser (it is a bijection), to build keys that hit chosen hash outputs."""
    z = unxorshift(value, 31)
    z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & MASK64
    z = unxorshift(z, 27)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & MASK64
    z = unxorshift(z, 30)
    return (z - 0x9E3779B97F4A7C15) & MASK64


def key_with_extreme_hash(output: int) -> int:
    """A key whose uniform at position 0, vocabulary entry 0 comes from the 64-bit hash value ``output``."""
    counter = reference_unmix(output)  # mix(counter) == output, counter == pos_key + 0
    return reference_unmix(counter)  # mix(0 ^ key) == counter


def test_inverse_hash_helper() -> None:
    for value in (0, 1, 12345, MASK64, 1 << 63):
        assert reference_mix(reference_unmix(value)) == value


@pytest.mark.parametrize("output", [0, MASK64])
def test_extreme_hash_values_give_uniforms_strictly_inside_unit_interval(output: int) -> None:
    """The 53-bit uniforms must stay in (0, 1) and the Gumbel noise finite for every hash value.

    For the largest 53-bit value, ``bits + 0.5 = 2**53 - 0.5`` is not a float64 (it rounds to ``2**53``), so the
    uniform is exactly 1.0 and the Gumbel noise is +inf.
    """
    key = key_with_extreme_hash(output)
    values = uniform(key, torch.tensor([0]), 1)
    assert 0.0 < values.item() < 1.0
    assert torch.isfinite(gumbel(key, torch.tensor([0]), 1)).all()


def test_gumbel_values_finite_over_a_large_draw() -> None:
    assert torch.isfinite(gumbel(fold_key(1), torch.arange(200), 500)).all()


def test_gumbel_mean_and_variance() -> None:
    values = gumbel(fold_key(13, 1, 2, 3), torch.arange(500), 200).flatten()
    euler_gamma = 0.5772156649
    assert values.mean().item() == pytest.approx(euler_gamma, abs=0.03)
    assert values.var().item() == pytest.approx(math.pi**2 / 6, rel=0.05)
    assert stats.kstest(values.numpy(), "gumbel_r").pvalue > 1e-3


@pytest.mark.parametrize("fields", [(-1,), (0, -1), (1, 2, 3, -4)])
def test_negative_key_fields_raise(fields: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        fold_key(*fields)


def test_negative_noise_key_raises_on_draw() -> None:
    with pytest.raises(ValueError):
        NoiseKey(seed=-1).gumbel(0, 0, torch.arange(2), 3)
    with pytest.raises(ValueError):
        NoiseKey(seed=0).gumbel(-1, 0, torch.arange(2), 3)


def test_fold_key_order_matters() -> None:
    assert fold_key(1, 2) != fold_key(2, 1)
    assert fold_key(0) != fold_key(0, 0)
