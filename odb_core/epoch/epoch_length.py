"""An epoch length for trainers that plan with `len()`: one ODB epoch per trainer epoch (the HF Trainer, and
LLaMA-Factory through it; any loop that sizes its schedule from `len(dataloader)` before the first batch).

NOTE [ Epochs under the HF Trainer ]
The HF Trainer reads `len(train_dataloader)` once and runs every epoch as `range(ceil(len / G))` optimizer steps,
each pulling G micro-batches; once the iterator is exhausted the remaining iterations get no batch and do nothing.
ODB epochs vary in length (batch sizes follow the observed lengths), so:
  * epoch-based runs with an exact plan (the default for map-style data; NOTE [ Exact schedule ] in estimate.py):
    `len()` is the longest planned epoch, and the schedule and `state.max_steps` are the real total;
  * other epoch-based runs (`max_steps <= 0`): `len()` is an upper bound U = estimate x (1 + slack), rounded up to G.
    An epoch shorter than U just ends early; the LR scheduler is built for the *estimated* total instead of the
    bound (`planned_steps`), and training stops after `num_train_epochs` ODB epochs. An epoch longer than U
    would be cut by the Trainer; the callback detects that at the epoch's end and raises (never silently).
  * step-based runs (`max_steps > 0`): `len()` raises TypeError, so the Trainer runs epochs of up to
    `max_steps` optimizer steps, i.e. each ODB epoch to its natural end, until `max_steps`.
With a step target (`samples_per_step`), the Trainer runs G = 1 and each item is one `StepWindow` (the
micro-batches of one optimizer step), so lengths count optimizer steps.
Every rank derives U from the same cross-rank estimate, and every rank's ODB epoch has the same number of steps,
a multiple of G (G2), so all ranks run the same optimizer steps and never split a GA window.
The Trainer's epoch number is mapped to ODB's own epoch counter, which a resumed loader restores, so the
Trainer's `epochs_trained = global_step // (U / G)` (an underestimate under a bound) cannot replay an epoch. It
must not overestimate either, or the resumed Trainer runs fewer epochs than are left and ends early, silently: so
an exact `len()` is the longest of every planned epoch, the ones before the resume point included (it was the
longest from the restored epoch on; after a longer earlier epoch a resume skipped whole epochs). With
`global_step` inside epoch k, global_step < (k + 1) x the longest, so the count is at most k.

NOTE [ Resuming at an epoch's end ]
A checkpoint taken at the last optimizer step of ODB epoch e (`save_steps` landing there, or the last one before
a crash) holds a state with `epoch_complete`: the Trainer saves before it asks the exhausted iterator for more.
Its loader's `iter()` for epoch e yields nothing, and the HF Trainer stops training at an epoch without a single
batch. So the first Trainer epoch of a resumed run maps to epoch e + 1 (`epoch_consumed`), which every rank
does alike (all ranks saved after the same step, and an epoch ends at the same step on every rank, G2): the
resumed run continues with the batches of epoch e + 1, as the uninterrupted one did. At the run's last step,
e + 1 is `stop_epoch`: the resumed run takes no batch (transformers logs that it found none) and ends at the
same `global_step`, its epoch count whole. A state taken at an epoch's last step whose end came in a round of no
steps is not marked so (NOTE [ Which last step is complete ] in odb_core/resume/round_log.py): the first resumed
epoch then replays to its end and yields nothing, and the view goes on into e + 1 in the same Trainer epoch, every
rank alike (the state is the same on each), instead of handing the Trainer an epoch without a batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from odb_core.epoch.loader import ODBDataLoader
from odb_core.settings.console import LOGGER
from odb_core.steps.accumulation import StepTarget, step_windows
from odb_core.steps.step_info import ODBBatch, StepInfo

logger = logging.getLogger(__name__)
CHANGED_LENGTHS = ("the samples' lengths differ from those the schedule was planned with, which it read once "
                   "before training (random truncation, templates or augmentation in __getitem__?), so the LR "
                   "schedule does not end at the run's last step; for such a dataset set exact_schedule=False "
                   "(ODBCallback(exact_schedule=False), odb_exact_schedule: false), which plans with an estimate "
                   "and length_slack, or set max_steps")


@dataclass(frozen=True, slots=True)
class EpochLength:
    """Lengths the Trainer plans with. `length` None: no len() (step-based or unsized data). `exact`: the step
    counts are the real ones (NOTE [ Exact schedule ]), so `planned_steps` is the run's real optimizer-step count."""

    length: int | None
    estimate: int | None
    planned_steps: int | None
    stop_epoch: int | None
    exact: bool = False
    micro_batches: tuple[int, ...] | None = None  # exact: every planned epoch's micro-batches, checked at its end


def _planned(per_epoch: Sequence[int], num_train_epochs: float) -> int:
    """Optimizer steps of `num_train_epochs` epochs of these lengths (a fraction takes part of the last)."""
    whole = math.floor(num_train_epochs)
    fraction = num_train_epochs - whole
    return max(sum(per_epoch[:whole]) + (math.ceil(fraction * per_epoch[whole]) if fraction else 0), 1)


def plan_epoch_length(loader: ODBDataLoader, *, max_steps: int, num_train_epochs: float, slack: float,
                      sample_size: int, exact: bool = True) -> EpochLength:
    """The trainer's epoch lengths: exact (`exact`, the default: every rank's lengths on the virtual cluster, for
    map-style data and sample- or G-sized steps) or estimated (one all_gather of one int). Every rank calls it at
    the same point. With a step target the trainer's unit is an optimizer step (one `StepWindow`), otherwise a
    micro-batch."""
    if max_steps > 0:
        return EpochLength(length=None, estimate=None, planned_steps=None, stop_epoch=None)
    stop_epoch = math.ceil(num_train_epochs)
    windows = loader.config.step_target is not None
    if exact:
        try:
            # the epochs before a resume point too (for the schedule's total), in the same call: one read of the data
            plan = loader.plan_epochs_exactly(range(0, max(stop_epoch, loader.epoch + 1)))
        except TypeError as exc:
            logger.info(f"ODB: the step count is estimated ({exc})")
        else:
            unit = plan.optimizer_steps if windows else plan.micro_batches  # every epoch's, the ones done too:
            ahead = slice(loader.epoch, None)  # NOTE [ Epochs under the HF Trainer ] (a resumed count of epochs)
            return EpochLength(length=max(max(unit), 1), estimate=max(plan.micro_batches[ahead]), exact=True,
                               planned_steps=_planned(plan.optimizer_steps, num_train_epochs), stop_epoch=stop_epoch,
                               micro_batches=plan.micro_batches)
    try:
        # from epoch 0 whatever the resume point: a resumed run plans the same schedule and bound as the run it
        # continues (before, the resumed epoch's own sample gave another estimate: the LR jumped at the resume)
        estimate = loader.estimate_steps(sample_size=sample_size, epoch=0)
    except TypeError as exc:
        raise TypeError(f"an epoch-based run needs an epoch length, but {exc}; set max_steps > 0") from exc
    per_epoch = _estimated_optimizer_steps(loader, estimate)
    unit = loader.config.accumulation_steps if not windows else 1
    bound = math.ceil(math.ceil(per_epoch * (1.0 + slack)) * unit)
    if windows:  # a step holds at least one micro-batch, whatever its samples or tokens: the estimated micro-batches
        bound = math.ceil(estimate * (1.0 + slack))  # with the slack bound the steps (the steps' own estimate may not)
    return EpochLength(length=max(bound, unit), estimate=estimate, stop_epoch=stop_epoch,
                       planned_steps=max(math.ceil(num_train_epochs * per_epoch), 1))


def _estimated_optimizer_steps(loader: ODBDataLoader, micro_batches: int) -> float:
    """Optimizer steps per epoch from the estimated micro-batches: / G, or, with samples_per_step, the steps the
    target's own rule closes over micro-batches of the mean global size, its floor and ceiling mixed (before: the
    epoch's samples / the target, which a step of whole micro-batches falls short of where they are large: 75 steps
    planned for 100 real ones, micro-batches of 6 samples under a target of 8, so the last quarter trained at the
    schedule's end value). Where micro-batches hold about half the target the rule tips on their spread, which the
    mean does not have: up to 30 % over (a review's runs; the LR then ends short of its end value, not at it
    early); the exact schedule (the default) has no such error. With tokens_per_step no better figure than the
    micro-batches exists before the collator ran (see the guide)."""
    target = loader.config.step_target
    if target is None:
        return micro_batches / loader.config.accumulation_steps
    if target[0] == "samples" and hasattr(loader.dataset, "__len__") and micro_batches > 0:
        mean = len(loader.dataset) / micro_batches  # global samples per micro-batch step: its floor and ceiling,
        sizes = [max(math.floor((k + 1) * mean) - math.floor(k * mean), 1) for k in range(micro_batches)]  # mixed
        return max(float(StepTarget(*target).count_steps(sizes)), 1.0)
    return float(micro_batches)


class EpochView:
    """`len()`, `set_epoch()` and `iter()` for the Trainer over an `ODBDataLoader` (see the NOTE above)."""

    def __init__(self, loader: ODBDataLoader, plan: EpochLength, *, resumed: bool) -> None:
        self.loader, self.plan, self.resumed = loader, plan, resumed
        self.dataset = loader.dataset  # Trainer.num_examples() reads len(dataloader.dataset)
        self._trainer_epoch: int | None = None
        self._offset: int | None = None
        self._running: Iterator[ODBBatch] | None = None
        self.finished = True
        self._progress_epoch: int | None = None  # NOTE [ Epoch progress ]: the epoch whose start step is known
        self._epoch_start_step = 0
        self._resumed_epoch: int | None = None  # the epoch a resume entered, not run whole here
        self._told_plan = False  # NOTE [ Lengths that change between reads ]: warned once

    def __bool__(self) -> bool:  # a loader is there, with or without a length (`if trainer_dataloader:`)
        return True

    def __len__(self) -> int:
        if self.plan.length is None:
            raise TypeError("ODB epochs have no fixed length in step-based runs; max_steps drives training")
        return self.plan.length

    def set_epoch(self, epoch: int) -> None:
        self._trainer_epoch = epoch

    def done(self) -> bool:
        """All `num_train_epochs` ODB epochs have run (epoch-based runs only)."""
        return self.plan.stop_epoch is not None and self.finished and self.loader.epoch >= self.plan.stop_epoch

    def __iter__(self) -> Iterator[ODBBatch]:
        if not self.finished:  # the Trainer stopped the epoch on request (should_epoch_stop)
            self.loader.leave_epoch()
        trainer_epoch = self._trainer_epoch if self._trainer_epoch is not None else self.loader.epoch
        first_resumed = self._offset is None and self.resumed
        if self._offset is None:  # a restored loader knows its epoch; otherwise the Trainer's count is used
            first = self.loader.epoch + int(self.loader.epoch_consumed)  # NOTE [ Resuming at an epoch's end ]
            self._offset = first - trainer_epoch if self.resumed else 0
        epoch = trainer_epoch + self._offset
        if first_resumed:
            self._resumed_epoch = epoch
        self.loader.set_epoch(epoch)  # past stop_epoch too: end_epoch() and done() read it
        if self.plan.stop_epoch is not None and epoch >= self.plan.stop_epoch:
            return iter(())
        self.finished = False
        self._running = iter(self.loader)
        return self._follow(self._running, epoch if first_resumed else None)

    def _follow(self, source: Iterator[ODBBatch], resumed_epoch: int | None = None) -> Iterator[Any]:
        items = step_windows(source) if self.loader.config.step_target is not None else source
        taken = False
        for item in items:  # not `yield from`: closing this generator must not close the epoch (end_epoch does)
            taken = True
            yield item
        following = None if resumed_epoch is None or taken else resumed_epoch + 1  # an unmarked end (NOTE above)
        if following is not None and (self.plan.stop_epoch is None or following < self.plan.stop_epoch):
            self._offset += 1
            self.loader.set_epoch(following)
            self._running = iter(self.loader)
            yield from self._follow(self._running)
            return
        self.finished = True

    def progress(self, info: StepInfo, *, global_step: int, max_steps: int) -> float:
        """NOTE [ Epoch progress ]
        The trainer's epoch count after the optimizer step that ends with micro-batch `info` (`global_step` of
        `max_steps`): `info.epoch` plus the fraction of that epoch done. The Trainer's own figure, the micro-batches
        of the epoch over `len()` (or, without a length, over max_steps x G), is wrong for ODB epochs, whose length
        varies: under `max_steps` an epoch that ended after 10 of 14 steps read 0.71, and the next one restarted
        from 1 + 1/14. Here the fraction is `done / length`, `done` the epoch's micro-batches so far, `length` the
        plan's estimate (epoch-based runs), else the length of the loader's last completed epoch (`len()`), else,
        in the first epoch of a stream, where no length exists, the share of the run's remaining optimizer steps
        taken since the epoch began (the Trainer's own guess for a stream: its steps over max_steps). The epoch's
        last step (`took_last_step`) makes it whole, `info.epoch + 1`; before it the fraction stays below
        `done / (done + 1)`, since one micro-batch at least is left. So the count never goes back, reaches every
        whole number at that epoch's last step, and a run that stops inside an epoch ends below the next
        whole number (where the epoch ends in a round of no steps, its last step is known only at the epoch's end,
        NOTE [ Which last step is complete ]: the count stays below the whole number until `end_epoch` makes it
        whole). A run resumed inside an epoch of unknown length measures from its resume step."""
        done = info.step + 1
        if self.loader.took_last_step:
            return float(info.epoch + 1)
        length = self.plan.estimate if self.plan.estimate is not None else self._completed_length()
        if length is not None:
            fraction = done / max(length, 1)
        else:
            if self._progress_epoch != info.epoch:  # the first step of this epoch that this run takes
                self._progress_epoch, self._epoch_start_step = info.epoch, global_step - 1
            fraction = (global_step - self._epoch_start_step) / max(max_steps - self._epoch_start_step, 1)
        return info.epoch + min(fraction, done / (done + 1))

    def _completed_length(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:  # no epoch completed yet (and no estimate)
            return None

    def end_epoch(self) -> float:
        """At the trainer's epoch end: the whole epoch count, or `RuntimeError` if the ODB epoch holds more
        batches than the trainer took (never a silent cut).

        Pulls one batch if the epoch is not known to be finished: every rank calls it at the same point.
        """
        if not self.finished and self._running is not None:
            try:
                next(self._running)
            except StopIteration:
                self.finished = True
            else:
                why = (f"exact schedule planned: {CHANGED_LENGTHS}" if self.plan.exact  # NOTE [ Lengths that ... ]
                       else f"trainer planned (estimate {self.plan.estimate}); raise length_slack "
                            "(ODBCallback(length_slack=...), odb_length_slack) or set max_steps")
                raise RuntimeError(f"ODB epoch {self.loader.epoch - 1} has more than the {len(self)} steps the {why}")
        self._check_plan()
        return float(self.loader.epoch)

    def _check_plan(self) -> None:
        """NOTE [ Lengths that change between reads ]
        The exact schedule (NOTE [ Exact schedule ] in estimate.py) reads every sample once before training and
        plans the epochs from those lengths, so it holds only where `dataset[i]` has the same length at every read.
        A dataset that truncates, templates or augments at random in `__getitem__` gives other lengths in the
        epoch: an epoch with fewer steps than planned ends the LR schedule short of its end value, with no error
        (a review's runs: 41 of 45 steps, the last LR 0.0011 instead of about 0), and one with more raises at its
        end (above), where the advice to raise `length_slack` did nothing, since an exact plan has no slack. So at
        each epoch's end the micro-batches it ran are compared with the plan's (not for an epoch a resume entered
        midway), and a difference is warned once, naming both and the fix: `exact_schedule=False` (an estimate
        with `length_slack`) or `max_steps`."""
        report, planned = self.loader.last_report, self.plan.micro_batches
        if (planned is None or report is None or self._told_plan or report.abandoned
                or report.epoch >= len(planned) or report.epoch == self._resumed_epoch):
            return
        if report.steps != planned[report.epoch]:
            self._told_plan = True
            LOGGER.warning(f"ODB epoch {report.epoch} ran {report.steps} micro-batches where the exact schedule "
                           f"planned {planned[report.epoch]}: {CHANGED_LENGTHS}")
