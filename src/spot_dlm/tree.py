"""Draft trees: candidate next states of one block, verified together in one target pass.

A node is a whole block state plus the index of the commit-rule step that would be applied to it (the noise of
that step depends on it). Parents are the single source of truth; depths and paths are derived. Identical states
are merged: the acceptance walk looks up the target's true next state among *all* nodes, so a state reached by
two commit orders is drafted (and scored) once.

A complete state (nothing left masked) needs no scoring: its last commit is free. When the target scores
hand-offs and a next block follows, a complete candidate is drafted as a *hand-off* instead: the pass scores the
next block's all-mask state after it, and if the walk's true next state is that complete state, the next block's
first pass is already done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Draft depth limit: at most this many drafted commits per pass (plus the free one). 32 never binds at block 32:
# at T = 0 runs of confident commits (digit runs, set phrases) fill whole blocks, and a limit of 8 cut 14% of
# budget-16 rounds short (10 GSM8K prompts, budget 32: 4.04x fewer passes at depth 8, 4.97x at depth 31).
DEFAULT_DEPTH = 32


def state_bytes(state: torch.Tensor) -> bytes:
    """The block tokens of a state as int64 bytes (what identifies it within one rule step)."""
    return state.to(torch.int64).cpu().numpy().tobytes()


def state_key(state: torch.Tensor, step_index: int) -> tuple[int, bytes]:
    """Hashable identity of a node: (step index, block tokens)."""
    return step_index, state_bytes(state)


@dataclass
class TreeBuilder:
    """Grows a draft tree from its root; ``add`` merges states already present."""

    root: torch.Tensor  # int64 [L]
    root_step: int
    mask_id: int
    max_nodes: int  # nodes and hand-offs: rows of the verification pass
    handoffs: bool = False  # draft complete candidates as hand-offs (else leave them out)
    stop_id: int | None = None  # a complete candidate holding this token ends decoding: never a hand-off
    states: list[torch.Tensor] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    index: dict[tuple[int, bytes], int] = field(default_factory=dict)
    handoff_states: list[torch.Tensor] = field(default_factory=list)
    handoff_index: dict[bytes, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._append(self.root, -1, self.root_step, state_key(self.root, self.root_step))

    @classmethod
    def rooted(cls, context, max_nodes: int) -> TreeBuilder:
        """A builder at a drafter's context (``decode.DraftContext``: its root, root step, mask and hand-offs)."""
        return cls(context.root, context.root_step, context.mask_id, max_nodes, context.handoffs, context.stop_id)

    def _append(self, state: torch.Tensor, parent: int, step_index: int, key: tuple[int, bytes]) -> int:
        self.index[key] = len(self.states)
        self.states.append(state)
        self.parents.append(parent)
        self.steps.append(step_index)
        return len(self.states) - 1

    @property
    def full(self) -> bool:
        return len(self.states) + len(self.handoff_states) >= self.max_nodes

    def add(self, parent: int, state: torch.Tensor, steps_taken: int = 1) -> int | None:
        """Add ``state`` as a child of ``parent`` reached by ``steps_taken`` rule steps.

        Returns the node index (existing one when merged), or None when the state is complete (its last commit
        is always free, so it never needs scoring; with ``handoffs`` it is kept as a hand-off) or the budget is
        spent.
        """
        return self.add_known(parent, state, state_bytes(state), not bool((state == self.mask_id).any()), steps_taken)

    def add_known(
        self, parent: int, state: torch.Tensor, tokens: bytes, complete: bool, steps_taken: int = 1
    ) -> int | None:
        """``add`` with the state's int64 bytes and whether it is complete already known."""
        step_index = self.steps[parent] + steps_taken
        key = (step_index, tokens)
        if key in self.index:
            return self.index[key]
        if self.full:
            return None
        if complete:
            if self.handoffs and tokens not in self.handoff_index and not self._stops(state):
                self.handoff_index[tokens] = len(self.handoff_states)
                self.handoff_states.append(state)
            return None
        return self._append(state, parent, step_index, key)

    def _stops(self, state: torch.Tensor) -> bool:
        """Whether decoding ends after this complete state (no next block to open)."""
        return self.stop_id is not None and bool((state == self.stop_id).any())

    def build(self, device: torch.device | None = None) -> DraftTree:
        """The tree, its states stacked on ``device`` (default: where they are)."""
        states = torch.stack(self.states)  # [N, L]
        handoffs = torch.stack(self.handoff_states) if self.handoff_states else states.new_zeros(0, states.shape[1])
        states, handoffs = (x if device is None else x.to(device) for x in (states, handoffs))
        return DraftTree(states, tuple(self.parents), tuple(self.steps), self.index, handoffs, self.handoff_index)


@dataclass(frozen=True)
class DraftTree:
    states: torch.Tensor  # int64 [N, L]; node 0 is the root (the free commit)
    parents: tuple[int, ...]  # parents[0] == -1
    steps: tuple[int, ...]  # rule-step index applied to each node's state
    index: dict[tuple[int, bytes], int]
    handoffs: torch.Tensor | None = None  # int64 [M, L]: complete candidates whose next block is scored too
    handoff_index: dict[bytes, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.parents)

    def lookup(self, state: torch.Tensor, step_index: int) -> int | None:
        return self.index.get(state_key(state, step_index))

    def handoff(self, state: torch.Tensor) -> int | None:
        """The hand-off holding this complete state, if any."""
        return self.handoff_index.get(state_bytes(state)) if self.handoff_index else None

    @property
    def n_handoffs(self) -> int:
        return 0 if self.handoffs is None else int(self.handoffs.shape[0])

    def depths(self) -> list[int]:
        depth = [0] * len(self)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                depth[node] = depth[parent] + 1
        return depth

    def paths(self) -> torch.Tensor:
        """Root-to-leaf node paths, int64 [n_leaves, max_depth + 1], padded with -1."""
        is_parent = set(self.parents)
        leaves = [n for n in range(len(self)) if n not in is_parent]
        rows = []
        for leaf in leaves:
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = self.parents[node]
            rows.append(path[::-1])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64)


def root_only(root: torch.Tensor, root_step: int, mask_id: int) -> DraftTree:
    return TreeBuilder(root=root, root_step=root_step, mask_id=mask_id, max_nodes=1).build()
