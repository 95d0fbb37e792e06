"""Moved tensors that already live in shared memory travel by handle between the ranks of one host.

NOTE [ Moving shared tensors by handle ]
A sample read by DataLoader workers reaches its rank with every tensor over the pipe's limit in a shared-memory
file (NOTE [ The pipe or shared memory ] in data/sendable.py): a VLM sample's `pixel_values`, MBs. When the sample
then moves to another rank (NOTE [ Moves overlap training ]), its frame copied those bytes once more and Gloo's
socket carried them (copied into the kernel and out again, into a buffer the receiver had faulted in). For a
rank of the same host none of that is needed: the file is already there. So, on the move lane, such a tensor is
replaced in the pickled sample by a `SharedHandle` (the owner's pid, the file descriptor of the tensor's storage,
the file's inode, its size, and the tensor's dtype, shape, stride and offset: `to_handles`), and the receiver
opens the same file through `/proc/<pid>/fd/<fd>` and maps it (`from_handles`): no byte of the tensor is copied
or sent. The owner
keeps the storages (`keep`) until every rank of the lane has opened what it received: after an exchange of a
round in which some rank sends handles, the lane's ranks meet once more (a one-int all_gather), and only then are
the storages let go; the receiver's mapping then holds the memory alone. Whether a round's exchanges end with that
meeting travels with the moved samples' facts (one int from every owner to every rank, NOTE [ Moves overlap
training ]), so every rank decides alike, and a round of text samples, which hold no shared file, has no meeting.
Nothing is named in /dev/shm (torch's `file_descriptor` files are unlinked when made), so a killed rank leaves
nothing behind: the kernel frees a file with its last descriptor and mapping.
Which pairs: when the lane opens (`HandleRoutes.open`), each rank makes a small shared storage holding a random
token and the ranks gather (host key, pid, fd, inode, token); each rank opens every peer's probe by that path
and checks the token; the ranks gather who could open whose. A sender passes handles to a receiver that read
its token, and frames otherwise: another host, another /dev/shm or pid namespace (the host key is the kernel's
boot id with the /dev/shm mount's device and inode, and the token catches a pid that names another process), a
/proc that hides the peer, or a process that shares tensors by file name (`torch.multiprocessing`'s
`file_system` strategy: its storages have no descriptor, `_get_shared_fd` refuses, and they travel in the frame
as before). A tensor whose
storage is not a shared file (text samples' small tensors; a dataset read without workers, unless it shares its
tensors itself) always travels in the frame. The ranks need not agree on `shared_memory_moves`: a rank that turns
it off reports key 0, and neither sends nor receives handles.
A tensor in a span of a DataLoader worker's region (NOTE [ A worker's region ] in data/worker_region.py) goes by a
handle to that region too (the rank keeps a descriptor of each region it maps), which names the span (`span`): the
receiver maps the region once and uses the span in place, and the worker reuses it only once both the owner and the
receiver have given it back.
The receiver maps a path only where it leads to the owner's file: opened without a controlling tty or blocking,
a regular file whose inode is the one the handle names and at least as large (`_open`), so a pid of another
process, or a pid reused after the owner died, can neither be read nor grown. Each mapped tensor keeps a file
open until it is freed, so a rank that may receive handles raises its soft limit of open files for a third
buffer's worth (`open_files_with_handles`); `ulimit -n` running out is an `OSError` naming the fix, an owner gone
a `PeerError`.
The batches are those of the frames: the receiver's tensor has the owner's dtype, shape and values (it is the
owner's memory). It also keeps the owner's strides, where a frame made a non-contiguous tensor contiguous, and a
dataset that hands one shared storage to two samples now gives two ranks the same memory, where frames gave each
a copy: as a sample that stays on its rank is the dataset's own. `moved_bytes` counts a handle's tensor as the
bytes the frame would have carried, so the counters stay those of moving in line (tests/test_shared_handles.py).
A receiver that fails to open what it received still meets the others before it raises, so every lane stays in
step (`_exchange` in moves_ahead.py).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import logging
import os
import secrets
import stat
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from odb_core.data.sendable import OTHER_FILES, open_files_needed, raise_open_files
from odb_core.data.worker_files import shared_fd, tensor_in
from odb_core.data.region_maps import borrowed, region_handle
from odb_core.data.worker_region import DTYPES, offset_of
from odb_core.ranks.sync import PeerError, Transport

LOGGER = logging.getLogger("odb")



class SharedHandle(NamedTuple):
    """A tensor left in its owner's shared-memory file: where the file is and how the tensor lies in it."""

    pid: int
    fd: int
    inode: int  # the file's: the receiver maps it only if the path leads to that file
    nbytes: int  # the storage's (a region's: its bytes up to the storage's end)
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    span: int = -1  # a span a worker's region lent, tagged: the receiver uses it in place and gives its half back


def host_key() -> int:
    """An int64 that two processes share when they run on one kernel and see one /dev/shm mount; 0 where either
    cannot be read."""
    try:
        shm = os.stat("/dev/shm")
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return 0
    digest = hashlib.blake2b(f"{boot}/{shm.st_dev}/{shm.st_ino}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


def to_handles(sample: Any, keep: list[torch.UntypedStorage]) -> tuple[Any, int]:
    """`sample` with each top-level tensor of a shared file replaced by its `SharedHandle` (a copy of the mapping;
    the caller's sample is left as it was), and the bytes those tensors hold; their storages are appended to
    `keep`, which the caller holds until the receivers have opened them."""
    if not isinstance(sample, dict):
        return sample, 0
    out, handled = None, 0
    for key, value in sample.items():
        if not isinstance(value, torch.Tensor):
            continue
        fd = shared_fd(value)
        if fd is not None:
            handle = SharedHandle(os.getpid(), fd, os.fstat(fd).st_ino, value.untyped_storage().nbytes(),
                                  str(value.dtype), tuple(value.shape), tuple(value.stride()), value.storage_offset())
        elif (region := region_handle(value)) is not None:
            handle = SharedHandle(os.getpid(), region.fd, region.inode, region.nbytes, str(value.dtype),
                                  tuple(value.shape), tuple(value.stride()), region.offset, span=region.span)
            region.lend()
        else:
            continue
        if out is None:
            out = dict(sample) if type(sample) is dict else copy.copy(sample)
        storage = value.untyped_storage()
        out[key] = handle
        keep.append(storage)
        handled += value.numel() * value.element_size()
    return (sample, 0) if out is None else (out, handled)


def from_handles(sample: Any) -> Any:
    """The receiver's side of `to_handles`: each `SharedHandle` of a received sample as the owner's tensor, mapped
    from its file."""
    if not isinstance(sample, dict):
        return sample
    for key, value in sample.items():
        if type(value) is SharedHandle:
            sample[key] = _open(value)
    return sample


def _open(handle: SharedHandle) -> torch.Tensor:
    """The handle's tensor, mapped from the owner's file; `PeerError` where the owner is gone, `OSError` (with
    what to do) for any other failure to open it, `ValueError` where the path leads to another file."""
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESRCH):
            raise PeerError(f"a moved tensor's shared-memory file {path} could not be opened ({exc}): its owner "
                            f"rank (pid {handle.pid}) probably died mid-move") from exc
        raise OSError(exc.errno, f"a moved tensor's shared-memory file {path} could not be opened ({exc.strerror}); "
                      "raise `ulimit -n` if too many files are open, or set shared_memory_moves=False") from exc
    try:
        seen = os.fstat(fd)  # map only the owner's file: never grow or write another one
        if not stat.S_ISREG(seen.st_mode) or seen.st_ino != handle.inode or seen.st_size < handle.nbytes:
            raise ValueError(f"{path} is not the owner's shared-memory file (inode {seen.st_ino}, {seen.st_size} "
                             f"bytes; the handle names inode {handle.inode}, {handle.nbytes} bytes)")
        if handle.span < 0:
            storage, offset = torch.UntypedStorage._new_shared_fd_cpu(fd, handle.nbytes), handle.offset
        else:  # a lent span: the storage starts at the span (NOTE [ A worker's region ])
            storage = borrowed(fd, seen, handle.span, handle.nbytes)
            offset = handle.offset - offset_of(handle.span) // DTYPES[handle.dtype].itemsize
    finally:
        os.close(fd)  # the storage keeps a descriptor (or the region's mapping) of its own
    return tensor_in(storage, handle.dtype, offset, handle.shape, handle.stride)


def open_files_with_handles(max_buffer_bytes: int | None, window: int) -> int:
    """`open_files_needed` and a third buffer's worth of tensors: the round's moved-in samples, each of whose
    handles keeps a file open on the receiver, beside the rank's own two buffers."""
    own = open_files_needed(max_buffer_bytes, window)
    return own + (own - OTHER_FILES) // 2


class HandleRoutes:
    """Which ranks of a lane pass shared tensors by handle to which (NOTE [ Moving shared tensors by handle ]):
    `to[r]`, whether this rank sends handles to lane rank r; `receives`, whether some rank sends it handles."""

    def __init__(self, to: Sequence[bool], receives: bool = False) -> None:
        self.to, self.receives = tuple(to), receives

    @classmethod
    def open(cls, lane: Transport, enabled: bool, open_files: int = 0) -> HandleRoutes:
        """Two all_gathers on the lane, at the same point on every rank: the probes, then who read whose. A rank
        that may receive handles raises its soft limit of open files to `open_files` (NOTE [ The pipe or shared
        memory ])."""
        probe, mine = None, [0, 0, 0, 0, 0]
        if enabled and (key := host_key()):
            try:
                probe = torch.UntypedStorage._new_shared(8)
                token = secrets.randbits(62) + 1
                torch.empty(0, dtype=torch.int64).set_(probe, 0, (1,)).fill_(token)
                fd = probe._get_shared_fd()
                mine = [key, os.getpid(), fd, os.fstat(fd).st_ino, token]
            except (RuntimeError, OSError):  # no shared memory, or shared by name (`file_system`)
                probe = None
        probes = lane.all_gather(mine)
        read = [int(r != lane.rank and _reads(mine[0], p)) for r, p in enumerate(probes)]
        table = lane.all_gather(read)  # table[r][s]: rank r read rank s's probe
        del probe  # every peer has tried it by now
        if any(read) and open_files and (warning := raise_open_files(open_files)) is not None:
            LOGGER.warning(warning)
        return cls([bool(table[r][lane.rank]) for r in range(lane.world_size)], receives=any(read))


def _reads(key: int, probe: Sequence[int]) -> bool:
    """Whether this rank (host `key`) opens a peer's probe by its path and finds its token."""
    peer_key, pid, fd, inode, token = probe
    if not key or peer_key != key:
        return False
    try:
        tensor = _open(SharedHandle(pid, fd, inode, 8, "torch.int64", (1,), (1,), 0))
    except (RuntimeError, OSError, ValueError):  # PeerError is a RuntimeError
        return False
    return int(tensor.item()) == token
