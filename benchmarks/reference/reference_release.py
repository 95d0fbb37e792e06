"""Checks the reference release's driver against the release's real loader, in the release's own environment.

`ref_driver` runs inside benchmarks/.venv-ref (`setup_ref_env.sh`); the comparison calls it through
`benchmarks.comparison.reference_peer`. This script runs the driver's `--validate` modes, which run the
release's own `ODBDataLoader` beside the driver and compare their batches.

    python -m benchmarks.reference.reference_release --validate   # the driver against the release's real loader
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import REPO_ROOT, RESULTS
from benchmarks.comparison.reference_peer import CLEAN_ENV, DRIVER_COMMAND, ensure_env


def _call(request: dict, *flags: str, timeout: float = 900) -> dict:
    done = subprocess.run([*DRIVER_COMMAND, *flags], input=json.dumps(request), capture_output=True, text=True,
                          timeout=timeout, env=CLEAN_ENV, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"ref_driver.py failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def validate(lengths: Sequence[int], token_budget: int) -> dict:
    """Driver vs the release's real loader: W = 1 (default buffer, buffer 64, buffer 64 with a patch cap) and W = 2
    over Gloo (default buffer)."""
    request = {"lengths": list(map(int, lengths)), "token_budget": token_budget}
    patches = [(7 * k) % 900 for k in range(len(lengths))]  # a spread of vision-patch counts
    out = {"w1_default": _call(request, "--validate"),
           "w1_buffer64": _call({**request, "buffer_size": 64}, "--validate"),
           "w1_buffer64_patch_cap": _call({**request, "buffer_size": 64, "patches": patches, "max_patches": 2048},
                                          "--validate")}
    two = _call(request, "--validate-two-ranks")
    out["w2_default_gloo"] = {k: v for k, v in two.items() if not k.endswith("_batches")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", action="store_true", help="check ref_driver.py against the real loader")
    parser.add_argument("--json", type=Path, default=RESULTS / "reference_validation.json")
    args = parser.parse_args()
    missing = ensure_env(create=True)
    if missing is not None:
        sys.exit(missing.reason)
    if args.validate:
        from benchmarks.data.workloads import lognormal

        result = validate(lognormal(600, 1.0, mean=128, hi=1024, seed=3), 2048)
        args.json.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
