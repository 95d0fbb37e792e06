"""Loader metrics, per step (on `StepInfo`) and cumulative (here).

Definitions:
  * budget utilization = real input tokens / (steps x L_max), over every rank (IDLE steps count as steps);
  * patch utilization = vision patches / (steps x max_patches), over every rank, when `max_patches` is set;
  * padding ratio = 1 - real input tokens / padded token slots, over non-IDLE steps;
  * rank imbalance of a step = coefficient of variation of the group cost across ranks (IDLE costs 0);
  * alignment bytes/latency = what this rank sent in the metadata collectives, and their wall time;
  * moved samples/bytes (global planning) = samples that ran on this rank but were read by another, and the
    bytes received for them (NOTE [ Moving samples ]).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from odb_core.step_info import StepInfo


@dataclass(slots=True)
class LoaderMetrics:
    """Cumulative counters for this rank's loader; `summary()` returns the derived ratios."""

    token_budget: int
    world_size: int
    patch_budget: int = 0  # max_patches, or 0 without a patch cap
    steps: int = 0
    idle_steps: int = 0
    local_samples: int = 0
    global_samples: int = 0
    local_input_tokens: int = 0
    global_input_tokens: int = 0
    global_supervised_tokens: int = 0
    global_patches: int = 0
    padded_tokens: int = 0
    oversize_samples: int = 0
    splits: int = 0
    pushed_back_groups: int = 0
    rounds: int = 0
    moved_samples: int = 0  # global planning: samples this rank received from the rank that read them
    moved_bytes: int = 0  # and their bytes (move="send"), received by this rank
    imbalance_sum: float = 0.0
    sync_bytes: int = 0
    sync_seconds: float = 0.0

    def snapshot(self) -> dict[str, float | int]:
        """Raw counters, for a loader state dict."""
        return asdict(self)

    def restore(self, counters: dict[str, float | int]) -> None:
        for name, value in counters.items():
            if name not in self.__slots__:  # type: ignore[attr-defined]
                raise ValueError(f"unknown metrics counter {name!r} in loader state")
            setattr(self, name, value)

    def record_step(self, info: StepInfo) -> None:
        self.steps += 1
        self.idle_steps += int(info.is_idle)
        self.local_samples += info.local_samples
        self.global_samples += info.global_samples
        self.global_input_tokens += info.global_input_tokens
        self.global_supervised_tokens += info.global_tokens
        self.global_patches += info.global_patches
        self.imbalance_sum += info.rank_imbalance
        if not info.is_idle:
            self.local_input_tokens += info.local_input_tokens
            self.padded_tokens += info.padded_tokens

    @property
    def budget_utilization(self) -> float:
        slots = self.steps * self.world_size * self.token_budget
        return self.global_input_tokens / slots if slots else 0.0

    @property
    def patch_utilization(self) -> float:
        slots = self.steps * self.world_size * self.patch_budget
        return self.global_patches / slots if slots else 0.0

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.local_input_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def mean_imbalance(self) -> float:
        return self.imbalance_sum / self.steps if self.steps else 0.0

    def summary(self) -> dict[str, float | int]:
        out = asdict(self)
        out.pop("imbalance_sum")
        out.update(budget_utilization=self.budget_utilization, patch_utilization=self.patch_utilization,
                   padding_ratio=self.padding_ratio,
                   mean_rank_imbalance=self.mean_imbalance)
        return out


def cost_cv(cost_sum: int, cost_sq_sum: int, world_size: int) -> float:
    """Coefficient of variation of a step's group costs across ranks, from their sum and sum of squares."""
    if cost_sum <= 0 or world_size <= 1:
        return 0.0
    mean = cost_sum / world_size
    variance = max(cost_sq_sum / world_size - mean * mean, 0.0)
    return math.sqrt(variance) / mean
