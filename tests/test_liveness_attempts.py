"""ODB's heartbeat keys belong to one attempt of a job (`liveness._attempt`): torchrun's agent store outlives an
attempt under `--max-restarts`, and a `failed` key an earlier attempt wrote must not fail the next one's healthy
ranks. A real TCPStore (as the agent's) and the real heartbeat, one process."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from odb_core.ranks import liveness
from odb_core.ranks.liveness import Liveness


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("restart", ["0", "1"])
def test_a_failed_key_of_an_earlier_attempt_is_not_read_by_the_next(monkeypatch, restart):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    serial = next(liveness._SERIAL) + 1  # the next transport's number, the same in either attempt
    agent.set(f"odb/liveness/job.0/{serial}/failed", "rank 1 stopped answering ODB's heartbeat (attempt 0)")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    heart = Liveness(rank=0, world_size=2, timeout_s=5.0)
    try:
        assert heart.prefix == f"odb/liveness/job.{restart}/{serial}"
        heart.beat_once(1, {})
        seen = heart.failure
    finally:
        heart.stop(5.0)
    if restart == "0":  # the attempt that wrote it reads it: the key is where the heartbeat looks
        assert "attempt 0" in str(seen)
    else:
        assert seen is None  # before, the same key was read by attempt 1: a PeerError on a healthy job
