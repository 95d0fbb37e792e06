"""ODB's data position in Trainer checkpoints: `odb_loader_rank{r}.json` per rank (`odb_core.resume.checkpoints`).

Written at every save beside the Trainer's own files; read before the first batch of a resumed `train()`. With
`ignore_data_skip=False` (the default) the Trainer asks for the exact data position: ODB restores it from its own
state and sets `ignore_data_skip=True`, with a warning, so that the Trainer does not skip batches a second time.
A user's own `ignore_data_skip=True` is honoured: no restore, the checkpoint's epoch restarts from its beginning,
and the run stops at the Trainer's `max_steps` inside it (`restarted`). ODB marks the arguments it changed
(`FLIPPED`), so a later Trainer built from the same `TrainingArguments` (a retry loop) still restores.
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
FLIPPED = "_odb_set_ignore_data_skip"  # on a TrainingArguments: ODB set its ignore_data_skip, not the user


@dataclass(slots=True)
class DataPosition:
    """Where the current `train()` resumes the data from (`resume_from`, None: the start), per Trainer."""

    resume_from: str | None = None
    restarted: bool = False  # resumed without the position (the user's ignore_data_skip): the epoch starts over

    def start(self, args: TrainingArguments, resume_from_checkpoint: str | bool | None) -> None:
        """At `train(resume_from_checkpoint)`, before the Trainer builds the dataloader."""
        if resume_from_checkpoint and args.device.type == "cpu":
            allow_indexed_cpu_location()
        restore = bool(resume_from_checkpoint) and (not args.ignore_data_skip or getattr(args, FLIPPED, False))
        if restore and not args.ignore_data_skip:
            logger.warning("ODB restores the exact data position from the checkpoint's odb_loader_rank*.json; "
                           "setting ignore_data_skip=True so the Trainer does not skip batches a second time")
            args.ignore_data_skip = True
            setattr(args, FLIPPED, True)  # not a dataclass field: to_dict() and the saved arguments leave it out
        self.restarted = bool(resume_from_checkpoint) and not restore
        self.resume_from = None
        if restore:
            self.resume_from = (get_last_checkpoint(args.output_dir) if resume_from_checkpoint is True
                                else str(resume_from_checkpoint))

    def restore(self, loader: ODBDataLoader) -> bool:
        """Load the saved position into a new `loader`; False when this `train()` does not resume."""
        if self.resume_from is None:
            return False
        try:
            load_loader_state(loader, self.resume_from, loader.transport.rank, missing="pass ignore_data_skip=True "
                              "to restart the checkpoint's epoch from its beginning instead")
        except FileNotFoundError as exc:
            raise ODBSetupError(str(exc)) from exc
        return True


def save_position(loader: ODBDataLoader, output_dir: str, global_step: int) -> None:
    folder = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")
    save_loader_state(loader, folder, loader.transport.rank)
