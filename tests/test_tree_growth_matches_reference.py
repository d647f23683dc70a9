"""Fast tree growth builds the very tree of the reference implementation it replaced (kept below verbatim, renamed):
same states, parents and steps in the same node order, over random contexts, scorers, budgets, depths and the sets
proposer."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from spot_dlm.decode import DraftContext
from spot_dlm.drafters.children import PositionScorer, masked_log_normalise
from spot_dlm.drafters.growth import _best_first, grow_tree
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.sets import DEFAULT_CUTOFFS, candidate_sets, sets_children
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule
from spot_dlm.tree import DraftTree, TreeBuilder

torch.set_num_threads(1)

MASK, V = 2, 12

# ------------------------------------------------------------------- the reference: grow_tree before batching

# (log-probability, positions committed together, token rank)
Child = tuple[float, tuple[int, ...], int]
_ReferenceChildProposer = Callable[[torch.Tensor, list[int]], list[list[Child]]]


def _reference_one_commit_children(scorer: PositionScorer, keep: int) -> _ReferenceChildProposer:
    """Children that each commit one position: the ``keep`` most likely positions of every node, each carrying the
    best guess and the position score."""

    def children(states: torch.Tensor, steps: list[int]) -> list[list[Child]]:
        scores = scorer(states, steps).cpu()  # [B, L]; ranked on the host (many tiny ops)
        rows = []
        for row in scores:
            n_children = min(int(torch.isfinite(row).sum()), keep)
            if n_children == 0:
                rows.append([])
                continue
            values, positions = row.topk(n_children)
            rows.append([(v, (p,), 0) for v, p in zip(values.tolist(), positions.tolist())])
        return rows

    return children


@dataclass(frozen=True)
class _ReferenceCandidate:
    state: torch.Tensor  # int64 [L]
    step: int  # rule-step index applied to this state
    logprob: float  # path log-probability from the root
    parent: int  # candidate index of the parent (-1 for the root)
    depth: int


def _reference_grow_tree(
    context: DraftContext,
    budget: int,
    max_depth: int,
    position_logprobs: PositionScorer | None = None,
    guesses: StaleGuesses | None = None,
    children: _ReferenceChildProposer | None = None,
) -> DraftTree:
    """Best-first tree under a node budget (root included) and a depth limit.

    Every edge commits one position (``position_logprobs``) or a set of positions (``children``) with their stale
    coupled tokens; a node's score is its path log-probability. The proposer runs once per depth on the (at most
    budget - 1) best nodes of that depth, batched; the tree keeps the budget - 1 best candidates overall (parents
    always score at least as high as their children).

    Candidate states live on the host: growing a tree is many tiny edits, each a kernel launch and a sync on a GPU.
    The proposer gets each level's states on the context's device (one copy per level) and the finished tree's
    states go back there in one copy.
    """
    guesses = guesses if guesses is not None else StaleGuesses(context)
    if children is None:
        children = _reference_one_commit_children(position_logprobs, budget - 1)
    device = context.root.device
    host_tokens: dict[tuple[int, int], torch.Tensor] = {}  # (step, rank) -> coupled guesses int64 [L] on the host

    def tokens_on_host(step_index: int, rank: int) -> torch.Tensor:
        if (step_index, rank) not in host_tokens:
            host_tokens[(step_index, rank)] = guesses.tokens(step_index, rank).cpu()
        return host_tokens[(step_index, rank)]

    root = context.root.cpu()
    candidates = [_ReferenceCandidate(root, context.root_step, 0.0, -1, 0)]
    best_per_state: dict[bytes, float] = {}  # distinct non-root states -> best path log-probability so far
    level = [0]
    keep = budget - 1
    for _ in range(max_depth):
        if not level or keep == 0:
            break
        states = torch.stack([candidates[i].state for i in level]).to(device)  # [B, L]
        proposals = children(states, [candidates[i].step for i in level])
        next_level = []
        for index, options in zip(level, proposals):
            parent = candidates[index]
            for value, positions, rank in options:
                tokens = tokens_on_host(parent.step, rank)
                child = parent.state.clone()
                where = list(positions)
                child[where] = tokens[where]
                candidates.append(
                    _ReferenceCandidate(child, parent.step + 1, parent.logprob + value, index, parent.depth + 1)
                )
                next_level.append(len(candidates) - 1)
                state_key = child.numpy().tobytes()
                best_per_state[state_key] = max(best_per_state.get(state_key, float("-inf")), candidates[-1].logprob)
        bar = _reference_admission_bar(best_per_state, keep)
        level = [
            i for i in sorted(next_level, key=lambda i: -candidates[i].logprob)[:keep] if candidates[i].logprob > bar
        ]
    order = sorted(range(1, len(candidates)), key=lambda i: (-candidates[i].logprob, candidates[i].depth))
    builder = TreeBuilder(root=root, root_step=context.root_step, mask_id=context.mask_id, max_nodes=budget)
    node_of = {0: 0}
    for index in order:
        if builder.full:
            break
        cand = candidates[index]
        parent_node = node_of.get(cand.parent)
        if parent_node is None:
            continue
        node = builder.add(parent_node, cand.state)
        if node is not None:
            node_of[index] = node
    return builder.build(device)


def _reference_admission_bar(best_per_state: dict[bytes, float], keep: int) -> float:
    """Path log-probability of the keep-th best distinct state so far (-inf while fewer exist).

    A child never scores above its parent, so the children of a node at or below the bar cannot beat the kept set:
    growth stops there. This prunes drafter calls, never the tree's scores (a child of a node exactly at the bar
    could at most tie it, through a probability-1 commit). At budget 2 it saves the second call per round.
    """
    if len(best_per_state) < keep:
        return float("-inf")
    return heapq.nlargest(keep, best_per_state.values())[-1]


def _reference_candidate_sets(join_prob: torch.Tensor, allowed: torch.Tensor, cutoffs: tuple[float, ...], keep: int):
    """Distinct candidate sets of one node with their log-probabilities, best first.

    join_prob float [L] in (0, 1); allowed bool [L]. Returns [(log-prob, positions)] (at most ``keep``).
    """
    if not bool(allowed.any()):
        return []
    q = join_prob.to(torch.float64).clamp(1e-6, 1 - 1e-6)
    order = torch.sort(q.masked_fill(~allowed, -1.0), descending=True, stable=True).indices
    order = order[: int(allowed.sum())]
    sizes = {1} | {max(1, int((q[order] >= c).sum())) for c in cutoffs}
    log_in, log_out = q.log(), (1 - q).log()
    base_out = float(log_out[allowed].sum())
    options = []
    for size in sorted(sizes):
        members = order[:size]
        score = base_out + float((log_in[members] - log_out[members]).sum())
        options.append((score, tuple(members.tolist()), 0))
    return sorted(options, key=lambda o: -o[0])[:keep]


def _reference_sets_children(
    join_probs, cutoffs: tuple[float, ...], keep: int, mask_id: int
) -> _ReferenceChildProposer:
    """ChildProposer from a function (states [B, L], steps) -> join probabilities [B, L]."""

    def children(states: torch.Tensor, steps: list[int]):
        probs = join_probs(states, steps).cpu()  # [B, L]; sets are cut on the host (many tiny ops)
        allowed = states.cpu() == mask_id
        return [_reference_candidate_sets(p, a, cutoffs, keep) for p, a in zip(probs, allowed)]

    return children


# ------------------------------------------------------------------------------------ random inputs


def make_context(temperature: float, seed: int, length: int, kind: str) -> DraftContext:
    """Random stale logits (some positions peaked), a root with one or two positions committed."""
    generator = torch.Generator().manual_seed(seed)
    stale = torch.randn(length, V, generator=generator, dtype=torch.float64) * 3
    parent = torch.full((length,), MASK, dtype=torch.int64)
    root = parent.clone()
    root[seed % length] = 5
    if seed % 3 == 0:
        parent[(seed + 1) % length] = 4  # one position committed before the stale pass
        root[(seed + 1) % length] = 4
    rule = CommitRule(kind, temperature=temperature, tau=0.3)
    return DraftContext(root, parent, stale, 1 + seed % 4, 0, NoiseKey(seed, 3), rule, MASK)


def position_scorer(seed: int, style: str) -> PositionScorer:
    """A random scorer that is a pure function of the node state. Styles: ``smooth`` (normalised over the masked
    positions), ``ties`` (coarse scores: many equal children), ``loose`` (finite scores on committed positions too,
    so children may repeat a state at another depth), ``float32``."""
    generator = torch.Generator().manual_seed(seed)
    bias = torch.randn(64, generator=generator, dtype=torch.float64) * 2
    mixing = torch.randn(64, 64, generator=generator, dtype=torch.float64)

    def scorer(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
        length = states.shape[-1]
        scores = bias[:length] + (states != MASK).to(torch.float64) @ mixing[:length, :length]
        if style == "ties":
            scores = (scores / 2).round()
        if style == "loose":
            return torch.log_softmax(scores, dim=-1)
        scores = masked_log_normalise(scores, states == MASK)
        return scores.float() if style == "float32" else scores

    return scorer


def counting(scorer: PositionScorer) -> PositionScorer:
    """The scorer (or join-probability function), recording each call's (states, steps)."""
    calls: list[tuple[list[list[int]], list[int]]] = []

    def recorded(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
        calls.append((states.tolist(), list(steps)))
        return scorer(states, steps)

    recorded.calls = calls
    return recorded


def join_probs(seed: int):
    """Random join probabilities, a pure function of the node state. -> float [B, L] in (0, 1)"""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(64, 64, generator=generator, dtype=torch.float64)

    def probs(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
        length = states.shape[-1]
        return torch.sigmoid(2 * (states != MASK).to(torch.float64) @ mixing[:length, :length] + 1)

    return probs


def assert_same_tree(fast: DraftTree, reference: DraftTree) -> None:
    assert torch.equal(fast.states, reference.states)
    assert fast.parents == reference.parents
    assert fast.steps == reference.steps
    assert fast.index == reference.index


# ----------------------------------------------------------------------------------------------- tests

BUDGETS, DEPTHS = (1, 2, 3, 4, 8, 16, 32), (1, 2, 4, 8)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.5])
@pytest.mark.parametrize("budget", BUDGETS)
def test_one_commit_trees_match_the_reference(temperature: float, budget: int) -> None:
    draw = random.Random(int(temperature * 10) * 100 + budget)
    for seed in range(10):
        length = draw.choice((6, 8, 16))
        context = make_context(temperature, seed, length, "one")
        for depth in DEPTHS:
            style = draw.choice(("smooth", "ties", "loose", "float32"))
            fast_scorer, reference_scorer = (
                counting(position_scorer(seed, style)),
                counting(position_scorer(seed, style)),
            )
            fast = grow_tree(context, budget, depth, fast_scorer, StaleGuesses(context))
            reference = _reference_grow_tree(context, budget, depth, reference_scorer, StaleGuesses(context))
            assert_same_tree(fast, reference)
            assert fast_scorer.calls == reference_scorer.calls  # the same admission bar: the same levels scored


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.5])
@pytest.mark.parametrize("budget", BUDGETS)
def test_set_trees_match_the_reference(temperature: float, budget: int) -> None:
    draw = random.Random(int(temperature * 10) * 100 + budget)
    for seed in range(6):
        length = draw.choice((6, 8, 16))
        context = make_context(temperature, seed, length, "threshold")
        for depth in DEPTHS:
            fast_probs, reference_probs = counting(join_probs(seed)), counting(join_probs(seed))
            fast_children = sets_children(fast_probs, DEFAULT_CUTOFFS, budget - 1, MASK)
            reference_children = _reference_sets_children(reference_probs, DEFAULT_CUTOFFS, budget - 1, MASK)
            fast = grow_tree(context, budget, depth, children=fast_children)
            reference = _reference_grow_tree(context, budget, depth, children=reference_children)
            assert_same_tree(fast, reference)
            assert fast_probs.calls == reference_probs.calls


@pytest.mark.parametrize("seed", range(20))
def test_candidate_sets_match_the_reference(seed: int) -> None:
    """Same sets, scores (bit for bit) and order, including coarse probabilities (ties) and odd cut-offs."""
    generator = torch.Generator().manual_seed(seed)
    draw = random.Random(seed)
    length = draw.choice((1, 3, 8, 16, 40))
    q = torch.rand(length, generator=generator, dtype=torch.float64)
    if seed % 2:
        q = (q * 4).round() / 4  # ties, and probabilities 0 and 1 (clamped)
    allowed = torch.rand(length, generator=generator) < draw.choice((0.0, 0.3, 0.8, 1.0))
    cutoffs = draw.choice(((), (0.5,), DEFAULT_CUTOFFS, (0.9, 0.9, 0.25, 1e-9)))
    keep = draw.choice((1, 2, 3, 31))
    assert candidate_sets(q, allowed, cutoffs, keep) == _reference_candidate_sets(q, allowed, cutoffs, keep)


@pytest.mark.parametrize("seed", range(10))
def test_best_first_is_a_stable_sort(seed: int) -> None:
    """The lazily sorted order is the stable sort by descending log-probability, whatever the head."""
    rng = np.random.default_rng(seed)
    logprob = rng.integers(-6, 1, 40) / 2  # many ties
    logprob[rng.random(40) < 0.15] = -np.inf
    for head in (1, 2, 5, 20, 39, 40, 41):
        assert list(_best_first(logprob, head)) == np.argsort(-logprob, kind="stable").tolist()
