"""`ODBDataLoader`: online dynamic batching around a plain DataLoader.

Guarantees (see docs/guarantees.md): every rank yields the same number of steps per epoch (IDLE included); with
`join=True` every index of the epoch's sampler output appears in exactly one non-IDLE step on exactly one rank;
every group's cost is <= token_budget except a lone oversize sample; batches depend only on (seed, epoch, data,
world size, config). Cost per round: one all_gather of 5 ints per rank and one all_reduce of 5 ints per step,
over a dedicated Gloo group.

`len()` is the step count of the last completed epoch on this loader (an honest estimate for the next one,
which differs only by the shuffle) or `estimate_steps()`' result; before either exists it raises TypeError, which
is how Python and the HF Trainer recognise a loader without a length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, fields
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, Sampler

from odb_core.collate import CollateFn, PadCollator
from odb_core.config import ODBConfig
from odb_core.engine import RankEngine
from odb_core.metrics import LoaderMetrics
from odb_core.pipeline import EpochReport, EpochRun, ResumePoint, RoundStart, RunContext
from odb_core.prefetch import BackgroundIterator
from odb_core.budget import Item
from odb_core.sample import LengthFn, inspect_sample
from odb_core.simulate import simulate_epoch
from odb_core.sources import (ChunkSampler, IndexedDataset, IndexedIterable, ShardedSampler, keep_chunk,
                              map_style_size)
from odb_core.step_info import ODBBatch, StepInfo
from odb_core.sync import Transport, default_transport

STATE_VERSION = 1
CONFIG_FIELDS = frozenset(f.name for f in fields(ODBConfig))
WORKER_OPTIONS = frozenset({"persistent_workers", "multiprocessing_context", "pin_memory", "prefetch_factor",
                            "worker_init_fn", "generator"})


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    unknown = set(options) - CONFIG_FIELDS - WORKER_OPTIONS
    if unknown:
        raise TypeError(f"ODBDataLoader got unknown arguments {sorted(unknown)}; ODB config fields are "
                        f"{sorted(CONFIG_FIELDS)} and DataLoader worker options are {sorted(WORKER_OPTIONS)}")
    config = {k: v for k, v in options.items() if k in CONFIG_FIELDS}
    workers = {k: v for k, v in options.items() if k in WORKER_OPTIONS}
    return config, workers


class DatasetFetchError(RuntimeError):
    """`dataset[index]` raised inside a worker; the message names the index and keeps the original error."""


class _CheckedDataset(IndexedDataset):
    """Names the failing index when the user's `__getitem__` raises (the worker traceback is kept)."""

    def __getitem__(self, index: int) -> tuple[int, Any]:
        try:
            return super().__getitem__(index)
        except Exception as exc:
            raise DatasetFetchError(f"sample {index}: dataset[{index}] raised {type(exc).__name__}: {exc}") from exc


class ODBDataLoader:
    """Yields variable-size, model-ready `ODBBatch`es under a token budget, aligned across ranks.

    Args:
        dataset: map-style (indexable, sized) or `IterableDataset` of processed samples (mappings with
            `input_ids`; see docs/design.md for the sample contract).
        token_budget: `L_max`, or pass a complete `config=ODBConfig(...)` instead.
        collate_fn: user collator for a list of samples; defaults to `PadCollator()`.
        sampler: optional map-style sampler yielding this rank's indices (e.g. `DistributedSampler`); by default
            ODB shards the dataset over ranks itself, without padding or dropping.
        shuffle, seed: shuffling of ODB's own sampler (seed also seeds the in-round step order).
        num_workers: DataLoader worker processes producing samples; the batches do not depend on it.
        join: True (default) drains every rank; False stops at the shortest rank (see `last_report`).
        length_fn: optional `sample -> int` cost length replacing `len(input_ids)`.
        transport: metadata transport; defaults to a dedicated Gloo group when torch.distributed is initialized.
        idle_sample: sample used for IDLE dummies on a rank that has seen no data (iterable datasets only).
        shard_iterable: for an `IterableDataset`, whether ODB shards it over ranks by stream position.
        observer: optional callable receiving every yielded `StepInfo` (e.g. to log emitted indices).
        **options: other `ODBConfig` fields (cost, window, accumulation_steps, ...) and DataLoader worker options
            (persistent_workers, multiprocessing_context, pin_memory, prefetch_factor, worker_init_fn).
    """

    def __init__(self, dataset: Any, *, token_budget: int | None = None, config: ODBConfig | None = None,
                 collate_fn: CollateFn | None = None, sampler: Sampler[int] | None = None, shuffle: bool = False,
                 seed: int = 0, num_workers: int = 0, join: bool = True, length_fn: LengthFn | None = None,
                 transport: Transport | None = None, idle_sample: Mapping[str, Any] | None = None,
                 shard_iterable: bool = True, observer: Callable[[StepInfo], None] | None = None,
                 **options: Any) -> None:
        config_options, worker_options = _split_options(options)
        if config is None:
            if token_budget is None:
                raise TypeError("ODBDataLoader needs token_budget=... (tokens per micro-batch per rank) or config=")
            config = ODBConfig(token_budget=token_budget, seed=seed, join=join, **config_options)
        elif token_budget is not None or config_options:
            raise TypeError("pass either config=ODBConfig(...) or individual config fields, not both")
        self.config = config
        self.dataset = dataset
        self.transport = transport if transport is not None else default_transport(config.sync_timeout_s)
        self.metrics = LoaderMetrics(token_budget=config.token_budget, world_size=self.transport.world_size)
        self._idle_sample = idle_sample
        self._size = map_style_size(dataset)
        self.sampler = self._build_sampler(sampler, shuffle, config.seed)
        self._workers = self._build_workers(num_workers, shard_iterable, worker_options)
        self._ctx = RunContext(engine_factory=lambda epoch: RankEngine(config, epoch), transport=self.transport,
                               collate_fn=collate_fn if collate_fn is not None else PadCollator(),
                               length_fn=length_fn, metrics=self.metrics, fallback_dummy=self._fallback_dummy,
                               fetch=self._fetch, observer=observer)
        self._epoch = 0
        self._current: Iterator[ODBBatch] | None = None
        self.last_report: EpochReport | None = None
        self._length: int | None = None
        self._resume: ResumePoint | None = None
        self._replayed: dict[int, Any] = {}

    # -- construction -------------------------------------------------------------------------------------
    def _build_sampler(self, sampler: Sampler[int] | None, shuffle: bool, seed: int) -> Sampler[int] | None:
        if self._size is None:
            if sampler is not None:
                raise ValueError("sampler= is not supported with an IterableDataset; it yields its own order")
            return None
        if sampler is None:
            return ShardedSampler(self._size, rank=self.transport.rank, world_size=self.transport.world_size,
                                  shuffle=shuffle, seed=seed)
        if shuffle:
            raise ValueError("sampler= and shuffle=True are mutually exclusive (shuffle inside your sampler)")
        if isinstance(sampler, DistributedSampler) and sampler.num_replicas != self.transport.world_size:
            raise ValueError(f"DistributedSampler has num_replicas={sampler.num_replicas} but ODB's transport has "
                             f"world_size={self.transport.world_size}; they must match")
        return sampler

    def _build_workers(self, num_workers: int, shard: bool, options: dict[str, Any]) -> DataLoader:
        timeout = self.config.worker_timeout_s if num_workers > 0 else 0
        if self._size is None:
            self._iterable = IndexedIterable(self.dataset, rank=self.transport.rank,
                                             world_size=self.transport.world_size, shard=shard,
                                             chunk=self.config.fetch_chunk)
            return DataLoader(self._iterable, batch_size=None, num_workers=num_workers, collate_fn=keep_chunk,
                              timeout=timeout, **options)
        self._chunks = ChunkSampler(self.sampler, self.config.fetch_chunk)  # type: ignore[arg-type]
        return DataLoader(_CheckedDataset(self.dataset, pack=num_workers > 0), batch_sampler=self._chunks, num_workers=num_workers,
                          collate_fn=keep_chunk, timeout=timeout, **options)

    def _fetch(self, index: int) -> Mapping[str, Any]:
        """A sample by its tag, in the calling thread: by index for map-style data, from the replay cache of
        an iterable stream (filled by `_replay_iterable` before a resumed epoch starts)."""
        if self._size is not None:
            return self.dataset[index]
        return self._replayed.pop(index)

    def _replay_iterable(self, start: RoundStart) -> None:
        """Re-read this rank's stream up to the resume position, keeping the buffered samples and the dummy."""
        needed = set(start.buffer) | ({start.dummy_index} if start.dummy_index is not None else set())
        self._replayed = {}
        for ordinal, (index, sample) in enumerate(self._iterable.tagged()):
            if ordinal >= start.consumed:
                break
            if index in needed:
                self._replayed[index] = sample

    def _fallback_dummy(self) -> Mapping[str, Any]:
        """A sample for IDLE dummies on a rank that has received no sample this epoch."""
        if self._idle_sample is not None:
            return self._idle_sample
        if self._size:
            return self.dataset[0]
        raise RuntimeError(f"rank {self.transport.rank} received no samples but must run an IDLE step; pass "
                           "idle_sample=<a processed sample> to ODBDataLoader for iterable datasets")

    # -- iteration ----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` will run."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next `iter()` (reshuffles). Without calls, each `iter()` advances by one."""
        self._epoch = epoch

    def __iter__(self) -> Iterator[ODBBatch]:
        self.close()
        epoch = self._epoch
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        resume, self._resume = self._resume, None
        self._set_stream_start(resume.start.consumed if resume is not None else 0)
        if resume is not None and self._size is None:
            self._replay_iterable(resume.start)
        run = EpochRun(self._ctx, epoch, iter(self._workers), resume)  # workers start here, on this thread
        self._epoch = epoch + 1
        self._current = _EpochIterator(self, run, epoch)
        return self._current

    def _set_stream_start(self, consumed: int) -> None:
        if self._size is None:
            self._iterable.start = consumed
        else:
            self._chunks.start = consumed

    # -- state ----------------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        keep = ("token_budget", "cost", "attention_alpha", "max_patches", "max_batch_size", "window", "join",
                "accumulation_steps", "seed", "shuffle_steps")
        return {name: getattr(self.config, name) for name in keep}

    def state_dict(self) -> dict[str, Any]:
        """This rank's position, as plain JSON-serialisable data (save one per rank).

        Taken after any consumed step, it makes a fresh loader's next `iter()` yield exactly the batches the
        uninterrupted run would have yielded next (same indices, order and `StepInfo`). Between epochs it
        points at the start of the next epoch.
        """
        state: dict[str, Any] = {"version": STATE_VERSION, "world_size": self.transport.world_size,
                                 "rank": self.transport.rank, "config": self._fingerprint(),
                                 "epoch": self._epoch, "position": None, "metrics": self.metrics.snapshot()}
        current = self._current
        if isinstance(current, _EpochIterator) and not current.finished:
            state["epoch"] = current.epoch
            if current.position is not None:
                start, consumed = current.position
                state["position"] = {"start": asdict(start), "steps_consumed": consumed}
        elif self._resume is not None:
            state["position"] = {"start": asdict(self._resume.start), "steps_consumed": self._resume.steps_consumed}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the next `iter()` continues from it. Refuses a different world size, rank
        or batching config, because the saved position only replays exactly under the same plan."""
        state = dict(state)
        version = state.pop("version", None)
        if version != STATE_VERSION:
            raise ValueError(f"loader state version {version!r} is not supported (expected {STATE_VERSION})")
        for key, mine in (("world_size", self.transport.world_size), ("rank", self.transport.rank),
                          ("config", self._fingerprint())):
            saved = state.pop(key)
            if saved != mine:
                raise ValueError(f"loader state was saved with {key}={saved!r} but this loader has {mine!r}; "
                                 "exact resume needs the same world size, rank and batching config")
        self.close()
        self._epoch = int(state.pop("epoch"))
        self.metrics.restore(state.pop("metrics"))
        position = state.pop("position")
        if state:
            raise ValueError(f"unexpected keys in loader state: {sorted(state)}")
        self._resume = None
        if position is not None:
            start = RoundStart(**{**position["start"], "buffer": tuple(position["start"]["buffer"])})
            self._resume = ResumePoint(start=start, steps_consumed=int(position["steps_consumed"]))

    def _finish(self, report: EpochReport) -> None:
        self.last_report = report
        self._length = report.steps

    def estimate_steps(self, sample_size: int = 512) -> int:
        """Estimate the next epoch's step count, the same on every rank, and make `len()` return it.

        Reads up to `sample_size` of this rank's samples for the next epoch (evenly spaced in sampler order) in
        the calling process, stretches their lengths over this rank's sample count, and runs the epoch on the
        virtual cluster at W=1. Ranks then agree on the max (join) or min (non-join) with one all_gather of one
        int, so every rank must call this at the same point. Exact at W=1 when `sample_size` covers the epoch.
        """
        if self._size is None:
            raise TypeError("estimate_steps() needs a map-style dataset: an IterableDataset has no known size")
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self._epoch)
        indices = list(iter(self.sampler))  # type: ignore[arg-type]
        picked = indices if len(indices) <= sample_size else [
            indices[(k * len(indices)) // sample_size] for k in range(sample_size)]
        observed = [inspect_sample(i, self.dataset[i], self._ctx.length_fn) for i in picked]
        stream = [Item(index=k, length=observed[k * len(observed) // len(indices)].length,
                       patches=observed[k * len(observed) // len(indices)].patches) for k in range(len(indices))]
        local = simulate_epoch([stream], self.config, epoch=self._epoch).n_steps if stream else 0
        agreed = [v[0] for v in self.transport.all_gather([local])]
        self._length = max(agreed) if self.config.join else min(agreed)
        return self._length

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("ODBDataLoader has no length before its first epoch completes (batch sizes depend on "
                            "observed lengths); call estimate_steps() or iterate once")
        return self._length

    def close(self) -> None:
        """Stop the current epoch's producer thread and workers, if any."""
        if self._current is not None:
            self._current.close()  # type: ignore[attr-defined]
            self._current = None

    def __del__(self) -> None:
        self.close()


class _EpochIterator(Iterator[ODBBatch]):
    """The iterator `ODBDataLoader.__iter__` returns: inline or through a background producer. It records the
    position of the last batch handed to the caller, which is what `state_dict()` saves."""

    def __init__(self, loader: ODBDataLoader, run: EpochRun, epoch: int) -> None:
        self.loader, self.run, self.epoch = loader, run, epoch
        depth = loader.config.prefetch_steps
        self.source: Iterator[ODBBatch] = BackgroundIterator(run, depth) if depth > 0 else run
        self.position: tuple[RoundStart, int] | None = None
        self.finished = False

    def __next__(self) -> ODBBatch:
        try:
            batch = next(self.source)
        except StopIteration:
            self.finished = True
            if self.run.report is not None:
                self.loader._finish(self.run.report)
            raise
        info = batch.info
        assert info is not None
        start = self.run.round_starts[info.round]
        for stale in [r for r in list(self.run.round_starts) if r < info.round]:
            self.run.round_starts.pop(stale, None)
        self.position = (start, info.step + 1)
        return batch

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
