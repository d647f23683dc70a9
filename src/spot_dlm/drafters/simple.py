"""Training-free drafters: stale-confidence order, random order, and the oracles (the true trajectory; the true
order with stale tokens)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from spot_dlm.decode import DraftContext, RawGeneration
from spot_dlm.drafters.children import masked_log_normalise
from spot_dlm.drafters.growth import grow_tree
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.neighbours import NeighbourTokens
from spot_dlm.tree import DEFAULT_DEPTH, DraftTree, TreeBuilder


@dataclass(frozen=True)
class StaleConfidenceDrafter:
    """Orders masked positions by the stale confidence of their coupled token (training-free)."""

    budget: int = 16
    depth: int = DEFAULT_DEPTH
    name: str = "stale-confidence"

    def propose(self, context: DraftContext) -> DraftTree:
        guesses = StaleGuesses(context)

        def scorer(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
            confidence = torch.stack([guesses.at(s).confidence for s in steps]).clamp_min(1e-30)  # [B, L]
            return masked_log_normalise(confidence.log(), states == context.mask_id)

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
    depth: int = DEFAULT_DEPTH
    token_noise: float = 0.3
    salt: int = 0
    name: str = "random"

    def propose(self, context: DraftContext) -> DraftTree:
        generator = torch.Generator().manual_seed(_context_seed(context, self.salt))
        guesses = StaleGuesses(context)
        vocab = context.stale_logits.shape[-1]
        steps = range(context.root_step, context.root_step + self.depth + 1) if context.rule.needs_noise else (0,)
        for step_index in steps:  # without noise all steps share one cached guess: perturb it once
            proposal = guesses.at(step_index)
            swap = torch.rand(proposal.tokens.shape, generator=generator) < self.token_noise
            random_tokens = torch.randint(0, vocab, proposal.tokens.shape, generator=generator)
            random_tokens = random_tokens.masked_fill(random_tokens == context.mask_id, 0)
            device = proposal.tokens.device
            proposal.tokens.copy_(torch.where(swap.to(device), random_tokens.to(device), proposal.tokens))

        def scorer(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
            scores = torch.randn(states.shape, generator=generator).to(states.device)
            return masked_log_normalise(scores, states == context.mask_id)

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
    """Drafts the true trajectory (from a reference run of the same rule): the ceiling for any drafter.

    With ``stale_tokens`` it knows the true commit *order* only and commits the stale coupled guesses, as every
    drafter must (the "order oracle"): its chain leaves the trajectory at the first guess the target changes. The
    gap between the two is what stale tokens cost; the gap between the order oracle and a drafter is what its order
    predictions cost. With ``neighbours`` the guesses are re-ranked by the chain's fresh neighbours, as SPOT's are.
    """

    references: dict[int, RawGeneration]  # request index -> reference decoding of that request
    block_length: int
    budget: int = 16
    depth: int = DEFAULT_DEPTH
    stale_tokens: bool = False
    name: str = "oracle"
    neighbours: NeighbourTokens | None = None
    _states: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)

    def propose(self, context: DraftContext) -> DraftTree:
        key = (context.noise.request, context.block_index)
        if key not in self._states:
            reference = self.references[context.noise.request]
            self._states[key] = true_states(reference, context.block_index, self.block_length, context.mask_id)
        states = [state.to(context.root.device) for state in self._states[key]]
        guesses = StaleGuesses(context, self.neighbours) if self.stale_tokens else None
        builder = TreeBuilder.rooted(context, self.budget)
        node, state = 0, context.root
        for offset in range(1, self.depth + 1):
            index = context.root_step + offset
            if index >= len(states) or builder.full:
                break
            if guesses is None:
                state = states[index]
            else:  # the true next position, the stale guess's token (off the trajectory once a guess is wrong)
                position = states[index] != states[index - 1]
                state = torch.where(position, self._guess(guesses, index - 1, state, position), state)
            node = builder.add(node, state)
            if node is None or not torch.equal(state, states[index]):
                break
        return builder.build()

    def _guess(self, guesses: StaleGuesses, step: int, state: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Tokens int64 [L] whose entries at ``position`` (bool [L]) are the guesses for committing them from
        ``state`` by rule step ``step``."""
        tokens = guesses.at(step).tokens
        if self.neighbours is None:
            return tokens
        at = torch.nonzero(position).flatten().cpu().numpy()
        parents = np.repeat(state.cpu().numpy()[None], len(at), axis=0)  # [P, L]
        best = guesses.child_guesses(step, parents, at, 1)[0][0]  # [P]
        return tokens.clone().index_put_((torch.from_numpy(at).to(tokens.device),), torch.from_numpy(best).to(tokens))


def ranked_allowed(confidence: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Allowed positions sorted by confidence, highest first (ties: lowest position). -> int64 [n_allowed]"""
    order = torch.sort(confidence.masked_fill(~allowed, float("-inf")), descending=True, stable=True).indices
    return order[: int(allowed.sum())]


def grow_rank_tree(context: DraftContext, rank_paths: list[tuple[int, ...]], budget: int) -> DraftTree:
    """A static tree given as stale-confidence rank paths, e.g. (0,), (1,), (0, 0): the k-th most confident
    still-masked position, under the coupled guesses of each node's step. Paths are used in the given order."""
    guesses = StaleGuesses(context)
    builder = TreeBuilder.rooted(context, budget)
    nodes: dict[tuple[int, ...], int | None] = {(): 0}
    for path in rank_paths:
        parent = nodes.get(path[:-1])
        if parent is None or builder.full:
            nodes[path] = None
            continue
        state = builder.states[parent]
        proposal = guesses.at(builder.steps[parent])
        ranked = ranked_allowed(proposal.confidence, state == context.mask_id)
        if path[-1] >= ranked.shape[0]:
            nodes[path] = None
            continue
        child = state.clone()
        position = ranked[path[-1]]
        child[position] = proposal.tokens[position]
        nodes[path] = builder.add(parent, child)
    return builder.build()


@dataclass(frozen=True)
class ChainDrafter:
    """FreeDave-style chain: candidate k commits the k + 1 most confident stale positions (one path)."""

    budget: int = 16
    depth: int = DEFAULT_DEPTH
    name: str = "chain"

    def propose(self, context: DraftContext) -> DraftTree:
        length = min(self.budget - 1, self.depth)
        return grow_rank_tree(context, [(0,) * d for d in range(1, length + 1)], self.budget)


@dataclass(frozen=True)
class CalibratedDrafter:
    """Spiffy-style static draft graph: the rank paths most often taken on calibration prompts."""

    rank_paths: tuple[tuple[int, ...], ...]
    budget: int = 16
    name: str = "calibrated"

    def propose(self, context: DraftContext) -> DraftTree:
        return grow_rank_tree(context, list(self.rank_paths), self.budget)
