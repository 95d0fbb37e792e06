"""Budget utilization of ODB's real loader against the offline oracle (issue: odb_core benchmark).

Utilization = real tokens / (steps x W x L_max). The oracle is a global sort of all lengths, then a greedy fill
(W=1). Under skewed shards no per-rank method can beat the rank-constrained bound:
real tokens / (W x max_r oracle_steps(rank r's lengths) x L_max).

The W>1 runs use the real `ODBDataLoader` on W threads of one process with a `VirtualTransport` (the same round
logic and collectives as Gloo) and a `DistributedSampler` for the even case.

    python -m benchmarks.utilization [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torch.utils.data import DistributedSampler

from benchmarks.data.workloads import LengthsDataset, lognormal
from benchmarks.lib.oracle import oracle_steps
from odb_core import ODBDataLoader, run_virtual_ranks

L_MAX = 16384


def run_loaders(dataset: LengthsDataset, world: int, samplers: list | None) -> int:
    """Steps per rank of one epoch of W real loaders (threads over a VirtualHub); asserts equal counts."""

    def rank_main(rank: int, transport) -> int:
        loader = ODBDataLoader(dataset, token_budget=L_MAX, transport=transport,
                               sampler=samplers[rank] if samplers else None, prefetch_steps=0,
                               collate_fn=lambda samples: {"input_ids": [s["input_ids"] for s in samples]})
        return sum(1 for _ in loader)

    steps = run_virtual_ranks(rank_main, world, timeout_s=600)
    assert len(set(steps)) == 1, f"unequal step counts {steps}"
    return steps[0]


def measure(name: str, lengths: list[int], world: int, skewed: bool) -> dict:
    total = sum(lengths)
    if skewed:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        shards = [order[r * len(order) // world : (r + 1) * len(order) // world] for r in range(world)]
        samplers = [shard for shard in shards]  # a list of indices is a valid sampler
        bound_steps = max(oracle_steps([lengths[i] for i in shard], L_MAX) for shard in shards)
    else:
        samplers = [DistributedSampler(range(len(lengths)), num_replicas=world, rank=r, shuffle=True, seed=0)
                    for r in range(world)] if world > 1 else None
        bound_steps = oracle_steps(lengths, L_MAX) / world
    steps = run_loaders(LengthsDataset(lengths), world, samplers)
    odb = total / (steps * world * L_MAX)
    bound = total / (bound_steps * world * L_MAX)
    return {"workload": name, "world_size": world, "shards": "skewed" if skewed else "even", "odb_steps": steps,
            "odb_utilization": round(odb, 4), "reference_bound": round(bound, 4), "ratio": round(odb / bound, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=20_000)
    args = parser.parse_args()
    rows = []
    for cv in (0.5, 1.0):
        lengths = lognormal(args.samples, cv, seed=0)
        for world, skewed in ((1, False), (4, False), (2, True), (4, True)):
            rows.append(measure(f"lognormal CV {cv}", lengths, world, skewed))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| workload | W | shards | ODB utilization | bound (oracle or rank-constrained) | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['world_size']} | {r['shards']} | {r['odb_utilization']:.3f} | "
              f"{r['reference_bound']:.3f} | {r['ratio']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
