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

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, Sampler

from odb_core.collate import CollateFn, PadCollator
from odb_core.config import ODBConfig
from odb_core.engine import RankEngine
from odb_core.metrics import LoaderMetrics
from odb_core.pipeline import Chunk, EpochReport, EpochRun, ResumePoint, RoundStart, RunContext
from odb_core.prefetch import BackgroundIterator
from odb_core.budget import Item
from odb_core.sample import LengthFn, inspect_sample
from odb_core.settings import PASSED_ON, SettingsSource, split_keys
from odb_core.simulate import simulate_epoch
from odb_core.resume import (MERGED_FORMAT, ElasticResumeError, check_merged, describe_source, progress,
                             remainder_plan, sharded_source, source_indices)
from odb_core.sources import (ChunkSampler, IndexedDataset, IndexedIterable, IndexListSampler, ShardedSampler,
                              keep_chunk, map_style_size, unpack_sample)
from odb_core.step_info import ODBBatch, StepInfo
from odb_core.sync import Transport, default_transport

STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)
WORKER_OPTIONS = frozenset({"persistent_workers", "multiprocessing_context", "pin_memory", "prefetch_factor",
                            "worker_init_fn", "generator"})
OPTIONS = SettingsSource(where="ODBDataLoader", noun="argument", key_error=TypeError,
                         keys=dict.fromkeys(sorted(WORKER_OPTIONS), PASSED_ON))  # its **options: fields, workers


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    split = split_keys(options, OPTIONS)
    return split.fields, split.extras


@dataclass(frozen=True, slots=True)
class _SavedPosition:
    """The last consumed step of an epoch, as `state_dict()` saves it: the round to replay, whether that step
    was the epoch's last (`complete`), and the metrics counters matching the replay point."""

    point: ResumePoint
    complete: bool
    metrics: dict[str, float | int]


def _position_to_json(saved: _SavedPosition) -> dict[str, Any]:
    start = {**asdict(saved.point.start), "buffer": list(saved.point.start.buffer)}
    return {"start": start, "steps_consumed": saved.point.steps_consumed,
            "round_emitted": list(saved.point.round_emitted), "epoch_complete": saved.complete}


def _position_from_json(position: dict[str, Any], metrics: dict[str, float | int]) -> _SavedPosition:
    position = dict(position)
    start = _round_start(position.pop("start"))
    point = ResumePoint(start=start, steps_consumed=int(position.pop("steps_consumed")),
                        round_emitted=tuple(int(i) for i in position.pop("round_emitted", ())))
    complete = bool(position.pop("epoch_complete", False))
    if position:
        raise ValueError(f"unexpected keys in loader state position: {sorted(position)}")
    return _SavedPosition(point=point, complete=complete, metrics=metrics)


def _round_start(start: dict[str, Any]) -> RoundStart:
    return RoundStart(**{**start, "buffer": tuple(int(i) for i in start["buffer"])})


def _plan_start(plan: dict[str, Any] | None) -> ResumePoint | None:
    """Where a remainder epoch starts: step numbers and rounds continue the old run's, nothing buffered."""
    if plan is None:
        return None
    start = RoundStart(round=int(plan["first_round"]), steps_done=int(plan["first_step"]), consumed=0, buffer=(),
                       carry_count=0, carry_tokens=0, dummy_index=None)
    return ResumePoint(start=start, steps_consumed=int(plan["first_step"]))


def _skip_stream(chunks: Iterator[Chunk], consumed: int, needed: set[int]) -> tuple[dict[int, Any], Iterator[Chunk]]:
    """Read the first `consumed` samples of a tagged chunk stream, keeping those whose tag is `needed`; returns
    them and the rest of the stream (resume of an iterable dataset: it can only be re-read from its start)."""
    kept: dict[int, Any] = {}
    seen = 0
    rest: Chunk = []
    while seen < consumed:
        chunk = next(chunks, None)
        if chunk is None:
            raise RuntimeError(f"the resumed stream ended after {seen} samples, but the saved position is at "
                               f"{consumed}: the IterableDataset does not replay the same samples")
        take = min(len(chunk), consumed - seen)
        for index, sample in chunk[:take]:
            if index in needed:
                kept[index] = unpack_sample(sample)
        seen += take
        rest = chunk[take:]
    return kept, itertools.chain([rest] if rest else [], chunks)


class DatasetFetchError(RuntimeError):
    """`dataset[index]` raised inside a worker; the message names the index and keeps the original error."""


class _CheckedDataset(IndexedDataset):
    """Names the failing index when the user's `__getitem__` raises (the worker traceback is kept)."""

    def __getitem__(self, index: int) -> tuple[int, Any]:
        try:
            return super().__getitem__(index)
        except Exception as exc:
            raise DatasetFetchError(f"sample {index}: dataset[{index}] raised {type(exc).__name__}: {exc}") from exc


class _LoaderCall:
    """Calls a loader method through a weak reference. The producer thread holds the epoch's `RunContext`; a
    bound method there would keep a deleted loader, and so its thread and workers, alive forever."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: Any) -> Any:
        method = self._method()
        if method is None:
            raise RuntimeError("the ODBDataLoader running this epoch was deleted")
        return method(*args)


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
                 seed: int | None = None, num_workers: int = 0, join: bool | None = None,
                 length_fn: LengthFn | None = None,
                 transport: Transport | None = None, idle_sample: Mapping[str, Any] | None = None,
                 shard_iterable: bool = True, observer: Callable[[StepInfo], None] | None = None,
                 **options: Any) -> None:
        config_options, worker_options = _split_options(options)
        if config is None:
            if token_budget is None:
                raise TypeError("ODBDataLoader needs token_budget=... (tokens per micro-batch per rank) or config=")
            config = ODBConfig(token_budget=token_budget, seed=0 if seed is None else seed,
                               join=True if join is None else join, **config_options)
        elif token_budget is not None or config_options or seed is not None or join is not None:
            raise TypeError("pass either config=ODBConfig(...) or individual config fields, not both")
        self.config = config
        self.dataset = dataset
        self.transport = transport if transport is not None else default_transport(config.sync_timeout_s)
        self.metrics = LoaderMetrics(token_budget=config.token_budget, world_size=self.transport.world_size,
                                     patch_budget=config.max_patches or 0)
        self._idle_sample = idle_sample
        self._size = map_style_size(dataset)
        self._own_sampler, self._shuffle = sampler is None, shuffle
        self.sampler = self._build_sampler(sampler, shuffle, config.seed)
        self._workers = self._build_workers(num_workers, shard_iterable, worker_options)
        self._ctx = RunContext(engine_factory=lambda epoch: RankEngine(config, epoch), transport=self.transport,
                               collate_fn=collate_fn if collate_fn is not None else PadCollator(),
                               length_fn=length_fn, metrics=self.metrics,
                               fallback_dummy=_LoaderCall(self._fallback_dummy), fetch=_LoaderCall(self._fetch),
                               observer=observer)
        self._epoch = 0
        self._current: Iterator[ODBBatch] | None = None
        self.last_report: EpochReport | None = None
        self._length: int | None = None
        self._resume: _SavedPosition | None = None  # pending position in epoch `self._epoch` (loaded state)
        self._plan: dict[str, Any] | None = None  # pending remainder of epoch `self._epoch` (elastic resume)
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
        an iterable stream (filled by `_skip_stream` before a resumed epoch starts)."""
        if self._size is not None:
            return self.dataset[index]
        return self._replayed[index]  # the IDLE dummy may also be buffered: fetched twice

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
        """Select the epoch of the next `iter()` (reshuffles). Without calls, each `iter()` advances by one.

        After `load_state_dict()` the restored epoch is `self.epoch`; selecting another one while the restored
        epoch still has steps to run raises ValueError instead of silently dropping (or misplacing) them."""
        if epoch != self._epoch and (self._resume is not None or self._plan is not None):
            done = self._resume is not None and self._resume.complete
            if not (done and epoch > self._epoch):
                raise ValueError(f"the loaded state continues epoch {self._epoch}; set_epoch({epoch}) would "
                                 f"{'replay' if epoch < self._epoch else 'skip'} its remaining steps. Call "
                                 f"set_epoch(loader.epoch) (= {self._epoch}), or build a fresh loader to start over")
            self._resume = self._plan = None
        self._epoch = epoch

    def __iter__(self) -> Iterator[ODBBatch]:
        self.close()
        epoch = self._epoch
        saved, self._resume = self._resume, None
        plan, self._plan = self._plan, None
        self._epoch = epoch + 1
        if saved is not None and saved.complete:  # its last step was consumed before the save: nothing to run
            return iter(())
        start_metrics = self.metrics.snapshot()
        point = saved.point if saved is not None else _plan_start(plan)
        chunks = self._open_stream(epoch, plan, point)
        run = EpochRun(self._ctx, epoch, chunks, point)  # re-fetches the resume point's samples
        self._replayed = {}
        self._current = _EpochIterator(self, run, epoch, plan=plan, saved=saved, start_metrics=start_metrics)
        return self._current

    def _open_stream(self, epoch: int, plan: dict[str, Any] | None, point: ResumePoint | None) -> Iterator[Chunk]:
        """Start the workers on this epoch's index source (the remainder `plan` after an elastic resume), past
        the samples admitted before the resume point. Workers start here, on the calling thread."""
        consumed = point.start.consumed if point is not None else 0
        if self._size is None:
            if hasattr(self.dataset, "set_epoch"):  # e.g. a shuffled HF IterableDataset: replay the same order
                self.dataset.set_epoch(epoch)
            chunks = iter(self._workers)
            if point is None:
                return chunks
            start = point.start
            needed = set(start.buffer) | ({start.dummy_index} if start.dummy_index is not None else set())
            self._replayed, rest = _skip_stream(chunks, consumed, needed)
            return rest
        if plan is not None:
            self._chunks.sampler = IndexListSampler(source_indices(plan, self.transport.rank, epoch))
        else:
            self._chunks.sampler = self.sampler
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
        self._chunks.start = consumed
        return iter(self._workers)

    # -- state ----------------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        keep = ("token_budget", "cost", "attention_alpha", "max_patches", "max_batch_size", "window", "join",
                "accumulation_steps", "seed", "shuffle_steps")
        return {name: getattr(self.config, name) for name in keep}

    def _source(self) -> dict[str, Any]:
        """Descriptor of this loader's index source for a normal epoch (see NOTE [ Elastic resume ])."""
        if self._size is None:
            return {"kind": "stream", "shard": self._iterable.shard}
        if self._own_sampler:
            return sharded_source(self._size, self._shuffle, self.config.seed, self.transport.world_size)
        return {"kind": "custom", "type": type(self.sampler).__name__, "size": self._size}

    def state_dict(self) -> dict[str, Any]:
        """This rank's position, as plain JSON-serialisable data (save one per rank, after the same step).

        Taken after any consumed step, it makes a fresh loader's next `iter()` yield exactly the batches the
        uninterrupted run would have yielded next (same indices, order and `StepInfo`). Between epochs it
        points at the start of the next epoch. To resume at another world size, merge every rank's state with
        `odb_core.resume.merge_states`. Size: O(window) ints (plus O(W x window) during a remainder epoch).
        """
        state: dict[str, Any] = {"version": STATE_VERSION, "world_size": self.transport.world_size,
                                 "rank": self.transport.rank, "config": self._fingerprint(),
                                 "sampler": self._source(), "epoch": self._epoch, "plan": self._plan,
                                 "position": None, "metrics": self.metrics.snapshot()}
        saved = self._resume
        current = self._current
        if isinstance(current, _EpochIterator) and not current.finished:
            state.update(epoch=current.epoch, plan=current.plan, metrics=dict(current.start_metrics))
            saved = current.saved_position()
        if saved is not None:
            state.update(position=_position_to_json(saved), metrics=dict(saved.metrics))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` (or a `merge_states()` of every rank's); the next `iter()` continues from it.

        A rank state, or a merged state of the same world size, resumes exactly. A merged state of another world
        size continues the epoch with the remaining samples (NOTE [ Elastic resume ] in `odb_core/resume.py`).
        Refuses (ValueError) a different batching config, dataset size or sampler, and a single rank's state
        from another world size.
        """
        if state.get("format") == MERGED_FORMAT:
            states = check_merged(state)
            if len(states) != self.transport.world_size:
                self._load_elastic(states)
                return
            state = states[self.transport.rank]
        self._load_rank_state(state)

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        version = state.pop("version", None)
        if version not in READABLE_VERSIONS:
            raise ValueError(f"loader state version {version!r} is not supported (expected {STATE_VERSION})")
        saved_world = state.pop("world_size")
        if saved_world != self.transport.world_size:
            raise ElasticResumeError(
                f"loader state was saved by rank {state.get('rank')} of a world of size {saved_world}, but this "
                f"loader has world_size={self.transport.world_size}; to resume at another world size, collect "
                "every rank's state_dict() and load odb_core.resume.merge_states(states) on every new rank")
        checks = [("rank", self.transport.rank), ("config", self._fingerprint())]
        if version >= 2:
            checks.append(("sampler", self._source()))
        for key, mine in checks:
            saved = state.pop(key)
            if saved != mine:
                raise ValueError(f"loader state was saved with {key}={saved!r} but this loader has {mine!r}; "
                                 "exact resume needs the same world size, rank, dataset, sampler and batching config")
        plan = state.pop("plan") if version >= 2 else None
        epoch, metrics, position = int(state.pop("epoch")), state.pop("metrics"), state.pop("position")
        if state:
            raise ValueError(f"unexpected keys in loader state: {sorted(state)}")
        self.close()
        self.metrics.restore(metrics)
        self._epoch, self._plan = epoch, plan
        self._resume = _position_from_json(position, metrics) if position is not None else None

    def _load_elastic(self, states: list[dict[str, Any]]) -> None:
        first, mine = states[0], self._source()
        if first["config"] != self._fingerprint():
            raise ValueError(f"loader states were saved with config={first['config']!r} but this loader has "
                             f"{self._fingerprint()!r}; resume needs the same batching config")
        saved = first["sampler"]
        change = f"from world size {len(states)} to {self.transport.world_size}"
        if saved.get("kind") != "sharded" or mine.get("kind") != "sharded":
            raise ElasticResumeError(
                f"cannot resume {change}: the saved run read {describe_source(saved)} and this loader reads "
                f"{describe_source(mine)}; only a map-style dataset with ODB's own sampler (no sampler= argument) "
                "has a per-rank order that can be recomputed at another world size. Resume at world size "
                f"{len(states)}")
        if {**saved, "world_size": 0} != {**mine, "world_size": 0}:
            raise ElasticResumeError(f"cannot resume {change}: it needs the same dataset and shuffle; the saved run "
                                     f"read {describe_source(saved)}, this loader {describe_source(mine)}")
        plan = remainder_plan(states, self.transport.world_size)
        self.close()
        self.metrics.restore(LoaderMetrics(token_budget=self.config.token_budget, world_size=self.transport.world_size,
                                           patch_budget=self.config.max_patches or 0).snapshot())
        self._epoch, self._plan, self._resume = progress(first)[0], plan, None

    def _finish(self, report: EpochReport) -> None:
        if report.unread_chunks_remaining and self._size is not None:  # non-join: name the never-read indices
            unread = self._chunks.order[report.stream_position :]
            report = dataclasses.replace(report, not_emitted=report.not_emitted + tuple(unread))
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
        if getattr(self, "_current", None) is not None:  # __init__ may have raised before setting it
            self.close()


class _EpochIterator(Iterator[ODBBatch]):
    """The iterator `ODBDataLoader.__iter__` returns: inline or through a background producer. It records the
    position of the last batch handed to the caller, which is what `state_dict()` saves: the start of that
    batch's round, the indices this rank emitted in the round so far, and whether it was the epoch's last step.
    """

    def __init__(self, loader: ODBDataLoader, run: EpochRun, epoch: int, *, plan: dict[str, Any] | None,
                 saved: _SavedPosition | None, start_metrics: dict[str, float | int]) -> None:
        self.loader, self.run, self.epoch, self.plan = loader, run, epoch, plan
        self.start_metrics = start_metrics
        depth = loader.config.prefetch_steps
        self.source: Iterator[ODBBatch] = BackgroundIterator(run, depth) if depth > 0 else run
        self.position = saved  # `round_emitted` lives in `self.emitted` while the epoch runs
        self.emitted: list[int] = list(saved.point.round_emitted) if saved is not None else []
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
        run = self.run
        start, metrics = run.round_starts[info.round], run.round_metrics[info.round]
        for stale in [r for r in list(run.round_starts) if r < info.round]:
            run.round_starts.pop(stale, None)
            run.round_metrics.pop(stale, None)
        if self.position is None or self.position.point.start.round != info.round:
            self.emitted = []
        self.emitted.extend(info.indices)
        complete = run.final_steps is not None and info.step + 1 == run.final_steps
        if complete:
            assert run.final_metrics is not None
            metrics = run.final_metrics
        self.position = _SavedPosition(point=ResumePoint(start=start, steps_consumed=info.step + 1),
                                       complete=complete, metrics=metrics)
        return batch

    def saved_position(self) -> _SavedPosition | None:
        if self.position is None:
            return None
        point = ResumePoint(start=self.position.point.start, steps_consumed=self.position.point.steps_consumed,
                            round_emitted=tuple(self.emitted))
        return _SavedPosition(point=point, complete=self.position.complete, metrics=self.position.metrics)

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
