"""Query layouts and attention masks, derived from per-token attributes (one rule for training and inference).

A token is either *clean* (prompt or finished text, causal) or belongs to a *noisy group* (a block being
decoded, or one candidate state of it). Visibility of key k from query q:

- cached prefix keys: always visible (they precede everything in the query);
- clean k from clean q: ``pos[k] <= pos[q]`` (causal);
- clean k from noisy q: ``pos[k] < block_start[q]`` (everything before the block);
- noisy k from noisy q: same group (bidirectional inside the block or candidate);
- noisy k from clean q: never;
- and, on top of these, a token of one *branch* never sees another branch's tokens (a hand-off row: a complete
  candidate of the block, clean, then the next block after it; ``SHARED`` tokens are seen from every branch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CLEAN = -1  # group id of clean tokens
SHARED = -1  # branch id of tokens every branch sees


@dataclass(frozen=True)
class Layout:
    """Per-token attributes of a query sequence (one row). All int64 [N]."""

    positions: torch.Tensor
    groups: torch.Tensor  # CLEAN for clean tokens, else the noisy group id
    block_starts: torch.Tensor  # first position of the token's block (clean tokens: unused)
    branches: torch.Tensor  # SHARED, or the branch id of tokens only their own branch sees

    def __len__(self) -> int:
        return self.positions.shape[0]


def concat(*layouts: Layout) -> Layout:
    return Layout(
        positions=torch.cat([lay.positions for lay in layouts]),
        groups=torch.cat([lay.groups for lay in layouts]),
        block_starts=torch.cat([lay.block_starts for lay in layouts]),
        branches=torch.cat([lay.branches for lay in layouts]),
    )


def clean_layout(start: int, length: int, device: torch.device | None = None, branch: int = SHARED) -> Layout:
    positions = torch.arange(start, start + length, device=device)
    return Layout(
        positions=positions,
        groups=torch.full_like(positions, CLEAN),
        block_starts=positions.clone(),
        branches=torch.full_like(positions, branch),
    )


def block_layout(
    start: int, length: int, group: int, device: torch.device | None = None, branch: int = SHARED
) -> Layout:
    positions = torch.arange(start, start + length, device=device)
    return Layout(
        positions=positions,
        groups=torch.full_like(positions, group),
        block_starts=torch.full_like(positions, start),
        branches=torch.full_like(positions, branch),
    )


def visibility(query: Layout, key: Layout) -> torch.Tensor:
    """bool [Nq, Nk]: may query token attend to key token (keys all in the query sequence, no cache)."""
    q_clean = (query.groups == CLEAN)[:, None]
    k_clean = (key.groups == CLEAN)[None, :]
    causal = key.positions[None, :] <= query.positions[:, None]
    before_block = key.positions[None, :] < query.block_starts[:, None]
    same_group = key.groups[None, :] == query.groups[:, None]
    clean_key = torch.where(q_clean, causal, before_block)
    noisy_key = ~q_clean & same_group
    same_branch = (key.branches[None, :] == SHARED) | (key.branches[None, :] == query.branches[:, None])
    return torch.where(k_clean, clean_key, noisy_key) & same_branch


def attention_mask(layout: Layout, n_past: int) -> torch.Tensor:
    """bool [N, n_past + N] for a query sequence that follows ``n_past`` cached clean tokens."""
    past = torch.ones(len(layout), n_past, dtype=torch.bool, device=layout.positions.device)
    return torch.cat([past, visibility(layout, layout)], dim=1)


def two_stream_layout(seq_len: int, block_length: int, device: torch.device | None = None) -> Layout:
    """Training layout [clean x_0 .. x_{T-1} ; noisy x_0 .. x_{T-1}], noisy side cut into blocks."""
    if seq_len % block_length:
        raise ValueError(f"sequence length {seq_len} is not a multiple of block length {block_length}")
    noisy = [block_layout(s, block_length, s // block_length, device) for s in range(0, seq_len, block_length)]
    return concat(clean_layout(0, seq_len, device), *noisy)
