"""Budget constraints: small policy objects that decide whether a group may take one more sample.

Each constraint follows one narrow interface (`fits`, `add`, `reset`, `measure`), in the spirit of lhotse's
`SamplingConstraint`. The grouping code knows nothing about cost models; it only asks `fits` and calls `add`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

from odb_core.settings.config import ODBConfig


class SampleError(ValueError):
    """A processed sample that odb cannot batch. The message names the dataset index and the cause."""

    def __init__(self, index: int, cause: str) -> None:
        super().__init__(f"sample {index}: {cause}")
        self.index = index
        self.cause = cause


class Item(NamedTuple):
    """What the planner knows of one buffered sample: its dataset index, observed cost facts, and, for global
    planning (NOTE [ Pooled rounds ]), the rank whose stream read it (`owner`) and whether it was already buffered
    when the round began (`carried`).

    A named tuple rather than a frozen dataclass: one is built per sample read (0.3 µs against 0.6-0.9), and a
    tuple of ints is untracked by the garbage collector once it survives a collection, so the buffer's items do
    not add to what each full collection walks (docs/benchmarks.md, "The loader's hot path")."""

    index: int
    length: int
    patches: int = 0
    owner: int = 0
    carried: bool = False


class Constraint(ABC):
    """A running group under one limit. `fits(item)` never mutates; `add(item)` does."""

    @abstractmethod
    def fits(self, item: Item) -> bool:
        """Whether the group would stay within the limit with `item` added."""

    @abstractmethod
    def add(self, item: Item) -> None:
        """Record `item` as part of the group."""

    @abstractmethod
    def reset(self) -> None:
        """Start an empty group."""

    @abstractmethod
    def measure(self) -> float:
        """Cost of the current group in the limit's own units."""

    @abstractmethod
    def fits_alone(self, item: Item) -> bool:
        """Whether `item` stays within the limit in a group of its own (never mutates)."""


class _LengthStats(Constraint, ABC):
    """Shared bookkeeping of size, longest and total length for the token cost models."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.reset()

    def reset(self) -> None:
        self.size = 0
        self.longest = 0
        self.total = 0

    def add(self, item: Item) -> None:
        self.size += 1
        self.longest = max(self.longest, item.length)
        self.total += item.length

    def fits(self, item: Item) -> bool:
        return self.cost_of(self.size + 1, max(self.longest, item.length), self.total + item.length) <= self.budget

    def measure(self) -> float:
        return self.cost_of(self.size, self.longest, self.total)

    def fits_alone(self, item: Item) -> bool:
        return self.cost_of(1, item.length, item.length) <= self.budget

    @abstractmethod
    def cost_of(self, size: int, longest: int, total: int) -> float:
        """Cost of a group with these statistics."""


class PaddedBudget(_LengthStats):
    """`B x max_len <= L_max`: the memory of a padded batch (the paper's model)."""

    def cost_of(self, size: int, longest: int, total: int) -> float:
        return size * longest


class TokenBudget(_LengthStats):
    """`sum(len) <= L_max`: padding-free or flattening collators."""

    def cost_of(self, size: int, longest: int, total: int) -> float:
        return total


class AttentionBudget(_LengthStats):
    """`B x max_len + alpha x B x max_len^2 <= L_max`: a padded batch whose attention cost is quadratic."""

    def __init__(self, budget: int, alpha: float) -> None:
        self.alpha = alpha
        super().__init__(budget)

    def cost_of(self, size: int, longest: int, total: int) -> float:
        return size * longest + self.alpha * size * longest * longest


class CountCap(Constraint):
    """At most `cap` samples per group, for collators or kernels with a hard batch limit."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.reset()

    def reset(self) -> None:
        self.size = 0

    def add(self, item: Item) -> None:
        self.size += 1

    def fits(self, item: Item) -> bool:
        return self.size + 1 <= self.cap

    def measure(self) -> float:
        return self.size

    def fits_alone(self, item: Item) -> bool:
        return self.cap >= 1


class PatchCap(Constraint):
    """At most `cap` vision patches (rows of `pixel_values`) per group: bounds the vision tower's memory."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.reset()

    def reset(self) -> None:
        self.patches = 0

    def add(self, item: Item) -> None:
        self.patches += item.patches

    def fits(self, item: Item) -> bool:
        return self.patches + item.patches <= self.cap

    def measure(self) -> float:
        return self.patches

    def fits_alone(self, item: Item) -> bool:
        return item.patches <= self.cap


class GroupBudget:
    """The conjunction of the configured constraints; the first one is the token cost model.

    `cost()` reports the token-cost measure, used for utilization (cost / L_max) and rank balance. `top_up` says
    whether a group may be topped up with short samples after its long end stops fitting (NOTE [ Grouping ]).
    """

    def __init__(self, constraints: list[Constraint], token_budget: int, *, top_up: bool = False) -> None:
        self.constraints = constraints
        self.token_budget = token_budget
        self.top_up = top_up
        # the default, a padded cost alone: `grouping.pack_sorted` cuts its groups without per-sample checks
        self.padded_only = len(constraints) == 1 and type(constraints[0]) is PaddedBudget and not top_up
        if len(constraints) == 1:  # the common case, on the per-sample hot path
            self.fits = constraints[0].fits  # type: ignore[method-assign]
            self.alone_fits = constraints[0].fits_alone  # type: ignore[method-assign]
        self.alone_length = self._longest_alone()

    def _longest_alone(self) -> int:
        """The longest sample without vision patches that fits alone (0 if none does): every cost model is
        nondecreasing in length (`attention_alpha >= 0`) and the caps do not look at length, so a sample of
        `1 <= length <= alone_length` and no patches fits alone with no call (`BufferEngine.admit`, once per sample).
        Found by bisection over `[0, token_budget]`, at construction."""
        low, high = 0, self.token_budget  # alone_fits holds at `low` (or low == 0); the answer is <= high
        while low < high:
            mid = (low + high + 1) // 2
            if self.alone_fits(Item(0, mid)):
                low = mid
            else:
                high = mid - 1
        return low

    def fits(self, item: Item) -> bool:
        return all(c.fits(item) for c in self.constraints)

    def add(self, item: Item) -> None:
        for c in self.constraints:
            c.add(item)

    def reset(self) -> None:
        for c in self.constraints:
            c.reset()

    def cost(self) -> float:
        return self.constraints[0].measure()

    def cost_of_items(self, items: tuple[Item, ...] | list[Item]) -> float:
        """Token cost of a whole group, leaving this budget empty afterwards."""
        self.reset()
        for item in items:
            self.add(item)
        cost = self.cost()
        self.reset()
        return cost

    def alone_fits(self, item: Item) -> bool:
        """Whether `item` fits in an otherwise empty group (False means it is oversize)."""
        return all(c.fits_alone(item) for c in self.constraints)

    def alone_cost(self, item: Item) -> float:
        """Token cost of `item` in a group of its own (never mutates): the least budget it fits under."""
        model = self.constraints[0]
        assert isinstance(model, _LengthStats), "the token cost model comes first"
        return model.cost_of(1, item.length, item.length)


def build_budget(config: ODBConfig) -> GroupBudget:
    """The constraints named by `config`, token cost model first."""
    if config.cost == "padded":
        constraints: list[Constraint] = [PaddedBudget(config.token_budget)]
    elif config.cost == "tokens":
        constraints = [TokenBudget(config.token_budget)]
    else:
        constraints = [AttentionBudget(config.token_budget, config.attention_alpha)]
    if config.max_patches is not None:
        constraints.append(PatchCap(config.max_patches))
    if config.max_batch_size is not None:
        constraints.append(CountCap(config.max_batch_size))
    return GroupBudget(constraints, config.token_budget, top_up=config.cost == "tokens")
