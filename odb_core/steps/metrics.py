"""Step counts and the ratios derived from them: one counter type for the loader, the HF logs and DeepSpeed's.

Definitions (every adapter reports these, computed here only):
  * budget utilization = real input tokens / (steps x world size x L_max), over every rank (IDLE steps count);
  * patch utilization = vision patches / (steps x world size x max_patches), when `max_patches` is set;
  * padding ratio = 1 - real input tokens / padded token slots, on this rank, over non-IDLE steps;
  * rank imbalance of a step = coefficient of variation of the group cost across ranks (IDLE costs 0);
  * alignment bytes/latency = what this rank sent in the metadata collectives, and their wall time;
  * optimizer-step size = global samples and supervised tokens per optimizer step (mean and standard deviation,
    over the steps completed): how near a step target (`samples_per_step` / `tokens_per_step`) the steps come;
  * moved samples/bytes (global planning) = samples that ran on this rank but were read by another, and the
    bytes received for them (NOTE [ Moving samples ]).
`StepMeter` turns the consumed steps into a trainer's periodic log (`odb/...` keys, a delta since the last log).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

from odb_core.settings.config import ODBConfig
from odb_core.steps.step_info import StepInfo


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCounts:
    """Sums over a run of steps, from their `StepInfo`s: `counts.add(info)` is the run one step longer, and
    `later - earlier` the steps in between (a per-log or per-optimizer-step delta).

    `global_*` add each step's all-rank totals; `local_input_tokens` and `padded_tokens` are this rank's, over
    non-IDLE steps only (an IDLE dummy is padding that nobody trains on).
    """

    steps: int = 0
    idle_steps: int = 0
    local_samples: int = 0
    global_samples: int = 0
    local_input_tokens: int = 0
    global_input_tokens: int = 0
    global_supervised_tokens: int = 0
    global_patches: int = 0
    padded_tokens: int = 0
    imbalance_sum: float = 0.0
    optimizer_steps: int = 0
    step_samples_sum: int = 0
    step_samples_sq: int = 0
    step_tokens_sum: int = 0
    step_tokens_sq: int = 0

    def add(self, info: StepInfo) -> StepCounts:
        """One more micro-batch, and one more optimizer step if it is the last of its (released) window."""
        real = not info.is_idle
        ends = info.ends_window  # then one more optimizer step, of the window's samples and tokens
        samples, tokens = (info.window_samples, info.window_tokens) if ends else (0, 0)
        return StepCounts(steps=self.steps + 1, idle_steps=self.idle_steps + int(info.is_idle),
                          local_samples=self.local_samples + info.local_samples,
                          global_samples=self.global_samples + info.global_samples,
                          local_input_tokens=self.local_input_tokens + (info.local_input_tokens if real else 0),
                          global_input_tokens=self.global_input_tokens + info.global_input_tokens,
                          global_supervised_tokens=self.global_supervised_tokens + info.global_tokens,
                          global_patches=self.global_patches + info.global_patches,
                          padded_tokens=self.padded_tokens + (info.padded_tokens if real else 0),
                          imbalance_sum=self.imbalance_sum + info.rank_imbalance,
                          optimizer_steps=self.optimizer_steps + int(ends),
                          step_samples_sum=self.step_samples_sum + samples,
                          step_samples_sq=self.step_samples_sq + samples * samples,
                          step_tokens_sum=self.step_tokens_sum + tokens,
                          step_tokens_sq=self.step_tokens_sq + tokens * tokens)

    def close_window(self, info: StepInfo) -> StepCounts:
        """Count the optimizer step that `info` (a released micro-batch, with its window fields) ends. Built field
        by field, as `add` is: both run once per step on the loader's path."""
        samples, tokens = info.window_samples, info.window_tokens
        return StepCounts(steps=self.steps, idle_steps=self.idle_steps, local_samples=self.local_samples,
                          global_samples=self.global_samples, local_input_tokens=self.local_input_tokens,
                          global_input_tokens=self.global_input_tokens,
                          global_supervised_tokens=self.global_supervised_tokens, global_patches=self.global_patches,
                          padded_tokens=self.padded_tokens, imbalance_sum=self.imbalance_sum,
                          optimizer_steps=self.optimizer_steps + 1, step_samples_sum=self.step_samples_sum + samples,
                          step_samples_sq=self.step_samples_sq + samples * samples,
                          step_tokens_sum=self.step_tokens_sum + tokens,
                          step_tokens_sq=self.step_tokens_sq + tokens * tokens)

    def step_size(self, unit: str) -> tuple[float, float]:
        """(mean, standard deviation) of the optimizer steps' global `unit` ("samples" or "tokens")."""
        n = self.optimizer_steps
        if not n:
            return 0.0, 0.0
        total, squares = (self.step_samples_sum, self.step_samples_sq) if unit == "samples" else (
            self.step_tokens_sum, self.step_tokens_sq)
        mean = total / n
        return mean, math.sqrt(max(squares / n - mean * mean, 0.0))

    def __sub__(self, earlier: StepCounts) -> StepCounts:
        return StepCounts(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def budget_utilization(self, token_budget: int, world_size: int) -> float:
        slots = self.steps * world_size * token_budget
        return self.global_input_tokens / slots if slots else 0.0

    def patch_utilization(self, max_patches: int, world_size: int) -> float:
        slots = self.steps * world_size * max_patches
        return self.global_patches / slots if slots else 0.0

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.local_input_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def mean_imbalance(self) -> float:
        return self.imbalance_sum / self.steps if self.steps else 0.0


STEP_FIELDS = tuple(f.name for f in fields(StepCounts))


UNSAVED = ("counts", "moves", "wait_seconds", "read_seconds")  # a state leaves out: saved on their own, derived, wall


@dataclass(slots=True)
class LoaderMetrics:
    """Cumulative counters of this rank's loader: the yielded steps' `StepCounts` and the per-round counters the
    pipeline adds to; `summary()` returns them flat with the derived ratios, `snapshot()` flat for a state dict."""

    token_budget: int
    world_size: int
    patch_budget: int = 0  # max_patches, or 0 without a patch cap
    counts: StepCounts = field(default_factory=StepCounts)
    oversize_samples: int = 0
    splits: int = 0
    pushed_back_groups: int = 0
    rounds: int = 0
    moved_samples: int = 0  # global planning: samples this rank received from the rank that read them
    moved_bytes: int = 0  # and their bytes (move="send"), received by this rank
    sync_bytes: int = 0
    sync_seconds: float = 0.0
    wait_seconds: float = 0.0  # the consumer's wall seconds inside next(), waiting (NOTE [ Waiting for data ])
    read_seconds: float = 0.0  # the loader's wall seconds blocked on the workers' stream (NOTE [ Waiting for data ])
    # (moved samples, moved bytes, local samples) after the last whole round, published in one assignment so that
    # a reader on the trainer's thread never sees a round's moves without its samples; derived, not saved
    moves: tuple[int, int, int] = (0, 0, 0)

    def snapshot(self) -> dict[str, float | int]:
        """Raw counters, for a loader state dict (flat: the step counts beside the round counters)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in UNSAVED}
        return {**own, **asdict(self.counts)}

    def publish_moves(self) -> None:
        self.moves = (self.moved_samples, self.moved_bytes, self.counts.local_samples)

    def restore(self, counters: dict[str, float | int]) -> None:
        """Set the counters of a `snapshot()` (a partial one leaves the others as they are)."""
        for name in counters:
            if name == "counts" or (name not in STEP_FIELDS and name not in self.__slots__):  # type: ignore[attr-defined]
                raise ValueError(f"unknown metrics counter {name!r} in loader state")
        self.counts = replace(self.counts, **{k: v for k, v in counters.items() if k in STEP_FIELDS})
        for name, value in counters.items():
            if name not in STEP_FIELDS and name != "moves":
                setattr(self, name, value)
        self.publish_moves()

    def record_step(self, info: StepInfo) -> None:
        self.counts = self.counts.add(info)

    def record_window(self, info: StepInfo) -> None:
        """The optimizer step that the released micro-batch `info` ends (NOTE [ Steps of a target size ])."""
        self.counts = self.counts.close_window(info)

    @property
    def budget_utilization(self) -> float:
        return self.counts.budget_utilization(self.token_budget, self.world_size)

    @property
    def patch_utilization(self) -> float:
        return self.counts.patch_utilization(self.patch_budget, self.world_size)

    @property
    def padding_ratio(self) -> float:
        return self.counts.padding_ratio

    @property
    def mean_imbalance(self) -> float:
        return self.counts.mean_imbalance

    def summary(self) -> dict[str, float | int]:
        out = self.snapshot()
        out.pop("imbalance_sum")
        for unit in ("samples", "tokens"):
            for name in (f"step_{unit}_sum", f"step_{unit}_sq"):
                out.pop(name)
            out[f"step_{unit}_mean"], out[f"step_{unit}_std"] = self.counts.step_size(unit)
        out.update(budget_utilization=self.budget_utilization, patch_utilization=self.patch_utilization,
                   padding_ratio=self.padding_ratio, mean_rank_imbalance=self.mean_imbalance)
        return out


def cost_cv(cost_sum: int, cost_sq_sum: int, world_size: int) -> float:
    """Coefficient of variation of a step's group costs across ranks, from their sum and sum of squares."""
    if cost_sum <= 0 or world_size <= 1:
        return 0.0
    mean = cost_sum / world_size
    variance = max(cost_sq_sum / world_size - mean * mean, 0.0)
    return math.sqrt(variance) / mean


class StepMeter:
    """What a trainer consumed, for its periodic log: `add()` once per micro-batch; `flush()` the metrics since the
    previous flush, under `odb/` keys (the HF Trainer's log, so `report_to` backends such as TensorBoard get them):
      * `odb/samples_per_second`, `odb/tokens_per_second`: samples and real input tokens over every rank per second
        of `clock` (NOTE [ The first interval starts at the first step ]);
      * `odb/padding_ratio`, `odb/budget_utilization`, `odb/patch_utilization` (with `max_patches`): as above;
      * `odb/idle_steps`: IDLE micro-batches on this rank; `odb/samples_per_step`: global samples per optimizer step,
        and `odb/samples_per_step_std` their standard deviation over the logged steps (how near `samples_per_step`
        the steps come); with `tokens_per_step`, `odb/tokens_per_step` and `odb/tokens_per_step_std` too;
      * `odb/data_wait_fraction`: the share of the interval this rank's trainer spent inside the loader's `next()`,
        waiting for its batch, and two of its parts, `odb/data_wait_reading_fraction` (waiting for the workers'
        samples) and, with world > 1, `odb/data_wait_exchange_fraction` (the rounds' exchanges with the other
        ranks) (NOTE [ Waiting for data ]);
      * `odb/moved_fraction`, `odb/moved_bytes` (global planning, world > 1): of the samples this rank's loader
        planned since the previous log, the share read by another rank, and the bytes received for them (these two
        come from the loader's own counters, `loader_metrics`, which run up to `prefetch_steps` ahead of the trainer).

    NOTE [ The first interval starts at the first step ]
    A trainer builds its meter with its dataloader, before the rest of its set-up: the HF Trainer calls
    `get_train_dataloader()` before it builds the DeepSpeed engine, and on a CPU machine DeepSpeed's first run also
    compiles its shared-memory comm op (about a minute). So the clock starts at the first `add()`, the first
    micro-batch the trainer consumed, not at construction: the first `odb/samples_per_second` is the rate of the
    first steps, not of the set-up (which once logged 0.2 instead of ~60). Later intervals run from flush to flush
    and include the time the trainer waits for its batches. A flush before any `add()` reports 0 per second and
    leaves the clock unstarted. Cost: one `is None` test per `add()`.

    NOTE [ Waiting for data ]
    Whether the loader keeps the accelerator fed is what a user needs to see first (docs/benchmarks.md, "Keeping
    the accelerator fed"): the loader's iterator adds the wall seconds each `next()` takes to
    `LoaderMetrics.wait_seconds` (two clock reads per step), and `odb/data_wait_fraction` is that over the log's
    interval. The first batch's wait falls before the first interval (it starts at the first `add()`), so it is
    left out with the set-up. Near 0: the next batch was ready when the step ended. High: the trainer waited,
    for the workers (more `num_workers`), for the rounds (a smaller `window`: docs/design.md, "A bound no rule of
    round sizes escapes"), or for the other ranks' exchange. A wall time, so not part of a saved state.
    Two parts of it say which, over the same interval:
      * `odb/data_wait_reading_fraction`: the loader blocked on the workers' stream for samples, in a round's
        fill or a step's read-ahead pull (`LoaderMetrics.read_seconds`, two clock reads per chunk: `SampleReader`).
        High with workers slower than the device, and while the rounds grow at an epoch's start or a round
        waits for its last samples;
      * `odb/data_wait_exchange_fraction` (world > 1): the rounds' collectives on ODB's own group, which wait for
        the slowest rank to arrive (`LoaderMetrics.sync_seconds`). High when another rank reads or trains slower.
    The rest of the wait is the loader's own work: planning, counting, collating, and moved samples still on the
    move lane. By default (`prefetch_steps=0`) both parts are spent inside `next()`, except a round run ahead
    while a round's last step trains (NOTE [ Planning the next round ahead ] in epoch/plan_ahead.py): its parts
    count in the share of it the consumer waited for, when the consumer takes its step, so they never exceed the
    wait. With `prefetch_steps > 0` a producer thread spends them, partly while the trainer trains, and they can
    exceed the wait. Wall times, capped at 1, not part of a saved state.
    """

    def __init__(self, config: ODBConfig, loader_metrics: LoaderMetrics, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config, self.world_size = config, loader_metrics.world_size
        self.loader_metrics = loader_metrics
        self.moves_logged = loader_metrics.moves  # at the previous flush (a restored loader's totals so far)
        self.seen = self.logged = StepCounts()
        self.last: StepInfo | None = None  # the latest consumed micro-batch
        self.clock = clock
        self.since: float | None = None  # start of the current interval; None until the first add() (NOTE above)
        self.waited = (0.0, 0.0, 0.0)  # the loader's waits at the start of the interval (NOTE [ Waiting for data ])

    def add(self, info: StepInfo) -> None:
        if self.since is None:
            self.since, self.waited = self.clock(), self._waits()
        self.seen, self.last = self.seen.add(info), info

    def _waits(self) -> tuple[float, float, float]:
        metrics = self.loader_metrics
        return metrics.wait_seconds, metrics.read_seconds, metrics.sync_seconds

    def flush(self) -> dict[str, float]:
        now = self.clock()
        seconds = max(now - self.since, 1e-9) if self.since is not None else math.inf  # no step yet: 0 per second
        delta, config = self.seen - self.logged, self.config
        logs = {
            "odb/samples_per_second": delta.global_samples / seconds,
            "odb/tokens_per_second": delta.global_input_tokens / seconds,
            "odb/padding_ratio": delta.padding_ratio,
            "odb/budget_utilization": delta.budget_utilization(config.token_budget, self.world_size),
            "odb/idle_steps": float(delta.idle_steps),
        }
        waits = self._waits()
        shares = [min((now_s - then_s) / seconds, 1.0) if self.since is not None else 0.0
                  for now_s, then_s in zip(waits, self.waited, strict=True)]
        logs["odb/data_wait_fraction"], logs["odb/data_wait_reading_fraction"] = shares[0], shares[1]
        if self.world_size > 1:
            logs["odb/data_wait_exchange_fraction"] = shares[2]
        for unit in ("samples", "tokens") if config.tokens_per_step is not None else ("samples",):
            logs[f"odb/{unit}_per_step"], logs[f"odb/{unit}_per_step_std"] = delta.step_size(unit)
        if config.max_patches:
            logs["odb/patch_utilization"] = delta.patch_utilization(config.max_patches, self.world_size)
        if self.world_size > 1 and config.planning == "global":
            logs.update(self._moves())
        self.logged = self.seen
        if self.since is not None:
            self.since, self.waited = now, waits
        return logs

    def _moves(self) -> dict[str, float]:
        now = self.loader_metrics.moves
        moved, moved_bytes, local = (a - b for a, b in zip(now, self.moves_logged, strict=True))
        self.moves_logged = now
        return {"odb/moved_fraction": moved / local if local else 0.0, "odb/moved_bytes": float(moved_bytes)}
