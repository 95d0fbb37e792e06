"""ODB's data position in Trainer checkpoints: `odb_loader_rank{r}.json` (the loader's `state_dict()`) per rank.

Written at every save beside the Trainer's own files; read before the first batch of a resumed `train()`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from odb_core.loader import ODBDataLoader
from odb_hf.arguments import ODBSetupError

LOADER_STATE = "odb_loader_rank{rank}.json"


def save_loader_state(loader: ODBDataLoader, output_dir: str, global_step: int) -> None:
    folder = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOADER_STATE.format(rank=loader.transport.rank)), "w") as f:
        json.dump(loader.state_dict(), f)


def read_loader_state(checkpoint: str, rank: int) -> dict[str, Any]:
    path = os.path.join(checkpoint, LOADER_STATE.format(rank=rank))
    if not os.path.isfile(path):
        raise ODBSetupError(f"{path} is missing: the checkpoint was not written by an ODB run with this world "
                            "size, so the data position cannot be restored; pass ignore_data_skip=True to "
                            "restart the checkpoint's epoch from its beginning instead")
    with open(path) as f:
        return json.load(f)
