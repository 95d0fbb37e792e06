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
from dataclasses import asdict, dataclass
from typing import Any

from odb_core import ODBBatch, ODBDataLoader, StepInfo

STATE_VERSION = 1


@dataclass(slots=True)
class ConsumedCounts:
    """What the training loop received so far. `samples`/`*_tokens` sum over all ranks; the rest is this rank."""

    optimizer_steps: int = 0
    micro_batches: int = 0
    idle_micro_batches: int = 0
    samples: int = 0
    supervised_tokens: int = 0
    input_tokens: int = 0


@dataclass(slots=True)
class _Window:
    samples: int = 0
    supervised_tokens: int = 0
    input_tokens: int = 0


class DeepSpeedODBLoader:
    """Iterates an `ODBDataLoader` unchanged (same `ODBBatch`es), counting what the engine really trains on.

    It also checks, at the first micro-batch of every accumulation window, that DeepSpeed's own window starts
    there too (`engine.micro_steps % G == 0`); a loop that skipped `engine.step()` for a batch would otherwise
    mix two windows' normalisers silently. Everything else is on `.odb`, the wrapped `ODBDataLoader`.
    """

    def __init__(self, loader: ODBDataLoader, engine: Any) -> None:
        self.odb = loader
        self.engine = engine
        self.accumulation_steps = loader.config.accumulation_steps
        self.consumed = ConsumedCounts()
        self._window = _Window()

    def __iter__(self) -> Iterator[ODBBatch]:
        for batch in self.odb:
            self._check_aligned(batch.info)
            self._count(batch.info)
            yield batch

    def __len__(self) -> int:
        return len(self.odb)

    def set_epoch(self, epoch: int) -> None:
        self.odb.set_epoch(epoch)

    def _check_aligned(self, info: StepInfo) -> None:
        if info.step % self.accumulation_steps == 0 and self.engine.micro_steps % self.accumulation_steps != 0:
            raise RuntimeError(f"ODB starts accumulation window at epoch {info.epoch} step {info.step}, but the "
                               f"DeepSpeed engine is at micro-step {self.engine.micro_steps} (G="
                               f"{self.accumulation_steps}): call forward, backward and engine.step() once per "
                               "yielded batch, IDLE batches included")

    def _count(self, info: StepInfo) -> None:
        counts, window = self.consumed, self._window
        counts.micro_batches += 1
        counts.idle_micro_batches += int(info.is_idle)
        window.samples += info.global_samples
        window.supervised_tokens += info.global_tokens
        window.input_tokens += info.global_input_tokens
        if info.step % self.accumulation_steps == self.accumulation_steps - 1:
            counts.optimizer_steps += 1
            counts.samples += window.samples
            counts.supervised_tokens += window.supervised_tokens
            counts.input_tokens += window.input_tokens
            self._report(window)
            self._window = _Window()

    def _report(self, window: _Window) -> None:
        monitor = getattr(self.engine, "monitor", None)
        if monitor is None or not monitor.enabled:
            return
        step = self.engine.global_steps + 1
        monitor.write_events([("Train/ODB/samples", window.samples, step),
                              ("Train/ODB/supervised_tokens", window.supervised_tokens, step),
                              ("Train/ODB/input_tokens", window.input_tokens, step),
                              ("Train/ODB/total_samples", self.consumed.samples, step)])

    def state_dict(self) -> dict[str, Any]:
        """The ODB loader's state and the counts (take it at an optimizer-step boundary, like DeepSpeed's)."""
        return {"version": STATE_VERSION, "odb": self.odb.state_dict(), "consumed": asdict(self.consumed),
                "window": asdict(self._window)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        version = state.pop("version", None)
        if version != STATE_VERSION:
            raise ValueError(f"DeepSpeedODBLoader state version {version!r} is not supported "
                             f"(expected {STATE_VERSION})")
        self.odb.load_state_dict(state.pop("odb"))
        self.consumed = ConsumedCounts(**state.pop("consumed"))
        self._window = _Window(**state.pop("window"))
        if state:
            raise ValueError(f"unexpected keys in DeepSpeedODBLoader state: {sorted(state)}")
