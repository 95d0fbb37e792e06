"""Writing a moved round's frames beside a training thread (issue 27, item 4): does the writer hold the GIL?

    python -m benchmarks.frame_gil [--samples 64] [--mb 2] [--repeats 4]

Under `overlap_moves` the move lane's thread writes each chunk's frame (`frame_of`: the one copy of the moved
samples' arrays, NOTE [ Sending samples without copies ]) while the training thread runs its step. A step's Python
work (kernel launches, the optimizer's loop) needs the GIL, so a writer that holds it for the copy stalls the step.

Two writers, each on a thread of its own, `--repeats` frames of `--samples` samples of `--mb` MiB of float32
`pixel_values` each, while the main thread counts iterations of a pure-Python loop (a stand-in for the training
thread's Python work):
  * `join`: the frame as the code before wrote it, `bytearray().join` of the pieces and their zero gaps (held the
    GIL for the copy);
  * `numpy`: numpy slice assignments into `np.empty`, one per piece (each copy runs without the GIL, but each
    assignment then waits to take the GIL back from the busy main thread);
  * `torch`: `frame_of` today, one `torch.cat` of the pieces into `torch.empty` (one release of the GIL).
Reported per writer: the writer's seconds, and the main thread's loop rate while the writer ran against its rate
alone (1.0: the writer never held the GIL). Alternating runs; medians. Writes results/frame_gil.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import RESULTS
from odb_core.data.sendable import pack_sample
from odb_core.ranks.moves import Pickled, _offsets, frame_of, pickle_samples


def frame_by_join(pickled: Pickled) -> bytearray:
    """The frame as `frame_of` wrote it before it moved to numpy (same bytes, written under the GIL)."""
    views = [b.raw() for b in pickled.buffers]
    header = np.array([len(views), len(pickled.stream), *(v.nbytes for v in views)], dtype="<i8").tobytes()
    pieces = [header, pickled.stream, *views]
    offsets = _offsets([len(p) for p in pieces])
    gaps = [bytes(end - start - len(p)) for p, start, end in zip(pieces, offsets[:-1], offsets[1:], strict=True)]
    frame = bytearray().join(x for pair in zip(pieces, gaps, strict=True) for x in pair)
    for buffer in pickled.buffers:
        buffer.release()
    return frame


def frame_by_numpy(pickled: Pickled) -> np.ndarray:
    """The same frame by numpy slice assignments, one per piece and gap."""
    views = [b.raw() for b in pickled.buffers]
    header = np.array([len(views), len(pickled.stream), *(v.nbytes for v in views)], dtype="<i8").tobytes()
    pieces = [header, pickled.stream, *views]
    offsets = _offsets([len(p) for p in pieces])
    frame = np.empty(offsets[-1], dtype=np.uint8)
    for piece, start, end in zip(pieces, offsets[:-1], offsets[1:], strict=True):
        frame[start : start + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        frame[start + len(piece) : end] = 0
    for buffer in pickled.buffers:
        buffer.release()
    return frame


WRITERS = {"join": frame_by_join, "numpy": frame_by_numpy, "torch": frame_of}


def loop_rate(stop: threading.Event) -> float:
    """Iterations per second of a pure-Python loop until `stop` is set."""
    count, start = 0, time.perf_counter()
    while not stop.is_set():
        count += 1
    return count / (time.perf_counter() - start)


def alone_rate(seconds: float) -> float:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    return loop_rate(stop)


def one_run(writer: str, samples: list[dict], repeats: int) -> dict:
    write = WRITERS[writer]
    stop, seconds = threading.Event(), []

    def work() -> None:
        for _ in range(repeats):
            pickled = pickle_samples([pack_sample(s, limit_bytes=None) for s in samples])
            start = time.perf_counter()
            frame = write(pickled)
            seconds.append(time.perf_counter() - start)
            assert len(frame) > 0
            del frame
        stop.set()

    thread = threading.Thread(target=work)
    thread.start()
    rate = loop_rate(stop)
    thread.join()
    return {"writer": writer, "seconds_per_frame": statistics.median(seconds), "loop_rate": rate}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--mb", type=float, default=2.0, help="MiB of float32 pixel_values per sample")
    parser.add_argument("--repeats", type=int, default=4, help="frames per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per writer, alternating")
    parser.add_argument("--out", type=Path, default=RESULTS / "frame_gil.json")
    args = parser.parse_args(argv)
    floats = int(args.mb * (1 << 20)) // 4
    samples = [{"input_ids": torch.arange(1024) + i, "pixel_values": torch.full((floats,), float(i))}
               for i in range(args.samples)]
    runs = []
    for _ in range(args.runs):
        for writer in WRITERS:  # the loop's rate alone, then with this writer, so that both see the same machine
            alone = alone_rate(0.5)
            runs.append(one_run(writer, samples, args.repeats) | {"alone_rate": alone})
    mb = args.samples * args.mb
    rows = []
    for writer in WRITERS:
        mine = [r for r in runs if r["writer"] == writer]
        seconds = statistics.median(r["seconds_per_frame"] for r in mine)
        rows.append({"writer": writer, "frame_mb": mb, "seconds_per_frame": seconds, "mb_per_s": mb / seconds,
                     "main_loop_vs_alone": statistics.median(r["loop_rate"] / r["alone_rate"] for r in mine)})
    print("| writer | frame MB | s per frame | MB/s | main thread's loop rate vs alone |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['writer']} | {r['frame_mb']:.0f} | {r['seconds_per_frame']:.3f} | {r['mb_per_s']:.0f} | "
              f"{r['main_loop_vs_alone']:.2f} |")
    result = {"command": vars(args) | {"out": str(args.out)}, "rows": rows, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
