"""The runs of `python -m benchmarks.overlap` (issue 27): every loader of a workload on W ranks, and their rows.

At W = 1 the loaders run in this process (no process group: ODB plans alone). At W > 1, `run_world` starts W
processes with `torch.multiprocessing.spawn` that join a real Gloo group on 127.0.0.1 (a free port), each with its
own DataLoader workers (forked from the rank), and every rank runs the same loaders in the same order, each after
a barrier. Plain reads its rank's share through a `DistributedSampler` (shuffled, seed 0; it repeats a few
samples so that every rank gets as many), ODB shards and shuffles by itself (`shuffle=True`). The dataset is
touched once in each rank before its loaders are built, so forked workers inherit a loaded tokenizer or
processor and the first batch measures the loader, not that one-time load.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.data import feeding
from benchmarks.lib.accelerator import RankRun, Step, aggregate, drive
from benchmarks.lib.localhost import free_port
from benchmarks.lib.round_model import bound
from benchmarks.lib.timeline import TimedFetches, fetch_spans, rank_timeline, world_timeline
from odb_core import ODBConfig, ODBDataLoader, PadCollator

WORKER_CONTEXT = "fork"  # what a torchrun rank's DataLoader gets on Linux


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """One workload's runs: its dataset, what was measured of it first, and the loaders to run on each rank."""

    workload: str
    samples: int
    process_ms: float  # the sleep workload's wait per sample
    payload_kb: int = 0  # the sleep workload's KiB of pixel_values per sample
    folder: str  # where `feeding.prepare` put the workload's files
    budget: int
    fixed_batch: int  # plain's batch: the largest that fits the longest sample under the budget
    process_s: float  # seconds of processing per sample, measured in one process
    nominal_process_s: float | None = None  # the sleep workload's wait alone (`feeding.nominal_seconds`)
    workers: int  # DataLoader workers per rank
    windows: tuple[int, ...]
    plannings: tuple[str, ...]
    odb_options: dict = field(default_factory=dict)
    step: Step = field(default_factory=Step)
    timeline_dir: str | None = None  # with a folder: the runs' timelines (benchmarks/lib/timeline.py)


@dataclass(frozen=True, slots=True)
class LoaderSpec:
    name: str
    planning: str | None = None  # None: plain
    window: int | None = None


def loader_specs(setup: Setup, world: int) -> list[LoaderSpec]:
    """Plain, then ODB per planning and window; at W = 1 both plannings are the same, so only the first runs."""
    suffix = "".join(f" {k}={v}" for k, v in setup.odb_options.items())
    plannings = setup.plannings if world > 1 else setup.plannings[:1]
    return [LoaderSpec("plain")] + [LoaderSpec(f"odb window {w}{suffix}", p, w) for p in plannings
                                    for w in setup.windows]


def build_loader(spec: LoaderSpec, dataset, setup: Setup, rank: int, world: int):
    if spec.planning is None:
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
        return torch.utils.data.DataLoader(dataset, batch_size=setup.fixed_batch, sampler=sampler,
                                           num_workers=setup.workers, collate_fn=PadCollator(),
                                           multiprocessing_context=WORKER_CONTEXT if setup.workers else None)
    options = {"multiprocessing_context": WORKER_CONTEXT} if setup.workers else {}
    return ODBDataLoader(dataset, token_budget=setup.budget, num_workers=setup.workers, shuffle=True,
                         window=spec.window, planning=spec.planning, **options, **setup.odb_options)


def run_rank(setups: list[Setup], rank: int, world: int) -> list[list[dict]]:
    """Every loader of every setup on this rank: per setup, one `RankRun` (as a dict) per loader spec."""
    out = []
    for k, setup in enumerate(setups):
        dataset = feeding.build(setup.workload, setup.samples, setup.process_ms, Path(setup.folder), setup.payload_kb)
        dataset[0]  # load the tokenizer / processor once, before the workers fork
        runs = []
        for j, spec in enumerate(loader_specs(setup, world)):
            timed = None if setup.timeline_dir is None else Path(setup.timeline_dir, f"{k}-{j}", f"rank{rank}")
            if timed is not None:
                timed.mkdir(parents=True)
            read = dataset if timed is None else TimedFetches(dataset, str(timed))
            loader = build_loader(spec, read, setup, rank, world)
            if world > 1:
                dist.barrier()
            run = drive(loader, setup.step, rank, timeline=timed is not None)
            figures = {**asdict(run), "step_at": ()}
            report = getattr(loader, "last_report", None)  # ODB's: what its waits point to (NOTE [ Which lever ])
            figures["advice"] = dict(report.advice) if report is not None else {}
            if timed is not None:
                figures["timeline"] = rank_timeline(fetch_spans(timed), list(run.step_at), run.started_at,
                                                    run.started_at + run.wall_s)
            runs.append(figures)
            if isinstance(loader, ODBDataLoader):
                loader.close()
            del loader
        out.append(runs)
    return out


def _spawned_rank(rank: int, world: int, port: int, setups: list[Setup], folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores, knowingly
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(run_rank(setups, rank, world)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def rank_runs(setups: list[Setup], world: int) -> list[list[list[dict]]]:
    """Per rank, `run_rank`'s result: in this process at W = 1, else on W spawned Gloo ranks."""
    if world == 1:
        return [run_rank(setups, 0, 1)]
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_spawned_rank, args=(world, port, setups, folder), nprocs=world, join=True)
        return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]


def run_world(setups: list[Setup], world: int) -> list[dict]:
    """One row per setup x loader at W = `world`: the figures over the ranks, each rank's, and for ODB whether
    the ranks together trained every sample exactly once."""
    ranks = rank_runs(setups, world)
    rows = []
    for k, setup in enumerate(setups):
        plain_rate = None
        for j, spec in enumerate(loader_specs(setup, world)):
            timelines = [r[k][j].pop("timeline") for r in ranks if "timeline" in r[k][j]]
            advice = [r[k][j].pop("advice") for r in ranks]
            runs = [RankRun(**{**r[k][j], "indices": tuple(r[k][j]["indices"]), "step_s": tuple(r[k][j]["step_s"])})
                    for r in ranks]
            figures = aggregate(runs, setup.workers, setup.process_s, setup.nominal_process_s)
            plain_rate = plain_rate or figures.samples_per_s
            allowed = None if spec.planning is None else round_bound(setup, spec, figures)
            rows.append({"workload": setup.workload, "loader": spec.name, "bound": allowed,
                         "planning": spec.planning if world > 1 or spec.planning is None else "any",
                         "window": spec.window, "workers_per_rank": setup.workers, "process_ms": setup.process_ms,
                         "payload_kb": setup.payload_kb,
                         "process_s": setup.process_s, "nominal_process_s": setup.nominal_process_s,
                         "fixed_batch": setup.fixed_batch, "budget": setup.budget,
                         "odb_options": setup.odb_options, **figures.row(),
                         "vs_plain": figures.samples_per_s / plain_rate,
                         "each_once": None if spec.planning is None else each_once(runs, setup.samples),
                         "per_rank": [per_rank(r) for r in runs], "advice": advice,
                         "timeline": world_timeline(timelines) if timelines else None})
    return rows


def round_bound(setup: Setup, spec: LoaderSpec, figures) -> float:
    """The efficiency ODB's round sizes allow one rank (benchmarks/lib/round_model.py) at this row's supply and
    demand per rank and samples per rank."""
    world = figures.world_size
    options = {k: setup.odb_options[k] for k in ("min_window", "round_growth", "pool_window")
               if k in setup.odb_options}
    planning = "local" if spec.planning == "local" else "global"
    config = ODBConfig(token_budget=setup.budget, window=spec.window, planning=planning, **options)
    return bound(setup.samples // world, figures.supply / world, figures.demand / world,
                 config.rounds_for_pool(world))  # a rank's rounds: NOTE [ Pooled round sizes ]


def per_rank(run: RankRun) -> dict:
    """A rank's figures for the JSON (its indices and step seconds left out)."""
    return {**{k: v for k, v in asdict(run).items() if k not in ("indices", "step_s", "step_at")}, "busy": run.busy,
            "samples_per_s": run.samples / run.wall_s}


def each_once(runs: list[RankRun], samples: int) -> bool:
    """Whether the ranks' indices together are every index of the dataset, each once."""
    seen = Counter(i for r in runs for i in r.indices)
    return len(seen) == samples and set(seen.values()) == {1} and set(seen) == set(range(samples))
