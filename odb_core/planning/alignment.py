"""Pure DGAP adjustment: turn one rank's buffer plan into exactly `target` step slots.

A slot holds a `Group` or `None` (an IDLE step). Ranks with more ready groups than the target push the extra
groups back into their buffer; ranks with fewer split their largest groups, then fill what is left with IDLE.
After adjustment the slots are put in a cross-rank order: largest cost first, so that the k-th step of every
rank holds that rank's k-th largest group (similar costs run side by side), then one permutation shared by all
ranks (a function of seed, epoch and round) so that training does not see a length curriculum.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from odb_core.planning.budget import GroupBudget, Item
from odb_core.planning.grouping import BufferPlan, Group, split_widest

Slot = Group | None


@dataclass(frozen=True, slots=True)
class Adjustment:
    """Exactly `target` slots for this round, and the items that go back into the buffer."""

    slots: tuple[Slot, ...]
    kept: tuple[Item, ...]
    n_split: int
    n_pushed_back: int


def adjust(plan: BufferPlan, target: int, budget: GroupBudget) -> Adjustment:
    """Choose, split or pad this rank's ready groups to exactly `target` slots. Pure and deterministic.

    With more ready groups than `target`, the fullest groups (highest cost) are emitted and the rest are kept:
    kept samples are re-planned next round with fresh samples, so a loose group gets a second chance to fill.
    """
    ready = list(plan.ready)
    held_items = [item for group in plan.held for item in group.items]
    if len(ready) >= target:
        by_fullness = sorted(range(len(ready)), key=lambda i: (-ready[i].cost, i))
        chosen = sorted(by_fullness[:target])
        pushed = sorted(by_fullness[target:])
        kept = [item for i in pushed for item in ready[i].items] + held_items
        return Adjustment(slots=tuple(ready[i] for i in chosen), kept=tuple(kept), n_split=0,
                          n_pushed_back=len(pushed))
    n_split = split_widest(ready, target, budget)
    slots: list[Slot] = [*ready, *([None] * (target - len(ready)))]
    return Adjustment(slots=tuple(slots), kept=tuple(held_items), n_split=n_split, n_pushed_back=0)


@dataclass(frozen=True, slots=True)
class RoundKey:
    """Identifies a round for the shared step permutation."""

    seed: int
    epoch: int
    round: int


def step_permutation(n: int, key: RoundKey, shuffle: bool) -> list[int]:
    """The order in which a round's n steps (ranked by cost) run: the same permutation on every rank."""
    permutation = list(range(n))
    if shuffle and n > 1:
        random.Random(f"odb-steps:{key.seed}:{key.epoch}:{key.round}").shuffle(permutation)
    return permutation


def order_slots(slots: tuple[Slot, ...], key: RoundKey, shuffle: bool) -> tuple[Slot, ...]:
    """Largest cost first (IDLE last), then a permutation that every rank derives from the same `key`."""
    ranked = sorted(range(len(slots)), key=lambda i: (slots[i] is None, -(slots[i].cost if slots[i] else 0), i))
    ordered = [slots[i] for i in ranked]
    return tuple(ordered[p] for p in step_permutation(len(ordered), key, shuffle))
