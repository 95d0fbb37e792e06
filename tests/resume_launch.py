"""Start test ranks as real processes for the resume tests: a forkserver that has already imported torch (and
datasets), so a rank starts in a fraction of a second and can be SIGKILLed like any training process."""

from __future__ import annotations

import multiprocessing
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Any

CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "datasets", "resume_worker"])
LAUNCH_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(target: Callable[..., None], args: Sequence[tuple[Any, ...]]) -> list:
    """One process per argument tuple (rank order), started."""
    procs = [CTX.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    return procs


def join_all(procs: list) -> list[int | None]:
    """Wait for every process (killing those past the timeout); returns their exit codes."""
    for p in procs:
        p.join(LAUNCH_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def run_to_end(target: Callable[..., None], args: Sequence[tuple[Any, ...]]) -> None:
    codes = join_all(launch(target, args))
    assert codes == [0] * len(codes), f"exit codes {codes}"


def run_and_kill(target: Callable[..., None], args: Sequence[tuple[Any, ...]]) -> None:
    """Rank 0 kills itself; then every other rank is SIGKILLed too (a lost node takes the job down)."""
    procs = launch(target, args)
    procs[0].join(LAUNCH_TIMEOUT_S)
    for p in procs[1:]:
        p.kill()
    codes = join_all(procs)
    assert codes[0] == -signal.SIGKILL, f"rank 0 exited with {codes[0]}, expected SIGKILL"
