"""ODB's data position in Trainer checkpoints: `odb_loader_rank{r}.json` per rank (`odb_core.resume.checkpoints`).

Written at every save beside the Trainer's own files; read before the first batch of a resumed `train()`. With
`ignore_data_skip=False` (the default) the Trainer asks for the exact data position: ODB restores it from its own
state and sets `ignore_data_skip=True`, with a warning, so that the Trainer does not skip batches a second time.
ODB puts the user's value back when `train()` returns or raises (`end`), so a later Trainer built from the same
`TrainingArguments` (a retry loop, a copy of them) still restores. A user's own `ignore_data_skip=True` is
honoured, with a warning: no restore, the Trainer restarts from the beginning of the epoch it counts from
`global_step`, and the run stops at its `max_steps` inside that epoch (`restarted`).
A resumed multi-process CPU run also needs torch to read `cpu:N` locations (NOTE [ Indexed CPU devices in
torch.load ] in odb_core/resume/checkpoints.py), which `start` registers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from transformers import TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from odb_core.epoch.loader import ODBDataLoader
from odb_core.resume.checkpoints import allow_indexed_cpu_location, load_loader_state, save_loader_state
from odb_hf.arguments import ODBSetupError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DataPosition:
    """Where the current `train()` resumes the data from (`resume_from`, None: the start), per Trainer."""

    resume_from: str | None = None
    restarted: bool = False  # resumed without the position (the user's ignore_data_skip): the epoch starts over
    flipped: bool = False  # ODB set args.ignore_data_skip for this train(); `end` puts the user's value back

    def start(self, args: TrainingArguments, resume_from_checkpoint: str | bool | None) -> None:
        """At `train(resume_from_checkpoint)`, before the Trainer builds the dataloader."""
        if resume_from_checkpoint and args.device.type == "cpu":
            allow_indexed_cpu_location()
        restore = bool(resume_from_checkpoint) and not args.ignore_data_skip
        if restore:
            logger.warning("ODB restores the exact data position from the checkpoint's odb_loader_rank*.json; "
                           "setting ignore_data_skip=True for this train() so the Trainer does not skip batches a "
                           "second time")
            args.ignore_data_skip = self.flipped = True
        self.restarted = bool(resume_from_checkpoint) and not restore
        if self.restarted:
            logger.warning("ODB resumes without the checkpoint's data position (ignore_data_skip=True): the Trainer "
                           "restarts an epoch from its beginning and stops at max_steps inside it")
        self.resume_from = None
        if restore:
            self.resume_from = (get_last_checkpoint(args.output_dir) if resume_from_checkpoint is True
                                else str(resume_from_checkpoint))

    def end(self, args: TrainingArguments) -> None:
        """When `train()` returns or raises: the user's `ignore_data_skip` back."""
        if self.flipped:
            args.ignore_data_skip = self.flipped = False

    def restore(self, loader: ODBDataLoader) -> bool:
        """Load the saved position into a new `loader`; False when this `train()` does not resume."""
        if self.resume_from is None:
            return False
        try:
            load_loader_state(loader, self.resume_from, loader.transport.rank, missing=(
                "if the run stopped while it saved this checkpoint (the Trainer writes its own files first, then "
                "ODB's), resume from the checkpoint before it, if one is left; otherwise pass "
                "ignore_data_skip=True to restart the checkpoint's epoch from its beginning instead"))
        except FileNotFoundError as exc:
            raise ODBSetupError(str(exc)) from exc
        return True


def save_position(loader: ODBDataLoader, output_dir: str, global_step: int) -> None:
    folder = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")
    save_loader_state(loader, folder, loader.transport.rank)
