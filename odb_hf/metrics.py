"""ODB's step metrics in the Trainer's log (so `report_to` backends such as TensorBoard receive them).

Counted from the `StepInfo` of the micro-batches the Trainer consumed since the previous log:
  * `odb/samples_per_second`, `odb/tokens_per_second`: samples and real input tokens over every rank per second;
  * `odb/padding_ratio`: 1 - real / padded token slots on this rank (non-IDLE micro-batches);
  * `odb/budget_utilization`: real input tokens / (micro-batches x world size x token_budget), over every rank;
  * `odb/patch_utilization` (with `max_patches`): vision patches / (micro-batches x world size x max_patches);
  * `odb/idle_steps`: IDLE micro-batches on this rank; `odb/samples_per_step`: global samples per optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from odb_core.step_info import StepInfo


@dataclass(slots=True)
class StepMeter:
    """Counters since the last `flush()`; `add()` is called once per consumed micro-batch."""

    token_budget: int
    world_size: int
    accumulation_steps: int
    patch_budget: int = 0
    micro_batches: int = 0
    idle: int = 0
    samples: int = 0
    input_tokens: int = 0
    patches: int = 0
    local_input_tokens: int = 0
    padded_tokens: int = 0
    since: float = field(default_factory=time.perf_counter)

    def add(self, info: StepInfo) -> None:
        self.micro_batches += 1
        self.idle += int(info.is_idle)
        self.samples += info.global_samples
        self.input_tokens += info.global_input_tokens
        self.patches += info.global_patches
        if not info.is_idle:
            self.local_input_tokens += info.local_input_tokens
            self.padded_tokens += info.padded_tokens

    def flush(self) -> dict[str, float]:
        """The metrics since the previous flush, then reset."""
        now = time.perf_counter()
        seconds = max(now - self.since, 1e-9)
        slots = self.micro_batches * self.world_size * self.token_budget
        logs = {
            "odb/samples_per_second": self.samples / seconds,
            "odb/tokens_per_second": self.input_tokens / seconds,
            "odb/padding_ratio": 1.0 - self.local_input_tokens / self.padded_tokens if self.padded_tokens else 0.0,
            "odb/budget_utilization": self.input_tokens / slots if slots else 0.0,
            "odb/idle_steps": float(self.idle),
            "odb/samples_per_step": self.samples * self.accumulation_steps / max(self.micro_batches, 1),
        }
        if self.patch_budget:
            patch_slots = self.micro_batches * self.world_size * self.patch_budget
            logs["odb/patch_utilization"] = self.patches / patch_slots if patch_slots else 0.0
        self.micro_batches = self.idle = self.samples = self.input_tokens = self.patches = 0
        self.local_input_tokens = self.padded_tokens = 0
        self.since = now
        return logs
