"""Samples crossing a process boundary: small tensors packed as arrays for the pipe, and samples that cannot be
pickled found before they are sent rather than after they were lost.

NOTE [ Samples that cannot travel ]
A sample read in a DataLoader worker reaches the rank through a pipe, pickled by the worker's queue feeder
thread; one that cannot be pickled (a lock, an open file, a generator, a lambda) makes that thread print a
traceback and drop the message, and the rank then waits for it forever. So a worker probes each sample before
handing it over (`sendable`): a mapping whose values are all tensors, arrays or plain scalars passes at a
glance (about 0.5 µs, in the worker; but for a tensor computed with autograd, which torch's reducer refuses);
any other is pickled into nothing, with tensors and arrays skipped (they pickle unless computed with autograd,
and their bytes are what costs), and one that fails travels as an `Unsendable` naming the field and the error
instead; `inspect_sample` raises it on the rank as a `SampleError` naming the index. Under `move="send"` the
owner pickles the samples it moves (ranks/moves.py) and names the sample that fails the same way
(`unpicklable_part`).
"""

from __future__ import annotations

import copy
import os
import pickle
import resource
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

_SKIPPED = (tuple, ())  # what a tensor or array is reduced to while probing: nothing
# torch's reducer refuses a tensor that is an autograd result (it would have failed in the queue's feeder thread)
NON_LEAF = "a tensor computed with autograd (it requires grad and is not a leaf) cannot leave its process; detach() it"
# NOTE [ The pipe or shared memory ]
# A worker's tensor reaches the rank either pickled into the pipe (a `PackedTensor`: the worker copies it into the
# pickle, the kernel through the pipe, the rank out of the pickle; each copy costs both sides CPU in proportion to
# the bytes, and the rank's copies land in its heap, where a round's samples fragment it) or in a shared-memory
# file of its own (the worker copies it once; then a fixed cost per tensor on both sides: a file, a mapping, a
# descriptor, one message per chunk: NOTE [ A worker's files travel as descriptors ]). Measured here before that
# note (2 forked workers; samples/s pipe / shared memory): 256 KiB 1,640 / 1,130, 384 KiB 1,150 / 970, 512 KiB 840 /
# 860, 1 MiB 470 / 640. So tensors of up to 512 KiB take the pipe, larger ones shared memory. Samples buffered for a
# round then hold their larger tensors in /dev/shm until collated (up to `max_buffer_bytes` a rank): a container
# needs a /dev/shm that large per rank (docs/guides/multimodal.md). And under torch's default sharing strategy
# (`file_descriptor`) the rank keeps each such tensor's file open while the tensor lives: a round's samples and the
# next buffer, up to 2 x `max_buffer_bytes` / 512 KiB = 4,096 files at the default bound, past the 1,024 that many
# systems allow a process (torch then fails: "Too many open files"). So a loader with workers raises the process's
# soft limit of open files to what its buffers may need (`open_files_needed`), within the hard limit, and says
# so when the hard limit is lower (`raise_open_files`).
PACK_LIMIT_BYTES = 1 << 19
OTHER_FILES = 1024  # files a training process holds besides its buffered tensors: libraries, sockets, pipes
SHM_DIR = "/dev/shm"  # where torch's shared-memory files live on Linux
SHARED_FILES = "; torch moves a worker's tensors to the rank through shared-memory files"
_MIB = 1 << 20
# NOTE [ Shared memory runs out ]
# A worker's tensor over the pipe limit is moved into a shared-memory file when it is sent. Left to the queue's
# feeder thread (torch's reducer, as it pickles the chunk), a failure there (/dev/shm full: Docker gives a
# container 64 MB, while a rank may buffer a GiB of images) is printed by that thread and the chunk is dropped, so
# the rank waited for it forever. So the worker moves such tensors itself, before handing the chunk on
# (`share_large`, on its share lane: NOTE [ Sharing beside processing ]; the feeder then sends the file it finds,
# without a second copy), and a tensor that does not fit turns its sample into an `Unsendable`: the rank raises a
# `SampleError` naming the sample, the field, /dev/shm's size and free space, and the fixes
# (tests/test_shared_memory.py runs it under a 16 MiB /dev/shm, with the images at the top level and inside a
# `BatchFeature`-like mapping). It looks into mappings, and lists or tuples holding tensors or containers, 4 levels
# deep; sparse and nested tensors (no storage of their own) and anything deeper are shared by torch's reducer in
# the feeder, whose failures ODB's hook names (NOTE [ A chunk the feeder cannot send ] in feeder.py).

# NOTE [ Sharing beside processing ]
# Moving a tensor into a shared-memory file is a copy plus a fresh file's pages to fault in: ~1 ms of CPU for a
# 2 MB image here. Torch's feeder thread did it beside the worker's main thread, which meanwhile processed the next
# sample; done in the main thread (NOTE [ Shared memory runs out ]), it came after each sample's processing. So a
# worker hands each sample that holds a tensor to move to its *share lane*, one thread (`share_lane`), and
# processes the next sample meanwhile; the chunk leaves once all its samples are handed over, in order (the copy
# releases the GIL). A sample with nothing to move is handed over at once, in the main thread: the lane's hand-off
# (10-50 µs a sample) would cost text more than it saves. Torch's `share_memory_()` moves the *storage* and frees
# its old memory under whatever holds that address (numpy arrays, reads in progress; tensor views follow the
# storage); reviews of the lane found samples corrupted and workers crashed
# (SIGSEGV) that way, some also without the lane: an image packed for the pipe in one sample and moved in another,
# a small view of a moved image, a numpy view of it beside it in the sample, a dataset that keeps a numpy view of
# the image it returned and reads it for the next sample. So a move points the one tensor at a new file
# (`move_to_shared`): whatever else holds the old storage keeps it, the lane keeps what it left until the read
# that ran beside the move has ended, and a view into a larger storage (a slice of a preloaded tensor) takes only
# its own elements, not the whole storage. A tensor packed for the pipe is a copy (`pack_sample(own=True)`); a
# sample that holds a storage the lane may still be moving waits for the lane (`unshared_storages`); a view into
# a larger storage is moved in line (`lane_may_move`: its neighbours in the chunk usually view the same storage and
# would wait for the lane anyway). The lane matters where a worker has a core to spare beside it (fewer busy
# processes than cores, a GPU host's usual case). Measured with one worker on the VLM workload (docs/benchmarks.md,
# "Where the VLM rows' gap lies"): the worker's CPU 0.97-0.98 cores without the lane, 1.03-1.07 with it (a plain
# DataLoader's worker, whose feeder shares its batches: 1.14).


class PackedTensor(NamedTuple):
    """A small tensor sent from a worker as a numpy array (pickled into the pipe) instead of through a shared-
    memory file descriptor, which costs far more per tensor than a small copy. Unpacked in the main process.
    A named tuple, not a dataclass: the main process unpickles one per tensor, and a tuple is rebuilt in one call
    (a frozen dataclass's state is set field by field: 1.8 µs more per two-tensor sample)."""

    array: np.ndarray


def open_files_needed(max_buffer_bytes: int | None, window: int) -> int:
    """The open files a rank's buffered samples may hold (NOTE [ The pipe or shared memory ]): one per tensor over
    the pipe limit, in two buffers' worth of samples (the round being trained and the next fill), plus the rest of
    the process's; without a byte bound, two tensors per sample of two windows."""
    tensors = 2 * max_buffer_bytes // PACK_LIMIT_BYTES if max_buffer_bytes is not None else 4 * window
    return tensors + OTHER_FILES


def raise_open_files(needed: int) -> str | None:
    """Raise this process's soft limit of open files to `needed`, within its hard limit; a warning's text when the
    hard limit is lower (None when enough files are allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    allowed = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if allowed > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (allowed, hard))
    if allowed >= needed:
        return None
    return (f"odb: warning: this process may keep up to {needed} files open (a shared-memory file per buffered tensor "
            f"over {PACK_LIMIT_BYTES // 1024} KiB) and may open only {allowed} (`ulimit -n`, hard limit); raise the "
            "limit, lower max_buffer_bytes, or call torch.multiprocessing.set_sharing_strategy('file_system')")


def pack_sample(sample: Any, limit_bytes: int | None = PACK_LIMIT_BYTES, own: bool = False) -> Any:
    """Sender side: replace numpy-compatible dense tensors (up to `limit_bytes` each; None: any size) at the top level
    of a mapping by `PackedTensor`: a view of the tensor's memory, or with `own` a copy, which no later move of
    that storage into shared memory can leave pointing at freed memory (a worker's hand-over, NOTE [ Sharing beside
    processing ])."""
    if not isinstance(sample, dict):
        return sample
    packed = dict(sample) if type(sample) is dict else copy.copy(sample)  # an OrderedDict stays one
    for key, value in sample.items():
        if (isinstance(value, torch.Tensor) and value.dtype in PACKABLE and not (value.requires_grad or value.is_nested)
                and value.layout is torch.strided and (limit_bytes is None or value.nbytes <= limit_bytes)):
            packed[key] = PackedTensor(value.numpy().copy() if own else value.numpy())
    return packed


def share_large(sample: Any, keep: list[torch.UntypedStorage] | None = None) -> Any:
    """Worker side, after `pack_sample`: the tensors it left (over the pipe limit, or not at the top level) moved
    into shared memory now, in the calling thread, or an `Unsendable` naming the field when that fails (NOTE [
    Shared memory runs out ]). Walks mappings (dicts, HF's `BatchFeature`) and lists or tuples that hold tensors,
    lists or mappings (not lists of ids), down to `SHARE_DEPTH` levels. The storages the tensors leave are
    appended to `keep`, for a caller whose other threads may still read them (NOTE [ Sharing beside processing ])."""
    for path, tensor in _unshared(sample, "", SHARE_DEPTH):
        try:
            left = move_to_shared(tensor)
        except RuntimeError as exc:
            size = f"a tensor of {tensor.numel() * tensor.element_size() / _MIB:,.1f} MiB"
            return Unsendable(f"field {path!r} ({size}) could not be put in shared memory to leave its DataLoader "
                              f"worker ({exc})" + (shm_advice(exc) or SHARED_FILES))
        if keep is not None and left is not None:
            keep.append(left)
    return sample


def move_to_shared(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """Point `tensor` at a new shared-memory file holding its values; the storage it leaves, which is not freed
    here (None where torch's own move ran). Unlike `share_memory_()`, which moves the storage itself and frees its
    old memory under whatever holds that address (a numpy array, a read in progress), this moves the one tensor:
    the dataset's other views of that storage, a numpy view beside it in the sample, and a read of it still running
    in another thread keep the old memory. A tensor over its whole storage (or over less storage than its own
    bytes: an `expand`) keeps its layout; a view into a larger storage (a slice of a preloaded tensor) takes only
    its own elements."""
    storage = tensor.untyped_storage()
    if not storage.nbytes() or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():  # torch's move (and bits)
        tensor.share_memory_()
        return None
    own = tensor.numel() * tensor.element_size()
    if storage.nbytes() <= own:
        shared = torch.UntypedStorage._new_shared(storage.nbytes())
        shared.copy_(storage)
        offset, stride = tensor.storage_offset(), tensor.stride()
    else:
        shared = torch.UntypedStorage._new_shared(own)
        compact = torch.empty(0, dtype=tensor.dtype).set_(shared, 0, tensor.shape)
        compact.copy_(tensor)
        offset, stride = 0, compact.stride()
    with torch.inference_mode() if tensor.is_inference() else torch.no_grad():  # a Parameter stays one
        tensor.set_(shared, offset, tensor.shape, stride)
    return storage


def share_lane() -> ThreadPoolExecutor:
    """This process's share lane (NOTE [ Sharing beside processing ]): one thread, made on first use in each
    process (a forked worker gets its own, not a copy of its parent's)."""
    pid = os.getpid()
    if pid not in _LANES:
        _LANES.clear()
        _LANES[pid] = ThreadPoolExecutor(1, thread_name_prefix="odb-share")
    return _LANES[pid]


_LANES: dict[int, ThreadPoolExecutor] = {}


def lane_may_move(sample: Any) -> bool:
    """Whether the share lane takes `sample` (after `pack_sample`): it holds a tensor to move into shared memory,
    and each such tensor spans its whole storage (a slice of a preloaded tensor is moved in line; NOTE [ Sharing
    beside processing ])."""
    tensors = [tensor for _, tensor in _unshared(sample, "", SHARE_DEPTH)]
    return bool(tensors) and all(tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes()
                                 == tensor.numel() * tensor.element_size() for tensor in tensors)


def unshared_storages(sample: Any) -> set[int]:
    """The addresses of the storages of `sample`'s tensors not in shared memory yet (top level included): what a
    move on the share lane could swap."""
    return {tensor.untyped_storage().data_ptr() for _, tensor in _unshared(sample, "", SHARE_DEPTH)
            if tensor.untyped_storage().nbytes()}  # empty storages all sit at address 0 and are never moved


SHARE_DEPTH = 4  # levels of nesting `share_large` looks into; torch's reducer still shares anything deeper
_NO_TENSOR = frozenset({PackedTensor, int, float, str, bool, bytes, type(None), np.ndarray})  # exact types


def _unshared(value: Any, path: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for each strided CPU tensor in `value` not in shared memory yet (no sparse or nested one)."""
    if isinstance(value, torch.Tensor):
        if value.layout is torch.strided and not value.is_nested and value.device.type == "cpu" \
                and not value.is_shared():
            yield path, value
        return
    if depth == 0:
        return
    if type(value) is dict or isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, list | tuple) and value and type(value[0]) not in _NO_TENSOR:  # not a list of ids
        items = enumerate(value)
    else:
        return
    for key, inner in items:
        if type(inner) not in _NO_TENSOR:
            where = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
            yield from _unshared(inner, where, depth - 1)


def shm_advice(exc: BaseException) -> str:
    """For an error saying shared memory ran out, a clause naming /dev/shm's size and free space and the fixes."""
    if "No space left" not in str(exc):
        return ""
    try:
        stats = os.statvfs(SHM_DIR)
        room = (f"{SHM_DIR} holds {stats.f_blocks * stats.f_frsize / _MIB:,.0f} MiB, "
                f"{stats.f_bavail * stats.f_frsize / _MIB:,.0f} MiB free now")
    except OSError:
        room = f"{SHM_DIR} could not be measured"
    return (f"; {room}. A rank keeps its buffered tensors there (those over {PACK_LIMIT_BYTES // 1024} KiB, and any "
            "not at a sample's top level), up to about 2 x max_buffer_bytes (a round and the next fill), and every "
            "rank on the host as much: give the host or container a larger /dev/shm (docker run --shm-size, a "
            "Kubernetes emptyDir with medium: Memory), or lower max_buffer_bytes")


def unpack_sample(sample: Any) -> Any:
    """Main-process side of `pack_sample`: the same mapping type and tensors the dataset returned."""
    if not isinstance(sample, dict):
        return sample
    unpacked = None
    for key, value in sample.items():  # exact type looks: this runs per sample in the trainer process
        if type(value) is PackedTensor:
            if unpacked is None:
                unpacked = dict(sample) if type(sample) is dict else copy.copy(sample)
            unpacked[key] = torch.from_numpy(value.array)
    return sample if unpacked is None else unpacked


PACKABLE = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32,
                      torch.float64, torch.float16})


# the value types a sample may hold that always pickle (checked by exact type: this runs per sample in the worker)
_ALWAYS_SENDABLE = frozenset({PackedTensor, torch.Tensor, np.ndarray, int, float, str, bool, bytes, type(None)})


class Unsendable(NamedTuple):
    """Stands in for a sample a worker could not send; `cause` says which field and why."""

    cause: str


class _Discard:
    """A file that keeps nothing: the probe only needs to know whether pickling succeeds."""

    def write(self, data: bytes) -> int:
        return len(data)


class _Probe(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
            raise RuntimeError(NON_LEAF)
        if isinstance(obj, torch.Tensor | np.ndarray):
            return _SKIPPED
        return NotImplemented


def unpicklable_part(sample: Any) -> str | None:
    """None if `sample` pickles; else which part fails (a mapping's key, when one alone fails) and the error."""
    try:
        _Probe(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(sample)
        return None
    except Exception as exc:  # noqa: BLE001 - any pickling error is the answer
        error = f"{type(exc).__name__}: {exc}"
    if isinstance(sample, Mapping):
        for key, value in sample.items():
            if unpicklable_part(value) is not None:
                return f"field {key!r} (a {type(value).__name__}) cannot be pickled ({error})"
    return f"it cannot be pickled ({error})"


def sendable(sample: Any) -> Any:
    """`sample` itself, or an `Unsendable` saying why it cannot leave this worker (NOTE above)."""
    if type(sample) is dict and all(type(value) in _ALWAYS_SENDABLE and (type(value) is not torch.Tensor
                                                                         or value.grad_fn is None)
                                    for value in sample.values()):
        return sample
    failure = unpicklable_part(sample)
    if failure is None:
        return sample
    return Unsendable(f"{failure}, so its DataLoader worker cannot send it to the rank; keep objects that cannot be "
                      "pickled (locks, open files, generators, lambdas) out of the samples, or read with "
                      "num_workers=0")
