"""Reading one epoch's samples into the buffer: the stream cursor, the payloads of buffered samples, the IDLE dummy.

`SampleReader` is the part of an epoch that touches samples; the planning only sees `Item`s. It admits every
sample it reads to the engine's buffer (checked by `inspect_sample`, which names the index of a bad sample),
keeps the payload by dataset index until its group is collated, and picks the sample IDLE steps are built from.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from odb_core.data.sample import LengthFn, count_patches, inspect_sample
from odb_core.data.payload import payload_bytes
from odb_core.data.sources import DatasetFetchError
from odb_core.epoch.plan_ahead import WaitParts
from odb_core.epoch.stream import Chunk, ReadChunk, read_chunk
from odb_core.epoch.wait_advice import ReadClock
from odb_core.planning.planner import BufferEngine
from odb_core.planning.round_sizes import fill_more
from odb_core.resume.state import RoundStart


@dataclass(frozen=True, slots=True)
class Pull:
    """What the reader pulls once a step was taken (NOTE [ Reading ahead ]): it waits until `samples`
    samples (or `bytes` of payloads; None: no byte bound) are pending, then takes, without waiting, the chunks a
    reader thread already holds, up to `cap` pending samples (`cap_bytes`)."""

    samples: int
    bytes: int | None
    cap: int = 0
    cap_bytes: int | None = None


@dataclass(slots=True)
class ReadAhead:
    """NOTE [ Reading ahead ]
    A round fills the buffer, plans, and releases its steps; if nothing were read while the consumer trains on
    them, the DataLoader workers would stop after their small prefetch and the next round would wait for a
    whole buffer of samples. So while a round's steps are taken, the reader pulls the next round's samples into
    its `pending` samples, a share per step: after a round is planned, the next fill will admit exactly
    `engine.space()` samples (the buffer changes only at a fill and a plan), so the reader waits for up to that
    many, spread over the steps released now, and the workers keep processing while the accelerator works. The
    samples wait unadmitted, so the next plan sees the buffer it would have seen (batches unchanged), and a saved
    position still points at the round's start (they are re-read on resume). The pulls run in the consumer's
    thread, between its steps; the pipe reads and unpickling behind them run in the reader thread while the
    consumer's device works (NOTE [ A thread reads the workers ] in reader_thread.py). Under `max_buffer_bytes` the next
    fill may stop before `space` samples: the pulls stop at the same share of the bytes it may add
    (`byte_space`), so pending samples hold about one fill's bytes (the last chunk pulled may pass it).
    Past that share, each step also takes whatever chunks the reader thread already holds (`ready`, never
    waiting), up to `cap` pending samples (the `window`) and `byte_space` bytes: towards the end of an epoch the
    rounds halve (NOTE [ Round sizes ]), the next fill is smaller than what the workers read while a round
    trains, and without these pulls they would idle until the next round. The device never waits for them, and
    they change no plan: fills admit pending samples in stream order, `space` at a time."""

    space: int = 0
    byte_space: int | None = None
    steps: int = 0
    taken: int = 0
    cap: int = 0

    @property
    def due(self) -> bool:
        return self.taken < self.steps

    def plan(self, space: int, byte_space: int | None, steps: int, cap: int) -> None:
        self.space, self.byte_space, self.steps, self.taken, self.cap = space, byte_space, steps, 0, cap

    def take_step(self) -> Pull:
        """Once one more step was taken: the pending samples (and payload bytes) to wait for, the next fill's share
        of the steps taken; then the samples (and bytes) to take without waiting, `cap` and `byte_space`."""
        self.taken += 1
        share_bytes = None if self.byte_space is None else -(-self.byte_space * self.taken // self.steps)
        return Pull(-(-self.space * self.taken // self.steps), share_bytes, self.cap, self.byte_space)


@dataclass(slots=True)
class Payloads:
    """Buffered sample payloads by dataset index, first in first out per index (a multiset: samplers may repeat
    an index). The common case, one payload per index, is a plain dict entry; repeats wait in `more`. `bytes` is
    the `payload_bytes` of the samples held (what `max_buffer_bytes` bounds)."""

    first: dict[int, tuple[Any, int]] = field(default_factory=dict)  # index -> (sample, its payload bytes)
    more: dict[int, deque[tuple[Any, int]]] = field(default_factory=dict)
    bytes: int = 0

    def put(self, index: int, sample: Any, nbytes: int) -> None:
        self.bytes += nbytes
        if index in self.first:
            self.more.setdefault(index, deque()).append((sample, nbytes))
        else:
            self.first[index] = (sample, nbytes)

    def take(self, index: int) -> Any:
        sample, nbytes = self.first.pop(index)
        self.bytes -= nbytes
        waiting = self.more.get(index)
        if waiting:
            self.first[index] = waiting.popleft()
            if not waiting:
                del self.more[index]
        return sample


class SampleReader:
    """This rank's stream of one epoch, read into a `RankEngine`'s buffer.

    `consumed` counts the samples admitted so far (the resume offset included); `pending` holds samples read from
    the workers that no fill admitted yet (`pending_bytes` their payloads); `stream_length` is the number of samples
    of this rank's epoch, resume offset included, or None when unknown (NOTE [ Round sizes ]). The seconds a read
    blocks on the stream are added to `parts.read_seconds` (NOTE [ Waiting for data ] in metrics.py)."""

    def __init__(self, chunks: Iterator[Chunk], length_fn: LengthFn | None,
                 fallback_dummy: Callable[[], Mapping[str, Any]], packed: bool, stream_length: int | None,
                 parts: WaitParts | None = None) -> None:
        self.chunks, self.length_fn, self.fallback_dummy = chunks, length_fn, fallback_dummy
        self.parts = parts
        self.packed = packed  # worker processes send small tensors as arrays (sendable.PackedTensor)
        self.stream_length = stream_length
        self.pending: deque[tuple[int, Any]] = deque()
        self.pending_sizes: deque[int] = deque()  # `payload_bytes` of each pending sample, measured once
        self.pending_bytes = 0
        self.payloads = Payloads()
        self.take = self.payloads.take  # a buffered payload by dataset index (bound once: per-sample hot path)
        self.stream_ended = False
        self.consumed = 0
        self.reads = ReadClock()  # NOTE [ Which lever ] in wait_advice.py
        self.dummy_index: int | None = None
        self.dummy: Mapping[str, Any] | None = None
        self.dummy_patches = 0

    def restore(self, start: RoundStart, engine: BufferEngine, fetch: Callable[[int], Mapping[str, Any]]) -> None:
        """Re-fetch the samples buffered at `start` (and the dummy) by index, as the saved round began. A failed
        re-read names the sample (`DatasetFetchError`) and releases the worker stream (`_fail`)."""
        self.consumed = start.consumed
        try:
            for index in start.buffer:
                sample = _refetch(fetch, index)
                engine.admit(inspect_sample(index, sample, self.length_fn))
                self.payloads.put(index, sample, payload_bytes(sample))
            if start.dummy_index is not None:
                self.dummy_index, self.dummy = start.dummy_index, _refetch(fetch, start.dummy_index)
                self.dummy_patches = count_patches(self.dummy)
        except BaseException as exc:
            self._fail(exc)
            raise

    def fill(self, engine: BufferEngine) -> bool:
        """Top the buffer up; returns whether this rank is still active (its stream holds more). On any error
        (a bad sample, the oversize policy, a failed fetch) the worker iterator is released before raising.

        NOTE [ Whether a rank's stream has ended ]
        A rank's `active` flag goes into the round's plan (an inactive rank's tail is planned, not held back), so
        it must be a function of the stream, not of when its end was read. A fill that admits the stream's last
        sample sees the end only if some read already met it: a read-ahead pull of chunks the reader thread held,
        which depends on worker timing, or none at all in a replayed round (exact resume). So when a fill leaves
        nothing pending and the stream may be at its end (its length is unknown, or every sample of it is
        admitted), it reads one more chunk: the end (inactive) or samples that wait, pending, for the next fill
        (active). Before, a round replayed from a saved state planned the end of an epoch differently from the
        uninterrupted run, and two runs could too (tests/test_read_ahead.py). The cost: one chunk's wait at the
        end of a fill with nothing pending, at a known stream's end or with an iterable dataset, where that chunk
        may pass `max_buffer_bytes` while it waits, pending (a stream that blocks until the trainer moves on waits
        here; none of ODB's sources does). `simulate_epoch` plans with the same rule."""
        try:
            return self._fill(engine)
        except BaseException as exc:
            self._fail(exc)
            raise

    def space(self, engine: BufferEngine) -> int:
        """How many samples the next fill admits at most (NOTE [ Round sizes ]): the round's target less the
        buffered samples; `max_buffer_bytes` may stop it earlier."""
        left = None if self.stream_length is None else max(self.stream_length - self.consumed, 0)
        return engine.space(left)

    def byte_space(self, engine: BufferEngine) -> int | None:
        """The payload bytes the next fill may add before `max_buffer_bytes` stops it (None: no bound)."""
        bound = engine.config.max_buffer_bytes
        return None if bound is None else max(bound - self.payloads.bytes, 0)

    def _fill(self, engine: BufferEngine) -> bool:
        pending, admit, put, length_fn = self.pending, engine.admit, self.payloads.put, self.length_fn
        config, payloads = engine.config, self.payloads
        space = self.space(engine)
        while space > 0 and fill_more(config, payloads.bytes):
            if not pending:
                chunk = self._next_chunk()
                if chunk is None:
                    self.stream_ended = True
                    return False
                self._extend(chunk)
            index, sample = pending.popleft()
            nbytes = self.pending_sizes.popleft()
            self.pending_bytes -= nbytes
            item = inspect_sample(index, sample, length_fn)
            admit(item)
            put(index, sample, nbytes)
            self.consumed += 1
            space -= 1
            self._offer_dummy(index, sample, item.patches)
        if not pending and not self.stream_ended and (self.stream_length is None
                                                       or self.consumed >= self.stream_length):
            chunk = self._next_chunk()  # NOTE [ Whether a rank's stream has ended ]
            if chunk is None:
                self.stream_ended = True
            else:
                self._extend(chunk)
        return not (self.stream_ended and not pending)

    def _fail(self, exc: BaseException) -> None:
        """Free the worker iterator now (not when the loader or the exception's frames are collected), so that
        its processes exit at once: the frames of the traceback hold it too."""
        traceback.clear_frames(exc.__traceback__)
        self.close()

    def read_ahead(self, pull: Pull) -> None:
        """Pull chunks from the workers until `pull.samples` samples (or `pull.bytes` of payloads) are pending or
        the stream ends, then those a reader thread already holds, up to `pull.cap` samples (`pull.cap_bytes`)
        pending (NOTE [ Reading ahead ]); they are admitted, in order, by the next fills."""
        pending, target, target_bytes, cap, cap_bytes = self.pending, pull.samples, pull.bytes, pull.cap, pull.cap_bytes
        try:
            while (len(pending) < target and not self.stream_ended
                   and (target_bytes is None or self.pending_bytes < target_bytes)):
                chunk = self._next_chunk()
                if chunk is None:
                    self.stream_ended = True
                else:
                    self._extend(chunk)
            ready = getattr(self.chunks, "ready", None)  # WatchedChunks (workers); not a resumed stream's chain
            held = False
            while (ready is not None and len(pending) < cap and not self.stream_ended
                   and (cap_bytes is None or self.pending_bytes < cap_bytes)):
                try:
                    chunk = ready()
                except StopIteration:
                    self.stream_ended = True
                    break
                if chunk is None:
                    break
                self._extend(chunk)
                held = True
            full = len(pending) >= cap or (cap_bytes is not None and self.pending_bytes >= cap_bytes)
            self.reads.pulled(getattr(self.chunks, "looks_ahead", False),  # NOTE [ Which lever ] in wait_advice.py
                              ahead=(held and full) or (cap > 0 and cap_bytes == 0 and ready is not None))
        except BaseException as exc:
            self._fail(exc)
            raise

    def _next_chunk(self) -> Chunk | None:
        """The stream's next chunk (None at its end), the seconds it took counted as reading."""
        if self.parts is None:
            return next(self.chunks, None)
        asked = time.perf_counter()
        try:
            return next(self.chunks, None)
        finally:
            self.parts.read_seconds += time.perf_counter() - asked

    def _extend(self, chunk: Chunk) -> None:
        """Queue a chunk's samples, unpacked, with their payload bytes; a reader thread already did both."""
        if type(chunk) is not ReadChunk:
            chunk = read_chunk(chunk, self.packed)
        self.reads.took(len(chunk))
        self.pending.extend(chunk)
        self.pending_sizes.extend(chunk.sizes)
        self.pending_bytes += chunk.nbytes

    def _offer_dummy(self, index: int, sample: Mapping[str, Any], patches: int) -> None:
        """NOTE [ IDLE dummy ] The dummy is the first sample this rank read, replaced once by the first one with
        vision patches: a VLM's IDLE step then runs the vision tower too, as every real step does, so sharded
        engines (ZeRO-3, FSDP) that gather the vision parameters see the same collectives on every rank. The
        choice depends only on the stream order, and `RoundStart.dummy_index` records it for resume."""
        if self.dummy is None or (patches > 0 and self.dummy_patches == 0):
            self.dummy_index, self.dummy, self.dummy_patches = index, sample, patches

    def dummy_sample(self) -> Mapping[str, Any]:
        if self.dummy is None:
            self.dummy = self.fallback_dummy()
        return self.dummy

    def pending_indices(self) -> list[int]:
        return [index for index, _ in self.pending]

    def close(self) -> None:
        """Release the worker iterator (and with it the worker processes); called on errors and on shutdown. A
        read after it raises (`ClosedStream`): a consumer that catches an error and calls `next()` again must not
        see the rest of its shard as an ended stream, silently unread."""
        chunks, self.chunks = self.chunks, ClosedStream()
        close = getattr(chunks, "close", None)  # WatchedChunks: its reader thread ends now, not when collected
        if close is not None:
            close()


def _refetch(fetch: Callable[[int], Mapping[str, Any]], index: int) -> Mapping[str, Any]:
    try:
        return fetch(index)
    except DatasetFetchError:
        raise
    except Exception as exc:
        raise DatasetFetchError(f"sample {index}: re-read by index to resume its round, dataset[{index}] raised "
                                f"{type(exc).__name__}: {exc}") from exc


class ClosedStream(Iterator[Chunk]):
    """The stream of an epoch whose reader was closed: every read raises, naming what to do."""

    def __next__(self) -> Chunk:
        raise RuntimeError("this epoch's samples can no longer be read: its stream was closed after an error (or "
                           "by close()); start a new epoch with iter(loader), or resume from a saved state")
