"""A worker's large tensors written into one shared region it reuses, which its rank maps once.

NOTE [ A worker's region ]
Each tensor over the pipe's limit leaves its DataLoader worker in a shared-memory file of its own (NOTE [ The pipe
or shared memory ] in sendable.py): the worker makes the file and faults its fresh pages in as it copies the tensor
there, and the rank, once the descriptor has come (NOTE [ A worker's files travel as descriptors ] in
worker_files.py), maps the file, faults its pages in as it reads them and unmaps and frees them when the sample's
step is done: per 2 MiB tensor ~0.34 ms more of the rank's CPU and ~1.2 ms more of the worker's than a region, taken
out of the cores they share (`benchmarks.worker_files`; docs/design.md, issue 27, item 9). With `worker_regions`
each worker makes one memory file when it starts, its *region* (`memfd_create`: it has no name and is not in
/dev/shm, whose mount a container may cap at 64 MB), maps it once, and writes each top-level tensor of a `dict` or
`UserDict` sample into a free *span* of it (`placed`, in the worker's hand-over: on the share lane where the sample
goes there); the sample then carries a `RegionSlot` in the tensor's place. The region's descriptor reaches the rank
once, in the first chunk message that names it; the rank maps the region once (`RegionMaps` in region_maps.py), and
each slot becomes a tensor over a numpy view of the span (`torch.from_numpy`, as `ArenaPool` hands out its buffers,
NOTE [ Reused collation memory ]): the view lives exactly as long as any tensor or storage that uses the span, and a
finalizer on it gives the span back. The rank sends the spans given back to the worker on the chunks' socket (once
`FLUSH_AT` have gathered, and to every worker after each chunk it reads), and the worker takes them before it places
a tensor. So once its spans are reused a worker writes into pages that are already there, and the rank reads pages
it has already mapped: no file, mapping, descriptor or page freed per tensor.
Samples leave in plan order, not read order, so spans come back with holes: the worker keeps a free list, first fit,
spans rounded to `ALIGN` bytes. A span is its offset tagged with the region's count of placements (`offset_of`; counted
from a random start), and the worker frees only the placement a span names: a span given back twice or late never frees
a later placement at its offset, and one meant for an earlier worker that reaches a new one on a reused socket (an inbox
closed while a finalizer sends, or a stale half below) matches a placement of its with a chance of 2^-22. A region never
makes a worker wait: the rank may hold a round's samples, whose steps come only once the round is read, so a worker that
waited for space could wait for itself. A tensor that does not fit (the region full, or smaller than the tensor), a
chunk whose message cannot be sent, or region pages the kernel cannot reserve (`posix_fallocate`, ahead of the writes,
so that a host out of memory is an error and never a SIGBUS on a page it cannot back) take the file way; the batches are
the same bytes either way. Only contiguous tensors of `DTYPES` that do not require grad are placed (the rank's tensor
has the worker's dtype, shape and values, with the default strides: a size-1 dimension's stride may differ); two fields
that view one storage become two spans. A chunk message lists its spans, so a chunk the DataLoader dropped (persistent
workers reset at an epoch's early end) gives its spans back when the rank skips its message.
Under global planning a moved sample's region tensor goes to a rank of the same host by a handle to the
region (`region_handle`; the rank keeps a descriptor of each region it maps; NOTE [ Moving shared tensors by handle
]), and the receiver uses the span in place: it maps that region once (`borrowed`; for as long as any span of it is
in use there) and builds the tensor over its own mapping. The span is then *lent*, and comes back in two halves: the
owner gives it back as before but with `LENT` set, and the receiver, once its last tensor over the span is gone,
sends its own half straight to the worker, on a datagram socket the worker binds in the abstract namespace when it
makes the region (`give_back_address`, named by the region's inode; read beside the chunks' socket). The worker
frees a lent span once both halves have come, in either order, so neither rank's tensor is ever written under it.
The worker tells the halves apart by the socket they come on, so two of one side never free a span. The receiver's
halves wait in `_DUE` until sent (`flush_borrowed`: after each chunk its own rank reads from workers with regions, and
at each exchange of the move lane). A worker whose socket could not be bound (its name taken) lends nothing: it says so
with its region's descriptor, and its moved tensors go in frames, as to another host. The worker reads at most `_READS`
datagrams a socket before a placement, and drops those of another user (anyone may send to a name). A half that cannot
reach the worker (the worker has ended: nothing to give back; a receiver in another network namespace than the worker's,
which shares its pid namespace and /dev/shm, or the handle would not open) is dropped, and that span stays taken until
the worker ends: its region fills and its later tensors take files. If the meeting that lets the owner go fails (a peer
died or timed out), the owner lets go at once, and a receiver that never opened the handle never sends its half: the
span stays taken, on a run that is failing anyway.
Costs: a worker's region is `region_size` bytes of address space in the worker, its rank and each rank that borrows a
span of it; its pages are reserved as the worker first reaches them and stay reserved while the worker lives (the
high-water mark of what its rank held at once, with holes), where files gave each tensor's pages back after its step;
the resident memory of each process that touched them counts them. `region_size` is `max_buffer_bytes` / workers (1 GiB
/ workers without a bound), at least `MIN_REGION`: what a rank holds beyond that (a round and the next fill may hold up
to twice the bound, NOTE [ The pipe or shared memory ]) takes files. A dead worker's region stays mapped on the rank
until its inbox is closed (the next `iter()` of workers that are not persistent, or `close()`) and the last tensor over
it is gone. A worker whose rank has closed its end places nothing more (`detach_region`). Measured (docs/benchmarks.md,
"A region each worker reuses"): per 2 MiB tensor the rank's CPU 0.394 -> 0.055 ms and the worker's 1.614 -> 0.374 ms; on
the VLM rows faster at W = 1 (1.07-1.13 of plain against 0.94-1.00, seven pairs), and under global planning at W = 2
somewhat (0.77-0.90 against 0.70-0.86, seven pairs; ODB's own samples/s ahead in each), still under plain there; mixed
at W = 2 with rank-local planning (behind in each of seven pairs of a matrix where it runs after the global row, level
or ahead in three of three run alone). On by default (`worker_regions=False` for files; docs/design.md item 9 says why).
"""

from __future__ import annotations

import array
import bisect
import copy
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
from collections import UserDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

LOGGER = logging.getLogger("odb")
ALIGN = 64  # bytes: every span starts at a multiple of it
RESERVE_STEP = 8 << 20  # region pages reserved at once, ahead of the worker's writes
MIN_REGION = 64 << 20
FLUSH_AT = 64  # spans gathered on the rank that make it send them, without waiting for the next chunk
MAX_SPANS = 2048  # spans one chunk message may list; a chunk's further tensors take a file each
LENT = 1 << 62  # on a span given back: one of two halves, the owner's or the receiver's (NOTE above)
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                              torch.int16, torch.int8, torch.uint8, torch.bool)}


def regions_of(on: bool, max_buffer_bytes: int | None) -> int:
    """The bytes of a rank's workers' regions together (0: none): a buffer's (1 GiB without a bound)."""
    return (max_buffer_bytes if max_buffer_bytes is not None else 1 << 30) if on else 0


def region_size(regions: int, workers: int) -> int:
    """One worker's region (NOTE above): its share of `regions` (0: none), at least `MIN_REGION`."""
    share = max(MIN_REGION, -(-regions // max(workers, 1) // ALIGN) * ALIGN)
    return min(share, 1 << _TAG_SHIFT) if regions > 0 else 0  # an offset fits under a span's tag


class RegionSlot(NamedTuple):
    """A sample's tensor in its worker's region, in span `span` (`offset_of`); the worker's chunk message `message`
    lists it."""

    message: int
    worker: int
    span: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def offset_of(span: int) -> int:
    """A span's offset in its region. A span is its offset and a count of the region's placements (`_TAG_SHIFT`
    bits up): a span given back twice, or late (a stale datagram), never frees a later placement at its offset."""
    return span & _OFFSET_MASK


_TAG_SHIFT = 40  # regions are smaller than 1 TiB
_OFFSET_MASK = (1 << _TAG_SHIFT) - 1
_TAGS = 1 << 22  # placement counts wrap here, so that a span stays a positive int64


def plain_bytes(tensor: torch.Tensor) -> bool:
    """Whether another process may rebuild `tensor` from its bytes, dtype and layout: dense, on the CPU, of a
    `DTYPES` dtype, not requiring grad, and not a lazily negated or conjugated view (whose bits read differently)."""
    return (tensor.layout is torch.strided and not tensor.is_nested and tensor.device.type == "cpu"
            and str(tensor.dtype) in DTYPES and not tensor.requires_grad and not tensor.is_neg()
            and not tensor.is_conj())


def placeable(tensor: torch.Tensor) -> bool:
    """Whether `tensor` may go into a region: `plain_bytes`, contiguous and not empty."""
    return plain_bytes(tensor) and tensor.numel() > 0 and tensor.is_contiguous()


def give_back_address(inode: int) -> bytes:
    """The abstract socket name on which the worker whose region is memory file `inode` takes back lent spans."""
    return b"\0odb-region-%d" % inode


class Region:
    """A worker's region (NOTE above): the memory file, its mapping, and the free spans, first fit. Placing and
    taking back run under a lock: the worker's main thread and its share lane both place."""

    def __init__(self, size: int, end: socket.socket) -> None:
        self.size, self._end = size, end
        self.fd = os.memfd_create("odb-region", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._bytes = torch.frombuffer(mmap.mmap(self.fd, size), dtype=torch.uint8)  # it keeps the mapping
            self._inbox = _bound(give_back_address(os.fstat(self.fd).st_ino))  # receivers' halves of lent spans
        except BaseException:
            os.close(self.fd)
            raise
        self._free: list[list[int]] = [[0, size]]  # [offset, length], by offset, no two touching
        self._used: dict[int, tuple[int, int]] = {}  # a placed span's offset: its length, and the span
        self._reserved = 0  # pages reserved below this offset
        self._placed = secrets.randbelow(_TAGS)  # placements, from a random count: a span's tag (NOTE above)
        self._halves: dict[int, int] = {}  # lent spans some of whose halves came back: 1 the owner's, 2 a receiver's
        self._lock = threading.Lock()
        self.declared = False  # whether its descriptor has gone to the rank
        self.takes_halves = self._inbox is not None  # told to the rank with the descriptor: it lends only then

    def place(self, tensor: torch.Tensor) -> int | None:
        """`tensor`'s bytes written into a free span: the span (`offset_of`), or None (none fits, or no pages)."""
        need = -(-tensor.nbytes // ALIGN) * ALIGN
        with self._lock:
            self._take_back()
            at = next((k for k, (_, length) in enumerate(self._free) if length >= need), None)
            if at is None:
                return None
            offset = self._free[at][0]
            if offset + need > self._reserved:
                top = min(self.size, max(offset + need, self._reserved + RESERVE_STEP))
                try:
                    os.posix_fallocate(self.fd, self._reserved, top - self._reserved)
                except OSError:
                    return None
                self._reserved = top
            if self._free[at][1] == need:
                del self._free[at]
            else:
                self._free[at] = [offset + need, self._free[at][1] - need]
            self._placed += 1
            span = offset | (self._placed % _TAGS) << _TAG_SHIFT
            self._used[offset] = (need, span)
        self._bytes[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return span

    def read(self, slot: RegionSlot) -> torch.Tensor:
        """The tensor at `slot`, copied out of the region (its span stays placed: `release` it)."""
        offset = offset_of(slot.span)
        return self._bytes[offset:offset + slot.nbytes].view(DTYPES[slot.dtype]).view(slot.shape).clone()

    def release(self, spans: list[int]) -> None:
        """Give `spans` back here, in the worker (their samples never left it)."""
        with self._lock:
            for span in spans:
                self._give_back(span)

    def _take_back(self) -> None:
        """The spans given back since the last look: the rank's datagrams on the worker's socket, and the halves of
        lent spans that receivers sent to its own."""
        for end, half in ((self._end, 1), (self._inbox, 2)):
            for _ in range(_READS if end is not None else 0):  # bounded: anyone may send to the inbox's name
                try:
                    data = end.recv(8 * MAX_SPANS, socket.MSG_DONTWAIT) if half == 1 else _halves_from(end)
                except OSError:  # none waiting (BlockingIOError), or the rank's end closed
                    break
                if data is None or (not data and half == 1):
                    break
                for span in array.array("q", data[: len(data) - len(data) % 8]):
                    self._give_back(span, half)

    def _give_back(self, span: int, half: int = 1) -> None:
        lent, span = span & LENT, span & ~LENT
        offset = offset_of(span)
        placed_here = self._used.get(offset)
        if placed_here is None or placed_here[1] != span:
            return  # given back already: not the placement that holds the offset now
        if lent and (halves := self._halves.get(span, 0) | half) != 3:  # the other rank still uses it
            self._halves[span] = halves
            return
        self._halves.pop(span, None)
        length = self._used.pop(offset)[0]
        at = bisect.bisect(self._free, [offset])
        if at < len(self._free) and self._free[at][0] == offset + length:  # joins the next free span
            length += self._free.pop(at)[1]
        if at and sum(self._free[at - 1]) == offset:  # joins the one before
            self._free[at - 1][1] += length
        else:
            self._free.insert(at, [offset, length])


def _bound(name: bytes) -> socket.socket | None:
    """A datagram socket bound to `name`, not blocking, that learns each sender's user; None where it cannot be
    (the rank then lends none of the region's spans)."""
    try:
        end = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    except OSError:
        return None
    try:
        end.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        end.bind(name)
    except (OSError, AttributeError):  # refused, or no `SO_PASSCRED` on this platform
        end.close()
        return None
    return end


_CREDENTIALS = struct.Struct("iII")  # pid, uid, gid
_READS = 64  # datagrams read from one socket before a placement, at most


def _halves_from(end: socket.socket) -> bytes | None:
    """One datagram of halves from the worker's own socket, or None (none waiting). Anyone on the host may send to
    an abstract name: a datagram from another user is dropped (empty), so only the job's processes free spans."""
    try:
        data, ancillary, _, _ = end.recvmsg(8 * MAX_SPANS, socket.CMSG_SPACE(_CREDENTIALS.size))
    except OSError:
        return None
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(value) >= _CREDENTIALS.size:
            if _CREDENTIALS.unpack_from(value)[1] == os.getuid():
                return data
    return b"" if data else None


@dataclass(slots=True)
class _Placer:
    region: Region
    worker: int


_PLACER: _Placer | None = None  # this worker process's, once `attach_region`ed


def attach_region(end: socket.socket, worker: int, size: int) -> None:
    """In a worker process: place its samples' large tensors in a region of `size` bytes, made now (0: never; a
    region that cannot be made: never, files as before, with a warning that names the cause)."""
    global _PLACER
    _PLACER = None
    if size > 0:
        try:
            _PLACER = _Placer(Region(size, end), worker)
        except (OSError, AttributeError) as exc:  # no memory for it, or no `memfd_create` here
            LOGGER.warning("ODB: DataLoader worker %d could not make its region of %d MiB (%s: %s); its large tensors "
                           "take a shared-memory file each, as with worker_regions=False (NOTE [ A worker's region ] "
                           "in odb_core/data/worker_region.py)", worker, size >> 20, type(exc).__name__, exc)


def detach_region() -> None:
    """In a worker whose rank has closed its end: place nothing more (each tensor would be copied in and out)."""
    global _PLACER
    _PLACER = None


def worker_region() -> Region | None:
    """This worker process's region, if it has one."""
    return _PLACER.region if _PLACER is not None else None


def placed(sample: Any) -> Any:
    """In a worker: `sample` (a copy, if any tensor is placed) with each top-level tensor that fits in the worker's
    region written there and replaced by a `RegionSlot` (NOTE above); `sample` itself otherwise."""
    placer = _PLACER
    if placer is None or not isinstance(sample, dict | UserDict):
        return sample
    out = None
    for key, value in sample.items():
        if type(value) is not torch.Tensor or not placeable(value) or (span := placer.region.place(value)) is None:
            continue
        if out is None:
            out = dict(sample) if type(sample) is dict else copy.copy(sample)
        out[key] = RegionSlot(-1, placer.worker, span, value.nbytes, str(value.dtype), tuple(value.shape))
    return sample if out is None else out


def settled(sample: Any, handed: Any) -> Any:
    """`handed`, what became of a `placed` sample; where that is not the sample (an `Unsendable`), the spans it
    held are given back."""
    if handed is not sample and _PLACER is not None and isinstance(sample, dict | UserDict):
        _PLACER.region.release([value.span for value in sample.values() if type(value) is RegionSlot])
    return handed


def copied_out(sample: Any, region: Region) -> Any:
    """`sample` with each `RegionSlot` a tensor of its own again, its span given back (its chunk could not be
    sent: torch's way)."""
    if not isinstance(sample, dict | UserDict):
        return sample
    out = dict(sample) if type(sample) is dict else copy.copy(sample)
    for key, value in sample.items():
        if type(value) is RegionSlot:
            out[key] = region.read(value)
            region.release([value.span])
    return out
