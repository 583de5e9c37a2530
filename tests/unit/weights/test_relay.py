"""The relay tree's shape, and a relayed tensor's checksum sent as known rather than recomputed."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import Snapshot, chunks, to_wire
from asyncrlhf.weights.relay import layout, plan

pytestmark = pytest.mark.unit


def test_plan_splits_into_at_most_fanout_contiguous_parts_first_ones_larger():
    # 7 into 2: sizes 4 and 3; each part is (who is pushed to, what it relays to)
    assert plan("abcdefg", 2) == [("a", ["b", "c", "d"]), ("e", ["f", "g"])]
    # 5 into 3: sizes 2, 2, 1
    assert plan("abcde", 3) == [("a", ["b"]), ("c", ["d"]), ("e", [])]
    # fewer targets than the fanout: one part each, nothing to relay
    assert plan("ab", 4) == [("a", []), ("b", [])]
    assert plan("", 2) == []
    assert plan("abc", 1) == [("a", ["b", "c"])]  # a chain
    with pytest.raises(ValueError, match="fanout must be >= 1"):
        plan("ab", 0)


def test_layout_is_the_plan_applied_at_every_node():
    tree = layout("abcdefg", 2)
    # roots a and e; a relays to [b c d] -> plan: (b, [c]) and (d, []); b relays to c; e to f and g
    assert tree == {"a": (None, ["b", "c", "d"]), "b": ("a", ["c"]), "c": ("b", []), "d": ("a", []),
                    "e": (None, ["f", "g"]), "f": ("e", []), "g": ("e", [])}


@pytest.mark.parametrize("n, fanout", [(16, 2), (64, 2), (64, 4), (100, 3), (5, 1)])
def test_every_target_is_placed_once_no_node_sends_more_than_fanout_and_depth_is_logarithmic(n, fanout):
    targets = list(range(n))
    tree = layout(targets, fanout)
    assert sorted(tree) == targets
    children: dict[int | None, int] = {}
    for parent, _ in tree.values():
        children[parent] = children.get(parent, 0) + 1
    assert max(children.values()) <= fanout  # the learner (None) included

    def depth(t):
        parent = tree[t][0]
        return 1 if parent is None else 1 + depth(parent)

    deepest = max(depth(t) for t in targets)
    # each level multiplies the nodes reached by `fanout` (a chain: one more per level)
    bound = n if fanout == 1 else math.ceil(math.log(n * (fanout - 1) / fanout + 1, fanout)) + 1
    assert deepest <= bound, (deepest, bound)
    for t, (_, below) in tree.items():  # what a node relays to is exactly its subtree
        subtree = [u for u in targets if u != t and t in _ancestors(tree, u)]
        assert sorted(below) == subtree


def _ancestors(tree, t):
    out = []
    while (t := tree[t][0]) is not None:
        out.append(t)
    return out


def test_a_known_checksum_is_sent_as_is():
    wire = to_wire("w", torch.arange(10, dtype=torch.float32))
    computed = [c for c in chunks(Snapshot(PolicyVersion(0, 1), [wire]), chunk_bytes=16) if c.checksum]
    assert len(computed) == 1  # on the last slice only
    relayed = to_wire("w", torch.arange(10, dtype=torch.float32))
    relayed = type(relayed)(relayed.name, relayed.dtype, relayed.shape, relayed.data, relayed.tensor, 12345)
    messages = chunks(Snapshot(PolicyVersion(0, 1), [relayed]), chunk_bytes=16)
    sent = [c.checksum for c in messages if not c.commit]
    assert sent == [0, 0, 12345]  # 40 bytes in slices of 16: the known checksum, not recomputed
