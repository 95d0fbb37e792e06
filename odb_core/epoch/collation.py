"""A step between its round's plan and its consumer: the samples and the counts, collated when the step is taken.

NOTE [ A step is collated when it is taken ]
A round plans many steps at once, and the all_reduce that ends it needs every step's local counts before any
step is released (NOTE [ One round ] in pipeline.py). Collating every slot then would hold a round's collated
batches beside each other until the last is taken: for VLM samples of megabytes (`pixel_values`), the round's
samples a second time. So, for a label-preserving collator, a planned step keeps only its samples (the payload
references taken from the reader) and its counts (`PlannedStep`); `EpochRun.__next__` collates it when the
consumer takes it, on the thread that runs the epoch (the background producer's, with `prefetch_steps > 0`), or
the step after it ahead in a thread (NOTE [ Collating the next step ahead ] in collate_ahead.py), so at most one
collated batch per step that has left the round exists, plus the next step's, and a step a resume skips is never
collated.
  * A label-preserving collator (NOTE [ Label-preserving collators ] in odb_core/data/collate.py; `PadCollator`)
    is counted from the samples: the counts equal those of its batch, so every `StepInfo` field, the metrics and
    the batches are what collating at plan time gave.
  * Any other collator may mask or shift labels, which only its batch shows: the slot is collated at plan time
    to count its supervised and padded tokens, and that batch is what the step hands on (held until the step
    is taken, as before this NOTE). Collating again when the step is taken would save the memory but run the
    collator twice, on the training thread: for LLaMA-Factory's, which makes `pixel_values` from image paths,
    that doubles the image processing.
  * The IDLE dummy is collated when its step is taken too; its counts are zero, so it is never collated to
    count. The dummy sample is the one chosen when the step was planned (a later fill may choose another).
A collation that fails raises `CollateError` naming the samples' indices from the `next()` that collates (the
step's own, or the round's first for a plan-time count) and first releases the worker iterator (`release`), as
the reader does on its own errors, so the workers exit while the loader lives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from odb_core.data.collate import (CollateFn, is_label_preserving, padded_tokens, run_collate, sample_padded_tokens,
                                   sample_supervised_tokens, supervised_tokens, takes_id_arrays)
from odb_core.data.sample import LengthFn, as_dummy, input_tokens, restore_id_lists
from odb_core.planning.grouping import Group
from odb_core.ranks.moves_ahead import Moved


@dataclass(frozen=True, slots=True)
class SlotCounts:
    """One step's local counts: what the round's all_reduce sums (`as_ints`) and the local `StepInfo` fields."""

    samples: int = 0
    tokens: int = 0
    input_tokens: int = 0
    padded: int = 0
    cost: int = 0
    patches: int = 0

    def as_ints(self) -> list[int]:
        return [self.samples, self.tokens, self.input_tokens, self.cost, self.cost * self.cost, self.patches]


@dataclass(frozen=True, slots=True)
class PlannedStep:
    """A planned step until it is taken: its samples in slot order (an IDLE step: the dummy sample, not yet
    made zero-weight), their dataset indices (none for IDLE) and its counts."""

    payloads: tuple[Any, ...]
    indices: tuple[int, ...]
    counts: SlotCounts
    batch: Mapping[str, Any] | None = None  # collated at plan time (a collator that is not label-preserving)


@dataclass(frozen=True, slots=True)
class Collation:
    """How one epoch counts and collates its steps (NOTE [ A step is collated when it is taken ]).

    `from_samples` is `is_label_preserving(collate_fn)`, decided once per epoch; `lists` that the collator is given
    ids as lists (`restore_id_lists`: it does not take the arrays they were buffered as, NOTE [ Compact buffered
    samples ]); `release` frees the worker iterator when a collation fails."""

    collate_fn: CollateFn
    length_fn: LengthFn | None
    from_samples: bool
    release: Callable[[], None]
    lists: bool = False

    @staticmethod
    def of(collate_fn: CollateFn, length_fn: LengthFn | None, release: Callable[[], None]) -> Collation:
        return Collation(collate_fn, length_fn, is_label_preserving(collate_fn), release,
                         lists=not takes_id_arrays(collate_fn))

    def plan(self, slot: Group, samples: list[Any]) -> PlannedStep:
        """The step of a real slot whose samples are `samples` (a `Moved` for one still in flight: NOTE [ Moves
        overlap training ]); a collator that is not label-preserving collates them here to count, and the step
        keeps that batch (and not the samples)."""
        indices = slot.indices  # a property that builds the tuple: once here
        moved = [s for s in samples if type(s) is Moved]
        if moved and not self.from_samples:  # it counts from its batch: the move must have ended
            samples, moved = resolved(samples), []
        # without a length_fn an item's length is its input tokens, counted when it was admitted
        lengths = ([item.length for item in slot.items] if self.length_fn is None
                   else [s.input_tokens if type(s) is Moved else input_tokens(s) for s in samples])
        real = sum(lengths)
        batch = None
        if moved:
            tokens, padded = moved_supervised_tokens(samples), sample_padded_tokens(lengths)
        elif self.from_samples:
            tokens, padded = sample_supervised_tokens(samples), sample_padded_tokens(lengths)
        else:
            batch = self._collate(samples, indices)
            tokens, padded = supervised_tokens(batch, samples), padded_tokens(batch, real)
        counts = SlotCounts(samples=slot.size, tokens=tokens, input_tokens=real, padded=padded,
                            cost=round(slot.cost), patches=sum(item.patches for item in slot.items))
        return PlannedStep(payloads=tuple(samples) if batch is None else (), indices=indices, counts=counts,
                           batch=batch)

    @staticmethod
    def idle(dummy: Mapping[str, Any]) -> PlannedStep:
        """An IDLE step built from the rank's dummy sample; its counts are zero."""
        return PlannedStep(payloads=(dummy,), indices=(), counts=SlotCounts())

    def take(self, step: PlannedStep, release: bool = True) -> Mapping[str, Any]:
        """The step's collated batch (an IDLE step's: the zero-weight copy of its dummy); `release=False` leaves
        the worker iterator alone if it fails (a collation in another thread: NOTE [ Collating the next step
        ahead ] in collate_ahead.py)."""
        if step.batch is not None:
            return step.batch
        samples = resolved(step.payloads) if step.indices else [as_dummy(step.payloads[0])]
        return self._collate(samples, step.indices, release)

    def _collate(self, samples: list[Any], indices: Sequence[int], release: bool = True) -> Mapping[str, Any]:
        try:
            return run_collate(self.collate_fn, [restore_id_lists(s) for s in samples] if self.lists else samples,
                               indices)
        except BaseException:
            if release:
                self.release()
            raise


def resolved(samples: Sequence[Any]) -> list[Any]:
    """`samples` with each `Moved` replaced by its sample, waiting for its move (NOTE [ Moves overlap training ])."""
    return [s.sample() if type(s) is Moved else s for s in samples]


def moved_supervised_tokens(samples: Sequence[Any]) -> int:
    """`sample_supervised_tokens` of `samples` when some are `Moved` (counted from their facts): the labelled
    samples' supervised tokens when any sample has labels, else each sample's input tokens less one."""
    held = [s for s in samples if type(s) is not Moved]
    moved = [s for s in samples if type(s) is Moved]
    if any("labels" in s for s in held) or any(m.labelled for m in moved):
        labelled = [s for s in held if "labels" in s]
        return (sample_supervised_tokens(labelled) if labelled else 0) + sum(m.supervised for m in moved if m.labelled)
    return sample_supervised_tokens(held) + sum(m.supervised for m in moved)
