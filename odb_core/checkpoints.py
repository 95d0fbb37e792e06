"""ODB's part of a training checkpoint: one loader-state file per rank.

A checkpoint folder written by a trainer (the HF Trainer's `checkpoint-N/` through odb_hf, or a user's own loop's)
gets `odb_loader_rank{r}.json` from every rank r: the `state_dict()` of that rank's loader (an `ODBDataLoader`, or
any object with `state_dict`/`load_state_dict`). The file is
written atomically (a temporary file, then `os.replace`), so a process killed while saving leaves the previous
file or the new one, never a cut one. Reading it back in a new process gives the exact data position (G8).
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

LOADER_STATE = "odb_loader_rank{rank}.json"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def loader_state_path(folder: str | os.PathLike, rank: int) -> str:
    return os.path.join(folder, LOADER_STATE.format(rank=rank))


def save_loader_state(loader: Stateful, folder: str | os.PathLike, rank: int) -> str:
    """Write `loader.state_dict()` into `folder` as this rank's file (atomically); returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = loader_state_path(folder, rank)
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump(loader.state_dict(), handle)
    os.replace(temporary, path)
    return path


def load_loader_state(loader: Stateful, folder: str | os.PathLike, rank: int, *, missing: str) -> None:
    """Load this rank's file from `folder` into `loader`; `missing` ends the error when there is none."""
    path = loader_state_path(folder, rank)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: the checkpoint was not written by an ODB run with this world "
                                f"size, so the data position cannot be restored; {missing}")
    with open(path) as handle:
        loader.load_state_dict(json.load(handle))

