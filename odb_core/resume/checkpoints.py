"""ODB's part of a training checkpoint: one loader-state file per rank, and loading a trainer's torch files on CPU.

A checkpoint folder written by a trainer (the HF Trainer's `checkpoint-N/` through odb_hf, or a user's own loop's)
gets `odb_loader_rank{r}.json` from every rank r: the `state_dict()` of that rank's loader (an `ODBDataLoader`, or
any object with `state_dict`/`load_state_dict`). The file is
written atomically (a temporary file, synced, then `os.replace`, and the folder synced), so a process killed while
saving, or a machine that crashes after it, leaves the previous file or the new one, never a cut one; a file cut
anyway (a copy) is a `StateError` naming it. Reading it back in a new process gives the exact data position (G8).

NOTE [ Indexed CPU devices in torch.load ]
Multi-process CPU runs of the HF Trainer load the optimizer state with `map_location=args.device`, which is
`cpu:0` there, and torch 2.13 has no restore function for a `cpu:N` location ("don't know how to restore data
location of torch.storage.UntypedStorage (tagged with cpu:0)"): a resumed run crashes, with or without ODB.
`allow_indexed_cpu_location()` registers one through torch's public `torch.serialization.register_package`: a
storage tagged `cpu:N` stays on the CPU, where it already is. Every other location is left to torch's own
functions (this one answers None for them). Registered once per process, on resume only.
"""

from __future__ import annotations

import errno
import functools
import json
import os
from typing import Any, Protocol

import torch

from odb_core.resume.fields import StateError

LOADER_STATE = "odb_loader_rank{rank}.json"
INDEXED_CPU_PRIORITY = 99  # after torch's own cpu (10), cuda (20), mps, meta, ... restore functions


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
    try:
        with open(temporary, "w") as handle:
            json.dump(loader.state_dict(), handle)
            handle.flush()
            _sync(handle.fileno())  # on disk before the rename: a crash of the machine leaves no empty file
        os.replace(temporary, path)
        _sync_folder(folder)
    finally:
        if os.path.exists(temporary):  # the dump failed: leave no half-written file behind
            os.remove(temporary)
    return path


def load_loader_state(loader: Stateful, folder: str | os.PathLike, rank: int, *, missing: str) -> None:
    """Load this rank's file from `folder` into `loader`; `missing` ends the error when there is none."""
    path = loader_state_path(folder, rank)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: the checkpoint was not written by an ODB run with this world "
                                f"size, so the data position cannot be restored; {missing}")
    with open(path) as handle:
        try:
            state = json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StateError(f"{path} is not a whole loader state ({exc}): the file was cut or overwritten "
                             "(a crash while it was copied or synced); resume from an earlier checkpoint") from exc
    loader.load_state_dict(state)


def _sync(descriptor: int) -> None:
    """fsync, except where the file system does not do it (some network and FUSE mounts): the save goes on."""
    try:
        os.fsync(descriptor)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
            raise


def _sync_folder(folder: str | os.PathLike) -> None:
    """The rename itself on disk (POSIX: fsync of the folder); skipped where the folder cannot be opened so."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _restore_indexed_cpu(storage: Any, location: str) -> Any:
    return storage if location.startswith("cpu:") else None


def _tag_nothing(obj: Any) -> None:
    return None  # saving keeps torch's own tags


@functools.cache
def allow_indexed_cpu_location() -> None:
    """Let `torch.load(..., map_location="cpu:N")` restore CPU storages (NOTE above); idempotent."""
    torch.serialization.register_package(INDEXED_CPU_PRIORITY, _tag_nothing, _restore_indexed_cpu)
