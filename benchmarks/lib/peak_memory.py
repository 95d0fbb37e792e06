"""Peak resident memory of a loader run, for the processes that hold its samples (Linux /proc).

`ru_maxrss` (getrusage) is a process's peak over its whole life, so a process that runs plain and then ODB cannot
tell their peaks apart with it. Here the training process's peak is its `VmHWM`, reset before each run by writing
5 to /proc/self/clear_refs (Linux >= 4.0), and the DataLoader workers' peaks are their own `VmHWM`, read while
they run (`WorkerPeaks`, a thread that polls them; workers found through /proc/self/task/*/children). A forked worker's RSS counts the pages it shares with its parent, so workers are
reported by the largest one, never summed.
"""

from __future__ import annotations

import threading
from pathlib import Path

MIB = 1024 * 1024


def _kib(status: Path, field: str = "VmHWM") -> int:
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """Start this process's peak RSS (`VmHWM`) afresh from its current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_mb() -> float:
    """This process's peak RSS since the last `reset_peak` (or its start), in MiB."""
    return _kib(Path("/proc/self/status")) / 1024


def children() -> set[int]:
    """The pids of this process's live children (started by any of its threads)."""
    pids: set[int] = set()
    for listing in Path("/proc/self/task").glob("*/children"):
        try:
            pids.update(int(p) for p in listing.read_text().split())
        except OSError:  # the thread ended meanwhile
            continue
    return pids


class WorkerPeaks:
    """The largest peak RSS among this process's children (MiB; 0 with no child), read every `interval_s` by a
    daemon thread between `start` and `stop` (a poll reads a few /proc files: ~0.1 ms of GIL every 50 ms), so
    that workers which finish before the first batch is taken are seen too."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s, self.largest_mb = interval_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-peaks", daemon=True)

    def start(self) -> WorkerPeaks:
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.poll()
        return self.largest_mb

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        for pid in children():
            try:
                self.largest_mb = max(self.largest_mb, _kib(Path(f"/proc/{pid}/status")) / 1024)
            except (OSError, KeyError):  # exited meanwhile
                continue
