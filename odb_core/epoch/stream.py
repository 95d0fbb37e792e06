"""Where an epoch's samples come from: the index source, the DataLoader workers, fetches by index, resume skips.

`SampleStream` owns the sampler (ODB's own `ShardedSampler`, a user sampler, or the remainder of an elastically
resumed epoch), the plain `torch.utils.data.DataLoader` whose workers produce tagged chunks (NOTE [ Workers emit
tagged samples ] in sources.py), and the two ways to get one sample again in the trainer process: by index
(map-style) or from the replay cache of a re-read stream (iterable). Workers start in `open()`, on the calling
thread, and are read through `WatchedChunks`: a worker that dies mid-epoch raises `WorkerDiedError` instead of
blocking the rank (NOTE [ A rank watches its workers ] in watch.py).

NOTE [ Pinned memory ]
`pin_memory=True` (the HF Trainer's default) is accepted and not passed on to the workers' DataLoader. There it
would pin each sample as it arrives: a round's samples wait in the buffer until their step, so up to
`max_buffer_bytes` (1 GiB) per rank would be page-locked, and every sample copied once more by the pin thread,
while the step's batch is a fresh tensor that the collator makes from them (pageable whatever its inputs), the
one the trainer copies to the device. Pinning that batch instead (in the collating thread, with torch's caching
pinned allocator, which knows when a non-blocking copy from it has ended) is the design for it; not built, as
this project's machines have no accelerator to run it on.
"""

from __future__ import annotations

import functools
import os
import random
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, Sampler

from odb_core.data.payload import payload_bytes
from odb_core.data.sendable import raise_open_files, unpack_sample
from odb_core.data.sharding import rank_sharding
from odb_core.data.stream_epoch import SharedEpoch
from odb_core.data.worker_files import FileInbox
from odb_core.data.worker_region import region_size
from odb_core.data.samplers import ChunkSampler, IndexListSampler, ShardedSampler
from odb_core.data.sources import (DatasetFetchError, Handover, IndexedDataset, IndexedIterable, integer_columns,
                                   keep_chunk, map_style_size, worker_parts)
from odb_core.epoch.lifeline import Lifeline
from odb_core.epoch.child_signal import direct_reads_rescued
from odb_core.epoch.watch import WatchedChunks, WorkerWatch
from odb_core.resume.source_state import CustomSource, RemainderSource, ShardedSource, Source, StreamSource
from odb_core.resume.replay import check_drawn_order, skip_stream
from odb_core.resume.state import ResumePoint
from odb_core.settings.console import LOGGER

Chunk = list[tuple[int, Any]]
IN_PROCESS_CHUNK = 64


def worker_seed(seed: int, epoch: int, rank: int = 0) -> int:
    """NOTE [ ODB draws nothing from the global RNG ]
    Each `iter()` of a torch DataLoader draws its workers' base seed (even at num_workers=0) from its `generator`,
    else from the global torch RNG, which the model's dropout uses too. A resumed trainer restores that RNG before
    the resumed epoch's `iter()`, while the uninterrupted run drew before the save: one draw more, other dropout
    masks (G8a). So the worker DataLoader draws from ODB's own generator, seeded with this function of (seed,
    epoch, rank) at every `iter()`: iterating, resuming and planning leave the global torch, Python and numpy RNGs
    alone. A user's `generator=` option replaces ODB's. The rank is in it so that the ranks' workers draw apart,
    as the HF Trainer's `seed_worker` makes them (it adds `num_workers * rank`): before, random crops or templates
    in `__getitem__` drew the same on every rank (a review's 2 ranks: 32 of 32 draws). Rank 0 keeps its seed."""
    return random.Random(f"odb-workers:{seed}:{epoch}" + (f":{rank}" if rank else "")).getrandbits(63)


class _CheckedDataset(IndexedDataset):
    """Names the failing index when the user's `__getitem__` raises (the worker traceback is kept)."""

    def __getitem__(self, index: int) -> tuple[int, Any]:
        try:
            return super().__getitem__(index)
        except Exception as exc:
            raise DatasetFetchError(f"sample {index}: dataset[{index}] raised {type(exc).__name__}: {exc}") from exc

    def __getitems__(self, indices: list[int]) -> list[tuple[int, Any]]:
        try:
            return super().__getitems__(indices)
        except Exception as exc:  # find the sample that fails, one index at a time, and name it
            for i in indices:
                self[i]
            if self.arrays is not None:
                raise DatasetFetchError(f"samples {indices}: reading them through ODB's numpy view of the dataset "
                                        f"raised {type(exc).__name__}: {exc}, although each dataset[i] alone works "
                                        "(NOTE [ Arrow ids read as arrays ]); please report it. A dataset with a "
                                        "format set (e.g. dataset.with_format('numpy')) is read as it is") from exc
            raise DatasetFetchError(f"samples {indices}: dataset.__getitems__ raised {type(exc).__name__}: {exc}, "
                                    "although each dataset[i] alone works (torch's DataLoader calls __getitems__ "
                                    "too): fix the dataset's __getitems__ or remove it") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamOptions:
    """How the workers read: `ODBDataLoader`'s sampling and worker arguments."""

    sampler: Sampler[int] | None
    shuffle: bool
    seed: int
    num_workers: int
    shard_iterable: bool
    fetch_chunk: int
    worker_timeout_s: float
    worker_options: Mapping[str, Any]
    idle_sample: Mapping[str, Any] | None
    compact_ids: bool = False  # NOTE [ Compact buffered samples ]
    mark_ids: bool = False  # the collator gets compacted ids as lists again (`restore_id_lists`)
    reader_thread: bool = True  # NOTE [ A thread reads the workers ] in reader_thread.py
    open_files: int = 0  # what the buffers may hold open (NOTE [ The pipe or shared memory ] in sendable.py)
    region_bytes: int = 0  # the workers' regions together; 0: none (NOTE [ A worker's region ] in worker_region.py)


class ReadChunk(list):
    """A chunk ready for the reader's pending queue: its samples unpacked (`sendable.PackedTensor` back to the
    tensors the dataset returned) and each one's payload bytes measured, in `sizes` (`nbytes`: their sum). Made by
    `read_chunk`, in the reader thread when there is one (NOTE [ A thread reads the workers ] in reader_thread.py)."""

    __slots__ = ("sizes", "nbytes")


def read_chunk(chunk: Chunk, packed: bool = True, files: FileInbox | None = None) -> ReadChunk:
    """`chunk` as a `ReadChunk` (`packed`: its samples come from worker processes, small tensors as arrays; `files`:
    their shared files as descriptors, NOTE [ A worker's files travel as descriptors ] in data/worker_files.py)."""
    if files is not None:
        chunk = files.opened(chunk)
    out = ReadChunk((index, unpack_sample(sample)) for index, sample in chunk) if packed else ReadChunk(chunk)
    out.sizes = [payload_bytes(sample) for _, sample in out]
    out.nbytes = sum(out.sizes)
    return out


class LoaderCall:
    """Calls a method of the loader's parts through a weak reference. The producer thread holds the epoch's
    `RunContext`; a bound method there would keep a deleted loader, and so its thread and workers, alive forever."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: Any) -> Any:
        method = self._method()
        if method is None:
            raise RuntimeError("the ODBDataLoader running this epoch was deleted")
        return method(*args)


class SampleStream:
    """One rank's sample source for every epoch of a loader (see the module docstring)."""

    def __init__(self, dataset: Any, options: StreamOptions, *, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.size = map_style_size(dataset)
        self._own_sampler, self._shuffle, self._seed = options.sampler is None, options.shuffle, options.seed
        self._idle_sample, self._reader_thread = options.idle_sample, options.reader_thread
        self.sampler = self._build_sampler(options.sampler)
        self._replayed: dict[int, Any] = {}
        self._parts = worker_parts(dataset, options.num_workers)  # a stream's parts; 1 for map-style data
        timeout = options.worker_timeout_s if options.num_workers > 0 else 0
        # In-process reads (no workers) cost a DataLoader step per chunk and nothing per byte: take larger ones.
        chunk = options.fetch_chunk if options.num_workers > 0 else max(options.fetch_chunk, IN_PROCESS_CHUNK)
        if options.num_workers > 0 and (warning := raise_open_files(options.open_files)) is not None:
            LOGGER.warning(warning)  # NOTE [ The pipe or shared memory ] in sendable.py
        passed = {key: value for key, value in options.worker_options.items() if key != "pin_memory"}
        self._loader_options = {**passed, "num_workers": options.num_workers,  # NOTE [ Pinned memory ]
                                "collate_fn": keep_chunk, "timeout": timeout}
        self._watch: WorkerWatch | None = None
        if options.num_workers > 0:  # NOTE [ Workers die with their rank ], NOTE [ A rank watches its workers ]
            user_init = options.worker_options.get("worker_init_fn")
            self._loader_options["worker_init_fn"] = Lifeline(os.getpid(), user_init)  # replaced at each open()
            self._watch = WorkerWatch(rank=rank, rank_pid=os.getpid(), user_init=user_init,
                                      region_bytes=region_size(options.region_bytes, options.num_workers))
        if self.size is None:
            shard = rank_sharding(dataset, options.shard_iterable, rank=rank, world_size=world_size)
            self._epochs = SharedEpoch(dataset) if SharedEpoch.needed(dataset, options.num_workers) else dataset
            self._iterable = IndexedIterable(self._epochs, rank=rank, world_size=world_size, shard=shard,
                                             chunk=chunk, compact=options.compact_ids, mark=options.mark_ids)
        else:
            self._chunks = ChunkSampler(self.sampler, chunk)  # type: ignore[arg-type]
            handover = Handover(pack=options.num_workers > 0, compact=options.compact_ids, mark=options.mark_ids,
                                integer_keys=integer_columns(dataset) if options.compact_ids else frozenset())
            self._indexed = _CheckedDataset(dataset, handover)
        self._workers = self._build_workers()

    def _build_workers(self) -> DataLoader:
        if self.size is None:
            return DataLoader(self._iterable, batch_size=None, **self._loader_options)
        return DataLoader(self._indexed, batch_sampler=self._chunks, **self._loader_options)

    def named_failure(self, exc: BaseException) -> BaseException:
        """torch's error for a dead worker, which its SIGCHLD handler raises wherever the main thread runs (ODB's
        planning, a wait for the collating thread, or the collator, which wraps it in a `CollateError`) where ODB
        has no handler of its own around it (NOTE [ A dead worker's signal ] in child_signal.py), as the
        `WorkerDiedError` naming that worker; anything else as it is. For the thread that reads the workers, after
        its epoch failed (NOTE [ A rank watches its workers ])."""
        if self._watch is None or RuntimeError not in (type(exc), type(exc.__cause__)):
            return exc
        dead = self._watch.dead()
        if dead is None:
            return exc
        error = self._watch.error(dead)
        error.__cause__ = exc
        self._watch.kill_survivors()  # as a WorkerDiedError raised while reading does
        return error

    def _start_workers(self) -> Iterator[Chunk]:
        """`iter()` of the worker DataLoader, watched when there are workers (a new DataLoader after one died)."""
        if self._watch is None:
            return iter(self._workers)
        if self._watch.failed or self._lost_persistent():  # persistent workers would resume the broken iterator
            self._workers, self._watch.failed = self._build_workers(), False
        chunks = self._watch.start(self._workers)
        direct = not self._reader_thread and direct_reads_rescued(self._workers)
        return WatchedChunks(chunks, self._watch, direct=direct, prepare=functools.partial(read_chunk,
                                                                                           files=self._watch.inbox))

    def _lost_persistent(self) -> bool:
        """A persistent worker dead since the last epoch, when none read (nothing is lost): a new DataLoader, with a
        warning. Before, every later `iter()` failed with torch's bare error after 5 s (a review's run)."""
        if not self._workers.persistent_workers or (dead := self._watch.dead()) is None:
            return False
        LOGGER.warning(f"ODB: DataLoader worker (pid {dead.pid}) of rank {self._watch.rank} died between epochs: "
                       f"{dead.how()}; the workers are started anew (a SIGKILL usually comes from the kernel's "
                       "out-of-memory killer: see `dmesg`)")
        self._watch.kill_survivors()
        return True

    def close_files(self) -> None:
        """Close the workers' socket pairs for shared files (the loader's `close()`; workers later go torch's way)."""
        if self._watch is not None:
            self._watch.close_files()

    def _build_sampler(self, sampler: Sampler[int] | None) -> Sampler[int] | None:
        if self.size is None:
            if sampler is not None:
                raise ValueError("sampler= is not supported with an IterableDataset; it yields its own order")
            return None
        if sampler is None:
            return ShardedSampler(self.size, rank=self.rank, world_size=self.world_size, shuffle=self._shuffle,
                                  seed=self._seed)
        if self._shuffle:
            raise ValueError("sampler= and shuffle=True are mutually exclusive (shuffle inside your sampler)")
        if isinstance(sampler, DistributedSampler) and sampler.num_replicas != self.world_size:
            raise ValueError(f"DistributedSampler has num_replicas={sampler.num_replicas} but ODB's transport has "
                             f"world_size={self.world_size}; they must match")
        return sampler

    def source(self) -> Source:
        """Descriptor of this rank's index source for a normal epoch (see NOTE [ Elastic resume ])."""
        if self.size is None:
            return StreamSource(shard=self._iterable.shard, parts=self._parts,
                                chunk=self._iterable.chunk if self._parts > 1 else 0)
        if self._own_sampler:
            return ShardedSource(size=self.size, shuffle=self._shuffle, seed=self._seed, world_size=self.world_size)
        return CustomSource(type=type(self.sampler).__name__, size=self.size)

    def open(self, epoch: int, plan: RemainderSource | None, point: ResumePoint | None) -> Iterator[Chunk]:
        """Start the workers on this epoch's index source (the remainder `plan` after an elastic resume), past
        the samples admitted before the resume point."""
        consumed = point.start.consumed if point is not None else 0
        self._replayed = {}
        if self.size is None:
            if hasattr(self.dataset, "set_epoch"):  # e.g. a shuffled HF IterableDataset: replay the same order
                self._epochs.set_epoch(epoch)  # NOTE [ A stream's epoch in persistent workers ]
            chunks = self._start_workers()
            if point is None:
                return chunks
            self._replayed, rest = skip_stream(chunks, point.start)
            return rest
        if plan is not None:
            self._chunks.sampler = IndexListSampler(plan.indices(self.rank, epoch))
        else:
            self._chunks.sampler = self.sampler
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
        self._chunks.start = consumed
        self._indexed.refresh()  # the dataset as it is now (NOTE [ Arrow ids read as arrays ])
        order = self._chunks.draw()  # before the workers start: NOTE [ A resume reads what the save read ]
        if point is not None:
            check_drawn_order(point, order, epoch)
        return self._start_workers()

    def length(self) -> int | None:
        """Samples of the open epoch's index source on this rank (resume offset included); None for a stream or a
        sampler without a length (NOTE [ Round sizes ]: the rounds shrink toward a known end)."""
        return None if self.size is None else self._length_of(self._chunks.sampler)

    def knows_length(self) -> bool:
        """Whether this rank's epochs have a known length (map-style data through a sampler with a `len`), as
        `length()` will find when an epoch opens: what `simulate_epoch(lengths_known=...)` must model."""
        return self._length_of(self.sampler) is not None

    def _length_of(self, sampler: Any) -> int | None:
        if self.size is None or sampler is None:
            return None
        try:
            return len(sampler)
        except (TypeError, NotImplementedError):
            return None

    def forget_replayed(self) -> None:
        """Drop the replay cache once the resumed epoch has re-fetched what it needs."""
        self._replayed = {}

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices of a normal epoch, in sampler order (map-style only)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        return list(iter(self.sampler))  # type: ignore[arg-type]

    def drawn_order(self) -> list[int] | None:
        """The open epoch's index order on this rank (map-style; None for a stream)."""
        return self._chunks.order if self.size is not None else None

    def unread(self, position: int) -> tuple[int, ...]:
        """The indices of the open epoch's source past `position` (map-style; empty for a stream)."""
        return tuple(self._chunks.order[position:]) if self.size is not None else ()

    def fetch(self, index: int) -> Mapping[str, Any]:
        """A sample by its tag, in the calling thread: by index for map-style data, from the replay cache of
        an iterable stream (filled by `open()` before a resumed epoch starts)."""
        if self.size is not None:
            return self.dataset[index]
        return self._replayed[index]  # the IDLE dummy may also be buffered: fetched twice

    def fallback_dummy(self) -> Mapping[str, Any]:
        """A sample for IDLE dummies on a rank that has received no sample this epoch."""
        if self._idle_sample is not None:
            return self._idle_sample
        if self.size:
            return self.dataset[0]
        raise RuntimeError(f"rank {self.rank} received no samples but must run an IDLE step; pass "
                           "idle_sample=<a processed sample> to ODBDataLoader for iterable datasets")
