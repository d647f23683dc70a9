"""Training-free drafters: stale-confidence order, random order, and the oracle (the true trajectory)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from spot_dlm.decode import DraftContext, RawGeneration
from spot_dlm.drafters.base import StaleGuesses, grow_tree, masked_log_normalise
from spot_dlm.tree import DraftTree, TreeBuilder


@dataclass(frozen=True)
class StaleConfidenceDrafter:
    """Orders masked positions by the stale confidence of their coupled token (training-free)."""

    budget: int = 16
    depth: int = 8
    name: str = "stale-confidence"

    def propose(self, context: DraftContext) -> DraftTree:
        guesses = StaleGuesses(context)

        def scorer(state: torch.Tensor, step_index: int) -> torch.Tensor:
            confidence = guesses.at(step_index).confidence.clamp_min(1e-30)
            return masked_log_normalise(confidence.log(), state == context.mask_id)

        return grow_tree(context, self.budget, self.depth, scorer, guesses)


def _context_seed(context: DraftContext, salt: int) -> int:
    """A seed that is a pure function of the draft context (keeps random drafters reproducible)."""
    digest = hashlib.blake2b(context.root.cpu().numpy().tobytes(), digest_size=8)
    digest.update(f"{context.noise.seed},{context.noise.request},{context.block_index},{salt}".encode())
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass(frozen=True)
class RandomDrafter:
    """Random positions and, with probability ``token_noise``, random tokens: a drafter that is mostly wrong."""

    budget: int = 16
    depth: int = 8
    token_noise: float = 0.3
    salt: int = 0
    name: str = "random"

    def propose(self, context: DraftContext) -> DraftTree:
        generator = torch.Generator().manual_seed(_context_seed(context, self.salt))
        guesses = StaleGuesses(context)
        vocab = context.stale_logits.shape[-1]
        for step_index in range(context.root_step, context.root_step + self.depth + 1):
            proposal = guesses.at(step_index)
            swap = torch.rand(proposal.tokens.shape, generator=generator) < self.token_noise
            random_tokens = torch.randint(0, vocab, proposal.tokens.shape, generator=generator)
            random_tokens = random_tokens.masked_fill(random_tokens == context.mask_id, 0)
            proposal.tokens.copy_(torch.where(swap, random_tokens.to(proposal.tokens.device), proposal.tokens))

        def scorer(state: torch.Tensor, step_index: int) -> torch.Tensor:
            scores = torch.randn(state.shape, generator=generator).to(state.device)
            return masked_log_normalise(scores, state == context.mask_id)

        return grow_tree(context, self.budget, self.depth, scorer, guesses)


def true_states(reference: RawGeneration, block_index: int, block_length: int, mask_id: int) -> list[torch.Tensor]:
    """The states standard decoding passed through in one block: state[c] is the block before rule step c."""
    lo = block_index * block_length
    tokens = reference.token_ids[lo : lo + block_length]
    steps = reference.commit_step[lo : lo + block_length]
    n_steps = int(steps.max()) + 1
    return [torch.where(steps < c, tokens, torch.full_like(tokens, mask_id)) for c in range(n_steps + 1)]


@dataclass
class OracleDrafter:
    """Drafts the true trajectory (from a reference run of the same rule): the ceiling for any drafter."""

    references: dict[int, RawGeneration]  # request index -> reference decoding of that request
    block_length: int
    budget: int = 16
    depth: int = 8
    name: str = "oracle"
    _states: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)

    def propose(self, context: DraftContext) -> DraftTree:
        key = (context.noise.request, context.block_index)
        if key not in self._states:
            reference = self.references[context.noise.request]
            self._states[key] = true_states(reference, context.block_index, self.block_length, context.mask_id)
        states = self._states[key]
        builder = TreeBuilder(context.root, context.root_step, context.mask_id, self.budget)
        node = 0
        for offset in range(1, self.depth + 1):
            index = context.root_step + offset
            if index >= len(states) or builder.full:
                break
            node = builder.add(node, states[index].to(context.root.device))
            if node is None:
                break
        return builder.build()
