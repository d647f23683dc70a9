"""What a decoder needs from a target DLM.

A target is used block by block: ``prefill`` the prompt into a prefix cache; ``score`` K candidate states of the
current block in one forward pass that shares the prefix (optionally writing the previous, finished block into the
cache in that same pass); ``write`` a finished block without scoring anything. Every call is one pass, counted with
the query tokens it processed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class PassCounter:
    """Target passes and query tokens processed (a batched forward over K states is one pass)."""

    passes: int = 0
    query_tokens: int = 0

    def record(self, query_tokens: int) -> None:
        self.passes += 1
        self.query_tokens += query_tokens

    def snapshot(self) -> tuple[int, int]:
        return self.passes, self.query_tokens


@dataclass(frozen=True)
class ScoreResult:
    logits: torch.Tensor  # [K, L, V]: the target's output at each candidate state
    cache: Any  # the prefix cache, extended by the finished block when one was passed


@runtime_checkable
class Target(Protocol):
    name: str
    vocab_size: int
    mask_id: int
    eos_id: int
    max_length: int  # prompt + generation must fit
    counter: PassCounter

    def prefill(self, prompt_ids: torch.Tensor) -> Any:
        """prompt_ids int64 [P] -> prefix cache."""

    def score(self, cache: Any, blocks: torch.Tensor, finished: torch.Tensor | None = None) -> ScoreResult:
        """blocks int64 [K, L] (candidate states of the block after the cache and ``finished``) -> logits."""

    def write(self, cache: Any, finished: torch.Tensor) -> Any:
        """Append a finished block (int64 [L]) to the prefix cache in its own pass."""
