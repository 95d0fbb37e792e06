"""The thread that reads a rank's DataLoader workers (NOTE below); watched by `watch.WatchedChunks`.

NOTE [ A thread reads the workers ]
Reading a worker's chunk costs the rank CPU: the pipe reads (a chunk of text samples is ~100 kB, several reads
through a 64 KiB pipe), unpickling, unpacking the arrays into tensors and measuring each sample's payload bytes.
Done by the thread that iterates the loader, between its steps, it took ~65 µs per sample of text that the device
waited for (the training thread's CPU for 6,000 samples: 0.73 s reading directly, 0.33 s with this thread; busy
0.89 -> 0.95 at 2 ms per sample on one rank, docs/benchmarks.md "Keeping the accelerator fed"). So a reader thread
does it, `prepare` included (`stream.read_chunk`), while the training thread waits for its device, as torch's own
pin-memory thread reads a plain DataLoader's batches in the background. Its GIL holds are short (one chunk's
unpickling and unpacking, tens of µs; the reads release the GIL), far below the interpreter's 5 ms switch
interval, unlike a thread that plans and collates (`prefetch_steps`). The consumer takes chunks from its queue
(`next`, waiting; `ready`, not waiting: NOTE [ Reading ahead ] in reader.py) in the order the DataLoader yields
them, so nothing it plans depends on the thread's timing. The cost is in fault detection (NOTE [ A rank watches
its workers ] in watch.py): a dead worker is reported after `GRACE_S` (1 s) of silence instead of at once, and a
thread blocked on a half message stays behind (a daemon). `reader_thread=False` reads directly, as before.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from odb_core.epoch.prefetch import Exhausted, Failed, Produced

POLL_S = 0.1  # how often a waiting consumer looks at the workers (and a blocked put at its stop flag)
HOP_DEPTH = 4  # chunks the reader thread reads ahead of its consumer
READER_THREAD = "odb-worker-reader"


def _put(out: queue.Queue[Any], message: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(message, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _read(chunks: Iterator[Any], prepare: Callable[[Any], Any] | None, out: queue.Queue[Any],
          stop: threading.Event) -> None:
    """The reader thread: the DataLoader iterator, each chunk through `prepare`, into `out`, until its end, an
    error or `stop`."""
    try:
        for chunk in chunks:
            if not _put(out, Produced(chunk if prepare is None else prepare(chunk)), stop):
                return
        _put(out, Exhausted(), stop)
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, not swallowed
        chunks = iter(())  # the iterator goes (and stops its workers) when this thread ends, not with the error
        _put(out, Failed(exc), stop)


class ReaderThread:
    """A `WatchedChunks`' reader thread and the queue it fills."""

    def __init__(self, chunks: Iterator[Any], prepare: Callable[[Any], Any] | None) -> None:
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=HOP_DEPTH)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_read, args=(chunks, prepare, self.queue, self.stop), name=READER_THREAD,
                                       daemon=True)
        self.thread.start()

    def abandon(self) -> None:
        """Let the thread end (at once unless it is blocked in a fetch); it is not waited for."""
        self.stop.set()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return
