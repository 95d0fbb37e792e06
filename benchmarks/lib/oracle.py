"""The offline oracle the benchmarks measure against: a global sort of all lengths, then a greedy next-fit.

No online loader can do better with the same cost model and per-group rule: it sees every length at once.
`odb_core`'s window planner applies the same greedy fill to each window (NOTE [ Grouping ] in
odb_core/planning/grouping.py); tests/test_grouping.py checks the two against each other.
"""

from __future__ import annotations

from collections.abc import Sequence

from odb_core.planning.budget import GroupBudget, Item, build_budget
from odb_core.planning.grouping import Group, sort_longest_first
from odb_core.settings.config import ODBConfig


def oracle_groups(items: Sequence[Item], budget: GroupBudget) -> list[Group]:
    """The offline oracle used in benchmarks: a global sort of all lengths, then a greedy next-fit."""
    groups: list[Group] = []
    members: list[Item] = []
    budget.reset()
    for item in sort_longest_first(items):
        if members and not budget.fits(item):
            groups.append(Group(tuple(members), budget.cost()))
            members = []
            budget.reset()
        budget.add(item)
        members.append(item)
    if members:
        groups.append(Group(tuple(members), budget.cost()))
    budget.reset()
    return groups


def oracle_steps(lengths: Sequence[int], token_budget: int) -> int:
    """The oracle's group count (its steps at W = 1) under the default config with `token_budget`."""
    budget = build_budget(ODBConfig(token_budget=token_budget))
    return len(oracle_groups([Item(i, n) for i, n in enumerate(lengths)], budget))
