"""What a decoder needs from a target DLM.

A target is used block by block: ``prefill`` the prompt into a prefix cache; ``score`` K candidate states of the
current block in one forward pass that shares the prefix (optionally writing the previous, finished block into the
cache in that same pass; with no cache, ``finished`` is the prompt: decoding prefills it in the first block's
pass); ``write`` a finished block without scoring anything. A target may also ``score_handoffs``: candidate states
and complete candidates of the block, each scored as the finished block before the all-mask next block, in one
pass (``scores_handoffs``). Every call is one pass, counted with the query tokens it processed.
"""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass(frozen=True)
class HandoffScore:
    """One pass over a round's candidate states and its hand-offs: complete candidates of the block, each scored as
    the finished block before the all-mask next block (what that block's first pass would compute)."""

    logits: torch.Tensor  # [K, L, V]: the target's output at each candidate state
    next_logits: torch.Tensor  # [M, L, V]: at the all-mask next block after each complete candidate
    opening: Callable[[int], Any]  # m -> the prefix cache with complete candidate m written (no pass)


@runtime_checkable
class Target(Protocol):
    name: str
    vocab_size: int
    mask_id: int
    eos_id: int
    max_length: int  # prompt + generation must fit
    counter: PassCounter
    device: torch.device  # where its weights live (drafters run beside them)

    def prefill(self, prompt_ids: torch.Tensor) -> Any:
        """prompt_ids int64 [P] -> prefix cache."""

    def score(self, cache: Any, blocks: torch.Tensor, finished: torch.Tensor | None = None) -> ScoreResult:
        """blocks int64 [K, L] (candidate states of the block after the cache and ``finished``) -> logits; cache
        None: nothing before ``finished`` (the prompt, prefilled in this pass)."""

    def write(self, cache: Any, finished: torch.Tensor) -> Any:
        """Append a finished block (int64 [L]) to the prefix cache in its own pass."""


@runtime_checkable
class Codec(Protocol):
    """Text <-> token ids for a target: its tokenizer, and the prompt template questions are wrapped in."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def encode_prompt(self, question: str) -> list[int]:
        """A question in the model's prompt template (chat template for instruct checkpoints)."""


def scores_handoffs(target: Target) -> bool:
    """Whether a target can score hand-offs (``score_handoffs(cache, blocks [K, L], handoffs [M, L]) ->
    HandoffScore``, one pass): then a round may also draft the next block's first pass."""
    return callable(getattr(target, "score_handoffs", None))
