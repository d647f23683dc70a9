"""Keyed Gumbel noise: every random number in decoding is a pure function of its key.

The Gumbel noise of vocabulary entry ``v`` at block position ``j`` in pass ``i`` of block ``k`` of request ``r``
under seed ``s`` is ``G(s, r, k, i, j, v)``, computed by a counter-based hash (SplitMix64 finaliser) in int64
tensor arithmetic. Nothing depends on how many numbers were drawn before, so standard decoding and speculative
decoding see the same noise for the same pass, and any subset of positions can be drawn lazily on any device.

Uniforms carry 53 random bits and are mapped to Gumbel(0, 1) in float64.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """Reinterpret an unsigned 64-bit integer as a signed int64 (torch has no uint64 arithmetic)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_int(value: int) -> int:
    """SplitMix64 finaliser on a Python int (used to fold key fields)."""
    z = (value + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _shift_right_logical(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's ``>>`` is arithmetic on negative values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on an int64 tensor; multiplication wraps modulo 2**64 like uint64."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shift_right_logical(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right_logical(z, 27)) * _signed(_MIX2)
    return z ^ _shift_right_logical(z, 31)


MAX_SEED = _MASK64  # the key is 64 bits: a larger seed would alias one below 2**64


def check_seed(seed: int) -> None:
    """A seed names one noise stream: an integer in [0, 2**64), else a ValueError."""
    if not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")


def fold_key(*fields: int) -> int:
    """Fold integer key fields into one 64-bit key (order matters; negative fields are rejected)."""
    key = 0
    for value in fields:
        if value < 0:
            raise ValueError(f"noise key fields must be >= 0, got {fields}")
        key = _mix_int(key ^ _mix_int(value))
    return key


def uniform(key: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1) for ``positions`` x ``range(vocab_size)`` under a folded ``key``.

    positions: int64 [P]; returns float64 [P, V] on the positions' device.
    """
    device = positions.device
    pos_key = _mix_tensor(positions.to(torch.int64) ^ _signed(key))  # [P]
    counters = pos_key[:, None] + torch.arange(vocab_size, device=device, dtype=torch.int64)[None, :]  # [P, V]
    bits = _shift_right_logical(_mix_tensor(counters), 11)  # 53 random bits, >= 0
    return ((bits.to(torch.float64) + 0.5) * (2.0**-53)).clamp(max=1.0 - 2.0**-53)  # 2**53 - 0.5 rounds up


def gumbel(key: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise, float64 [P, V], for ``positions`` (int64 [P]) under ``key``."""
    return -torch.log(-torch.log(uniform(key, positions, vocab_size)))


@dataclass(frozen=True)
class NoiseKey:
    """Identifies one request's noise stream: ``(seed, request)``; passes and blocks are added per draw."""

    seed: int
    request: int = 0

    def __post_init__(self) -> None:
        check_seed(self.seed)
        if not 0 <= self.request <= MAX_SEED:
            raise ValueError(f"request index must be in [0, 2**64), got {self.request}")

    def pass_key(self, block: int, pass_index: int) -> int:
        """The folded key of pass ``pass_index`` (counted inside the block) of block ``block``."""
        return fold_key(self.seed, self.request, block, pass_index)

    def gumbel(self, block: int, pass_index: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Gumbel noise float64 [P, V] for the given block positions (int64 [P]) of one pass."""
        return gumbel(self.pass_key(block, pass_index), positions, vocab_size)


@dataclass
class BlockNoise:
    """The Gumbel tables of one block, drawn row by row on demand and shared by drafter and verifier.

    A pure memo over ``NoiseKey.gumbel``: every drawn row of ``table(i)`` equals the same row of
    ``key.gumbel(block, i, arange(L), V)`` bit for bit. The commit rule reads the rows of masked positions only, so
    callers may ask for just those (``positions``); the other rows of the returned table may be zeros. Tables are
    shared: do not modify them. ``forget_before(i)`` drops the tables of rule steps the block has passed.
    """

    key: NoiseKey
    block: int
    block_length: int
    vocab_size: int
    device: torch.device
    _tables: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # step -> float64 [L, V]
    _drawn: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # step -> bool [L]

    def table(self, pass_index: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """float64 [L, V] noise of one rule step; with ``positions`` (bool [L]) only those rows are drawn."""
        if pass_index not in self._tables:
            shape = (self.block_length, self.vocab_size)
            self._tables[pass_index] = torch.zeros(shape, dtype=torch.float64, device=self.device)
            self._drawn[pass_index] = torch.zeros(self.block_length, dtype=torch.bool, device=self.device)
        table, drawn = self._tables[pass_index], self._drawn[pass_index]
        wanted = ~drawn if positions is None else positions.to(self.device) & ~drawn
        missing = wanted.nonzero()[:, 0]  # [P]
        if missing.numel():
            table[missing] = self.key.gumbel(self.block, pass_index, missing, self.vocab_size)
            drawn[missing] = True
        return table

    def tables(self, pass_indices: list[int] | tuple[int, ...], positions: torch.Tensor | None = None) -> torch.Tensor:
        """float64 [K, L, V] noise for K nodes at the given rule-step indices (rows of ``positions`` bool [K, L])."""
        rows = [None] * len(pass_indices) if positions is None else positions
        return torch.stack([self.table(i, wanted) for i, wanted in zip(pass_indices, rows)])

    def forget_before(self, pass_index: int) -> None:
        for old in [i for i in self._tables if i < pass_index]:
            del self._tables[old], self._drawn[old]
