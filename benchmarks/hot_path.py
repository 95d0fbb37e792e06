"""The loader's hot path: ODB against a plain DataLoader, side by side in one process, on three real shapes.

    python -m benchmarks.hot_path [--workers 0,2,4] [--repeats 5] [--samples 4000] [--rss] [--step-ms 0,4]
                                  [--cost padded] [--trivial-samples 20000]

Datasets (map-style, what trainers feed):
  * `trivial`: 20,000 in-memory samples of 64 tokens (`torch.full`; `--trivial-samples`): the loader machinery alone;
  * `arrow`: a pre-tokenized HF `datasets.Dataset` of ChitChat conversations (DeepSeek tokenizer, lists of ids),
    what LLaMA-Factory and TRL users load; read with `__getitems__` by both loaders;
  * `tokenize`: the same conversations as raw turns, templated and tokenized in `__getitem__`.
Plain = `DataLoader(batch_size=16)`; ODB = `ODBDataLoader(token_budget=16 x mean length)` with its defaults
(`cost="padded"`, the cost of a padding collator; `prefetch_steps=0`: planned in the caller's thread), and
`odb_thread` the same with a background producer thread `prefetch_steps=2` ahead (the default before the
measurements in docs/benchmarks.md); both collate with `odb_core.PadCollator` (padded tensors and an attention
mask), except `trivial`, where plain keeps `default_collate` (what `DataLoader(batch_size=B)` does). `--cost
tokens` gives batches of about 16 samples, as the runs before did, but pads the long groups' short top-ups (59% of
the slots on `arrow`): that cost suits padding-free collators, not `PadCollator`. On `arrow` a fourth loader,
`plain_arrays`, is the plain one reading the same numpy view of the table that ODB reads (NOTE [ Arrow ids read
as arrays ]), so that ODB's own work is also measured without the view's gain. Every repeat
runs one epoch of each, back to back; samples/s is the median over repeats, the ratio the median of the
per-repeat ratios. ODB's own work per sample = 1 / ODB's rate - 1 / plain's rate: the time ODB adds beyond reading
and collating the same samples; and, less sensitive to a loaded machine, the trainer process's CPU time per sample
(all its threads, no worker process; best of the repeats) of each loader and their difference. `--step-ms 4`
puts a simulated GPU step (`Step`) between batches. `--rss` measures peak RSS of one epoch of each in a fresh
process, and ODB's extra RSS on a 200,000-sample epoch of `trivial`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from benchmarks import RESULTS
from benchmarks.lib.hot_path_loaders import (BATCH, SEQ, LengthSorted, Step, build, epoch_rate, loader_options,
                                             loaders)
from odb_core import PadCollator
from odb_core.data.sources import arrow_arrays, integer_columns


def median_ratio(rates: list[float], baseline: list[float]) -> float:
    """Median of the per-repeat ratios (each repeat ran both loaders back to back)."""
    return round(statistics.median([r / b for r, b in zip(rates, baseline, strict=True)]), 3)


def compare(name: str, workers: int, repeats: int, samples: int, step_ms: float = 0.0, cost: str = "padded",
            trivial_samples: int = 20_000) -> dict:
    dataset, mean = build(name, samples, trivial_samples)
    step = Step(step_ms) if step_ms else None
    plain, odb = loaders(name, dataset, mean, workers, cost=cost)
    _, thread = loaders(name, dataset, mean, workers, prefetch_steps=2, cost=cost)
    runs = [("plain", plain, lambda b: b["input_ids"].shape[0]), ("odb", odb, lambda b: b.info.local_samples),
            ("odb_thread", thread, lambda b: b.info.local_samples)]
    if name == "trivial" and not workers:
        runs.append(("length_sorted", LengthSorted(dataset), lambda b: b["input_ids"].shape[0]))
    if name == "arrow":  # a plain loader reading the Arrow ids as arrays too (what ODB reads, NOTE [ Arrow ids ...])
        view = arrow_arrays(dataset, integer_columns(dataset))
        runs.append(("plain_arrays", DataLoader(view, batch_size=BATCH, collate_fn=PadCollator(),
                                                **loader_options(workers)),
                     lambda b: b["input_ids"].shape[0]))
    rates: dict[str, list[float]] = {which: [] for which, _, _ in runs}
    cpu: dict[str, list[float]] = {which: [] for which, _, _ in runs}
    full: dict[str, int] = dict.fromkeys(rates, 0)
    for _ in range(repeats):
        for which, loader, count in runs:
            rate, us, collections = epoch_rate(loader, count, step)
            rates[which].append(rate)
            cpu[which].append(us)
            full[which] += collections
    odb.close()
    thread.close()
    plain_sps, odb_sps = statistics.median(rates["plain"]), statistics.median(rates["odb"])
    ratios = [o / p for o, p in zip(rates["odb"], rates["plain"], strict=True)]
    plain_cpu, odb_cpu = min(cpu["plain"]), min(cpu["odb"])
    row = {"dataset": name, "workers": workers, "step_ms": step_ms, "cost": cost, "samples": len(dataset),
            "plain_samples_per_s": round(plain_sps),
            "odb_samples_per_s": round(odb_sps), "ratio": median_ratio(rates["odb"], rates["plain"]),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "odb_own_us_per_sample": round(1e6 * (1 / odb_sps - 1 / plain_sps), 1),
            "thread_ratio": median_ratio(rates["odb_thread"], rates["plain"]),
            "trainer_cpu_us_per_sample": {which: round(min(us), 1) for which, us in cpu.items()},
            "odb_own_cpu_us_per_sample": round(odb_cpu - plain_cpu, 1),
            "odb_thread_own_cpu_us_per_sample": round(min(cpu["odb_thread"]) - plain_cpu, 1),
            "odb_own_cpu_us_per_sample_median": round(statistics.median(cpu["odb"]) - statistics.median(cpu["plain"]),
                                                      1),
            "full_collections_per_epoch": {which: round(k / repeats, 2) for which, k in full.items()}}
    if "length_sorted" in rates:
        row.update(length_sorted_samples_per_s=round(statistics.median(rates["length_sorted"])),
                   length_sorted_ratio=median_ratio(rates["length_sorted"], rates["plain"]))
    if "plain_arrays" in rates:
        arrays_sps = statistics.median(rates["plain_arrays"])
        row.update(plain_arrays_samples_per_s=round(arrays_sps),
                   ratio_vs_plain_arrays=median_ratio(rates["odb"], rates["plain_arrays"]),
                   odb_own_cpu_us_vs_plain_arrays=round(odb_cpu - min(cpu["plain_arrays"]), 1))
    return row


def peak_rss_mb(which: str, name: str, n: int) -> float:
    """Extra peak RSS of one epoch of `which` loader in a fresh process: the peak during the epoch (VmHWM, reset
    after the set-up through /proc/self/clear_refs) minus the resident size before it, in MiB. The set-up's freed
    memory is handed back to the system first (`malloc_trim`), so that the epoch cannot reuse it unseen."""
    code = ("import ctypes, gc; from benchmarks.lib.hot_path_loaders import Trivial, build, loaders, proc_status_kib; "
            f"ds, mean = (Trivial({n}), {SEQ}) if '{name}' == 'trivial' else build('{name}', {n}); "
            f"plain, odb = loaders('{name}', ds, mean, 0); loader = {which}; "
            "gc.collect(); ctypes.CDLL('libc.so.6').malloc_trim(0); "
            "open('/proc/self/clear_refs', 'w').write('5'); before = proc_status_kib('VmRSS'); "
            "[None for _ in loader]; print(proc_status_kib('VmHWM') - before)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    return int(done.stdout.strip().splitlines()[-1]) / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="trivial,arrow,tokenize")
    parser.add_argument("--workers", default="0,2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4000, help="conversations for arrow/tokenize")
    parser.add_argument("--trivial-samples", type=int, default=20_000, help="samples of `trivial`")
    parser.add_argument("--rss", action="store_true")
    parser.add_argument("--cost", default="padded", choices=["padded", "tokens"], help="ODB's cost model")
    parser.add_argument("--step-ms", default="0", help="comma-separated simulated step lengths (see `Step`)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hot_path.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in filter(None, args.datasets.split(",")):  # --datasets "": the --rss part alone
        for workers in (int(w) for w in args.workers.split(",")):
            for step_ms in (float(ms) for ms in args.step_ms.split(",")):
                rows.append(compare(name, workers, args.repeats, args.samples, step_ms, args.cost,
                                    args.trivial_samples))
                print(json.dumps(rows[-1]), flush=True)
    result = {"rows": rows, "command": " ".join(["python -m benchmarks.hot_path", *(argv or sys.argv[1:])])}
    if args.rss:
        result["rss_mb"] = {f"{which}_{name}_{n}": round(peak_rss_mb(which, name, n), 1)
                            for name, n in (("trivial", 200_000), ("arrow", args.samples))
                            for which in ("plain", "odb")}
        print(json.dumps(result["rss_mb"]), flush=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
