"""Loader alignment cost against W: bytes and latency of the metadata collectives per round.

Setup: every rank holds the same number of samples (lognormal CV 1.0 lengths, mean 128, <= 1024), `L_max` 2048,
window 128, so an epoch runs several rounds. Three sources, one table:
  * `virtual`: the real `ODBDataLoader` on W threads of one process (`VirtualTransport`: the same round logic and
    collectives as Gloo), 2 <= W <= 16 (at W = 1 nothing is exchanged); latency is the wall time spent inside the collectives (it includes waiting for
    the slowest rank's planning);
  * `gloo`: the real loader in W processes over a real Gloo group (mp.spawn), W = 2 and 4;
  * `simulated`: `odb_core.simulate` (what `odb plan` runs) counts the integers for large W; no latency.
Bytes: what one rank sends per round (its own vectors) and receives per round (every rank's gathered state plus
the reduced step vector). The reference release gathers `2 + buffer_size` int64 from every rank per round
(`odb/grouping.py`, one `all_gather_into_tensor`), i.e. W x (2 + buffer_size) x 8 bytes received per rank.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.data.workloads import LengthsDataset, lognormal
from odb_core import ODBConfig, ODBDataLoader, VirtualHub, VirtualTransport, simulate_epoch
from odb_core.cli import shard
from odb_core.step_info import STEP_SUM_FIELDS
from odb_core.termination import STATE_FIELDS

PER_RANK = 512
L_MAX = 2048
WINDOW = 128
REF_BUFFERS = (8, 512)


def _lengths(world: int) -> list[int]:
    return lognormal(PER_RANK * world, 1.0, mean=128.0, lo=8, hi=1024, seed=world)


def _collate(samples: list[dict]) -> dict:
    return {"input_ids": [s["input_ids"] for s in samples]}


def _loader(lengths: list[int], transport=None) -> ODBDataLoader:
    return ODBDataLoader(LengthsDataset(lengths), token_budget=L_MAX, window=WINDOW, shuffle=True,
                         transport=transport, prefetch_steps=0, collate_fn=_collate)


def _rank_facts(loader: ODBDataLoader, steps: int, seconds: float) -> dict:
    stats = loader.transport.stats
    rounds = loader.last_report.rounds if loader.last_report is not None else 0
    return {"steps": steps, "rounds": rounds, "calls": stats.calls, "bytes_sent": stats.bytes_sent,
            "collective_seconds": stats.seconds, "epoch_seconds": seconds}


def _summary(world: int, source: str, ranks: list[dict], received_per_round: float) -> dict:
    rounds = ranks[0]["rounds"]
    return {"world_size": world, "source": source, "rounds": rounds, "steps": ranks[0]["steps"],
            "bytes_sent_per_round": ranks[0]["bytes_sent"] / rounds,
            "bytes_received_per_round": received_per_round,
            "latency_ms_per_round": 1e3 * statistics.median(r["collective_seconds"] for r in ranks) / rounds,
            "epoch_seconds": max(r["epoch_seconds"] for r in ranks)}


def _received(world: int, steps: int, rounds: int) -> float:
    """Bytes one rank receives per round: W gathered states + the reduced vector of the round's steps."""
    return 8 * (world * STATE_FIELDS + STEP_SUM_FIELDS * steps / rounds)


def virtual(world: int) -> dict:
    lengths = _lengths(world)
    hub = VirtualHub(world, timeout_s=300)
    facts: list[dict] = [{}] * world

    def rank_main(rank: int) -> None:
        loader = _loader(lengths, VirtualTransport(hub, rank))
        start = time.perf_counter()
        steps = sum(1 for _ in loader)
        facts[rank] = _rank_facts(loader, steps, time.perf_counter() - start)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _summary(world, "virtual", facts, _received(world, facts[0]["steps"], facts[0]["rounds"]))


def _gloo_rank(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        loader = _loader(_lengths(world))
        start = time.perf_counter()
        steps = sum(1 for _ in loader)
        facts = _rank_facts(loader, steps, time.perf_counter() - start)
        Path(folder, f"rank{rank}.json").write_text(json.dumps(facts))
    finally:
        dist.destroy_process_group()


def gloo(world: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_gloo_rank, args=(world, port, folder), nprocs=world, join=True)
        facts = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    return _summary(world, "gloo", facts, _received(world, facts[0]["steps"], facts[0]["rounds"]))


def simulated(world: int) -> dict:
    config = ODBConfig(token_budget=L_MAX, window=WINDOW)
    plan = simulate_epoch(shard(_lengths(world), world, config.seed), config)
    sent = 8 * (plan.rounds * STATE_FIELDS + STEP_SUM_FIELDS * plan.n_steps) / plan.rounds
    received = 8 * (plan.gathered_ints + plan.reduced_ints) / (world * plan.rounds)
    return {"world_size": world, "source": "simulated", "rounds": plan.rounds, "steps": plan.n_steps,
            "bytes_sent_per_round": sent, "bytes_received_per_round": received,
            "latency_ms_per_round": None, "epoch_seconds": None}


def reference_bytes(world: int) -> dict:
    """The reference release's per-round traffic from its source (no run needed): one all_gather of
    2 + buffer_size int64 per rank; a round per buffer_size new samples."""
    return {f"buffer{b}": {"bytes_sent_per_round": 8 * (2 + b), "bytes_received_per_round": 8 * world * (2 + b),
                           "rounds_per_epoch": -(-PER_RANK // b)} for b in REF_BUFFERS}


def run_alignment(virtual_worlds=(2, 4, 8, 16), gloo_worlds=(2, 4), simulated_worlds=(64, 256, 1024),
                  log=print) -> list[dict]:
    rows = []
    for world in virtual_worlds:
        rows.append(virtual(world))
        log(f"  alignment virtual W={world}: {rows[-1]['latency_ms_per_round']:.2f} ms/round")
    for world in gloo_worlds:
        rows.append(gloo(world))
        log(f"  alignment gloo W={world}: {rows[-1]['latency_ms_per_round']:.2f} ms/round")
    for world in simulated_worlds:
        rows.append(simulated(world))
        log(f"  alignment simulated W={world}: {rows[-1]['bytes_received_per_round']:.0f} B/round received")
    for row in rows:
        row["reference_release"] = reference_bytes(row["world_size"])
    return rows
