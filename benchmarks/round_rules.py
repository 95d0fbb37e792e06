"""Other rules of round sizes, what-if (issue 27): would a different `round_target` feed the device better?

    python -m benchmarks.round_rules                       # the sweep of docs/design.md, item 2
    python -m benchmarks.round_rules --per-rank 1200 6000 --worlds 1 --ratios 0.92 3
    python -m benchmarks.round_rules --worlds 8 64 --plannings global --per-rank 1000 4000 --pool-window 8192

The loader's rounds trade two costs (NOTE [ Round sizes ], docs/design.md item 2): a round trains only once all of
it is read, so large rounds keep the device waiting where the workers are about as fast as it (S ~ D); small rounds
pack less tightly, so the device has more steps to train where it is the bound. This sweep puts candidate rules
side by side on both at once. For each rule, world size, planning mode and epoch length it plans the epoch with
the real planner (`simulate_epoch`, lognormal lengths with mean 900 and CV 1, budget 16,384) with the rule swapped
in for `odb_core.planning.planner.round_target` (for this process only; restored after), records each round's
read boundary (the furthest any rank's stream was read when the round planned) and its device seconds (per step
the largest rank's padded tokens x 1.5 us, summed), and runs the pipeline of benchmarks/lib/round_model.py on
them (reading at S per rank while fewer than a window wait unplanned, round j trained once read and once round
j-1 is trained). Score = samples / the modelled epoch seconds / min(W x S, D_full), where D_full is the device rate
of whole-window rounds (the best packing): the samples/s a user gets, packing included, as a fraction of what the
workers or the best-packed device allow. S = ratio x D_full / W for each `--ratios` value.

Rules (`RULES`): `current` (odb's), and variants of its three parts: the smallest round (`min_window`), the rest of
a short stream planned whole (`whole`: while the rounds grow, a rest up to twice the round's size, odb's; or only
up to twice `min_window`), and the share of the rest a round may plan (`share`: 1/2, odb's; or 1/4, 1/8); and odb's
own rule at another `round_growth` (1.5, 1.25: each growing round that many times the one before, not twice).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks import RESULTS
from benchmarks.lib.planned_rounds import FULL, Candidate, plan_epoch, score, variant
from odb_core.planning.round_sizes import round_target

RULES = (Candidate("current", round_target, 256), Candidate("current, min_window 128", round_target, 128),
         Candidate("whole <= 2 x min_window", variant(whole="min_window"), 256),
         Candidate("whole <= 2 x min_window, 128", variant(whole="min_window"), 128),
         Candidate("share 1/4", variant(share=4), 256),
         Candidate("share 1/4, whole <= 2 x min_window, 128", variant(share=4, whole="min_window"), 128),
         Candidate("share 1/8", variant(share=8), 256),
         Candidate("round_growth 1.5", round_target, 256, (("round_growth", 1.5),)),
         Candidate("round_growth 1.25", round_target, 256, (("round_growth", 1.25),)))
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-rank", type=int, nargs="+", default=[500, 800, 1200, 1700, 2500, 3300, 4500, 6000,
                                                                     8000, 11000, 15000])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--plannings", nargs="+", default=["global", "local"], choices=["global", "local"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.92, 1.4, 3.0, 10.0],
                        help="S/D: the workers' rate over the device's")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--pool-window", type=int, default=None,
                        help="ODBConfig.pool_window for every rule (default: none, so each rank keeps --window)")
    parser.add_argument("--out", type=Path, default=RESULTS / "round_rules.json")
    args = parser.parse_args(argv)
    cases = [(w, p, n) for w in args.worlds for p in (args.plannings if w > 1 else ["global"]) for n in args.per_rank]
    scores: dict[str, list[list[float]]] = {c.name: [] for c in RULES}
    steps: dict[str, list[int]] = {c.name: [] for c in RULES}
    for world, planning, per_rank in cases:
        samples = per_rank * world
        full = plan_epoch(FULL, samples, world, planning, args.window)
        full_rate = samples / sum(full.device_seconds)
        for candidate in RULES:
            epoch = plan_epoch(candidate, samples, world, planning, args.window, pool_window=args.pool_window)
            scores[candidate.name].append([score(epoch, samples, world, r, full_rate, args.window)
                                           for r in args.ratios])
            steps[candidate.name].append(epoch.steps)
    base = np.array(scores["current"])
    header = " | ".join(f"S/D {r:g}" for r in args.ratios)
    print(f"| rule | {header} | mean | worst change vs current | steps vs current |")
    print("|---|" + "---|" * (len(args.ratios) + 3))
    rows = []
    for candidate in RULES:
        mine = np.array(scores[candidate.name])
        change = (mine - base).min()
        more_steps = sum(steps[candidate.name]) / sum(steps["current"]) - 1
        rows.append({"rule": candidate.name, "mean_by_ratio": mine.mean(0).tolist(), "mean": float(mine.mean()),
                     "worst_change": float(change), "steps_change": more_steps})
        print(f"| {candidate.name} | " + " | ".join(f"{x:.3f}" for x in mine.mean(0)) +
              f" | {mine.mean():.3f} | {change:+.3f} | {100 * more_steps:+.1f} % |")
    result = {"command": vars(args) | {"out": str(args.out)}, "cases": cases, "rows": rows, "scores": scores,
              "steps": steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
