"""`ODBDataLoader`: online dynamic batching around a plain DataLoader.

Guarantees (docs/guarantees.md): every rank yields the same number of steps per epoch (IDLE included); with `join=True`
every index of the epoch's sampler output appears in exactly one non-IDLE step on exactly one rank; every group's cost
is <= token_budget except a lone oversize sample; batches depend only on (seed, epoch, data, world size, config). Cost
per round: one all_gather of `STATE_FIELDS` (10) ints per rank and one all_reduce of `STEP_SUM_FIELDS` (6) ints per
step, over a dedicated Gloo group. `len()`: the last completed epoch's step count (an estimate for the next) or
`estimate_steps()`' result; before either, TypeError (no length).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch.utils.data import Sampler

from odb_core.data.collate import CollateFn, PadCollator, takes_id_arrays
from odb_core.data.sample import LengthFn
from odb_core.data.sendable import open_files_needed
from odb_core.data.worker_region import regions_of
from odb_core.epoch.estimate import ExactPlan, estimate_steps, plan_epochs_exactly
from odb_core.epoch.pipeline import EpochReport, EpochRun, RunContext
from odb_core.epoch.plan_ahead import RoundAheadError
from odb_core.epoch.prefetch import BackgroundIterator, unwinding
from odb_core.epoch.stream import LoaderCall, SampleStream, StreamOptions, worker_seed
from odb_core.epoch.wait_advice import Advisor, EpochWaits, Levers, rounds_config
from odb_core.ranks.node_groups import node_layout, node_transports
from odb_core.ranks.rounds import RoundsFactory, move_lane, move_mode
from odb_core.ranks.sync import Transport, default_transport
from odb_core.resume.cursor import EpochCursor
from odb_core.resume.resume import restore
from odb_core.resume.round_log import RoundLog
from odb_core.resume.source_state import CustomSource, RemainderSource, ShardedSource, source_to_dict
from odb_core.resume.state import LoaderIdentity, LoaderState
from odb_core.settings.config import ODBConfig, fingerprint, given_config
from odb_core.settings.settings import PASSED_ON, SettingsSource, split_keys
from odb_core.steps.metrics import LoaderMetrics
from odb_core.steps.step_info import ODBBatch, StepInfo

__all__ = ["ODBDataLoader"]
logger = logging.getLogger(__name__)

WORKER_OPTIONS = frozenset({"persistent_workers", "multiprocessing_context", "pin_memory", "prefetch_factor",
                            "worker_init_fn", "generator"})
OPTIONS = SettingsSource(where="ODBDataLoader", noun="argument", key_error=TypeError,
                         keys=dict.fromkeys(sorted(WORKER_OPTIONS), PASSED_ON))  # its **options: fields, workers


class ODBDataLoader:
    """Yields variable-size, model-ready `ODBBatch`es under a token budget, aligned across ranks.

    Args:
        dataset: map-style (indexable, sized) or `IterableDataset` of processed samples (mappings with
            `input_ids`; see docs/design.md for the sample contract).
        token_budget: `L_max`, with any other `ODBConfig` field by name (cost, window, join, seed, ...); or pass a
            complete `config=ODBConfig(...)` instead.
        collate_fn: user collator for a list of samples; defaults to `PadCollator()`.
        sampler: optional map-style sampler yielding this rank's indices (e.g. `DistributedSampler`); by default
            ODB shards the dataset over ranks itself, without padding or dropping.
        shuffle: shuffling of ODB's own sampler (seeded by the config's `seed` and the epoch).
        num_workers: DataLoader worker processes producing samples; the batches do not depend on it.
        length_fn: optional `sample -> int` cost length replacing `len(input_ids)`.
        transport: metadata transport; defaults to a dedicated Gloo group when torch.distributed is initialized.
        idle_sample: sample used for IDLE dummies on a rank that has seen no data (iterable datasets only).
        shard_iterable: for an `IterableDataset`, whether ODB shards it over ranks by stream position.
        observer: optional callable receiving every yielded `StepInfo` (e.g. to log emitted indices).
        **options: `ODBConfig` fields and DataLoader worker options (persistent_workers, multiprocessing_context,
            prefetch_factor, worker_init_fn, generator: the workers' seeds, else drawn from ODB's own generator,
            NOTE [ ODB draws nothing from the global RNG ]; pin_memory: NOTE [ Pinned memory ] in stream.py).
    """

    def __init__(self, dataset: Any, *, token_budget: int | None = None, config: ODBConfig | None = None,
                 collate_fn: CollateFn | None = None, sampler: Sampler[int] | None = None, shuffle: bool = False,
                 num_workers: int = 0, length_fn: LengthFn | None = None, transport: Transport | None = None,
                 idle_sample: Mapping[str, Any] | None = None, shard_iterable: bool = True,
                 observer: Callable[[StepInfo], None] | None = None, **options: Any) -> None:
        split = split_keys(options, OPTIONS)  # config fields, and worker options passed on
        self.config = config = given_config(token_budget, config, split.fields)
        seeds = self._worker_seeds = None if "generator" in split.extras else torch.Generator()
        worker_options = split.extras if seeds is None else {**split.extras, "generator": seeds}
        self.dataset = dataset
        self.transport = transport if transport is not None else default_transport(config.sync_timeout_s,
                                                                                       config.liveness_timeout_s)
        self._owned_transport = self.transport if transport is None else None  # close() closes it
        world = self.transport.world_size
        self._new_metrics = partial(LoaderMetrics, token_budget=config.token_budget, world_size=world,
                                    patch_budget=config.max_patches or 0)
        self.metrics = self._new_metrics()
        collate_fn = collate_fn if collate_fn is not None else PadCollator()
        stream_options = StreamOptions(sampler=sampler, shuffle=shuffle, seed=config.seed, num_workers=num_workers,
                                       shard_iterable=shard_iterable, fetch_chunk=config.fetch_chunk,
                                       worker_timeout_s=config.worker_timeout_s, worker_options=worker_options,
                                       idle_sample=idle_sample, reader_thread=config.reader_thread,
                                       open_files=open_files_needed(config.max_buffer_bytes, config.window),
                                       region_bytes=regions_of(config.worker_regions, config.max_buffer_bytes),
                                       compact_ids=length_fn is None or takes_id_arrays(length_fn),
                                       mark_ids=not takes_id_arrays(collate_fn))
        self._stream = SampleStream(dataset, stream_options, rank=self.transport.rank, world_size=world)
        self.sampler = self._stream.sampler
        self.layout = node_layout(config, world)  # node-aware rounds: NOTE [ Node groups ]
        self.transport.require_agreement(self._agreed_settings())
        map_style = self._stream.size is not None
        move_mode(config, map_style)  # refuses move='fetch' for a stream, now
        self._nodes = node_transports(self.transport, self.layout) if self.layout.n_nodes > 1 else None
        self._lane = move_lane(config, self.transport, self.layout, map_style)  # NOTE [ Moves overlap training ]
        rounds = RoundsFactory(config=config, transport=self.transport, fetch=LoaderCall(self._stream.fetch),
                               map_style=map_style, length_fn=length_fn, nodes=self._nodes, lane=self._lane)
        self._ctx = RunContext(rounds_factory=rounds, transport=self.transport, collate_fn=collate_fn,
                               length_fn=length_fn, metrics=self.metrics, observer=observer,
                               fallback_dummy=LoaderCall(self._stream.fallback_dummy),
                               fetch=LoaderCall(self._stream.fetch), packed_samples=num_workers > 0,
                               collate_ahead=config.collate_ahead and config.prefetch_steps == 0,
                               plan_ahead=config.plan_ahead and config.prefetch_steps == 0)
        self._cursor = EpochCursor()
        self._current: _EpochIterator | None = None
        self.last_report: EpochReport | None = None
        self._length: int | None = None
        self._advisor = Advisor(Levers(rounds_config(config, self.layout), config.window, num_workers == 0))

    # -- iteration ----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` will run."""
        return self._cursor.epoch

    @property
    def epoch_consumed(self) -> bool:
        """A loaded state was taken after the last step of `epoch`: the next `iter()` yields nothing (and runs no
        collective), and `set_epoch(epoch + 1)` moves on without dropping a step."""
        return self._cursor.position is not None and self._cursor.position.complete

    @property
    def took_last_step(self) -> bool:
        """The consumer of the running epoch took its last step: the next `next()` raises StopIteration. Known from
        that step where its round planned the end, else at that StopIteration (NOTE [ Which last step is complete ])."""
        return self._current is not None and self._current.log.complete

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next `iter()` (reshuffles); without calls, each `iter()` advances by one. After
        `load_state_dict()` the restored epoch is `self.epoch`; selecting another one while the restored epoch
        still has steps to run raises ValueError instead of silently dropping (or misplacing) them."""
        self._cursor.select(epoch)

    def __iter__(self) -> Iterator[ODBBatch]:
        self.leave_epoch()
        closed, start = self._cursor.closed_at, self._cursor.begin()
        if start.nothing_left:  # its last step was consumed before the save
            return iter(())
        if self._worker_seeds is not None:  # NOTE [ ODB draws nothing from the global RNG ]
            self._worker_seeds.manual_seed(worker_seed(self.config.seed, start.epoch, self.transport.rank))
        start_metrics = self.metrics.snapshot()
        try:  # re-fetches the resume point's samples
            chunks = self._stream.open(start.epoch, start.plan, start.point)
            log = RoundLog(start.position, self._stream.drawn_order())
            run = EpochRun(self._ctx, start.epoch, chunks, log, start.point, stream_length=self._stream.length())
        except BaseException:  # nothing of the epoch was taken: a loaded position stays pending (and in state_dict)
            self._cursor.load(start.epoch, start.position, start.plan)
            self._cursor.closed_at = closed  # and a state after `close()` too
            raise
        self._stream.forget_replayed()
        self._current = _EpochIterator(self, run, log, epoch=start.epoch, plan=start.plan, start_metrics=start_metrics)
        return self._current

    def _finish(self, report: EpochReport, waits: EpochWaits) -> None:
        unread = self._stream.unread(report.stream_position) if report.unread_chunks_remaining else ()  # non-join
        self.last_report = dataclasses.replace(report, not_emitted=report.not_emitted + unread,
                                               advice=self._advisor.advise(waits, report.epoch, report.abandoned))
        self._length = report.steps

    def _agreed_settings(self) -> dict[str, object]:
        """What every rank must share (NOTE [ Ranks agree on their settings ]): the batching fingerprint (with the
        node layout), `oversize`, `move`, and ODB's own sharded index source (size, shuffle, seed)."""
        settings: dict[str, object] = {**fingerprint(self.config, self.layout),
                                       "oversize": self.config.oversize, "move": self.config.move,
                                       "overlap_moves": self.config.overlap_moves, "plan_ahead": self.config.plan_ahead}
        source = self._stream.source()
        if isinstance(source, ShardedSource):
            settings["sampler"] = source_to_dict(source)
        return settings

    # -- state ----------------------------------------------------------------------------------------------
    def _identity(self) -> LoaderIdentity:
        return LoaderIdentity(world_size=self.transport.world_size, rank=self.transport.rank,
                              config=fingerprint(self.config, self.layout), source=self._stream.source())

    def state_dict(self) -> dict[str, Any]:
        """This rank's position, as plain JSON-serialisable data (save one per rank, after the same step).

        Taken after any consumed step, it makes a fresh loader's next `iter()` yield exactly the batches the
        uninterrupted run would have yielded next (same indices, order and `StepInfo`). Between epochs (a left one
        too) it points at the start of the next epoch; after `close()` inside an epoch, where its consumer stood. To
        resume at another world size, merge every rank's state with
        `odb_core.resume.resume.merge_states`. Size: O(window) ints (plus O(W x window) during a remainder epoch).
        """
        current, cursor, me = self._current, self._cursor, self._identity()
        if current is not None and not current.finished:  # where the trainer stands, not the producer thread
            epoch, plan, position, metrics = current.epoch, current.plan, current.log.position, current.start_metrics
        elif cursor.closed_at is not None:  # as it stood when `close()` ended the epoch
            epoch, plan, position, metrics = cursor.closed_at
        else:
            epoch, plan, position, metrics = cursor.epoch, cursor.plan, cursor.position, self.metrics.snapshot()
        return LoaderState(world_size=me.world_size, rank=me.rank, config=me.config, source=me.source, epoch=epoch,
                           plan=plan, position=position,
                           metrics=dict(position.metrics if position is not None else metrics)).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` (or a `merge_states()` of every rank's); the next `iter()` continues from it.

        A rank state, or a merged state of the same world size, resumes exactly. A merged state of another world
        size continues the epoch with the remaining samples (NOTE [ Elastic resume ] in `odb_core/resume/resume.py`).
        Refuses (ValueError) a different batching config, dataset size or sampler, and a single rank's state
        from another world size.
        """
        fixed = self.config.accumulation_steps if self.config.step_target is None else None  # None: a step target
        restored = restore(state, self._identity(), self._shard_order, self.config.window, fixed)
        self.leave_epoch()
        self.metrics.restore(restored.metrics if restored.metrics is not None else self._new_metrics().snapshot())
        self._cursor.load(restored.epoch, restored.position, restored.plan)

    def _shard_order(self, loaded: LoaderState) -> list[int] | None:
        """This rank's index order of the loaded epoch (its remainder after an elastic resume); None: a stream, or a
        user sampler, checked as `iter()` draws it (NOTE [ A resume reads what the save read ] in replay.py)."""
        if self._stream.size is None or loaded.position is None:
            return None
        if loaded.plan is not None:
            return loaded.plan.indices(self.transport.rank, loaded.epoch)
        return None if isinstance(self._stream.source(), CustomSource) else self._stream.epoch_indices(loaded.epoch)

    # -- length ---------------------------------------------------------------------------------------------
    def estimate_steps(self, sample_size: int = 512, epoch: int | None = None) -> int:
        """Estimate the step count of `epoch` (the next one by default), the same on every rank, and make `len()`
        return it. Every rank must call this at the same point (one all_gather of one int;
        `odb_core.epoch.estimate`). Exact at W=1 when `sample_size` covers the epoch."""
        self._quiet_epoch()
        self._length = estimate_steps(self._stream, self.config, epoch=self._cursor.epoch if epoch is None else epoch,
                                      length_fn=self._ctx.length_fn, transport=self.transport,
                                      sample_size=sample_size, per_node=self.layout.aware_per_node)
        return self._length

    def plan_epochs_exactly(self, epochs: Iterable[int]) -> ExactPlan:
        """The real micro-batch and optimizer-step counts of `epochs`, the same on every rank (NOTE [ Exact
        schedule ] in estimate.py). Every rank must call it at the same point. Raises TypeError where no exact
        plan exists (an iterable dataset, `tokens_per_step`)."""
        self._quiet_epoch()
        return plan_epochs_exactly(self._stream, self.config, epochs=list(epochs), length_fn=self._ctx.length_fn,
                                   transport=self.transport, per_node=self.layout.aware_per_node)

    def _quiet_epoch(self) -> None:
        """A collective of the loader's own waits for a round the current epoch runs ahead (NOTE [ Planning the
        next round ahead ]): two threads' collectives on one transport could pair up differently on each rank."""
        if self._current is not None and not self._current.run.quiet():
            raise RuntimeError("ODB: the round run ahead did not end; no other exchange can start (a peer is stuck)")

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("ODBDataLoader has no length before its first epoch completes (batch sizes depend on "
                            "observed lengths); call estimate_steps() or iterate once")
        return self._length

    def leave_epoch(self) -> None:
        """Stop the current epoch (its producer thread, its workers), if any, in step with the other ranks (NOTE [
        Leaving an epoch ] in pipeline.py): this waits, at most `sync_timeout_s` (plus as long again for a round run
        ahead), until every rank continued or left it too, so the next epoch starts aligned; the loader can run
        another. `iter()`, `load_state_dict()` call it."""
        self._stop_epoch(leave=True)

    def _stop_epoch(self, leave: bool) -> None:
        if getattr(self, "_current", None) is not None:  # from __del__, __init__ may have raised before setting it
            self._current.close(leave=leave)
            self._current = None

    def close(self) -> None:
        """End the loader on every rank after its last step: leave the current epoch (`leave_epoch`), then close
        the transport the loader built itself, whose threads and Gloo group must not outlive the run (NOTE [ Threads
        at interpreter exit ] in odb_core/ranks/sync.py); a transport passed in stays the caller's. Idempotent. A
        closed loader keeps its state (`state_dict()` of an epoch closed before its end: where its consumer stood, as
        before the close), metrics and `len()`; over Gloo its next collective raises RuntimeError."""
        current = self._current
        try:
            if current is not None and not current.finished:  # a preemption handler, a `finally:`, then a save
                self._cursor.closed_at = current.epoch, current.plan, current.log.position, current.start_metrics
            self._stop_epoch(leave=not unwinding())  # NOTE [ A failed epoch is not left ] in pipeline.py
        finally:
            self._release()

    def _release(self) -> None:  # NOTE [ A dropped loader ends its threads ] in odb_core/ranks/sync.py
        if getattr(self, "_stream", None) is not None:  # what __init__ built, where a refusal there stopped it
            self._stream.close_files()  # never blocks (NOTE [ A worker's files travel as descriptors ])
        for part in (getattr(self, name, None) for name in ("_lane", "_nodes", "_owned_transport")):
            if part is not None:  # the lane first: a move may end on its group
                part.close()

    def __del__(self) -> None:  # NOTE [ A dropped loader ends its threads ] in odb_core/ranks/sync.py
        self._stop_epoch(leave=False)  # no collective from a finalizer
        self._release()


class _EpochIterator(Iterator[ODBBatch]):
    """The iterator `ODBDataLoader.__iter__` returns: inline or through a background producer. Each batch it
    hands to the caller is reported to the epoch's `RoundLog`, whose position is what `state_dict()` saves."""

    def __init__(self, loader: ODBDataLoader, run: EpochRun, log: RoundLog, *, epoch: int,
                 plan: RemainderSource | None, start_metrics: dict[str, float | int]) -> None:
        self.loader, self.run, self.log, self.epoch, self.plan = loader, run, log, epoch, plan
        self.start_metrics, self.waits = start_metrics, loader._advisor.epoch_waits(loader.metrics, run.reader.reads)
        depth = loader.config.prefetch_steps
        self.source: Iterator[ODBBatch] = BackgroundIterator(run, depth) if depth > 0 else run
        self.finished = self.failed = False  # failed: a next() raised, the epoch is not left in step (see `close`)

    def __next__(self) -> ODBBatch:
        asked = time.perf_counter()
        try:  # the bookkeeping too: torch's SIGCHLD error (no handler of ODB's) becomes a WorkerDiedError
            batch = next(self.source)
            assert batch.info is not None
            self.waits.took(batch.info.local_samples, asked, time.perf_counter())  # NOTE [ Which lever ]
            self.log.consume(batch.info)
        except StopIteration:
            self.finished = True
            if self.run.report is not None:
                self.loader._finish(self.run.report, self.waits)
            raise
        except BaseException as exc:
            self.failed = True
            raise self.loader._stream.named_failure(exc) if self.source is self.run else exc
        finally:  # the last next() too: a round it ran is in read_seconds and sync_seconds, parts of this wait
            self.loader.metrics.wait_seconds += time.perf_counter() - asked  # NOTE [ Waiting for data ]
        return batch

    def close(self, leave: bool = True) -> None:
        """Stop the epoch; with `leave` (an explicit close before the end; a `yield from` closed), leave it with the
        other ranks, unless a `next()` raised (NOTE [ A failed epoch is not left ] in pipeline.py)."""
        leave = leave and not self.finished and not self.failed
        if isinstance(self.source, BackgroundIterator):
            self.source.close(leave=leave, timeout_s=self.loader.config.sync_timeout_s + 5.0)
            return
        try:
            if leave:
                self.run.leave()
        except RoundAheadError:  # this rank cannot go on in step: said, not logged (NOTE [ Planning the next ... ])
            raise
        except Exception as exc:  # noqa: BLE001 - the next epoch's first exchange reports the same peer problem
            logger.warning("ODB: leaving the epoch early failed (%s: %s)", type(exc).__name__, exc)
        finally:
            self.run.close()
