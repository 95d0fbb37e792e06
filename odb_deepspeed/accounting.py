"""The training dataloader `odb_deepspeed.initialize` returns: the ODB loader plus real sample/token counts.

NOTE [ DeepSpeed's counters assume a fixed micro-batch ]
`engine.global_samples` grows by `train_batch_size()` = micro x G x W per optimizer step, and the throughput
timer's samples/sec and every `Train/Samples/*` monitor event's x-axis use that nominal figure. With ODB the
micro-batch size varies per step and per rank, so those numbers are fiction. `DeepSpeedODBLoader.consumed`
counts what the loop really received (all ranks), and when the engine's monitor is enabled it writes, at the
last micro-batch of each optimizer step, `Train/ODB/samples`, `Train/ODB/supervised_tokens`,
`Train/ODB/input_tokens` (that step, all ranks) and `Train/ODB/total_samples`, at x = the optimizer step the
window produces (`engine.global_steps + 1`). Costs nothing: the global counts are already in `StepInfo`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from odb_core import ODBBatch, ODBDataLoader, StepInfo
from odb_core.steps.metrics import StepCounts

STATE_VERSION = 1
WINDOW_KEYS = {"samples": "global_samples", "supervised_tokens": "global_supervised_tokens",
               "input_tokens": "global_input_tokens"}  # state "window" key -> StepCounts field


@dataclass(frozen=True, slots=True)
class ConsumedCounts:
    """What the training loop received so far. `samples`/`*_tokens` sum over all ranks and complete optimizer
    steps; `micro_batches`/`idle_micro_batches` are this rank's, every micro-batch."""

    optimizer_steps: int = 0
    micro_batches: int = 0
    idle_micro_batches: int = 0
    samples: int = 0
    supervised_tokens: int = 0
    input_tokens: int = 0


class DeepSpeedODBLoader:
    """Iterates an `ODBDataLoader` unchanged (same `ODBBatch`es), counting what the engine really trains on.

    With `samples_per_step` / `tokens_per_step` (the engine's gradient_accumulation_steps must be 1) it sets
    DeepSpeed's gradient-accumulation boundary before yielding each micro-batch, at the last micro-batch of each
    optimizer step, so that `engine.step()` after every micro-batch steps the optimizer only there.
    It also checks, at the first micro-batch of every accumulation window, that DeepSpeed's own window starts
    there too (`engine.micro_steps % G == 0`; with a step target, where G is 1, that the engine took one
    optimizer step, `global_steps`, since the last window's last micro-batch was served: DeepSpeed counts a step
    whose fp16 overflow it skipped too); a loop that skipped `engine.step()` for a batch would otherwise mix two
    windows' normalisers silently. Everything else is on `.odb`, the wrapped `ODBDataLoader`.
    The counts are `odb_core.steps.metrics.StepCounts`: `_seen` over every yielded micro-batch, `_stepped` up to the
    last complete optimizer step; their difference is the open window.
    """

    def __init__(self, loader: ODBDataLoader, engine: Any) -> None:
        self.odb = loader
        self.engine = engine
        self.accumulation_steps = loader.config.accumulation_steps
        self._seen = self._stepped = StepCounts()
        self._steps_at_window_end: int | None = None  # engine.global_steps when a window's last batch was served

    @property
    def consumed(self) -> ConsumedCounts:
        done = self._stepped
        return ConsumedCounts(optimizer_steps=done.optimizer_steps, micro_batches=self._seen.steps,
                              idle_micro_batches=self._seen.idle_steps, samples=done.global_samples,
                              supervised_tokens=done.global_supervised_tokens, input_tokens=done.global_input_tokens)

    def __iter__(self) -> Iterator[ODBBatch]:
        serve = getattr(self.engine, "odb_serve", None)  # ODB's engine weights and checks the loss (engine_mixin.py)
        target = self.odb.config.step_target is not None
        for batch in self.odb:
            self._check_aligned(batch.info)
            self._count(batch.info)
            if target:  # a step of a target size ends where the loader says (NOTE [ Steps of a target size ])
                self.engine.set_gradient_accumulation_boundary(batch.info.ends_window)
            if serve is not None:
                serve(batch)
            yield batch
            if serve is not None:
                self.engine.odb_require_backward()

    def __len__(self) -> int:
        return len(self.odb)

    def set_epoch(self, epoch: int) -> None:
        self.odb.set_epoch(epoch)

    def _check_aligned(self, info: StepInfo) -> None:
        if self.odb.config.step_target is not None:  # G = 1: the window ends where the loader says
            ended, self._steps_at_window_end = self._steps_at_window_end, None
            if info.window_index == 0 and ended is not None and self.engine.global_steps != ended + 1:
                raise RuntimeError(f"ODB starts an optimizer step at epoch {info.epoch} step {info.step}, but the "
                                   f"DeepSpeed engine took {self.engine.global_steps - ended} optimizer steps since "
                                   "the last one ended: call forward, backward and engine.step() once per yielded "
                                   "batch, IDLE batches included")
            if info.ends_window:
                self._steps_at_window_end = self.engine.global_steps
            return
        if info.step % self.accumulation_steps == 0 and self.engine.micro_steps % self.accumulation_steps != 0:
            raise RuntimeError(f"ODB starts accumulation window at epoch {info.epoch} step {info.step}, but the "
                               f"DeepSpeed engine is at micro-step {self.engine.micro_steps} (G="
                               f"{self.accumulation_steps}): call forward, backward and engine.step() once per "
                               "yielded batch, IDLE batches included")

    def _count(self, info: StepInfo) -> None:
        self._seen = self._seen.add(info)
        if info.ends_window:
            window = self._seen - self._stepped
            self._stepped = self._seen
            self._report(window)

    def _report(self, window: StepCounts) -> None:
        monitor = getattr(self.engine, "monitor", None)
        if monitor is None or not monitor.enabled:
            return
        step = self.engine.global_steps + 1
        monitor.write_events([("Train/ODB/samples", window.global_samples, step),
                              ("Train/ODB/supervised_tokens", window.global_supervised_tokens, step),
                              ("Train/ODB/input_tokens", window.global_input_tokens, step),
                              ("Train/ODB/total_samples", self._stepped.global_samples, step)])

    def state_dict(self) -> dict[str, Any]:
        """The ODB loader's state and the counts (take it at an optimizer-step boundary, like DeepSpeed's)."""
        window = self._seen - self._stepped
        return {"version": STATE_VERSION, "odb": self.odb.state_dict(), "consumed": asdict(self.consumed),
                "window": {key: getattr(window, name) for key, name in WINDOW_KEYS.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        version = state.pop("version", None)
        if version != STATE_VERSION:
            raise ValueError(f"DeepSpeedODBLoader state version {version!r} is not supported "
                             f"(expected {STATE_VERSION})")
        self.odb.load_state_dict(state.pop("odb"))
        consumed, window = ConsumedCounts(**state.pop("consumed")), state.pop("window")
        unexpected = sorted(state) + [f"window.{key}" for key in window if key not in WINDOW_KEYS]
        if unexpected:
            raise ValueError(f"unexpected keys in DeepSpeedODBLoader state: {unexpected}")
        self._stepped = StepCounts(steps=consumed.micro_batches, idle_steps=consumed.idle_micro_batches,
                                   optimizer_steps=consumed.optimizer_steps,
                                   global_samples=consumed.samples, global_supervised_tokens=consumed.supervised_tokens,
                                   global_input_tokens=consumed.input_tokens)
        # the open window's sums (its micro-batch count is not saved: only its sums are ever reported)
        self._seen = replace(self._stepped, **{name: getattr(self._stepped, name) + window.get(key, 0)
                                               for key, name in WINDOW_KEYS.items()})
