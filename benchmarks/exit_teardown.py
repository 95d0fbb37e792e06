"""Do two-rank HF Trainer runs exit 0? Consecutive torchrun launches, with ODB and with a plain Trainer.

    python -m benchmarks.exit_teardown                       # 20 launches of each of odb/none and plain/none
    python -m benchmarks.exit_teardown --end none,destroy,barrier-destroy --label after

Each launch trains a tiny Llama for 6 optimizer steps (one epoch) on 2 CPU ranks (gloo, `TrainingArguments(
use_cpu=True)`) and ends as `--end` says: returning with the process groups alive (`none`), after
`torch.distributed.destroy_process_group()` (`destroy`), or after `dist.barrier()` and that (`barrier-destroy`).
The settings alternate launch by launch, so that machine load falls on all of them alike. A launch is clean when
torchrun exits 0 and no rank aborted ("terminate called", SIGABRT). `--max-steps 4` stops inside ODB's epoch, so
ODB leaves it at the end of training (one more ODB collective just before the script ends). Writes results/exit_teardown_<label>.json; see
docs/benchmarks.md, "Clean exits".
"""

from __future__ import annotations

import argparse
import json

from benchmarks import RESULTS
from benchmarks.lib.exit_runs import launch, summarise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="launches of each setting")
    parser.add_argument("--variants", default="odb,plain", help="comma-separated: odb, plain")
    parser.add_argument("--end", default="none", help="comma-separated: none, destroy, barrier-destroy")
    parser.add_argument("--max-steps", type=int, default=-1, help="> 0: stop there, inside ODB's epoch (it is left)")
    parser.add_argument("--label", default="latest", help="results/exit_teardown_<label>.json")
    ns = parser.parse_args()
    settings = [(variant == "odb", end) for variant in ns.variants.split(",") for end in ns.end.split(",")]
    runs = []
    for k in range(ns.runs):
        for odb, end in settings:
            run = launch(odb, end, max_steps=ns.max_steps)
            runs.append(run)
            status = "clean" if run.clean else f"rc {run.returncode}" + (", aborted" if run.aborted else "")
            print(f"{k + 1:3d} {'odb' if odb else 'plain':5s} end={end:7s} {status:18s} {run.seconds:5.1f}s",
                  flush=True)
    summary = summarise(runs)
    for name, entry in summary.items():
        print(f"{name:14s} {entry['clean']}/{entry['runs']} clean, {entry['aborted']} aborted, "
              f"{entry['failed']} other failures")
    path = RESULTS / f"exit_teardown_{ns.label}.json"
    setup = {"runs": ns.runs, "max_steps": ns.max_steps}
    path.write_text(json.dumps({"setup": setup, "summary": summary, "runs": [r.to_dict() for r in runs]}, indent=1)
                    + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
