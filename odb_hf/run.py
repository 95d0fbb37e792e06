"""`RunState`: ODB's state on one Trainer, `trainer.odb`; its one owner.

NOTE [ ODB's state on a Trainer ]
A Trainer with ODB carries one `RunState`, set by `attach.attach_odb` (the one place a user's Trainer changes):
  * `settings`: what the Trainer runs with (the callback's, completed by a DeepSpeed `odb` section), fixed at attach;
  * `adapter`: who runs ODB, for the start line ("HF Trainer", "LLaMA-Factory"), fixed at attach;
  * the data position that the current `train()` resumes from (checkpoint.py), set by `start_train`;
  * `run`: the live `ODBRun` of the latest `get_train_dataloader()`, replaced by `new_run` (None before).
Only this module writes them. `ODBTrainerMixin` (trainer.py) calls `start_train`, `new_run`, `close_run` and reads
`run`; `ODBCallback` (callback.py) reads `run` in its events and calls `save_position`. Neither imports the other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from transformers import TrainingArguments

from odb_core.epoch.epoch_length import EpochView, plan_epoch_length
from odb_core.epoch.loader import ODBDataLoader
from odb_core.settings.settings import ODBSettings
from odb_core.steps.metrics import StepMeter
from odb_hf.arguments import build_loader
from odb_hf.checkpoint import DataPosition, save_position

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ODBRun:
    """One `get_train_dataloader()`'s ODB objects: the loader, the Trainer's view of it, the log meter, and how
    many micro-batches of the first optimizer step still have their loss checked (`take_loss_check`)."""

    loader: ODBDataLoader
    view: EpochView
    meter: StepMeter
    loss_checks_left: int = 0
    first_step: int | None = None  # the Trainer's global_step when this train() began (after a resume, its step)

    def take_loss_check(self) -> bool:
        """True for each of the first `loss_checks_left` calls: that micro-batch's loss is to be checked."""
        if self.loss_checks_left <= 0:
            return False
        self.loss_checks_left -= 1
        return True


class RunState:
    """ODB's state on one Trainer (see the NOTE above); one per attached Trainer, so a callback serves one."""

    def __init__(self, settings: ODBSettings, adapter: str) -> None:
        self.settings = settings
        self.adapter = adapter
        self._position = DataPosition()
        self._run: ODBRun | None = None

    def close_run(self) -> None:
        """NOTE [ A failed train() ends its loader ]
        When `train()` raises (a bad sample, a dead peer, Ctrl-C in a notebook), the Trainer never reaches
        `on_train_end`, where the callback closes the loader: its DataLoader workers, its reader and planning
        threads and its Gloo group lived on until the process ended, beside the loader a second `train()` builds.
        So the loader is closed as the error leaves `train()`, while it unwinds, which leaves the epoch without a
        collective (NOTE [ A failed epoch is not left ] in odb_core/epoch/pipeline.py). The run stays readable: a
        closed loader keeps its `state_dict()`, metrics and `last_report`. A failure to close is logged, and the
        error that ended `train()` is the one raised."""
        if self._run is None:
            return
        try:
            self._run.loader.close()
        except Exception as error:  # the error in flight is the user's cause; this one is logged beside it
            logger.warning("ODB: closing the loader of a failed train() failed too: %s: %s",
                           type(error).__name__, error)

    def end_train(self, args: TrainingArguments) -> None:
        """When `train()` returns or raises: the arguments as the user gave them (checkpoint.py)."""
        self._position.end(args)

    @property
    def restarted(self) -> bool:
        """This `train()` resumed without the data position (the user's `ignore_data_skip`): its first epoch starts
        over, so the run reaches `max_steps` inside an epoch."""
        return self._position.restarted

    @property
    def run(self) -> ODBRun | None:
        """The live run: the latest `get_train_dataloader()`'s loader, view and meter; None before the first."""
        return self._run

    def start_train(self, args: TrainingArguments, resume_from_checkpoint: str | bool | None) -> None:
        """At `train(resume_from_checkpoint)`, before the Trainer builds the dataloader: where the data resumes."""
        self._position.start(args, resume_from_checkpoint)

    def new_run(self, args: TrainingArguments, dataset: Any, collate_fn: Any, loss_checks: int) -> EpochView:
        """Build the training loader, restore the data position into it, plan the epoch length and make this the
        live run; `loss_checks`: micro-batches whose loss `compute_loss` checks (trainer.py)."""
        loader = build_loader(args, dataset, collate_fn, self.settings)
        resumed = self._position.restore(loader)
        extras = self.settings.extras
        plan = plan_epoch_length(loader, max_steps=args.max_steps, num_train_epochs=args.num_train_epochs,
                                 slack=extras["length_slack"], sample_size=extras["estimate_sample_size"],
                                 exact=extras["exact_schedule"])
        view = EpochView(loader, plan, resumed=resumed)
        self._run = ODBRun(loader=loader, view=view, meter=StepMeter(loader.config, loader.metrics),
                           loss_checks_left=loss_checks)
        return view

    def save_position(self, output_dir: str, global_step: int) -> None:
        """At a checkpoint save: the live run's data position beside the Trainer's files (checkpoint.py)."""
        assert self._run is not None, "the Trainer saves checkpoints only while training"
        save_position(self._run.loader, output_dir, global_step)
