"""Memory reused for the large tensors a collator concatenates, once no tensor refers to it any more.

NOTE [ Reused collation memory ]
ODB collates in the trainer process (a step's samples are known only once its round is planned), so a VLM step's
`pixel_values` (~67 images of ~2 MB: ~140 MB) are concatenated there, into fresh memory: an allocation that large
is a new mapping, and the kernel faults and zeroes each of its 4 KiB pages on the first write. On this project's
machine that is 72 ms of CPU for a 141 MB step, of which the copy itself is 13 ms (`python -m
benchmarks.collate_memory`); a plain DataLoader pays the same in its workers, ODB on the rank's own cores, and
in the epoch's last round, after the last read, on the critical path.

So `ArenaPool.cat` concatenates into an *arena*, a byte array it keeps, and hands out a tensor over a numpy view of
it. The tensor's storage holds that view, so the view lives exactly as long as some tensor (the batch's field, a
slice of it, a numpy array made from it) refers to the memory; the pool holds only a weak reference to it and
writes into an arena again only once that reference is dead. Nothing in use is ever overwritten, whatever the
consumer keeps; what it keeps only makes the pool allocate (or, with every arena in use, fall back to a plain
`torch.cat`).
  * Same values: the concatenation is `torch.cat(parts, dim=0, out=...)` of the same parts, dtype and shape.
  * Memory: at most `arenas` arenas per pool; a new one is 1/8 larger than the concatenation that needed it, or
    as large as the largest held (rounded up to 1 MiB), so the arenas grow to the epoch's largest step and are
    reused; a consumer's loop holds about three steps at once (the one it trains, the one collated ahead, the
    one being collated), what fresh allocations held too, now each as large as the largest. `release()` forgets
    them all (the loader calls it at an epoch's end when its collator is a `PadCollator`).
  * Only for what gains: dense CPU tensors of one dtype and trailing shape, at least 1-D, without grad, of at
    least `min_bytes` together; anything else goes to `torch.cat` as before.
  * Thread-safe: a lock guards the arenas (the collating thread and the consumer's may collate).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

_MIB = 1 << 20


@dataclass(slots=True, eq=False)  # identity: `list.remove` must not compare the arrays
class _Arena:
    memory: np.ndarray  # uint8, never handed out itself: views of it are
    lease: weakref.ref | None = None  # the view last handed out; the arena is in use while it is alive

    def free(self) -> bool:
        return self.lease is None or self.lease() is None


@dataclass(slots=True)
class ArenaPool:
    """Concatenations along dim 0 into reused memory (NOTE [ Reused collation memory ])."""

    arenas: int = 3
    min_bytes: int = _MIB
    _held: list[_Arena] = field(default_factory=list, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """`torch.cat(parts, dim=0)`, written into a free arena when the parts qualify and one is at hand."""
        nbytes = _eligible_bytes(parts)
        view = self._lease(nbytes) if nbytes and nbytes >= self.min_bytes else None
        if view is None:
            return torch.cat(parts, dim=0)
        first = parts[0]  # the rows follow from the bytes `_eligible_bytes` counted
        out = torch.from_numpy(view).view(first.dtype).view(-1, *first.shape[1:])
        return torch.cat(parts, dim=0, out=out)

    def release(self) -> None:
        """Forget every arena: a free one's memory goes back to the allocator now, one in use when the tensors over
        it are freed (they hold it). Skipped if the pool is busy: a loader finalized by a garbage collection that
        runs inside `_lease`, on the thread holding the lock, would otherwise wait for itself."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._held = []
        finally:
            self._lock.release()

    def _lease(self, nbytes: int) -> np.ndarray | None:
        with self._lock:
            free = [arena for arena in self._held if arena.free()]
            fitting = [arena for arena in free if arena.memory.nbytes >= nbytes]
            if fitting:
                arena = min(fitting, key=lambda a: a.memory.nbytes)
            elif len(self._held) < self.arenas or free:
                if free:  # every free arena is too small: the smallest makes way for a larger one
                    self._held.remove(min(free, key=lambda a: a.memory.nbytes))
                largest = max((a.memory.nbytes for a in self._held), default=0)
                arena = _Arena(_allocate(max(nbytes + nbytes // 8, largest)))
                self._held.append(arena)
            else:
                return None
            view = arena.memory[:nbytes]
            arena.lease = weakref.ref(view)
            return view

    def __getstate__(self) -> dict:  # a collator pickled to another process starts with no arenas
        return {"arenas": self.arenas, "min_bytes": self.min_bytes}

    def __setstate__(self, state: dict) -> None:
        self.arenas, self.min_bytes = state["arenas"], state["min_bytes"]
        self._held, self._lock = [], threading.Lock()


def _allocate(nbytes: int) -> np.ndarray:
    """`nbytes` rounded up to whole MiB, by torch's allocator: numpy's asks the kernel for transparent huge pages,
    whose first touch here cost ~8 ms per 2 MiB page (compaction), far more than the 4 KiB faults it saves."""
    return torch.empty(-(-nbytes // _MIB) * _MIB, dtype=torch.uint8).numpy()


def _eligible_bytes(parts: list[torch.Tensor]) -> int:
    """The bytes of the parts' concatenation, or 0 when an arena cannot hold it as `torch.cat` would make it: not
    all dense (strided, not quantized) CPU tensors of one dtype, rank and trailing shape without grad, or 0-D."""
    if not parts or type(parts[0]) is not torch.Tensor:
        return 0
    first = parts[0]
    dtype, trailing = first.dtype, first.shape[1:]
    if first.ndim == 0:
        return 0
    rows = 0
    for part in parts:
        if (type(part) is not torch.Tensor or part.ndim != first.ndim or part.dtype != dtype
                or part.shape[1:] != trailing or part.layout != torch.strided or part.device.type != "cpu"
                or part.requires_grad or part.is_quantized):
            return 0
        rows += part.shape[0]
    return rows * trailing.numel() * first.element_size()
