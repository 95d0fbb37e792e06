"""Real training throughput on CPU at W = 2 (torchrun, gloo), standalone: `lib/cpu_training` launches
`train_worker` and summarises it, here with the model size given on the command line (the comparison's `training`
part runs the default size).

    python -m benchmarks.workers.training [--methods standard,odb] [--hidden 256] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.lib.cpu_training import launch, summarise


def main() -> None:
    """A standalone run, e.g. with a larger model: python -m benchmarks.workers.training --hidden 256 --layers 4."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="standard,odb")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    extra = ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    result = summarise(launch(args.methods.split(","), args.repeats, args.samples, extra))
    for method, entry in result["summary"].items():
        print(f"{method:11s} {entry['samples_per_s']:7.1f} samples/s {entry['tokens_per_s']:8.0f} tok/s"
              + (f"  x{entry['vs_standard']:.2f} vs standard" if "vs_standard" in entry else ""))
    if args.json:
        result["command"] = "python -m benchmarks.workers.training " + " ".join(sys.argv[1:])
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
