"""Launch two-rank HF Trainer runs (torchrun, gloo, CPU) and count how they exit (`benchmarks.exit_teardown`).

One launch is `torchrun --standalone --nproc_per_node 2 -m benchmarks.workers.exit_worker`: a few optimizer steps
with ODB or as a plain Trainer, ended with or without `destroy_process_group()`. A run counts as clean when torchrun
exits 0 and nothing in its output says that a rank aborted: "terminate called" (a C++ std::terminate: SIGABRT,
NOTE [ Threads at interpreter exit ] in odb_core/ranks/sync.py) or a signal named by torchrun. Each run also keeps
the `facts` every rank wrote after `train()` (its steps, ODB's helper threads still alive, Gloo work threads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import REPO_ROOT

ABORT_MARKS = ("terminate called", "SIGABRT", "Signal 6", "core dumped")


@dataclass(frozen=True, slots=True)
class ExitRun:
    """One launch: its settings, torchrun's exit status, whether a rank aborted, its wall time, and the end of
    its output when it was not clean."""

    odb: bool
    end: str
    returncode: int
    aborted: bool
    seconds: float
    facts: tuple[dict, ...] = ()
    tail: str = ""
    ignored_errors: int = 0  # "Exception ignored in ..." reports in the output: a finalizer that raised at exit

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and not self.aborted

    def to_dict(self) -> dict:
        return {**asdict(self), "clean": self.clean}


def launch(odb: bool, end: str, max_steps: int = -1, timeout: float = 300) -> ExitRun:
    """One two-rank launch of the exit worker (`end`: "none", "destroy" or "barrier-destroy"; `max_steps` > 0
    stops the run there; see the worker)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "benchmarks.workers.exit_worker", "--out", out, "--end", end, "--max-steps", str(max_steps),
                   *(["--odb"] if odb else [])]
        start = time.perf_counter()
        done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                              check=False)
        facts = tuple(json.loads(path.read_text()) for path in sorted(Path(out).glob("facts.rank*.json")))
    output = done.stdout + done.stderr
    aborted = any(mark in output for mark in ABORT_MARKS)
    run = ExitRun(odb=odb, end=end, returncode=done.returncode, aborted=aborted,
                  seconds=round(time.perf_counter() - start, 1), facts=facts,
                  ignored_errors=output.count("Exception ignored in"))
    return run if run.clean and not run.ignored_errors else ExitRun(**{**asdict(run), "tail": output[-3000:]})


def summarise(runs: list[ExitRun]) -> dict[str, dict]:
    """Per setting ("odb/none", "plain/destroy", ...): launches, clean exits, aborts, other failures."""
    out: dict[str, dict] = {}
    for run in runs:
        entry = out.setdefault(f"{'odb' if run.odb else 'plain'}/{run.end}",
                               {"runs": 0, "clean": 0, "aborted": 0, "failed": 0, "seconds": 0.0})
        entry["runs"] += 1
        entry["clean"] += run.clean
        entry["aborted"] += run.aborted
        entry["failed"] += run.returncode != 0 and not run.aborted
        entry["seconds"] = round(entry["seconds"] + run.seconds, 1)
    return out
