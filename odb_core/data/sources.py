"""How a sample keeps its index: index tagging and chunked fetches (which indices a rank reads: samplers.py).

NOTE [ Workers emit tagged samples ]
Workers are an ordinary `torch.utils.data.DataLoader`. Every fetch returns a list of `(index, sample)` pairs
(a *chunk* of `fetch_chunk` samples, to cut inter-process overhead), produced by module-level, picklable
wrappers, so fork, spawn and forkserver all work and `num_workers=0` runs the same code in-process.
The DataLoader returns chunks in sampler order whatever the number of workers, so the windows, and therefore
the batches, do not depend on `num_workers` or on worker timing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from odb_core.data.feeder import WorkerChunk
from odb_core.data.sample import ID_DTYPE, ID_FIELDS, ID_KEYS, compact_ids
from odb_core.data.sendable import lane_may_move, pack_sample, sendable, share_lane, share_large, unshared_storages
from odb_core.data.stream_epoch import from_datasets
from odb_core.data.worker_files import send_files
from odb_core.data.worker_region import placed, settled


class DatasetFetchError(RuntimeError):
    """`dataset[index]` raised (in a worker, or re-read by index); the message names the index and keeps the
    original error."""


@dataclass(frozen=True, slots=True)
class Handover:
    """What the stream does to each sample before handing it on: `pack` small tensors for the pipe and move larger
    ones into shared memory (worker processes, see `PackedTensor` and NOTE [ Shared memory runs out ]; a sample that
    cannot be pickled or shared goes as an `Unsendable`, NOTE [ Samples that cannot travel ]), `compact` lists of
    ids into arrays (NOTE [ Compact buffered samples ])."""

    pack: bool = False
    compact: bool = False
    mark: bool = False  # compacted ids marked as made from lists, for a collator that gets lists again
    integer_keys: frozenset[str] = frozenset()  # `integer_columns` of the dataset

    def __call__(self, sample: Any) -> Any:
        return self.chunk([sample])[0]

    def each(self, pairs: Iterable[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """The tagged samples of a chunk, handed over as `pairs` yields them (reading a pair is where a dataset
        processes its sample; ids are compacted per sample here): in a worker, a sample with a tensor to move into
        shared memory is moved on the process's share lane while the next one is read (NOTE [ Sharing beside
        processing ] in sendable.py). If reading fails, the lane's moves finish before the error leaves."""
        if not self.pack:
            read = list(pairs)
            return list(zip([i for i, _ in read], self.chunk([s for _, s in read]), strict=True))
        lane, handed, moving = share_lane(), [], set()
        left: list[Any] = []  # storages the lane moved tensors off, which a read running beside it may still use
        settled = 0
        try:
            for index, sample in pairs:  # a read has ended: what the lane left before it began is free to go
                del left[:settled]
                settled = len(left)
                if self.compact and holds_id_list(sample):
                    sample = compact_ids(sample, self.integer_keys, self.mark)
                if moving and unshared_storages(sample) & moving:  # the lane may be moving a storage this
                    handed, moving = _settled(handed), set()  # sample holds too: let it finish first
                packed = pack_sample(sample, own=True)
                if lane_may_move(packed):
                    moving |= unshared_storages(packed)  # what the lane is about to move
                    handed.append((index, lane.submit(_hand_over, packed, left)))
                else:
                    handed.append((index, _hand_over(packed)))
        except BaseException:
            wait([value for _, value in handed if isinstance(value, Future)])
            raise
        return _settled(handed)

    def chunk(self, samples: list[Any]) -> list[Any]:
        """The samples of one chunk, handed over; not compacted where its first sample holds no list of ids."""
        if self.compact and samples and holds_id_list(samples[0]):
            samples = [compact_ids(sample, self.integer_keys, self.mark) for sample in samples]
        return [_hand_over(pack_sample(sample, own=True)) for sample in samples] if self.pack else samples


def _settled(handed: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """`Handover.each`'s samples, every move on the share lane finished (in order)."""
    return [(index, value.result() if isinstance(value, Future) else value) for index, value in handed]


def _hand_over(packed: Any, left: list[Any] | None = None) -> Any:
    """A packed sample probed, its other tensors placed in the worker's region (worker_region.py) or moved into
    shared memory (on the share lane, or in line); on the lane, the storages the tensors left are kept in `left`."""
    sample = placed(sendable(packed))
    return settled(sample, share_large(sample, left))


def holds_id_list(sample: Any) -> bool:
    """Whether a sample is a dict with a list under one of the `ID_FIELDS` (what `compact_ids` converts)."""
    return type(sample) is dict and any(type(value) is list for key, value in sample.items() if key in ID_KEYS)


def integer_columns(dataset: Any) -> frozenset[str]:
    """The `ID_FIELDS` whose HF `datasets` schema is a list of integers (`List(Value('int32'))` and the like):
    every row of such a column is a list of ints or nulls, so compacting it needs no per-element check."""
    if type(dataset).__module__.split(".")[0] != "datasets":
        return frozenset()
    features = getattr(dataset, "features", None) or {}
    keys = set()
    for key in ID_FIELDS:
        inner = getattr(features.get(key), "feature", None)
        if type(inner).__name__ == "Value" and str(getattr(inner, "dtype", "")).startswith(("int", "uint")):
            keys.add(key)
    return frozenset(keys)


def arrow_arrays(dataset: Any, keys: frozenset[str]) -> Any | None:
    """NOTE [ Arrow ids read as arrays ]
    An HF `datasets.Dataset` in its default (Python) format turns every integer-list cell into a Python list
    (~45 µs per sample of the hot-path benchmark's conversations, 926 tokens on average), and compacting those
    lists into int64 arrays (NOTE [ Compact buffered samples ]) costs about as much again. Where ids are
    compacted anyway, ODB reads those columns (`keys`, from `integer_columns`) through a numpy-formatted view of
    the same table instead: the rows come out of Arrow as int64 arrays, with no Python list on the way (~19 µs per
    sample), and every other column exactly as the dataset returns it (`output_all_columns`). Only a dataset in
    its default format gets a view: a format, a column selection or a transform the user set stays in charge. A
    cell the view cannot give as integer ids (a null row, a null inside a list, which Arrow gives as a float array)
    is re-read from the dataset itself and checked as before, so its error is the one a list gets. A uint64 column
    gets no view (numpy would wrap ids past the int64 range, which a list refuses). The view is rebuilt at every
    epoch's start (`IndexedDataset.refresh`), so a format or transform set on the dataset since is honoured. Rows
    that numpy hands out as views of one chunk-wide block (equal-length rows) are copied, so that a sample waiting
    in the window holds its own row only. None: read `dataset` as it is."""
    if not keys or getattr(dataset, "format", None) is None:
        return None
    format_ = dataset.format
    shown = format_.get("columns")
    if format_.get("type") is not None or format_.get("format_kwargs") or (
            shown is not None and set(shown) != set(dataset.column_names)):
        return None
    if any(str(dataset.features[key].feature.dtype) == "uint64" for key in keys):  # `integer_columns`' keys
        return None
    return dataset.with_format("numpy", columns=[c for c in dataset.column_names if c in keys],
                               output_all_columns=True)


def view_reorders(dataset: Any, keys: frozenset[str]) -> bool:
    """Whether `arrow_arrays`' view puts the columns in another order than the dataset (its formatted columns
    come first): then its rows are rebuilt in the dataset's order, so that batches keep the dataset's keys order."""
    names = list(dataset.column_names)
    return [c for c in names if c in keys] + [c for c in names if c not in keys] != names


class IndexedDataset(Dataset):
    """Map-style wrapper: `wrapped[i]` is `(i, dataset[i])`; the DataLoader fetches a chunk of them at once.
    Each sample goes through `handover` (packing for the pipe, compacting ids) in the process that read it.
    Where `arrow_arrays` gives a view of the dataset, chunks are read through it."""

    def __init__(self, dataset: Dataset, handover: Handover) -> None:
        self.dataset, self.handover = dataset, handover
        self.arrays: Any | None = None
        self.columns: tuple[str, ...] | None = None
        self.refresh()

    def refresh(self) -> None:
        """Build `arrow_arrays`' view of the dataset as it is now (at every epoch's start)."""
        keys = self.handover.integer_keys
        self.arrays = arrow_arrays(self.dataset, keys)
        reorders = self.arrays is not None and view_reorders(self.dataset, keys)
        self.columns = tuple(self.dataset.column_names) if reorders else None

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return int(index), self.handover(self.dataset[index])

    def __getitems__(self, indices: list[int]) -> list[tuple[int, Any]]:
        """A whole chunk in one call (torch's fetcher uses it): the dataset's own `__getitems__` when it has one
        (HF `datasets` reads a batch of rows at once), else one `__getitem__` per index."""
        if self.arrays is not None:
            samples = self._as_arrays(indices)
        else:
            many = getattr(self.dataset, "__getitems__", None)
            if many is None:  # each sample processed by its own `dataset[i]`: hand over beside the next one
                return self.handover.each((i, self.dataset[i]) for i in indices)
            samples = many(indices)
        return list(zip(indices, self.handover.chunk(samples), strict=True))

    def _as_arrays(self, indices: list[int]) -> list[Any]:
        """The chunk read through the numpy view; a row whose ids are not all int64 arrays (nulls) is re-read
        from the dataset itself, so that the checks see, and name, what the dataset holds."""
        keys = self.handover.integer_keys
        samples = self.arrays.__getitems__(indices)
        if self.columns is not None:
            samples = [{c: sample[c] for c in self.columns} for sample in samples]
        for k, sample in enumerate(samples):
            for key in keys:
                value = sample[key]
                if type(value) is not np.ndarray or value.dtype != np.int64 or value.ndim != 1:
                    samples[k] = self.dataset[indices[k]]
                    break
                if value.base is not None:  # a row of one chunk-wide block: its own copy
                    value = sample[key] = value.copy()
                if self.handover.mark:  # made from a list for the collator (`restore_id_lists`)
                    sample[key] = value.view(ID_DTYPE)
        return samples

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


class IndexedIterable(IterableDataset):
    """Iterable wrapper: tags each sample with its stream position and deals chunks to workers in turn.

    With `shard=True` rank r keeps stream positions p with p % W == r; the tag is the global position p. With
    `shard=False` (the dataset is already split by node, e.g. `datasets.distributed.split_dataset_by_node`) the
    k-th sample of this rank is tagged k * W + r, which is unique across ranks. Chunk c of this rank's samples
    goes to worker c % num_workers, so the DataLoader's round-robin returns chunks in stream order; every worker
    reads the whole stream for that.

    NOTE [ Streams that split themselves over workers ]
    A dataset with `num_shards` (HF datasets' IterableDataset; LLaMA-Factory streams a local file as
    `dataloader_num_workers` shards) gives each DataLoader worker only its own shards. Then every worker w of n
    reads its part and keeps all of it: the k-th sample of part w has position k * n + w, and rank r keeps the
    samples with k % W == r (tags as above, from that position), so the parts are read once, in parallel. The
    stream's order is the DataLoader's round-robin over the workers' chunks, which is fixed for a given
    `num_workers` (a resume re-reads it the same way), but differs between worker counts, as it would without ODB:
    the state records the number of parts (`StreamSource.parts`) and a resume with another count is refused.
    """

    def __init__(self, dataset: IterableDataset, *, rank: int, world_size: int, shard: bool, chunk: int,
                 compact: bool = False, mark: bool = False) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.shard, self.chunk = shard, chunk
        self.compact, self.integer_keys = compact, integer_columns(dataset) if compact else frozenset()
        self.mark = mark

    def tagged(self, part: int = 0, parts: int = 1) -> Iterator[tuple[int, Any]]:
        """This rank's samples of the stream this process reads (part `part` of `parts`), with their tags."""
        for k, sample in enumerate(self.dataset):
            position = k * parts + part
            if not self.shard:
                yield position * self.world_size + self.rank, sample
            elif k % self.world_size == self.rank:
                yield position, sample

    def __iter__(self) -> Iterator[list[tuple[int, Any]]]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        splits = worker_parts(self.dataset, n_workers) > 1  # see the NOTE above
        stream = self.tagged(worker, n_workers) if splits else self.tagged()
        handover = Handover(pack=info is not None, compact=self.compact, integer_keys=self.integer_keys,
                            mark=self.mark)
        changes = handover.pack or handover.compact
        for c in itertools.count():
            pairs = itertools.islice(stream, self.chunk)
            ours = splits or c % n_workers == worker
            chunk = handover.each(pairs) if ours and changes else list(pairs)
            if not chunk:
                return
            if ours:  # else another worker's chunk
                yield chunk


def worker_parts(dataset: Any, num_workers: int) -> int:
    """How many parts the stream is read in: `num_workers` for an HF `datasets` stream with shards, which gives
    each DataLoader worker only its own shards (NOTE [ Streams that split themselves over workers ]), else 1.
    Only the `datasets` package's streams are trusted to split: another class with a `num_shards` attribute would
    otherwise be read once per worker."""
    return num_workers if num_workers > 1 and from_datasets(dataset) and hasattr(dataset, "num_shards") else 1


def keep_chunk(chunk: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """The workers' collate function: the tagged chunk untouched (module level, so picklable); in a worker process
    a `WorkerChunk` (NOTE [ A chunk the feeder cannot send ] in feeder.py) whose shared files go as descriptors."""
    return chunk if get_worker_info() is None else WorkerChunk(send_files(chunk))


def map_style_size(dataset: Any) -> int | None:
    """Length of a map-style dataset, or None for an iterable one."""
    if isinstance(dataset, IterableDataset):
        return None
    if not isinstance(dataset, Sized):
        raise TypeError(f"dataset of type {type(dataset).__name__} is neither an IterableDataset nor sized; "
                        "map-style datasets need __len__ and __getitem__")
    return len(dataset)
