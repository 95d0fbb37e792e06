"""What one round's sample moves cost under `move="send"`, stage by stage, on real Gloo ranks (issue 27, item 4).

    python -m benchmarks.move_bytes [--worlds 2 4] [--samples 150] [--mb 2] [--repeats 3]

Each rank sends `--samples` VLM-like samples (float32 `pixel_values` of `--mb` MiB, 1,024 `input_ids` and
`labels`), split evenly over the other ranks, and receives as many: one round's moves. Two ways, each in fresh
processes (so that one's freed memory does not hide the other's peak), alternating which runs first:
  * `before`: the code of 74777dc: pickle each destination's list in band, `b"".join` then `bytearray` into the
    send tensor, one `all_to_all_single`, `tobytes` of the received tensor, a slice per sender, unpickle;
  * `after`: `SendMoves`' frames (`encode_samples`: pickle protocol 5 with the arrays out of band, written once into
    one bytearray per destination), `GlooTransport._all_to_all_bytes` (sent from the frames, each received into its
    own bytearray), `decode_samples` (the arrays are views into it).
Stages, each timed on every rank between barriers (the slowest rank's seconds are reported, as a round waits for
it): `pickle` (pack and pickle, or frame), `copy` (join and bytearray; nothing after), `transfer` (the sizes and
the bytes, Gloo), `unpickle` (tobytes, slices, unpickle and unpack; or decode and unpack). MB/s is the round's
bytes sent by one rank over the stage's seconds. Peak MB is the rank's peak RSS over its RSS with the samples
made (`VmHWM` reset through /proc/self/clear_refs), the worst rank. W processes share the machine's cores (2 here),
so the transfer is a loopback's, not a network's. Writes results/move_bytes.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import RESULTS
from benchmarks.lib.localhost import free_port
from odb_core.data.sendable import pack_sample, unpack_sample
from odb_core.ranks.moves import decode_samples, encode_samples
from odb_core.ranks.sync import GlooTransport

STAGES = ("pickle", "copy", "transfer", "unpickle")


def make_samples(rank: int, n: int, mb: float) -> list[dict]:
    floats = int(mb * (1 << 20)) // 4
    ids = torch.arange(1024, dtype=torch.int64)
    return [{"input_ids": ids + i, "labels": ids.clone(), "pixel_values": torch.full((floats,), float(rank + i))}
            for i in range(n)]


def memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def before(transport: GlooTransport, outgoing: list[list[dict]], clock: Clock) -> list[list]:
    """The send path of 74777dc, stage by stage, each buffer living as long as it did there."""
    chunks = [pickle.dumps([pack_sample(s, limit_bytes=None) for s in out], protocol=pickle.HIGHEST_PROTOCOL)
              if out else b"" for out in outgoing]
    outgoing.clear()
    clock.tick("pickle")
    sizes = torch.tensor([len(c) for c in chunks], dtype=torch.int64)
    send = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    clock.tick("copy")
    incoming = torch.empty_like(sizes)
    transport._collective("all_to_all", lambda: dist.all_to_all_single(incoming, sizes, group=transport.group))
    received = torch.empty(int(incoming.sum()), dtype=torch.uint8)
    transport._collective("all_to_all", lambda: dist.all_to_all_single(
        received, send, incoming.tolist(), sizes.tolist(), group=transport.group))
    clock.tick("transfer")
    data, slices, offset = received.numpy().tobytes(), [], 0
    for size in incoming.tolist():
        slices.append(data[offset : offset + size])
        offset += size
    out = [[unpack_sample(s) for s in pickle.loads(c)] if c else [] for c in slices]
    clock.tick("unpickle")
    return out


def after(transport: GlooTransport, outgoing: list[list[dict]], clock: Clock) -> list[list]:
    """`SendMoves.exchange`'s path, stage by stage."""
    frames = [encode_samples([pack_sample(s, limit_bytes=None) for s in out]) if out else b"" for out in outgoing]
    outgoing.clear()
    clock.tick("pickle")
    clock.tick("copy")
    received = transport._all_to_all_bytes(frames)
    del frames
    clock.tick("transfer")
    out = [[unpack_sample(s) for s in decode_samples(c)] if len(c) else [] for c in received]
    del received
    clock.tick("unpickle")
    return out


class Clock:
    """Seconds per stage, each ended by a barrier of all ranks."""

    def __init__(self, group) -> None:
        self.group, self.seconds, self.start = group, {}, time.perf_counter()

    def tick(self, stage: str) -> None:
        dist.barrier(group=self.group)
        now = time.perf_counter()
        self.seconds[stage] = now - self.start
        self.start = now


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, mode: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    transport = GlooTransport(timeout_s=300)
    samples = make_samples(rank, args.samples, args.mb)
    others = [d for d in range(world) if d != rank]
    outgoing = [[] for _ in range(world)]
    for i, sample in enumerate(samples):
        outgoing[others[i % len(others)]].append(sample)
    del samples
    sent_mb = sum(s["pixel_values"].nbytes + 2 * s["input_ids"].nbytes for out in outgoing for s in out) / 1e6
    dist.barrier(group=transport.group)
    base_kb = memory_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    clock = Clock(transport.group)
    got = (before if mode == "before" else after)(transport, outgoing, clock)
    peak_mb = (memory_kb("VmHWM") - base_kb) / 1e3
    assert sum(len(g) for g in got) == args.samples, [len(g) for g in got]
    assert all(float(s["pixel_values"][-1]) == o + int(s["input_ids"][0]) for o, g in enumerate(got) for s in g)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"seconds": clock.seconds, "peak_mb": peak_mb,
                                                         "sent_mb": sent_mb}))
    transport.close()
    dist.destroy_process_group()


def one_run(world: int, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_main, args=(world, free_port(), args, mode, out_dir), nprocs=world)
        ranks = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(world)]
    seconds = {stage: max(r["seconds"][stage] for r in ranks) for stage in STAGES}
    return {"seconds": seconds, "peak_mb": max(r["peak_mb"] for r in ranks), "sent_mb": ranks[0]["sent_mb"]}


def summarize(world: int, mode: str, runs: list[dict], args: argparse.Namespace) -> dict:
    sent = runs[0]["sent_mb"]
    seconds = {stage: statistics.median(r["seconds"][stage] for r in runs) for stage in STAGES}
    total = statistics.median(sum(r["seconds"].values()) for r in runs)
    return {"W": world, "mode": mode, "samples_per_rank": args.samples, "mb_per_sample": args.mb,
            "sent_mb_per_rank": sent, "seconds": seconds, "total_s": total,
            "mb_per_s": {s: (sent / t if t > 1e-9 else None) for s, t in seconds.items()},
            "total_mb_per_s": sent / total, "peak_mb": statistics.median(r["peak_mb"] for r in runs),
            "repeats": len(runs)}


def markdown(rows: list[dict]) -> str:
    lines = ["| W | path | MB sent per rank | " + " | ".join(f"{s} s (MB/s)" for s in STAGES)
             + " | total s (MB/s) | peak RSS MB over samples |", "|---" * (5 + len(STAGES)) + "|"]
    for r in rows:
        cells = [f"{r['seconds'][s]:.3f} ({r['mb_per_s'][s]:,.0f})" if r["seconds"][s] > 1e-3 else "0"
                 for s in STAGES]
        lines.append(f"| {r['W']} | {r['mode']} | {r['sent_mb_per_rank']:.0f} | " + " | ".join(cells)
                     + f" | {r['total_s']:.2f} ({r['total_mb_per_s']:,.0f}) | {r['peak_mb']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--samples", type=int, default=150, help="samples each rank sends (and receives)")
    parser.add_argument("--mb", type=float, default=2.0, help="MiB of float32 pixel_values per sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "move_bytes.json")
    args = parser.parse_args(argv)
    rows = []
    for world in args.worlds:
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for repeat in range(args.repeats):
            for mode in (("before", "after") if repeat % 2 == 0 else ("after", "before")):
                runs[mode].append(one_run(world, mode, args))
        rows += [summarize(world, mode, runs[mode], args) for mode in ("before", "after")]
    print(markdown(rows))
    args.out.write_text(json.dumps(rows, indent=1))
    args.out.with_suffix(".md").write_text(markdown(rows) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
