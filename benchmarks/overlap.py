"""Keeping the accelerator fed (issue 27): ODB against a plain padded DataLoader on 1, 2 and 4 real Gloo ranks,
with a simulated device step (benchmarks/lib/accelerator.py) and workers that do each workload's processing
(benchmarks/data/feeding.py: `sleep`, a GIL-free wait of --process-ms per sample; `tokenize`, real ChitChat
tokenization; `vlm`, the MM-Mix-like pipeline with real image processing).

    python -m benchmarks.overlap                     # the tables of docs/benchmarks.md
    python -m benchmarks.overlap --workloads sleep --worlds 1 --process-ms 6 --samples 2000 --windows 4096 512
    python -m benchmarks.overlap --worlds 2 --odb-option window=512 --odb-option min_window=256

Plain is a padded `DataLoader` with the largest fixed batch that fits the longest sample under the budget, as a
user without ODB would size it, over a `DistributedSampler`. Both loaders read the same samples with the same
workers per rank (--workers: one count per --worlds entry, or one for all). The seconds of processing per sample
of `tokenize` and `vlm` (for the supply) are measured in this process before the runs (--timing-samples).
`--odb-option key=value` (repeatable; ints, floats, true/false and none are parsed) goes to every ODBDataLoader;
a `window` given that way replaces --windows. `--host-copy` makes each simulated step first read the batch's bytes
into a staging buffer, as a real step's copy to the device does (docs/benchmarks.md, "Where the VLM rows' gap lies
on two cores"). `--timeline` also times every worker fetch and every step, and adds a second table: when the
workers read, how busy they were in between, and where the device's gaps fall (benchmarks/lib/timeline.py).
Writes Markdown tables to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from benchmarks import RESULTS
from benchmarks.data import feeding
from benchmarks.lib.accelerator import Step
from benchmarks.lib.odb_options import parse_options
from benchmarks.lib.overlap_runs import Setup, run_world

DEFAULT_WINDOWS = (4096, 512)
COLUMNS = ("workload", "W", "planning", "loader", "samples/s", "vs plain", "busy", "data wait (reading / exchange)",
           "sync", "machine CPU", "efficiency", "nominal", "bound", "first batch s", "training CPU s",
           "peak RSS MB rank / worker", "supply", "demand", "advice (per rank)")


def measured_setups(args: argparse.Namespace, folder: Path) -> list[dict]:
    """Per workload (and per --process-ms for sleep), what the runs need to know first: plain's fixed batch (from
    the longest processed sample) and the processing seconds per sample."""
    out = []
    for workload in args.workloads:
        feeding.prepare(workload, folder)
        for ms in args.process_ms if workload == "sleep" else [0.0]:
            payload = args.payload_kb if workload == "sleep" else 0
            dataset = feeding.build(workload, args.samples, ms, folder, payload)
            longest = max(feeding.lengths(workload, dataset))
            out.append({"workload": workload, "samples": args.samples, "process_ms": ms, "folder": str(folder),
                        "payload_kb": payload,
                        "budget": args.budget, "fixed_batch": max(args.budget // longest, 1),
                        "process_s": feeding.process_seconds(dataset, args.timing_samples),
                        "nominal_process_s": feeding.nominal_seconds(dataset)})
    return out


def windows_and_options(args: argparse.Namespace) -> tuple[tuple[int, ...], dict]:
    options = parse_options(args.odb_option)
    if "window" in options:
        if args.windows is not None:
            raise SystemExit("give the window once: --windows or --odb-option window=...")
        return (options.pop("window"),), options
    return tuple(args.windows or DEFAULT_WINDOWS), options


def optional(value: float | None) -> str:
    return "-" if value is None else format(value, ".2f")


def wait_parts(row: dict) -> str:
    """ODB's data wait with its reading and exchange parts: "0.17 (0.10 / 0.01)"; "-" for plain."""
    if row.get("data_wait") is None:
        return "-"
    if row.get("reading") is None:  # a row of a JSON written before the parts were measured
        return optional(row["data_wait"])
    return f"{row['data_wait']:.2f} ({row['reading']:.2f} / {optional(row.get('exchange'))})"


def workload_label(row: dict) -> str:
    """A row's workload as the tables name it: "sleep 2 ms", "sleep 2 ms + 1024 KiB", "vlm"."""
    label = f"sleep {row['process_ms']:g} ms" if row["workload"] == "sleep" else row["workload"]
    return label + (f" + {row['payload_kb']} KiB" if row.get("payload_kb") else "")


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append(f"| {workload_label(r)} | {r['world_size']} | {r['planning'] or '-'} | {r['loader']} | "
                     f"{r['samples_per_s']:.0f} | {r['vs_plain']:.2f} | {r['busy']:.2f} | "
                     f"{wait_parts(r)} | {r['sync']:.2f} | {optional(r.get('machine_cpu'))} | "
                     f"{r['efficiency']:.2f} | {optional(r.get('nominal_efficiency'))} | "
                     f"{optional(r['bound'])} | "
                     f"{r['first_batch_s']:.2f} | {r['cpu_s']:.1f} | {r['rss_mb']:.0f} / {r['worker_rss_mb']:.0f} | "
                     f"{r['supply']:.0f} | {r['demand']:.0f} | {advice_cases(r)} |")
    return "\n".join(lines)


def advice_cases(row: dict) -> str:
    """The cases ODB's waits pointed to on each rank (NOTE [ Which lever ]), " / " between ranks, "-" for a rank that
    named none (plain names none: "-" on each rank)."""
    per_rank = row.get("advice") or []
    return " / ".join(", ".join(sorted(advice)) or "-" for advice in per_rank) or "-"


TIMELINE_COLUMNS = ("workload", "W", "planning", "loader", "first fetch s", "last read s (latest)", "workers busy",
                    "worker CPU ms per sample (share of a core)", "after last read s",
                    "gaps between steps s (at round boundaries)", "wall s (slowest rank)")


def worker_cpu(timeline: dict) -> str:
    """The workers' CPU ms per sample and their share of a core, as "2.41 (0.93)"; "-" for a timeline without."""
    if "worker_cpu_ms_per_sample" not in timeline:
        return "-"
    return f"{timeline['worker_cpu_ms_per_sample']:.2f} ({timeline['worker_cpu_share']:.2f})"


def timeline_markdown(rows: list[dict]) -> str:
    """The rows' timelines (means over ranks; the wall time is the slowest rank's), for the runs that recorded
    one."""
    lines = ["| " + " | ".join(TIMELINE_COLUMNS) + " |", "|" + "---|" * len(TIMELINE_COLUMNS)]
    for r in rows:
        t = r.get("timeline")
        if t is None:
            continue
        lines.append(f"| {workload_label(r)} | {r['world_size']} | {r['planning'] or '-'} | {r['loader']} | "
                     f"{t['first_fetch_s']:.2f} | {t['last_read_s']:.2f} ({t['latest_last_read_s']:.2f}) | "
                     f"{t['workers_busy']:.3f} | {worker_cpu(t)} | {t['after_last_read_s']:.2f} | "
                     f"{t['gaps_s']:.2f} ({t['boundary_gaps_s']:.2f}) | {r['wall_s']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--workloads", nargs="+", choices=feeding.WORKLOADS, default=list(feeding.WORKLOADS))
    parser.add_argument("--process-ms", type=float, nargs="+", default=[2.0, 6.0], help="the sleep workload's")
    parser.add_argument("--payload-kb", type=int, default=0, help="the sleep workload's pixel_values per sample")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workers", type=int, nargs="+", default=None,
                        help="per rank: one count, or one per --worlds entry (default 4 // W, at least 1)")
    parser.add_argument("--plannings", nargs="+", choices=["global", "local"], default=["global", "local"])
    parser.add_argument("--windows", type=int, nargs="+", default=None, help="ODB buffer sizes (4096 512)")
    parser.add_argument("--odb-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--step-us-per-token", type=float, default=1.5)
    parser.add_argument("--no-step-sync", action="store_true", help="no per-step all_reduce between ranks")
    parser.add_argument("--host-copy", action="store_true",
                        help="each step first copies the batch's bytes into a staging buffer (the host's part of the "
                             "copy to a device; benchmarks/lib/accelerator.py)")
    parser.add_argument("--timing-samples", type=int, default=200)
    parser.add_argument("--timeline", action="store_true",
                        help="time every worker fetch and every step: a second table (benchmarks/lib/timeline.py)")
    parser.add_argument("--out", default=str(RESULTS / "overlap.json"))
    args = parser.parse_args(argv)
    counts = args.workers or [max(4 // w, 1) for w in args.worlds]
    if len(counts) not in (1, len(args.worlds)):
        parser.error("--workers: one count, or one per --worlds entry")
    workers = dict(zip(args.worlds, counts * len(args.worlds) if len(counts) == 1 else counts))
    windows, options = windows_and_options(args)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores, knowingly
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the W = 1 runs fork workers from this process
    torch.set_num_threads(1)
    step = Step(us_per_token=args.step_us_per_token, sync=not args.no_step_sync, host_copy=args.host_copy)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        measured = measured_setups(args, Path(folder))
        for n, world in enumerate(args.worlds):
            timeline_dir = str(Path(folder, f"timeline-{n}-w{world}")) if args.timeline else None
            setups = [Setup(**m, workers=workers[world], windows=windows, plannings=tuple(args.plannings),
                            odb_options=options, step=step, timeline_dir=timeline_dir) for m in measured]
            rows += run_world(setups, world)
            print(markdown([r for r in rows if r["world_size"] == world]) + "\n", flush=True)
            if args.timeline:
                print(timeline_markdown([r for r in rows if r["world_size"] == world]) + "\n", flush=True)
    command = " ".join(["python -m benchmarks.overlap", *(sys.argv[1:] if argv is None else argv)])
    Path(args.out).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
