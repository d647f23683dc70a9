"""Best-first tree growth: candidate children in, the draft tree of the budget's best nodes out.

``grow_tree`` asks a ``ChildProposer`` (``drafters/children.py``) for the children of each depth's best nodes, in
one batch per depth, scores each candidate by its path log-probability, stops expanding nodes below the admission
bar (no child of theirs could enter the tree), and assembles the best candidates into a ``DraftTree``.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from spot_dlm.decode import DraftContext
from spot_dlm.drafters.children import ChildProposer, Children, PositionScorer, one_commit_children
from spot_dlm.drafters.guesses import StaleGuesses, stale_tokens
from spot_dlm.drafters.token_survival import TokenSurvival
from spot_dlm.tree import DraftTree, TreeBuilder


def _admission_bar(best_per_state: dict[bytes, float], top: list[bytes], keep: int) -> tuple[float, list[bytes]]:
    """Path log-probability of the keep-th best distinct state so far (-inf while fewer exist), and the keys of the
    keep best states. ``top`` holds the keep best keys of an earlier call and those whose value rose since: values
    only grow, so a state outside both can never climb back.

    A child never scores above its parent, so the children of a node at or below the bar cannot beat the kept set:
    growth stops there. This prunes drafter calls, never the tree's scores (a child of a node exactly at the bar
    could at most tie it, through a probability-1 commit). At budget 2 it saves the second call per round.
    """
    top = heapq.nlargest(keep, set(top), key=best_per_state.__getitem__)
    if len(best_per_state) < keep:
        return float("-inf"), top
    return best_per_state[top[-1]], top


def _record(best_per_state: dict[bytes, float], keys: list[bytes], logprobs: list[float], keep: int) -> list[bytes]:
    """Keep each distinct state's best path log-probability, children taken best first; returns the keys whose value
    was set or rose. Stops below the keep-th distinct state of the level: the bar cannot end below it, and a value
    below the bar never counts for it (bars only rise)."""
    changed, seen, floor = [], set(), float("-inf")
    for key, logprob in zip(keys, logprobs):
        if logprob < floor:
            break
        if key not in best_per_state or logprob > best_per_state[key]:
            best_per_state[key] = logprob
            changed.append(key)
        seen.add(key)
        if len(seen) == keep:
            floor = logprob
    return changed


def _row_keys(states: np.ndarray) -> list[bytes]:
    """The bytes of each row of an int64 [N, L] array (as ``row.tobytes()``)."""
    rows = np.ascontiguousarray(states)
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel().tolist()


@dataclass
class _Levels:
    """Every candidate node grown so far, level by level (level 0: the root alone), as host arrays."""

    states: list[np.ndarray]  # per level int64 [C_d, L]
    logprob: list[np.ndarray]  # per level float64 [C_d]: path log-probability from the root
    parent: list[np.ndarray]  # per level int64 [C_d]: candidate index of the parent (-1 for the root)
    complete: list[np.ndarray]  # per level bool [C_d]: no position left masked
    count: int = 1  # candidates in all; a candidate's index counts from the root's 0 in creation order


def grow_tree(
    context: DraftContext,
    budget: int,
    max_depth: int,
    position_logprobs: PositionScorer | None = None,
    guesses: StaleGuesses | None = None,
    children: ChildProposer | None = None,
    token_survival: TokenSurvival | None = None,
) -> DraftTree:
    """Best-first tree under a node budget (root included) and a depth limit.

    Every edge commits one position (``position_logprobs``) or a set of positions (``children``) with their stale
    coupled tokens; a node's score is its path log-probability (with ``token_survival``, the token's survival
    counts too: see ``one_commit_children``). The proposer runs once per depth on the (at most
    budget - 1) best nodes of that depth, batched; the tree keeps the budget - 1 best candidates overall (parents
    always score at least as high as their children).

    Candidate states live on the host, each level's children made in a few array ops: growing a tree is many tiny
    edits, each a kernel launch and a sync on a GPU. The proposer gets each level's states on the context's device
    (one copy per level) and the finished tree's states go back there in one copy.
    """
    guesses = guesses if guesses is not None else StaleGuesses(context)
    if children is None:
        children = one_commit_children(position_logprobs, budget - 1, guesses, token_survival)
    root = context.root.cpu()
    grown = _Levels([root.numpy()[None]], [np.zeros(1)], [np.full(1, -1)], [np.zeros(1, dtype=bool)])
    best_per_state: dict[bytes, float] = {}  # distinct non-root states -> best path log-probability so far
    top: list[bytes] = []  # the keys of the (budget - 1) best of them
    bar = float("-inf")
    level = np.zeros(1, dtype=np.int64)  # rows of the last level to expand, best first
    keep = budget - 1
    for depth in range(max_depth):
        if not len(level) or keep == 0:
            break
        states, logprob = grown.states[-1][level], grown.logprob[-1][level]  # [B, L], [B]
        step = context.root_step + depth  # every node of a level is ``depth`` rule steps below the root
        proposed = children(torch.from_numpy(states).to(context.root.device), [step] * len(level))
        path = logprob[proposed.node] + proposed.logprob  # [C]
        made = _commit(states, proposed, guesses, step)  # [C, L]
        grown.parent.append(grown.count - len(grown.logprob[-1]) + level[proposed.node])  # candidate indices
        grown.states.append(made)
        grown.logprob.append(path)
        grown.complete.append(~(made == context.mask_id).any(-1))
        grown.count += len(path)
        ranking = np.argsort(-path, kind="stable")  # [C], best first (ties: in proposal order)
        contenders = ranking[path[ranking] >= bar]  # a value below the bar can never count for it again
        changed = _record(best_per_state, _row_keys(made[contenders]), path[contenders].tolist(), keep)
        bar, top = _admission_bar(best_per_state, top + changed, keep)
        level = ranking[:keep][path[ranking[:keep]] > bar]
    return _assemble(context, grown, budget, root)


def _commit(states: np.ndarray, proposed: Children, guesses: StaleGuesses, step: int) -> np.ndarray:
    """Children states: each parent row with its committed positions set to the proposed tokens, or else to the
    coupled tokens of its rank under the noise of ``step``. states int64 [B, L] -> int64 [C, L]"""
    if proposed.commit_token is not None:
        made = states.take(proposed.node, axis=0)  # [C, L]
        made[proposed.commit_child, proposed.commit_position] = proposed.commit_token
        return made
    child, position = proposed.commit_child, proposed.commit_position  # [P] each
    made = states.take(proposed.node, axis=0)  # [C, L]
    made[child, position] = stale_tokens(guesses, step, proposed.rank[child], position)
    return made


def _assemble(context: DraftContext, grown: _Levels, budget: int, root: torch.Tensor) -> DraftTree:
    """The tree of the best candidates: best first (ties: shallower, then older), merged states kept once, complete
    states left out, and a candidate whose parent is not in the tree skipped."""
    logprob, parent = np.concatenate(grown.logprob), np.concatenate(grown.parent)  # [N], by depth then age
    complete = np.concatenate(grown.complete).tolist()  # [N]
    starts = np.cumsum([0] + [len(lp) for lp in grown.logprob]).tolist()  # first candidate index of each level
    builder = TreeBuilder(root, context.root_step, context.mask_id, budget, context.handoffs, context.stop_id)
    node_of = {0: 0}
    for index in _best_first(logprob[1:], 4 * budget):
        if builder.full:
            break
        index += 1  # the root is not a candidate
        parent_node = node_of.get(int(parent[index]))
        if parent_node is None:
            continue
        level = bisect.bisect_right(starts, index) - 1
        state = grown.states[level][index - starts[level]]  # int64 [L]
        node = builder.add_known(parent_node, torch.from_numpy(state), state.tobytes(), complete[index])
        if node is not None:
            node_of[index] = node
    return builder.build(context.root.device)


def _best_first(logprob: np.ndarray, head: int) -> Iterator[int]:
    """Indices by descending logprob, ties in index order (a stable sort), the ``head`` best sorted first and the
    rest only if asked for. float64 [N] -> N indices"""
    key = -logprob
    if len(key) <= head:
        yield from np.argsort(key, kind="stable").tolist()
        return
    in_head = key <= np.partition(key, head - 1)[head - 1]  # [N], >= head of them: every tie of the cut
    for part in (np.flatnonzero(in_head), np.flatnonzero(~in_head)):
        yield from part[np.argsort(key[part], kind="stable")].tolist()
