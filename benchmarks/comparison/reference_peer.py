"""The reference release (`online-dynamic-batching` on PyPI) as a peer, run in its own environment.

The release is never installed into the project's .venv: `reference/setup_ref_env.sh` puts it (with torch pinned
to the project's CPU build) into benchmarks/.venv-ref, and `reference/ref_driver.py` runs there (`python -m
benchmarks.reference.ref_driver` from the repository root), driving the release's own `grouping_data` on the same
per-rank streams as ODB. This module is the .venv side: it sends lengths and streams as JSON and turns the answer
into a `Schedule`. `python -m benchmarks.reference.reference_release --validate` checks the driver against the
release's real loader.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
from collections.abc import Sequence

from benchmarks import PACKAGE, REF_VENV, REPO_ROOT
from benchmarks.comparison.peers import Setting, Unavailable
from benchmarks.comparison.schedule import Schedule
from odb_core.data.sharding import shard

VENV_PYTHON = REF_VENV / "bin" / "python"
SETUP = PACKAGE / "reference" / "setup_ref_env.sh"
# run with cwd = REPO_ROOT, which `-m` puts on .venv-ref's path (no PYTHONPATH: see CLEAN_ENV and ref_driver)
DRIVER_COMMAND = [str(VENV_PYTHON), "-m", "benchmarks.reference.ref_driver"]
# a clean environment: nothing of the caller's .venv (PYTHONPATH, VIRTUAL_ENV) may leak into .venv-ref
CLEAN_ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}


def ensure_env(create: bool) -> Unavailable | None:
    """None when the reference environment is ready (creating it if `create`), else why it is not."""
    if (REF_VENV / ".installed").exists():
        return None
    if not create:
        return Unavailable("benchmarks/.venv-ref is missing: run `bash benchmarks/reference/setup_ref_env.sh`")
    done = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True)
    if done.returncode != 0:
        return Unavailable(f"setup_ref_env.sh failed: {done.stderr[-500:]}")
    return None


class _Server:
    """One long-lived `ref_driver.py --serve` process (importing torch costs seconds per start)."""

    process: subprocess.Popen | None = None

    @classmethod
    def ask(cls, request: dict) -> dict:
        if cls.process is None or cls.process.poll() is not None:
            cls.process = subprocess.Popen([*DRIVER_COMMAND, "--serve"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, env=CLEAN_ENV, cwd=REPO_ROOT)
            atexit.register(cls.close)
        assert cls.process.stdin is not None and cls.process.stdout is not None
        cls.process.stdin.write(json.dumps(request) + "\n")
        cls.process.stdin.flush()
        line = cls.process.stdout.readline()
        if not line:
            raise RuntimeError("ref_driver.py --serve exited; see its stderr above")
        return json.loads(line)

    @classmethod
    def close(cls) -> None:
        if cls.process is not None and cls.process.poll() is None:
            cls.process.stdin.close()  # type: ignore[union-attr]
            cls.process.wait(timeout=30)
        cls.process = None


def run(setting: Setting, buffer_size: int | None, patches: Sequence[int] | None = None,
        max_patches: int = 0) -> tuple[Schedule, dict]:
    """The release's schedule (buffer_size None = its defaults; with `patches` and `max_patches`, its own patch
    cap) and the driver's facts (rounds, ints, time)."""
    streams = [[item.index for item in rank] for rank in shard(setting.lengths, setting.world_size, setting.seed)]
    request = {"lengths": list(map(int, setting.lengths)), "streams": streams, "token_budget": setting.token_budget,
               "buffer_size": buffer_size}
    if patches is not None:
        request.update(patches=list(map(int, patches)), max_patches=max_patches)
    answer = _Server.ask(request)
    steps = [[tuple(group) for group in rank] for rank in answer.pop("steps")]
    return Schedule(steps), answer
