"""Global against rank-local planning at scale, with `odb plan` on a real ShareGPT length profile (issue 14).

    python -m benchmarks.global_scale            # about 1 minute; writes results/global_scale.{json,md}

Profile: ShareGPT V3 whole conversations with the Qwen2.5 vocabulary and 5 tokens of ChatML markup per turn
(`real_lengths.sharegpt_whole`, computed in benchmarks/.venv-ref), clipped to [16, 8192]: the real 17,545
conversations, and 50,000 and 200,000 lengths resampled from them with replacement (`real_lengths.sharegpt_profile`:
`numpy.random.default_rng(RESAMPLE_SEED).choice`). Budget `L_max` = 16,384, padded cost, every other setting
`odb plan`'s default (window 4096, join, seed 0).

Every cell is one run of the real CLI, `python -m odb_core.cli plan <lengths.npy> --world-size W --token-budget
16384 --json`, which prints global planning (the loader's default at W > 1) and rank-local planning side by side
(the loader's own planning code on W virtual ranks). The oracle is `benchmarks.lib.oracle.oracle_groups` over all
lengths (a global sort, then the greedy fill): utilization = tokens / (groups x L_max), the same at every W.
`dealt oracle` deals the oracle's groups to W ranks (ceil(groups / W) steps): no plan that keeps the oracle's
groups does better at that W. All figures are deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import REPO_ROOT, RESULTS
from benchmarks.data.real_lengths import PROFILE_CLIP, RESAMPLE_SEED, sharegpt_profile
from benchmarks.lib.oracle import oracle_steps

L_MAX = 16384
SIZES = (17_545, 50_000, 200_000)  # the first is the real dataset itself
WORLDS = (8, 64, 256)
TARGETS = {(17_545, 64): 0.95, (200_000, 256): 0.97}  # issue 14's done-when, as a ratio to the oracle


EXTRA: list[str] = []  # --plan-arg values, passed on to every `odb plan`


def plan_command(lengths: str, world: int | str) -> list[str]:
    return ["python", "-m", "odb_core.cli", "plan", lengths, "--world-size", str(world), "--token-budget", str(L_MAX),
            "--json", *EXTRA]


def odb_plan(path: Path, world: int) -> tuple[dict, float]:
    """Both reports of one `odb plan` run, keyed by planning mode, and its wall time."""
    start = time.perf_counter()
    command = [sys.executable, *plan_command(str(path), world)[1:]]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return {r["planning"]: r for r in json.loads(done.stdout)}, time.perf_counter() - start


def cell(n: int, world: int, path: Path, oracle: dict) -> dict:
    reports, seconds = odb_plan(path, world)
    row = {"samples": n, "world_size": world, "oracle": oracle["utilization"],
           "dealt_oracle": oracle["tokens"] / (math.ceil(oracle["groups"] / world) * world * L_MAX),
           "plan_seconds": round(seconds, 1)}
    for mode in ("global", "local"):
        r = reports[mode]
        row[mode] = {k: r[k] for k in ("steps", "budget_utilization", "padding_ratio", "idle_fraction",
                                       "moved_fraction", "mean_rank_imbalance", "alignment_bytes_per_rank",
                                       "not_emitted", "rounds")}
        row[mode]["vs_oracle"] = r["budget_utilization"] / oracle["utilization"]
    return row


def run(sizes=SIZES, worlds=WORLDS, log=print) -> dict:
    rows = []
    for n in sizes:
        path = sharegpt_profile(n)
        lengths = np.load(path).tolist()
        groups = oracle_steps(lengths, L_MAX)
        oracle = {"tokens": sum(lengths), "groups": groups, "utilization": sum(lengths) / (groups * L_MAX)}
        log(f"{n} samples: mean {np.mean(lengths):.0f}, CV {np.std(lengths) / np.mean(lengths):.2f}, "
            f"oracle {oracle['utilization']:.4f} ({groups} groups)")
        for world in worlds:
            rows.append(cell(n, world, path, oracle))
            g, loc = rows[-1]["global"], rows[-1]["local"]
            log(f"  W={world:<4d} global {g['budget_utilization']:.4f} ({g['vs_oracle']:.3f}x oracle, moved "
                f"{g['moved_fraction']:.2f})  local {loc['budget_utilization']:.4f} ({loc['vs_oracle']:.3f}x)  "
                f"[{rows[-1]['plan_seconds']} s]")
    return {"command": "python -m benchmarks.global_scale",
            "plan_command": " ".join(plan_command("<lengths.npy>", "W")),
            "profile": f"ShareGPT V3 whole conversations, Qwen2.5 tokens + 5 per turn, clipped to "
                       f"{list(PROFILE_CLIP)}; 50k/200k resampled with replacement "
                       f"(numpy default_rng({RESAMPLE_SEED}).choice)",
            "token_budget": L_MAX, "rows": rows, "targets": check_targets(rows)}


def check_targets(rows: list[dict]) -> list[dict]:
    out = []
    for (n, world), target in TARGETS.items():
        row = next((r for r in rows if r["samples"] == n and r["world_size"] == world), None)
        if row is not None:
            ratio = row["global"]["vs_oracle"]
            out.append({"samples": n, "world_size": world, "target": target, "global_vs_oracle": ratio,
                        "met": ratio >= target, "local_vs_oracle": row["local"]["vs_oracle"]})
    return out


def markdown(result: dict) -> str:
    lines = [f"# Global against rank-local planning (`{result['command']}`)", "",
             f"Profile: {result['profile']}. `L_max` {result['token_budget']}, padded cost. Each row: "
             f"`{result['plan_command']}`.", "",
             "| samples | W | oracle | dealt oracle | global | global / oracle | rank-local | rank-local / oracle "
             "| steps global / local | moved (global) | IDLE global / local | imbalance global / local "
             "| alignment B/rank global / local |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        g, loc = r["global"], r["local"]
        lines.append(
            f"| {r['samples']:,} | {r['world_size']} | {r['oracle']:.3f} | {r['dealt_oracle']:.3f} | "
            f"{g['budget_utilization']:.3f} | **{g['vs_oracle']:.3f}** | {loc['budget_utilization']:.3f} | "
            f"{loc['vs_oracle']:.3f} | {g['steps']} / {loc['steps']} | {g['moved_fraction']:.3f} | "
            f"{g['idle_fraction']:.4f} / {loc['idle_fraction']:.4f} | {g['mean_rank_imbalance']:.3f} / "
            f"{loc['mean_rank_imbalance']:.3f} | {g['alignment_bytes_per_rank']:,} / {loc['alignment_bytes_per_rank']:,} |")
    lines += ["", "Targets (global / oracle):", ""]
    for t in result["targets"]:
        lines.append(f"- {t['samples']:,} samples, W = {t['world_size']}: {t['global_vs_oracle']:.3f} "
                     f"(target >= {t['target']}: {'met' if t['met'] else 'missed'}; rank-local {t['local_vs_oracle']:.3f})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plan-arg", action="append", default=[],
                   help="an `odb plan` argument for every cell, e.g. --plan-arg=--pool-window --plan-arg=none")
    args = p.parse_args(argv)
    EXTRA[:] = args.plan_arg
    result = run()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "global_scale.json").write_text(json.dumps(result, indent=1))
    (args.out / "global_scale.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
