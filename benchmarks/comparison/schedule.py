"""What every batching method produces, and the batch-quality measures computed the same way for all of them.

A `Schedule` is one epoch on W ranks: `steps[r][k]` is the tuple of dataset indices that rank r trains on at step
k, or None when rank r has no batch at that step (IDLE, or a rank that ran out). Every measure below depends only
on the schedule, the lengths and the budget, so the numbers are deterministic and identical across machines.

Definitions (the same as `odb_core.steps.metrics` and `odb plan`):
  * budget utilization = real tokens / (steps x W x L_max);
  * padding ratio = 1 - real tokens / padded token slots (sum over groups of B x longest);
  * rank imbalance of a step = coefficient of variation (population std / mean) of the per-rank group cost, an
    empty slot costing 0; reported as the mean over steps (0 at W = 1);
  * max cost ratio = the largest group cost / L_max under the method's cost model; above 1.0 for a group of two
    or more samples means the method broke the memory bound (`violations` counts such groups);
  * padded-step time = sum over steps of the slowest rank's padded tokens (B x longest): `odb plan`'s default
    step-time model, used for the modelled speed-up against Standard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

Group = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CostModel:
    """How a group's memory cost is measured: `padded` B x max, `tokens` sum, `attention` B x max + a B max^2."""

    name: str
    alpha: float = 0.0

    def cost(self, group_lengths: Sequence[int]) -> float:
        if not group_lengths:
            return 0.0
        size, longest = len(group_lengths), max(group_lengths)
        if self.name == "tokens":
            return float(sum(group_lengths))
        if self.name == "attention":
            return size * longest + self.alpha * size * longest * longest
        return float(size * longest)


@dataclass(slots=True)
class Schedule:
    """One epoch of one method on W ranks (see the module docstring). `moved`: samples that ran on another rank
    than the one whose stream read them (ODB global planning; None where the method does not say)."""

    steps: list[list[Group | None]]
    moved: int | None = None

    @property
    def world_size(self) -> int:
        return len(self.steps)

    @property
    def n_steps(self) -> int:
        return max((len(rank) for rank in self.steps), default=0)

    def groups(self) -> list[Group]:
        return [g for rank in self.steps for g in rank if g]

    def padded(self) -> Schedule:
        """Every rank filled with empty slots up to the longest rank's step count."""
        n = self.n_steps
        return Schedule([list(rank) + [None] * (n - len(rank)) for rank in self.steps], self.moved)


def deal_round_robin(groups: Sequence[Group], world_size: int) -> Schedule:
    """Fair sharding of a global list of batches: batch k goes to rank k mod W at step k // W (what accelerate's
    batch-sampler sharding and DeepSpeed's interleaved DistributedSampler do)."""
    steps: list[list[Group | None]] = [list(groups[r::world_size]) for r in range(world_size)]
    return Schedule(steps).padded()


@dataclass(frozen=True, slots=True)
class Quality:
    """Batch-quality measures of one schedule (see the module docstring)."""

    steps: int
    samples: int
    dropped: int
    duplicated: int
    ranks_unequal: bool
    real_tokens: int
    padded_tokens: int
    budget_utilization: float
    padding_ratio: float
    mean_batch: float
    mean_rank_imbalance: float
    max_cost_ratio: float
    violations: int
    padded_step_time: float

    def as_dict(self) -> dict:
        return asdict(self)


def _rank_imbalance(costs: np.ndarray) -> float:
    """Mean over steps of the CV of per-rank costs; `costs` has shape (W, steps)."""
    if costs.shape[0] <= 1 or costs.shape[1] == 0:
        return 0.0
    mean = costs.mean(axis=0)
    std = costs.std(axis=0)
    cv = np.divide(std, mean, out=np.zeros_like(mean), where=mean > 0)
    return float(cv.mean())


def measure(schedule: Schedule, lengths: Sequence[int], token_budget: int, cost: CostModel) -> Quality:
    """All measures of `schedule` for a dataset of `len(lengths)` samples."""
    unequal = len({len(rank) for rank in schedule.steps}) > 1
    full = schedule.padded()
    world, n = full.world_size, full.n_steps
    lens = np.asarray(lengths, dtype=np.int64)
    group_cost = np.zeros((world, n))
    padded_cost = np.zeros((world, n))
    seen: list[int] = []
    real = padded = violations = 0
    worst = 0.0
    for r, rank in enumerate(full.steps):
        for k, group in enumerate(rank):
            if not group:
                continue
            g = lens[list(group)]
            c = cost.cost(g.tolist())
            group_cost[r, k] = c
            padded_cost[r, k] = len(g) * int(g.max())
            real += int(g.sum())
            seen.extend(group)
            worst = max(worst, c / token_budget)
            violations += int(c > token_budget and len(g) > 1)
    padded = int(padded_cost.sum())
    unique = len(set(seen))
    n_groups = int((padded_cost > 0).sum())
    return Quality(
        steps=n, samples=unique, dropped=len(lengths) - unique, duplicated=len(seen) - unique, ranks_unequal=unequal,
        real_tokens=real, padded_tokens=padded,
        budget_utilization=real / (n * world * token_budget) if n else 0.0,
        padding_ratio=1.0 - real / padded if padded else 0.0,
        mean_batch=len(seen) / n_groups if n_groups else 0.0,
        mean_rank_imbalance=_rank_imbalance(group_cost), max_cost_ratio=worst, violations=violations,
        padded_step_time=float(padded_cost.max(axis=0).sum()) if n else 0.0)
