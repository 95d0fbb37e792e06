"""Which epoch a loader runs next, and what a loaded state left to finish in it."""

from __future__ import annotations

from dataclasses import dataclass

from odb_core.resume.source_state import RemainderSource
from odb_core.resume.state import ResumePoint, SavedPosition, start_of_remainder


@dataclass(frozen=True, slots=True)
class EpochStart:
    """What the next `iter()` runs: `epoch`, from `point` (None: the beginning), over `plan` (None: the sampler)."""

    epoch: int
    position: SavedPosition | None
    plan: RemainderSource | None

    @property
    def point(self) -> ResumePoint | None:
        if self.position is not None:
            return self.position.point
        return start_of_remainder(self.plan) if self.plan is not None else None

    @property
    def nothing_left(self) -> bool:
        """The loaded position was the epoch's last step: iterating runs nothing (and no collective)."""
        return self.position is not None and self.position.complete


@dataclass(slots=True)
class EpochCursor:
    """The epoch of the next `iter()`; each `begin()` advances it by one. A loaded state pins `epoch` with a
    pending `position` (exact resume) or `plan` (elastic resume) that the next `begin()` consumes. `closed_at`:
    where the consumer of an epoch that `close()` ended early stood, (epoch, plan, position, metrics), which
    `state_dict()` saves until the loader moves (`begin`, `load`, `select`)."""

    epoch: int = 0
    position: SavedPosition | None = None
    plan: RemainderSource | None = None
    closed_at: tuple[int, RemainderSource | None, SavedPosition | None, dict[str, float | int]] | None = None

    def select(self, epoch: int) -> None:
        """`set_epoch`: refuse to replay or skip what a loaded state left pending in its epoch."""
        if epoch != self.epoch and (self.position is not None or self.plan is not None):
            done = self.position is not None and self.position.complete
            if not (done and epoch > self.epoch):
                raise ValueError(f"the loaded state continues epoch {self.epoch}; set_epoch({epoch}) would "
                                 f"{'replay' if epoch < self.epoch else 'skip'} its remaining steps. Call "
                                 f"set_epoch(loader.epoch) (= {self.epoch}), or build a fresh loader to start over")
            self.position = self.plan = None
        if epoch != self.epoch:
            self.epoch, self.closed_at = epoch, None

    def load(self, epoch: int, position: SavedPosition | None, plan: RemainderSource | None) -> None:
        self.epoch, self.position, self.plan, self.closed_at = epoch, position, plan, None

    def begin(self) -> EpochStart:
        start = EpochStart(epoch=self.epoch, position=self.position, plan=self.plan)
        self.epoch, self.position, self.plan, self.closed_at = self.epoch + 1, None, None, None
        return start
