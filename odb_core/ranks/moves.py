"""Moving samples between ranks under global planning: the only data that crosses ranks.

NOTE [ Moving samples ]
A pooled plan (NOTE [ Pooled rounds ]) may put a sample that rank o read into a group that rank d runs. Every rank
knows the whole plan, so both ends know the move without asking: rank o's outgoing list to d is, in step order,
the items of d's slots whose owner is o, and rank d expects exactly that list from o. Two ways to move:
  * `send` (`SendMoves`): rank o pickles the processed samples (top-level tensors as numpy arrays) into one frame
    per destination and one `all_to_all_bytes` per round carries each frame to its rank (NOTE [ Sending samples
    without copies ]); a sample that stays is never sent. Works for any dataset, streams included; the receiving
    rank only unpickles.
  * `fetch` (`FetchMoves`): rank d re-reads `dataset[index]` in its trainer process (map-style datasets only, so the
    sample's processing runs a second time there), and rank o drops its copy.
Both give the same batches (the collated samples are the same), so the choice never changes the plan.

NOTE [ Sending samples without copies ]
Under `send` most of a round's bytes are arrays (a VLM sample's `pixel_values`: MBs), and each copy of them costs
a pass over the round's moved bytes (GBs at W=4 with VLM samples; docs/benchmarks.md, "Moving samples"). So each
destination's samples travel as one frame (`encode_samples`): a header (the buffer count, the stream's length and
each buffer's), the pickle stream (protocol 5, every contiguous array out of band), and each array's bytes at a
multiple of `ALIGN`, copied once, from the sample into the frame (one `torch.cat`, without the GIL).
`GlooTransport` sends a bytearray or numpy chunk from its own memory and receives each sender's chunk into its own
bytearray (`_all_to_all_bytes`: a sizes all_to_all, then one isend/irecv per pair of ranks with bytes to move);
`decode_samples` unpickles with the buffers as views into it. On the move lane, a tensor already in a shared-memory
file goes to a rank of the same host by handle instead (NOTE [ Moving shared tensors by handle ]). The old path
copied the arrays six times (pickle in band, `join`, `bytearray`, `tobytes`, a slice per sender, unpickle) and
held up to four copies at once. Costs now: one copy on the sending rank, none on the receiving one;
peak memory on top of the samples, the frames sent (freed when the exchange returns, with the samples they were
made of) and those received (which are the samples). A sender's chunk lives as long as any sample in it: the
samples it carried are all staged in this round, so it is freed when the last of them is trained on. A
non-contiguous array, and a tensor that is not packed (nested in a list, or of a dtype numpy lacks, such as
bfloat16), is pickled in band as before. The received samples are the ones the old path gave (dtype, shape,
strides, values; tests/test_send_frames.py).

NOTE [ A re-read sample is checked ]
`fetch` assumes that `dataset[index]` returns the same sample on every read. A dataset that augments at random or
processes differently per rank breaks that, and the re-read sample would be collated into a group planned for
the owner's length: over the budget, with a `StepInfo.cost` that is not the batch's. So the receiving rank checks
each re-read sample (`inspect_sample`, the owner's own check) against the planned item and refuses a different
length or patch count with `SampleError`, naming the index, both ranks and the fix (`move='send'`); it does not
re-plan, since every other rank already runs the plan. A failing re-read raises `DatasetFetchError` naming the
index and saying that the sample moved. Cost: one check per moved sample, on the receiving rank.
"""

from __future__ import annotations

import pickle
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from odb_core.data.sample import LengthFn, inspect_sample
from odb_core.data.sendable import pack_sample, unpack_sample, unpicklable_part
from odb_core.data.sources import DatasetFetchError
from odb_core.planning.budget import Item, SampleError
from odb_core.planning.pooled import PooledRound
from odb_core.ranks.sync import Transport

Key = tuple[int, int]  # (owner rank, dataset index)


def outgoing(plan: PooledRound, rank: int) -> dict[int, list[Item]]:
    """Per destination rank, this rank's items that run there, in step order."""
    out: dict[int, list[Item]] = defaultdict(list)
    for step in plan.steps:
        for dest, slot in enumerate(step):
            if dest != rank and slot is not None:
                out[dest].extend(it for it in slot.items if it.owner == rank)
    return out


def incoming(plan: PooledRound, rank: int) -> dict[int, list[Item]]:
    """Per owner rank, the items of this rank's slots that owner read, in step order."""
    out: dict[int, list[Item]] = defaultdict(list)
    for step in plan.steps:
        slot = step[rank]
        if slot is not None:
            for it in slot.items:
                if it.owner != rank:
                    out[it.owner].append(it)
    return out


@dataclass(slots=True)
class Arrivals:
    """Samples moved to this rank in one round, taken by (owner, index) in the order they were sent."""

    by_key: defaultdict[Key, deque[Any]] = field(default_factory=lambda: defaultdict(deque))
    samples: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def put(self, key: Key, sample: Any) -> None:
        self.by_key[key].append(sample)
        self.samples += 1

    def take(self, key: Key) -> Any:
        return self.by_key[key].popleft()


class SendMoves:
    """`move="send"`: the owners send the processed samples (one all_to_all of bytes per round, NOTE [ Sending
    samples without copies ])."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def exchange(self, plan: PooledRound, take_own: Callable[[int], Any]) -> Arrivals:
        rank, world = self.transport.rank, self.transport.world_size
        frames: list[bytes | np.ndarray] = [b""] * world
        for dest, items in outgoing(plan, rank).items():
            samples = [pack_sample(take_own(it.index), limit_bytes=None) for it in items]
            try:
                frames[dest] = encode_samples(samples)
            except Exception as exc:  # noqa: BLE001 - name the sample that cannot travel
                raise unsendable(items, samples, rank, dest) from exc
        bytes_out = sum(len(f) for f in frames)
        received = self.transport.all_to_all_bytes(frames)
        del frames  # the samples sent are freed here, before this rank unpickles what it received
        arrivals = Arrivals(bytes_in=sum(len(c) for c in received), bytes_out=bytes_out)
        for owner, items in incoming(plan, rank).items():
            for item, sample in zip(items, decode_samples(received[owner]), strict=True):
                arrivals.put((owner, item.index), unpack_sample(sample))
            received[owner] = b""  # its arrays hold the chunk now, and free it with their samples
        return arrivals


def encode_samples(samples: list[Any]) -> np.ndarray:
    """One frame of `samples` (NOTE [ Sending samples without copies ]): the header, the pickle stream (protocol
    5), and each out-of-band buffer (the bytes of a contiguous array) at a multiple of `ALIGN` bytes. The arrays'
    bytes are copied once, into the frame. Raises what pickling raises."""
    return frame_of(pickle_samples(samples))


@dataclass(frozen=True, slots=True)
class Pickled:
    """`samples` pickled (protocol 5) with their arrays out of band: the stream, and the arrays' buffers (views
    of the samples' memory, not copies)."""

    stream: bytes
    buffers: tuple[pickle.PickleBuffer, ...]


def pickle_samples(samples: list[Any]) -> Pickled:
    """The first half of `encode_samples`: what can fail (an unpicklable sample), without copying any array."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(samples, protocol=5, buffer_callback=buffers.append)
    return Pickled(stream, tuple(buffers))


def frame_size(pickled: Pickled) -> int:
    """The length of `frame_of(pickled)`, known before the frame is written."""
    sizes = [b.raw().nbytes for b in pickled.buffers]
    return _offsets([16 + 8 * len(sizes), len(pickled.stream), *sizes])[-1]


def frame_of(pickled: Pickled) -> np.ndarray:
    """The second half of `encode_samples`: the frame (uint8), the one copy of the arrays' bytes; releases the
    buffers. Written by one `torch.cat` into uninitialised memory, which runs without the GIL (NOTE [ Sending
    samples without copies ]): a frame written on the move lane's thread does not stall the training thread, as a
    `bytearray().join` of the pieces did (it held the GIL for its whole copy). One call, not one numpy assignment
    per piece: each of those would wait to take the GIL back from a busy training thread (`python -m
    benchmarks.frame_gil`). The pickle stream, the header, and an array whose buffer is read-only are first copied
    into a bytearray (the stream and header are small; torch views only writable memory without a warning)."""
    views = [b.raw() for b in pickled.buffers]
    header = np.array([len(views), len(pickled.stream), *(v.nbytes for v in views)], dtype="<i8").tobytes()
    pieces: list[Any] = [header, pickled.stream, *views]
    offsets = _offsets([len(p) for p in pieces])
    zeros = torch.zeros(ALIGN, dtype=torch.uint8)
    parts = []
    for piece, start, end in zip(pieces, offsets[:-1], offsets[1:], strict=True):
        if len(piece):
            writable = isinstance(piece, memoryview) and not piece.readonly
            parts.append(torch.frombuffer(piece if writable else bytearray(piece), dtype=torch.uint8))
        if end - start - len(piece):
            parts.append(zeros[: end - start - len(piece)])  # the alignment gap
    frame = torch.empty(offsets[-1], dtype=torch.uint8)
    torch.cat(parts, out=frame)
    for buffer in pickled.buffers:
        buffer.release()
    return frame.numpy()


def decode_samples(frame: bytes | bytearray | np.ndarray) -> list[Any]:
    """The samples of `encode_samples`' frame; the arrays are views into `frame` (writable when `frame` is a
    bytearray), which lives as long as any of them."""
    view = memoryview(frame)
    n_buffers, stream_len = np.frombuffer(view[:16], dtype="<i8").tolist()
    sizes = np.frombuffer(view[16 : 16 + 8 * n_buffers], dtype="<i8").tolist()
    offsets = _offsets([16 + 8 * n_buffers, stream_len, *sizes])
    pieces = [view[start : start + size] for start, size in zip(offsets[1:], [stream_len, *sizes], strict=False)]
    return pickle.loads(pieces[0], buffers=pieces[1:])


ALIGN = 64  # where each piece of a frame starts: arrays viewed in place stay aligned for any dtype


def _offsets(sizes: list[int]) -> list[int]:
    """Where each piece of a frame starts, then the frame's length."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + -(-size // ALIGN) * ALIGN)
    return out


def unsendable(items: list[Item], samples: list[Any], rank: int, dest: int) -> SampleError:
    """The first of `samples` that cannot be pickled, as the error that names it (NOTE [ Samples that cannot
    travel ])."""
    for item, sample in zip(items, samples, strict=True):
        failure = unpicklable_part(sample)
        if failure is not None:
            return SampleError(item.index, f"{failure}, so it cannot move from rank {rank} to rank {dest} "
                                           "(move='send'); keep objects that cannot be pickled out of the samples, or "
                                           "use move='fetch' (the receiving rank re-reads the sample)")
    return SampleError(items[0].index, f"the samples moving from rank {rank} to rank {dest} cannot be pickled together")


class FetchMoves:
    """`move="fetch"`: the receiving rank re-reads each moved index; the owner drops its copy.

    The re-read sample is checked against what its owner read (NOTE [ A re-read sample is checked ]): its length
    and patches must be the planned item's, or the re-read raises `SampleError`; a failing `dataset[index]`
    raises `DatasetFetchError`; both name the index and say that the sample moved."""

    def __init__(self, rank: int, fetch: Callable[[int], Mapping[str, Any]], length_fn: LengthFn | None = None) -> None:
        self.rank, self.fetch, self.length_fn = rank, fetch, length_fn

    def exchange(self, plan: PooledRound, take_own: Callable[[int], Any]) -> Arrivals:
        for items in outgoing(plan, self.rank).values():
            for item in items:
                take_own(item.index)
        arrivals = Arrivals()
        for owner, items in incoming(plan, self.rank).items():
            for item in items:
                arrivals.put((owner, item.index), self._reread(item, owner))
        return arrivals

    def _reread(self, item: Item, owner: int) -> Mapping[str, Any]:
        moved = f"moved from rank {owner} to rank {self.rank} (move='fetch') and re-read there"
        try:
            sample = self.fetch(item.index)
        except Exception as exc:
            raise DatasetFetchError(f"sample {item.index}: {moved}, dataset[{item.index}] raised "
                                    f"{type(exc).__name__}: {exc}") from exc
        seen = inspect_sample(item.index, sample, self.length_fn)
        if (seen.length, seen.patches) != (item.length, item.patches):
            raise SampleError(item.index, f"{moved}, it has length {seen.length} and {seen.patches} patches where rank "
                                          f"{owner} read length {item.length} and {item.patches} patches, so its "
                                          "group would not be the one planned under the budget: this dataset's "
                                          "__getitem__ does not return the same sample on every read (random "
                                          "augmentation, rank-dependent processing); use move='send', which moves "
                                          "the sample its owner processed")
        return sample
