"""ODB's step metrics in the Trainer's log (so `report_to` backends such as TensorBoard receive them).

Counted (`odb_core.metrics.StepCounts`) from the `StepInfo` of the micro-batches the Trainer consumed since the
previous log, with the core's definitions:
  * `odb/samples_per_second`, `odb/tokens_per_second`: samples and real input tokens over every rank per second;
  * `odb/padding_ratio`: 1 - real / padded token slots on this rank (non-IDLE micro-batches);
  * `odb/budget_utilization`: real input tokens / (micro-batches x world size x token_budget), over every rank;
  * `odb/patch_utilization` (with `max_patches`): vision patches / (micro-batches x world size x max_patches);
  * `odb/idle_steps`: IDLE micro-batches on this rank; `odb/samples_per_step`: global samples per optimizer step,
    and `odb/samples_per_step_std` their standard deviation over the logged steps (how near `samples_per_step`
    the steps come); with `tokens_per_step`, `odb/tokens_per_step` and `odb/tokens_per_step_std` too;
  * `odb/moved_fraction`, `odb/moved_bytes` (global planning, world > 1): of the samples this rank's loader
    planned since the previous log, the share read by another rank, and the bytes received for them (these two
    come from the loader's own counters, which run up to `prefetch_steps` ahead of the Trainer).
"""

from __future__ import annotations

import time

from odb_core.loader import ODBDataLoader
from odb_core.metrics import StepCounts
from odb_core.step_info import StepInfo


class StepMeter:
    """What the Trainer consumed: `add()` once per micro-batch; `flush()` the metrics since the previous flush."""

    def __init__(self, loader: ODBDataLoader) -> None:
        self.config, self.world_size = loader.config, loader.transport.world_size
        self.loader_metrics = loader.metrics
        self.moves_logged = (0, 0, 0)  # (moved samples, moved bytes, local samples) at the previous flush
        self.seen = self.logged = StepCounts()
        self.last: StepInfo | None = None  # the latest consumed micro-batch
        self.since = time.perf_counter()

    def add(self, info: StepInfo) -> None:
        self.seen, self.last = self.seen.add(info), info

    def flush(self) -> dict[str, float]:
        now = time.perf_counter()
        seconds, delta, config = max(now - self.since, 1e-9), self.seen - self.logged, self.config
        logs = {
            "odb/samples_per_second": delta.global_samples / seconds,
            "odb/tokens_per_second": delta.global_input_tokens / seconds,
            "odb/padding_ratio": delta.padding_ratio,
            "odb/budget_utilization": delta.budget_utilization(config.token_budget, self.world_size),
            "odb/idle_steps": float(delta.idle_steps),
        }
        for unit in ("samples", "tokens") if config.tokens_per_step is not None else ("samples",):
            logs[f"odb/{unit}_per_step"], logs[f"odb/{unit}_per_step_std"] = delta.step_size(unit)
        if config.max_patches:
            logs["odb/patch_utilization"] = delta.patch_utilization(config.max_patches, self.world_size)
        if self.world_size > 1 and config.planning == "global":
            logs.update(self._moves())
        self.logged, self.since = self.seen, now
        return logs

    def _moves(self) -> dict[str, float]:
        m = self.loader_metrics
        now = (m.moved_samples, m.moved_bytes, m.counts.local_samples)
        moved, moved_bytes, local = (a - b for a, b in zip(now, self.moves_logged, strict=True))
        self.moves_logged = now
        return {"odb/moved_fraction": moved / local if local else 0.0, "odb/moved_bytes": float(moved_bytes)}
