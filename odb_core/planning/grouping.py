"""Pure grouping: a buffer of samples becomes groups under the budget.

NOTE [ Grouping ]
The buffer is sorted by observed length, longest first, and cut by a two-pointer greedy: a group takes samples
from the long end while they fit, then, for the `tokens` cost only, tops up from the short end while they fit,
filling the gap a long sample leaves, which a plain next-fit wastes. For `padded` and `attention` costs there is
no top-up and the result is the oracle's greedy fill applied to the buffer: a shorter sample costs a full padded
row of the group's longest, so once the token cost stops the long end nothing shorter fits either, and when a
patch cap stops it (a long sample with many patches), a short sample with few patches would fit, but only as a
row of padding-heavy compute. On the MM-Mix-like VLM workload that top-up cut steps by 2% and raised the padding
ratio from 0.01 to 0.17, i.e. about 19% more padded tokens for the same samples (docs/benchmarks.md).

The last group formed (the *tail*) is usually under-filled. Unless the rank is closing its epoch, the tail is
not emitted: its samples stay in the buffer and are re-planned with the next round's samples. This is what
lets a bounded buffer come within a few percent of the offline global-sort oracle, where the paper's greedy
emits every buffer's remainder as a small batch.

Everything here is a pure function of lengths and the budget; there is no randomness and no I/O.
"""

from __future__ import annotations

import heapq

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odb_core.planning.budget import GroupBudget, Item


@dataclass(frozen=True, slots=True)
class Group:
    """Samples that will share one micro-batch on one rank, with the group's token cost."""

    items: tuple[Item, ...]
    cost: float

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(item.index for item in self.items)

    @property
    def tokens(self) -> int:
        return sum(item.length for item in self.items)

    @property
    def patches(self) -> int:
        return sum(item.patches for item in self.items)


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """Groups of one buffer in formation order; the first `n_ready` may be emitted this round."""

    groups: tuple[Group, ...]
    n_ready: int

    @property
    def ready(self) -> tuple[Group, ...]:
        return self.groups[: self.n_ready]

    @property
    def held(self) -> tuple[Group, ...]:
        return self.groups[self.n_ready :]


def sort_longest_first(items: Sequence[Item], *, by_owner: bool = False) -> list[Item]:
    """Deterministic order: longest first, then most patches, then (`by_owner`: owner rank, then) dataset index.
    One numpy lexsort for 64 items or more."""
    if len(items) < 64:
        if by_owner:
            return sorted(items, key=lambda it: (-it.length, -it.patches, it.owner, it.index))
        return sorted(items, key=lambda it: (-it.length, -it.patches, it.index))
    n = len(items)
    keys = [np.fromiter((it.index for it in items), np.int64, n)]
    if by_owner:
        keys.append(np.fromiter((it.owner for it in items), np.int64, n))
    keys += [-np.fromiter((it.patches for it in items), np.int64, n),
             -np.fromiter((it.length for it in items), np.int64, n)]
    return [items[k] for k in np.lexsort(keys).tolist()]


def pack_sorted(items: Sequence[Item], budget: GroupBudget) -> list[Group]:
    """Two-pointer greedy over `items` (already sorted longest first); see NOTE [ Grouping ].

    A sample that does not fit an empty group (oversize) forms a group on its own. Cost: O(n) budget checks, or
    O(groups) under the padded cost alone (`_pack_padded`).
    """
    if budget.padded_only and (not items or items[-1].length > 0):  # `odb plan` and simulate_epoch accept 0
        return _pack_padded(items, budget.token_budget)
    groups: list[Group] = []
    head, tail = 0, len(items) - 1
    while head <= tail:
        budget.reset()
        members = [items[head]]
        budget.add(items[head])
        head += 1
        while head <= tail and budget.fits(items[head]):
            budget.add(items[head])
            members.append(items[head])
            head += 1
        while budget.top_up and head <= tail and budget.fits(items[tail]):
            budget.add(items[tail])
            members.append(items[tail])
            tail -= 1
        groups.append(Group(items=tuple(members), cost=budget.cost()))
    budget.reset()
    return groups


def _pack_padded(items: Sequence[Item], token_budget: int) -> list[Group]:
    """`pack_sorted` under the padded cost with no other constraint, per group instead of per sample: a group
    starting at a sample of length L holds L's row width, every later (shorter) sample costs L more, so it takes
    the next max(token_budget // L, 1) samples, exactly what the sample-by-sample greedy takes (checked against
    it in tests/test_grouping.py)."""
    groups: list[Group] = []
    head, n = 0, len(items)
    while head < n:
        longest = items[head].length
        members = tuple(items[head : head + max(token_budget // longest, 1)])
        groups.append(Group(items=members, cost=len(members) * longest))
        head += len(members)
    return groups


def plan_buffer(items: Sequence[Item], budget: GroupBudget, *, closing: bool) -> BufferPlan:
    """Group a buffer. Not closing: every group but the tail is ready (a lone group is ready, so that a
    buffer too small for one full group still makes progress). Closing: every group is ready."""
    groups = pack_sorted(sort_longest_first(items), budget)
    if closing or len(groups) <= 1:
        return BufferPlan(groups=tuple(groups), n_ready=len(groups))
    return BufferPlan(groups=tuple(groups), n_ready=len(groups) - 1)


def split_group(group: Group, budget: GroupBudget) -> tuple[Group, Group]:
    """Halve a group of >= 2 samples. Each half costs no more than the whole (every cost model is monotone)."""
    assert group.size >= 2, "a single-sample group cannot be split"
    middle = group.size // 2
    first, second = group.items[:middle], group.items[middle:]
    return (Group(first, budget.cost_of_items(first)), Group(second, budget.cost_of_items(second)))


def split_widest(groups: list[Group], count: int, budget: GroupBudget) -> int:
    """Split the group with the most samples (the earliest on ties) until `groups` holds `count` groups or none
    can be split; halves take their parent's place in order. Returns the number of splits.

    A heap keyed by (-size, position path): a half's path is its parent's plus 0 or 1, so comparing paths orders
    groups as the list does, without re-scanning the list per split (O(s log n) for s splits, not O(s n))."""
    if len(groups) >= count:
        return 0
    heap = [(-g.size, (i,), g) for i, g in enumerate(groups)]
    heapq.heapify(heap)
    n_split, total = 0, len(groups)
    while total < count and heap and heap[0][0] <= -2:
        _, path, group = heapq.heappop(heap)
        for k, half in enumerate(split_group(group, budget)):
            heapq.heappush(heap, (-half.size, (*path, k), half))
        n_split, total = n_split + 1, total + 1
    done = sorted([(path, g) for _, path, g in heap], key=lambda pg: pg[0])
    groups[:] = [g for _, g in done]
    return n_split

