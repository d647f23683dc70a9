"""TreeBuilder / DraftTree: node storage, merging of identical states, budget, and derived depths and paths."""

from __future__ import annotations

import pytest
import torch

from spot_dlm.tree import DraftTree, TreeBuilder, root_only, state_key

MASK = 9
L = 5


def state(*tokens: int) -> torch.Tensor:
    """A block state from tokens; ``MASK`` marks masked positions."""
    assert len(tokens) == L
    return torch.tensor(tokens, dtype=torch.int64)


ROOT = state(3, MASK, MASK, MASK, MASK)


def builder(max_nodes: int = 16, root_step: int = 1) -> TreeBuilder:
    return TreeBuilder(root=ROOT.clone(), root_step=root_step, mask_id=MASK, max_nodes=max_nodes)


def test_root_only_tree() -> None:
    tree = root_only(ROOT, root_step=4, mask_id=MASK)
    assert isinstance(tree, DraftTree)
    assert len(tree) == 1
    assert tree.parents == (-1,)
    assert tree.steps == (4,)
    assert torch.equal(tree.states, ROOT[None])
    assert tree.states.dtype == torch.int64
    assert tree.depths() == [0]
    assert tree.paths().tolist() == [[0]]
    assert tree.lookup(ROOT, 4) == 0
    assert tree.lookup(ROOT, 5) is None
    assert tree.lookup(state(4, MASK, MASK, MASK, MASK), 4) is None


def test_root_only_builder_is_full_and_refuses_children() -> None:
    b = builder(max_nodes=1)
    assert b.full
    assert b.add(0, state(3, 1, MASK, MASK, MASK)) is None
    assert len(b.build()) == 1


def test_chain() -> None:
    b = builder(root_step=2)
    a = b.add(0, state(3, 1, MASK, MASK, MASK))
    c = b.add(a, state(3, 1, 7, MASK, MASK))
    d = b.add(c, state(3, 1, 7, 0, MASK))
    assert (a, c, d) == (1, 2, 3)
    tree = b.build()
    assert len(tree) == 4
    assert tree.parents == (-1, 0, 1, 2)
    assert tree.steps == (2, 3, 4, 5)
    assert tree.depths() == [0, 1, 2, 3]
    assert tree.paths().tolist() == [[0, 1, 2, 3]]
    assert torch.equal(tree.states[3], state(3, 1, 7, 0, MASK))
    for node in range(4):
        assert tree.lookup(tree.states[node], tree.steps[node]) == node


def test_steps_taken_advances_step_index() -> None:
    b = builder(root_step=1)
    node = b.add(0, state(3, 1, 2, MASK, MASK), steps_taken=3)
    tree = b.build()
    assert tree.steps[node] == 4
    assert tree.lookup(state(3, 1, 2, MASK, MASK), 4) == node
    assert tree.lookup(state(3, 1, 2, MASK, MASK), 2) is None


def test_identical_states_merge() -> None:
    """Committing position 1 then 2, or 2 then 1, reaches one state: it is stored once and found by lookup."""
    b = builder(root_step=1)
    first = b.add(0, state(3, 1, MASK, MASK, MASK))
    second = b.add(0, state(3, MASK, 2, MASK, MASK))
    via_first = b.add(first, state(3, 1, 2, MASK, MASK))
    via_second = b.add(second, state(3, 1, 2, MASK, MASK))
    assert via_first == via_second == 3
    tree = b.build()
    assert len(tree) == 4
    assert tree.parents == (-1, 0, 0, 1)  # the first parent to reach it owns it
    assert tree.steps[3] == 3
    assert tree.lookup(state(3, 1, 2, MASK, MASK), 3) == 3
    assert tree.lookup(state(3, 1, 2, MASK, MASK), 2) is None  # same block, different step: another state
    assert tree.lookup(state(3, 1, 2, MASK, MASK), 4) is None
    assert tree.lookup(state(3, 1, 3, MASK, MASK), 3) is None  # same positions, different token


def test_same_block_at_different_step_is_a_different_node() -> None:
    b = builder(root_step=0)
    once = b.add(0, state(3, 1, MASK, MASK, MASK), steps_taken=1)
    twice = b.add(0, state(3, 1, MASK, MASK, MASK), steps_taken=2)
    assert once != twice
    tree = b.build()
    assert tree.lookup(state(3, 1, MASK, MASK, MASK), 1) == once
    assert tree.lookup(state(3, 1, MASK, MASK, MASK), 2) == twice


def test_merge_does_not_spend_budget_even_when_full() -> None:
    b = builder(max_nodes=2)
    node = b.add(0, state(3, 1, MASK, MASK, MASK))
    assert b.full
    assert b.add(0, state(3, 1, MASK, MASK, MASK)) == node  # already present: found, not added
    assert b.add(0, state(3, MASK, 1, MASK, MASK)) is None  # new: over budget
    assert len(b.build()) == 2


def test_complete_states_are_never_nodes() -> None:
    b = builder()
    chain = b.add(0, state(3, 1, 2, 4, MASK))
    assert b.add(chain, state(3, 1, 2, 4, 5)) is None
    assert b.add(0, state(3, 1, 2, 4, 5), steps_taken=4) is None
    tree = b.build()
    assert len(tree) == 2
    assert all(bool((s == MASK).any()) for s in tree.states)
    assert tree.lookup(state(3, 1, 2, 4, 5), tree.steps[chain] + 1) is None
    assert tree.n_handoffs == 0 and tree.handoff(state(3, 1, 2, 4, 5)) is None  # no next block to hand off to


def test_with_handoffs_complete_states_are_kept_once_and_spend_the_budget() -> None:
    b = TreeBuilder(root=ROOT.clone(), root_step=1, mask_id=MASK, max_nodes=4, handoffs=True)
    chain = b.add(0, state(3, 1, 2, 4, MASK))
    done = state(3, 1, 2, 4, 5)
    assert b.add(chain, done) is None  # a hand-off never parents a node
    assert b.add(0, done, steps_taken=4) is None  # the same complete block by another order: merged
    assert b.add(chain, state(3, 1, 2, 4, 6)) is None
    assert b.full  # root, chain and two hand-offs: four rows
    assert b.add(chain, state(3, 1, 2, 4, 7)) is None
    tree = b.build()
    assert len(tree) == 2 and tree.n_handoffs == 2
    assert torch.equal(tree.handoffs, torch.stack([done, state(3, 1, 2, 4, 6)]))
    assert tree.handoff(done) == 0 and tree.handoff(state(3, 1, 2, 4, 6)) == 1
    assert tree.handoff(state(3, 1, 2, 4, 7)) is None
    assert tree.lookup(done, tree.steps[chain] + 1) is None  # not a node: the walk ends before it


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 7])
def test_budget_respected(max_nodes: int) -> None:
    b = builder(max_nodes=max_nodes)
    added = []
    for position in range(1, L):
        for token in range(4):
            child = ROOT.clone()
            child[position] = token
            node = b.add(0, child)
            if node is not None:
                added.append(node)
    tree = b.build()
    assert len(tree) == max_nodes
    assert len(added) == max_nodes - 1
    assert len(tree.index) == max_nodes
    assert tree.states.shape == (max_nodes, L)


def test_depths_and_paths_of_hand_built_tree() -> None:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    b = builder(root_step=1)
    n1 = b.add(0, state(3, 1, MASK, MASK, MASK))
    n2 = b.add(0, state(3, MASK, 1, MASK, MASK))
    n3 = b.add(n1, state(3, 1, 0, MASK, MASK))
    n4 = b.add(n1, state(3, 1, MASK, 0, MASK))
    n5 = b.add(n2, state(3, MASK, 1, MASK, 8))
    n6 = b.add(n3, state(3, 1, 0, 6, MASK))
    assert (n1, n2, n3, n4, n5, n6) == (1, 2, 3, 4, 5, 6)
    tree = b.build()
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert tree.depths() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.steps == (1, 2, 2, 3, 3, 3, 4)
    paths = tree.paths()
    assert paths.dtype == torch.int64
    assert sorted(paths.tolist()) == [[0, 1, 3, 6], [0, 1, 4, -1], [0, 2, 5, -1]]
    depths = tree.depths()
    for row in paths.tolist():
        nodes = [n for n in row if n >= 0]
        assert row[len(nodes) :] == [-1] * (paths.shape[1] - len(nodes))
        assert nodes[0] == 0
        for parent, child in zip(nodes, nodes[1:]):
            assert tree.parents[child] == parent
        assert depths[nodes[-1]] == len(nodes) - 1


def test_state_key_ignores_dtype_and_separates_steps() -> None:
    s = state(3, 1, MASK, MASK, MASK)
    assert state_key(s, 2) == state_key(s.to(torch.int32), 2)
    assert state_key(s, 2) != state_key(s, 3)


def test_a_complete_state_holding_the_stop_token_is_never_handed_off() -> None:
    b = TreeBuilder(root=ROOT.clone(), root_step=1, mask_id=MASK, max_nodes=3, handoffs=True, stop_id=5)
    chain = b.add(0, state(3, 1, 2, 4, MASK))
    assert b.add(chain, state(3, 1, 2, 4, 5)) is None  # holds the stop token: decoding ends after it, no next block
    assert not b.full  # so it does not spend the budget either
    assert b.add(chain, state(3, 1, 2, 4, 6)) is None  # another complete candidate is handed off
    tree = b.build()
    assert tree.n_handoffs == 1 and tree.handoff(state(3, 1, 2, 4, 5)) is None
    assert tree.handoff(state(3, 1, 2, 4, 6)) == 0


def test_round_endings_say_why_the_walk_stopped() -> None:
    from spot_dlm.decode import round_ending

    b = TreeBuilder(root=ROOT.clone(), root_step=1, mask_id=MASK, max_nodes=6, handoffs=True)
    a = b.add(0, state(3, 1, MASK, MASK, MASK))
    b.add(a, state(3, 1, 2, MASK, MASK))  # a's one child fills position 2
    other = b.add(0, state(3, MASK, MASK, MASK, 7))  # a sibling of a, filling position 4
    b.add(b.add(0, state(3, 8, MASK, MASK, MASK)), state(3, 8, 2, 4, 6))  # a chain ending in a hand-off
    tree = b.build()
    assert tree.n_handoffs == 1
    assert round_ending(tree, a, state(3, 1, 5, MASK, MASK), MASK) == "wrong token"
    assert round_ending(tree, a, state(3, 1, MASK, 5, MASK), MASK) == "wrong position"
    assert round_ending(tree, other, state(3, MASK, 1, MASK, 7), MASK) == "leaf"
    assert round_ending(tree, 0, state(3, 8, 2, 4, 6), MASK) == "hand-off"
    assert round_ending(tree, 0, state(3, 8, 2, 4, 5), MASK) == "block end"
    # the walk looks states up in the whole tree: a state one step below that extends a counts as its child
    merged = TreeBuilder(root=ROOT.clone(), root_step=1, mask_id=MASK, max_nodes=4)
    left = merged.add(0, state(3, 1, MASK, MASK, MASK))
    merged.add(merged.add(0, state(3, MASK, 2, MASK, MASK)), state(3, 1, 2, MASK, MASK))  # parent: the other branch
    assert round_ending(merged.build(), left, state(3, 1, 4, MASK, MASK), MASK) == "wrong token"
