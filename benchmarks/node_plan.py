"""Node-aware against global and rank-local planning on nodes of 8 ranks (issue 30), with `odb plan`'s own figures.

    python -m benchmarks.node_plan                      # 8x8 and 32x8 on 200,000 samples, 128x8 on 1,000,000
    python -m benchmarks.node_plan --cells 8x8:20000    # a quick look

Each cell runs `odb_core.plan_report.node_columns` (what `odb plan --nproc-per-node 8 --json` prints): the three
planning modes on the same per-rank streams (`shard`, the loader's own sampler), budget 16,384, padded cost, every
other setting the default (window 4096, join, seed 0). With 4096-sample windows and <= 3,125 samples per rank each
cell's epoch is one round, so "per round" is "per epoch" here. Columns per mode: budget utilization (real tokens /
(steps x W x budget)), against the offline oracle (`benchmarks.lib.oracle`, a global sort + greedy over every
length: tokens / (groups x budget)) and against global planning, steps, IDLE fraction, step-cost imbalance (mean
CV of a step's rank costs), the moved fractions within and across nodes, and per rank per round the planning
metadata received (int64 all_gathers; the per-step all_reduce, 48 B per step in every mode, left out) and the
process-CPU seconds of the plan one rank computes (node-aware: its node's; global: the whole pool's; rank-local:
its own buffer's). The seconds are measured on this machine's shared cores: compare them within a cell.

Profiles: the ShareGPT whole-conversation profile (`real_lengths.sharegpt_whole`, clipped to [16, 8192],
resampled with replacement) when benchmarks/.venv-ref has it; otherwise its stand-in, a lognormal with the
profile's mean and CV (1473, 0.57) clipped to [16, 8192] (`workloads.lognormal`). MM-Mix-like: the bimodal VLM
lengths of the peer comparison (`workloads.bimodal`). Steps (bound): global, ceil(oracle groups / W), the fewest steps of
any plan made of the oracle's groups; node-aware, max over nodes of ceil(oracle groups of the node / 8), the fewest
of any plan that keeps every sample on its node and packs each node with the oracle's greedy. Writes <out>/node_plan.{json,md} (default
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from benchmarks import RESULTS
from benchmarks.data import real_lengths, workloads
from benchmarks.lib.oracle import oracle_steps
from odb_core.data.sharding import shard
from odb_core.plan_report import StepTimeModel, node_columns
from odb_core.settings.config import ODBConfig

BUDGET = 16384
PER_NODE = 8
CELLS = ((8, 200_000), (32, 200_000), (128, 1_000_000))  # (nodes, samples)
SHAREGPT_STAND_IN = {"mean": 1473.0, "cv": 0.57}  # the clipped profile's figures (docs/benchmarks.md)


def sharegpt(n: int) -> tuple[list[int], str]:
    """`n` lengths of the ShareGPT whole-conversation profile, or of its lognormal stand-in, and which."""
    real = real_lengths.sharegpt_whole(*real_lengths.PROFILE_CLIP) if real_lengths.REF_PYTHON.exists() else None
    if real is not None:
        return np.random.default_rng(real_lengths.RESAMPLE_SEED).choice(real, n).tolist(), "ShareGPT whole (real)"
    return workloads.lognormal(n, SHAREGPT_STAND_IN["cv"], SHAREGPT_STAND_IN["mean"]), \
        "ShareGPT stand-in (lognormal mean 1473, CV 0.57, [16, 8192])"


def profile(name: str, n: int) -> tuple[list[int], str]:
    if name == "sharegpt":
        return sharegpt(n)
    return workloads.bimodal(n), "MM-Mix-like (bimodal VLM lengths)"


OPTIONS: dict[str, object] = {}  # ODBConfig fields from the command line (--pool-window)


def cell(lengths: list[int], nodes: int) -> dict:
    """The three modes at W = nodes x PER_NODE on these lengths, with the oracle's utilization."""
    world, groups = nodes * PER_NODE, oracle_steps(lengths, BUDGET)
    oracle = sum(lengths) / (groups * BUDGET)
    streams = shard(lengths, world, 0)  # the streams node_columns plans (seed 0)
    node_groups = [oracle_steps([it.length for r in range(n * PER_NODE, (n + 1) * PER_NODE) for it in streams[r]],
                                BUDGET) for n in range(nodes)]
    start = time.perf_counter()
    columns = node_columns(lengths, ODBConfig(token_budget=BUDGET, **OPTIONS), world, StepTimeModel(), PER_NODE)
    row = {"nodes": nodes, "per_node": PER_NODE, "samples": len(lengths), "oracle": oracle,
           "dealt_oracle": sum(lengths) / (math.ceil(groups / world) * world * BUDGET),
           "global_bound_steps": math.ceil(groups / world),
           "node_bound_steps": max(math.ceil(g / PER_NODE) for g in node_groups),
           "seconds": round(time.perf_counter() - start, 1)}
    global_utilization = columns[1][0].budget_utilization
    for report, costs in columns:
        row[report.planning] = {
            "utilization": report.budget_utilization, "vs_oracle": report.budget_utilization / oracle,
            "vs_global": report.budget_utilization / global_utilization, "steps": report.steps,
            "idle_fraction": report.idle_fraction, "imbalance": report.mean_rank_imbalance, "rounds": report.rounds,
            "moved_within": costs.moved_within_fraction, "moved_across": costs.moved_across_fraction,
            "metadata_bytes": costs.metadata_bytes_per_round, "plan_seconds": costs.plan_seconds_per_round}
    return row


MODES = (("node", "node-aware"), ("global", "global"), ("local", "rank-local"))


def markdown(result: dict) -> str:
    lines = [f"# Node-aware planning (`{result['command']}`)", "",
             "| profile | nodes x ranks | samples | mode | utilization | / oracle | / global | steps (bound) | IDLE | "
             "imbalance | moved within | moved across | metadata B/rank/round | plan s/rank/round |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        bounds = {"node": r["node_bound_steps"], "global": r["global_bound_steps"]}
        for key, label in MODES:
            m = r[key]
            steps = f"{m['steps']} ({bounds[key]})" if key in bounds else str(m["steps"])
            lines.append(f"| {r['profile']} | {r['nodes']}x{r['per_node']} | {r['samples']:,} | {label} | "
                         f"{m['utilization']:.4f} | {m['vs_oracle']:.3f} | {m['vs_global']:.4f} | {steps} | "
                         f"{m['idle_fraction']:.4f} | {m['imbalance']:.3f} | {m['moved_within']:.3f} | "
                         f"{m['moved_across']:.3f} | {m['metadata_bytes']:,.0f} | {m['plan_seconds']:.4f} |")
    return "\n".join(lines) + "\n"


def parse_cells(text: str) -> list[tuple[int, int]]:
    """`8x8:200000,32x8:200000`: nodes x ranks per node (8) : samples."""
    out = []
    for part in text.split(","):
        shape, samples = part.split(":")
        nodes, per_node = (int(x) for x in shape.split("x"))
        if per_node != PER_NODE:
            raise SystemExit(f"{part}: this benchmark runs {PER_NODE} ranks per node")
        out.append((nodes, int(samples)))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(f"{n}x{PER_NODE}:{s}" for n, s in CELLS))
    p.add_argument("--profiles", default="sharegpt,mm_mix")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--pool-window", default="default", help="ODBConfig.pool_window: an int, none, or the default")
    args = p.parse_args(argv)
    OPTIONS.clear()
    if args.pool_window != "default":
        OPTIONS["pool_window"] = None if args.pool_window == "none" else int(args.pool_window)
    rows = []
    for name in args.profiles.split(","):
        for nodes, samples in parse_cells(args.cells):
            lengths, label = profile(name, samples)
            rows.append({"profile": label, **cell(lengths, nodes)})
            r = rows[-1]
            print(f"{label} {nodes}x{PER_NODE} {samples}: " + "  ".join(
                f"{key} {r[key]['utilization']:.4f} ({r[key]['vs_global']:.4f} x global)" for key, _ in MODES)
                + f" [{r['seconds']} s]", flush=True)
    command = "python -m benchmarks.node_plan --cells " + args.cells + (
        f" --pool-window {args.pool_window}" if args.pool_window != "default" else "")
    result = {"command": command, "token_budget": BUDGET, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "node_plan.json").write_text(json.dumps(result, indent=1))
    (args.out / "node_plan.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
