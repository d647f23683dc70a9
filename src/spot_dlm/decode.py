"""The decoding loop: standard, threshold and speculative decoding are one loop with a pluggable drafter.

Per block the loop holds a state ``s`` and the target's logits ``Z(s)``:

1. free commit: ``s1 = step(s, Z(s), noise[c])`` (no pass; ``c`` counts rule steps inside the block);
2. draft: the drafter proposes a tree of candidate next states rooted at ``s1`` (the no-op drafter proposes the
   root only, which is standard decoding);
3. verify: one target pass scores every node;
4. accept: walk from the root while the rule's true next state is a node of the tree; the deepest accepted node
   and its logits become ``s`` and ``Z(s)``, and its true next state is the next free commit.

Nothing unverified is kept, so every drafter yields exactly the tokens of the drafter-free loop with the same rule
and keyed noise. The last commit of a block needs no pass; the finished block is written into the prefix cache
by the next block's first pass. With a target that scores hand-offs, a round may also draft complete candidates
of the block: the pass scores the next block's all-mask state after each, and when the walk ends on one, that is
the next block's first pass (its logits and the cache with the block written), so the next block opens without
a pass of its own.

One module, longer than most: the round (commit, draft, verify, accept) and the two block loops that run it
(``decode_ids`` over a prefix cache, ``decode_canvas`` over a family's canvas) share their state and invariants, and
exactness is easiest to check with them side by side.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from spot_dlm.models.base import Target, scores_handoffs
from spot_dlm.noise import BlockNoise, NoiseKey
from spot_dlm.rules import CommitRule, Proposal, StepResult, step
from spot_dlm.tree import DraftTree, root_only


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may read: the free-commit root, the stale logits it came from, and the rule's setting."""

    root: torch.Tensor  # int64 [L]: s1, the state after the free commit
    parent: torch.Tensor  # int64 [L]: s, the state the stale logits were computed on
    stale_logits: torch.Tensor  # [L, V]: Z(s)
    root_step: int  # index of the rule step that will be applied to the root
    block_index: int
    noise: NoiseKey
    rule: CommitRule
    mask_id: int
    block_noise: BlockNoise | None = None  # the loop's memo of this block's noise tables (None: draw afresh)
    previous_logits: torch.Tensor | None = None  # [L, V]: Z of the state one commit before ``parent`` (None: none)
    proposal: Proposal | None = None  # the rule's proposal at ``parent`` for the free commit (None: not given)
    prefix: torch.Tensor | None = None  # int64 [P]: the clean text before the block, prompt and finished blocks
    block_memo: dict | None = None  # the loop's memo for what a drafter computes once per block (None: per round)
    handoffs: bool = False  # a next block follows and the target scores hand-offs: complete candidates may be drafted
    stop_id: int | None = None  # decoding ends after a block holding this token (EOS under stop_at_eos): no hand-off

    def gumbel(self, step_index: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Keyed noise of rule step ``step_index``, float64 [L, V] (shared: do not modify); with ``positions``
        (bool [L]) only those rows are guaranteed, the others may be zeros."""
        if self.block_noise is not None:
            return self.block_noise.table(step_index, positions)
        positions = torch.arange(self.root.shape[0], device=self.root.device)
        return self.noise.gumbel(self.block_index, step_index, positions, self.stale_logits.shape[-1])


class Drafter(Protocol):
    name: str

    def propose(self, context: DraftContext) -> DraftTree: ...


@dataclass(frozen=True)
class StepRecord:
    """One rule step as standard decoding sees it (given to an observer, e.g. trajectory logging)."""

    block_index: int
    step_index: int
    state: torch.Tensor  # int64 [L]: the state the step was applied to
    logits: torch.Tensor  # [L, V]: the target's logits at that state
    next_state: torch.Tensor  # int64 [L]
    prefix: torch.Tensor | None = None  # int64 [P]: the clean text before the block (prompt, finished blocks)


Observer = Callable[[StepRecord], None]


@dataclass(frozen=True)
class NoDrafter:
    """Proposes nothing beyond the free commit: the loop reduces to plain (standard or threshold) decoding."""

    name: str = "none"

    def propose(self, context: DraftContext) -> DraftTree:
        return root_only(context.root, context.root_step, context.mask_id)


@dataclass
class DecodeStats:
    target_passes: int = 0
    query_tokens: int = 0
    wall_seconds: float = 0.0
    draft_seconds: float = 0.0
    rule_steps: int = 0  # rule applications (commits, for one-commit decoding)
    committed_tokens: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)  # per verify pass: free commit + accepted nodes
    handoff_blocks: int = 0  # blocks opened by a hand-off (their first pass done in the previous block's round)
    round_endings: Counter = field(default_factory=Counter)  # per verify pass: why its walk stopped (ROUND_ENDINGS)

    def merge(self, other: DecodeStats) -> None:
        self.target_passes += other.target_passes
        self.query_tokens += other.query_tokens
        self.wall_seconds += other.wall_seconds
        self.draft_seconds += other.draft_seconds
        self.rule_steps += other.rule_steps
        self.committed_tokens += other.committed_tokens
        self.accepted_lengths.update(other.accepted_lengths)
        self.handoff_blocks += other.handoff_blocks
        self.round_endings.update(other.round_endings)

    @property
    def mean_accepted(self) -> float:
        total = sum(self.accepted_lengths.values())
        return sum(k * v for k, v in self.accepted_lengths.items()) / total if total else 0.0

    def to_dict(self) -> dict:
        return {
            "target_passes": self.target_passes,
            "query_tokens": self.query_tokens,
            "wall_seconds": self.wall_seconds,
            "draft_seconds": self.draft_seconds,
            "rule_steps": self.rule_steps,
            "committed_tokens": self.committed_tokens,
            "mean_accepted": self.mean_accepted,
            "commits_per_pass": self.committed_tokens / self.target_passes if self.target_passes else 0.0,
            "draft_time_share": self.draft_seconds / self.wall_seconds if self.wall_seconds else 0.0,
            "accepted_lengths": {str(k): v for k, v in sorted(self.accepted_lengths.items())},
            "handoff_blocks": self.handoff_blocks,
            "round_endings": dict(sorted(self.round_endings.items())),
        }


@dataclass(frozen=True)
class DecodeSettings:
    rule: CommitRule
    block_length: int
    gen_length: int
    stop_at_eos: bool = True
    handoffs: bool = True  # draft the next block's first pass where the target can score it (no effect on tokens)
    # a real family's own pass (``family_rules``: ``step(tokens, logits, gumbel, steps, window)``) in place of
    # ``rule``, which drafters still read for the temperature and the kind of rule
    family_rule: object | None = None


@dataclass(frozen=True)
class BlockOpening:
    """A block's first pass, done by the previous block's last round (a hand-off)."""

    logits: torch.Tensor  # [L, V]: the target's logits at the all-mask block
    cache: object  # the prefix cache with the previous block written


@dataclass(frozen=True)
class RawGeneration:
    token_ids: torch.Tensor  # int64 [G']: every decoded block (G' <= gen_length; less after an EOS stop)
    commit_step: torch.Tensor  # int64 [G']: rule-step index (inside its block) that committed each position
    commit_pass: torch.Tensor  # int64 [G']: request pass count when the position was committed
    stats: DecodeStats


@dataclass
class _BlockTrace:
    """Per-position record of when a block's positions were committed."""

    step: torch.Tensor  # int64 [L]
    pass_no: torch.Tensor  # int64 [L]

    def mark(self, before: torch.Tensor, after: torch.Tensor, mask_id: int, step_index: int, pass_no: int) -> int:
        filled = (before == mask_id) & (after != mask_id)
        self.step[filled] = step_index
        self.pass_no[filled] = pass_no
        return int(filled.sum())


def step_noise(
    block_noise: BlockNoise, steps: tuple[int, ...], rule: CommitRule, states: torch.Tensor, mask_id: int
) -> torch.Tensor | None:
    """Keyed Gumbel noise for nodes at the given rule-step indices: float64 [N, L, V] (rows of the positions masked
    in ``states`` [N, L]; the rule reads no others), or None at T = 0."""
    return block_noise.tables(steps, states == mask_id) if rule.needs_noise else None


def _apply_rule(
    states: torch.Tensor,
    logits: torch.Tensor,
    steps: tuple[int, ...],
    settings: DecodeSettings,
    block_noise: BlockNoise,
    mask_id: int,
    window=None,
) -> StepResult:
    """The rule's step for every node: true next states [N, L] and the proposal they came from.
    states [N, L], logits [N, L, V]; ``window``: where a family rule ranks positions (``family_rules.Window``)"""
    noise = step_noise(block_noise, steps, settings.rule, states, mask_id)
    if settings.family_rule is not None:
        return settings.family_rule.step(states, logits, noise, steps, window)
    return step(states, logits, noise, settings.rule, mask_id)


def _row(proposal: Proposal, node: int) -> Proposal:
    return Proposal(tokens=proposal.tokens[node], confidence=proposal.confidence[node])


def _accept(tree: DraftTree, next_states: torch.Tensor) -> list[int]:
    """Acceptance walk by state equality: the accepted node path from the root (root included)."""
    path = [0]
    while (child := tree.lookup(next_states[path[-1]], tree.steps[path[-1]] + 1)) is not None:
        path.append(child)
    return path


# Why an acceptance walk stops at its deepest accepted node ``a`` (its true next state ``n`` is not in the tree). The
# walk looks states up in the whole tree, so a's "children" are all nodes one rule step below it that extend it.
ROUND_ENDINGS = (
    "wrong token",  # a child fills exactly n's new positions, with other tokens
    "wrong position",  # a has children, none fills exactly n's new positions
    "leaf",  # a has no children (the budget or depth ran out there; always so for drafter-free decoding)
    "hand-off",  # n completes the block and was drafted as a hand-off: the next block opens without a pass
    "block end",  # n completes the block, not handed off (last block, EOS, or not drafted)
)


def round_ending(tree: DraftTree, node: int, next_state: torch.Tensor, mask_id: int) -> str:
    """Why the walk stopped at ``node`` whose true next state is ``next_state`` (int64 [L]); see ``ROUND_ENDINGS``."""
    if not bool((next_state == mask_id).any()):
        return "hand-off" if tree.handoff(next_state) is not None else "block end"
    one_below = [i for i, step in enumerate(tree.steps) if step == tree.steps[node] + 1]
    if not one_below:
        return "leaf"
    state = tree.states[node]  # [L]
    masked = state == mask_id  # [L]
    below = tree.states[one_below]  # [B, L]
    extends = ((below == state) | masked).all(-1)  # [B]: filled where ``state`` is, and agreeing there
    if not bool(extends.any()):
        return "leaf"
    filled = masked & (below[extends] != mask_id)  # [C, L]: each child's new positions
    same_positions = (filled == (masked & (next_state != mask_id))).all(-1)  # [C]
    return "wrong token" if bool(same_positions.any()) else "wrong position"


def _verify(target: Target, cache, tree: DraftTree):
    """One target pass over the tree's nodes (and its hand-offs, if any). -> (logits [N, L, V], HandoffScore or
    None)"""
    if not tree.n_handoffs:
        return target.score(cache, tree.states).logits, None
    scored = target.score_handoffs(cache, tree.states, tree.handoffs)
    return scored.logits, scored


def _opening(tree: DraftTree, scored, next_state: torch.Tensor, mask_id: int) -> BlockOpening | None:
    """The next block's first pass when the round's true next state completes the block and was handed off."""
    if scored is None or bool((next_state == mask_id).any()):
        return None
    handoff = tree.handoff(next_state)
    return None if handoff is None else BlockOpening(scored.next_logits[handoff], scored.opening(handoff))


def _check_passes(settings: DecodeSettings, step_index: int, length: int) -> None:
    """A block still masked after its rule's last scheduled pass (a family's schedule, else one commit per pass) got
    there by committing the mask token itself; the authors carry such positions on, which is not reproduced."""
    from spot_dlm.family_rules import MaskTokenChosen

    passes = getattr(settings.family_rule, "passes", None) or length
    if step_index >= passes:
        raise MaskTokenChosen(
            f"the block still holds masks after {passes} passes: the model committed its mask token, which the "
            "authors' loop leaves masked for later (not reproduced)"
        )


def decode_block(
    target: Target,
    cache,
    finished: torch.Tensor | None,
    block_index: int,
    settings: DecodeSettings,
    key: NoiseKey,
    drafter: Drafter,
    stats: DecodeStats,
    first_pass: int,
    observer: Observer | None = None,
    prefix: torch.Tensor | None = None,
    opening: BlockOpening | None = None,
    handoffs: bool = False,
    initial: torch.Tensor | None = None,
    window=None,
) -> tuple[torch.Tensor, object, _BlockTrace, BlockOpening | None]:
    """Decode one block from all-mask to complete; returns (block [L], cache, trace, the next block's opening if
    the last round handed it off). ``prefix`` (int64 [P]: the prompt and the finished blocks) is handed to drafters
    that read the text before the block; ``opening`` replaces this block's first pass (``finished`` is then in its
    cache already); ``handoffs``: drafters may hand off to the next block."""
    mask_id, length = target.mask_id, settings.block_length
    stop_id = target.eos_id if settings.stop_at_eos else None  # no hand-off of a block that ends decoding
    device = getattr(target, "device", torch.device("cpu"))
    state = torch.full((length,), mask_id, dtype=torch.int64, device=device) if initial is None else initial.clone()
    trace = _BlockTrace(
        step=torch.full((length,), -1, device=device), pass_no=torch.full((length,), -1, device=device)
    )
    if opening is None:
        scored = target.score(cache, state[None], finished)
        cache, logits = scored.cache, scored.logits[0]
    else:
        cache, logits = opening.cache, opening.logits
        stats.handoff_blocks += 1
    step_index, opening = 0, None
    block_noise = BlockNoise(key, block_index, length, logits.shape[-1], logits.device)
    block_memo: dict = {}  # drafters' per-block results (a small LM's prefix cache and scored states)
    stepped = _apply_rule(state[None], logits[None], (0,), settings, block_noise, mask_id, window)
    next_state, proposal = stepped.tokens[0], _row(stepped.proposal, 0)

    def passes() -> int:
        return target.counter.passes - first_pass

    previous_logits = None  # Z of the state one rule step before the one ``logits`` belong to
    while True:
        stats.committed_tokens += trace.mark(state, next_state, mask_id, step_index, passes())
        stats.rule_steps += 1
        if observer is not None:
            observer(StepRecord(block_index, step_index, state, logits, next_state, prefix))
        parent, state, step_index = state, next_state, step_index + 1
        if not bool((state == mask_id).any()):
            return state, cache, trace, opening
        _check_passes(settings, step_index, length)
        block_noise.forget_before(step_index)
        tick = time.perf_counter()
        context = DraftContext(
            root=state,
            parent=parent,
            stale_logits=logits,
            root_step=step_index,
            block_index=block_index,
            noise=key,
            rule=settings.rule,
            mask_id=mask_id,
            block_noise=block_noise,
            previous_logits=previous_logits,
            proposal=proposal,
            prefix=prefix,
            block_memo=block_memo,
            handoffs=handoffs,
            stop_id=stop_id,
        )
        tree = drafter.propose(context)
        stats.draft_seconds += time.perf_counter() - tick
        node_logits, scored = _verify(target, cache, tree)  # [N, L, V]
        stepped = _apply_rule(tree.states, node_logits, tree.steps, settings, block_noise, mask_id, window)
        next_states = stepped.tokens
        path = _accept(tree, next_states)
        stats.accepted_lengths[len(path)] += 1
        stats.round_endings[round_ending(tree, path[-1], next_states[path[-1]], mask_id)] += 1
        for a, b in zip(path, path[1:]):
            stats.committed_tokens += trace.mark(tree.states[a], tree.states[b], mask_id, tree.steps[a], passes())
            stats.rule_steps += 1
            if observer is not None:
                record = StepRecord(block_index, tree.steps[a], tree.states[a], node_logits[a], tree.states[b], prefix)
                observer(record)
        node = path[-1]
        previous_logits = node_logits[path[-2]] if len(path) > 1 else logits
        state, logits, step_index, next_state = (
            tree.states[node],
            node_logits[node],
            tree.steps[node],
            next_states[node],
        )
        proposal = _row(stepped.proposal, node)
        opening = _opening(tree, scored, next_state, mask_id)


def _generation(target, stats: DecodeStats, started: tuple, blocks, steps, pass_nos, skip: int = 0) -> RawGeneration:
    """The decoded blocks (less their first ``skip`` positions: a prompt tail) and the stats since ``started`` =
    (target passes, query tokens, perf_counter) at the start."""
    start_passes, start_tokens, start_time = started
    stats.target_passes = target.counter.passes - start_passes
    stats.query_tokens = target.counter.query_tokens - start_tokens
    stats.wall_seconds = time.perf_counter() - start_time
    return RawGeneration(
        token_ids=torch.cat(blocks)[skip:].cpu(),
        commit_step=torch.cat(steps)[skip:].cpu(),
        commit_pass=torch.cat(pass_nos)[skip:].cpu(),
        stats=stats,
    )


def decode_ids(
    target: Target,
    prompt_ids: torch.Tensor,
    settings: DecodeSettings,
    drafter: Drafter,
    key: NoiseKey,
    observer: Observer | None = None,
) -> RawGeneration:
    """Decode one prompt block by block (stopping after a block holding EOS when ``stop_at_eos``); a real family's
    target (one with a ``plan``) decodes on its authors' canvas (``decode_canvas``)."""
    if prompt_ids.ndim != 1 or prompt_ids.shape[0] == 0:
        raise ValueError("the prompt must be a non-empty 1-D tensor of token ids")
    if callable(getattr(target, "plan", None)):
        return decode_canvas(target, prompt_ids, settings, drafter, key, observer)
    start_passes, start_tokens = target.counter.snapshot()
    start_time = time.perf_counter()
    stats = DecodeStats()
    cache = None  # the first block's first pass prefills the prompt (written as its finished text), one pass
    blocks, steps, pass_nos = [], [], []
    finished, opening = prompt_ids, None
    n_blocks = settings.gen_length // settings.block_length
    can_hand_off = settings.handoffs and scores_handoffs(target)
    for block_index in range(n_blocks):
        prefix = torch.cat([prompt_ids, *(block.to(prompt_ids.device) for block in blocks)])  # [P]
        hand_off = can_hand_off and block_index + 1 < n_blocks
        finished, cache, trace, opening = decode_block(
            target,
            cache,
            finished,
            block_index,
            settings,
            key,
            drafter,
            stats,
            start_passes,
            observer,
            prefix=prefix,
            opening=opening,
            handoffs=hand_off,
        )
        blocks.append(finished)
        steps.append(trace.step)
        pass_nos.append(trace.pass_no)
        if settings.stop_at_eos and bool((finished == target.eos_id).any()):
            break
    return _generation(target, stats, (start_passes, start_tokens, start_time), blocks, steps, pass_nos)


def _holds_stop(target, plan, block_index: int, trace: _BlockTrace, block: torch.Tensor) -> bool:
    """Does a finished block end decoding: a stop token among its generated positions, or (``stop_counts ==
    "committed"``) among those the rule committed."""
    stops = torch.tensor(target.stop_ids, device=block.device)
    counted = torch.ones_like(block, dtype=torch.bool)
    if block_index == 0:
        counted[: plan.tail] = False
    if target.stop_counts == "committed":
        counted &= trace.step >= 0
    return bool((torch.isin(block, stops) & counted).any())


def decode_canvas(
    target,
    prompt_ids: torch.Tensor,
    settings: DecodeSettings,
    drafter: Drafter,
    key: NoiseKey,
    observer: Observer | None = None,
) -> RawGeneration:
    """Decode one prompt on a real family's canvas (``models/family_targets.py``): the authors' prefill, each block
    from its starting state (prompt tail or known first token, then masks) by the same rounds as ``decode_block``,
    the authors' finish / store pass between blocks, and their stopping (after a block holding a stop token, for
    the families that stop early). The returned tokens start after the prompt (the tail is left out)."""
    start_passes, start_tokens = target.counter.snapshot()
    start_time = time.perf_counter()
    stats = DecodeStats()
    plan = target.plan(prompt_ids.shape[0], settings.gen_length, settings.block_length)
    cache, state = target.open(prompt_ids, plan)
    blocks, steps, pass_nos = [], [], []
    can_hand_off = settings.handoffs and scores_handoffs(target)
    opening = None  # the next block's first pass, when the last round handed it off
    for block_index in range(plan.n_blocks):
        prefix = torch.cat([prompt_ids[: plan.first_start].to(state.device), *blocks])  # [P]
        block, cache, trace, opening = decode_block(
            target,
            cache,
            None,
            block_index,
            settings,
            key,
            drafter,
            stats,
            start_passes,
            observer,
            prefix=prefix,
            opening=opening,
            handoffs=can_hand_off and block_index + 1 < plan.n_blocks,
            initial=state,
            window=target.window(plan, block_index),
        )
        blocks.append(block)
        steps.append(trace.step)
        pass_nos.append(trace.pass_no)
        stop = (
            target.family.stops_early and settings.stop_at_eos and _holds_stop(target, plan, block_index, trace, block)
        )
        last = stop or block_index + 1 == plan.n_blocks
        if stop and not target.finish_stopping_block:
            break
        if opening is not None:  # handed off: the candidate's pass closed the block and opened the next one
            if last:
                break
            cache, state = opening.cache, target.next_state(plan)
            continue
        cache, state = target.finish(cache, block, plan)
        if last:
            if target.trailing_token and not stop:  # the last store pass's token ends the output
                blocks.append(state[:1])
                steps.append(torch.full((1,), -1, device=state.device))
                pass_nos.append(torch.full((1,), -1, device=state.device))
            break
    started = (start_passes, start_tokens, start_time)
    return _generation(target, stats, started, blocks, steps, pass_nos, skip=plan.tail)
