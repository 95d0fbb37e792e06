"""ODB's heartbeat keys belong to one run of a transport: torchrun's agent store outlives an attempt under
`--max-restarts`, and a `failed` key an earlier attempt wrote must not fail the next one's healthy ranks. Rank 0
draws the token and `GlooTransport` broadcasts it (each node's agent counts its own restarts, so the environment's
restart count may differ between nodes). A real TCPStore (as the agent's) and the real heartbeat; the Gloo tests of
test_faults.py run the broadcast token (a rank frozen, found by its peer's heartbeat)."""

from __future__ import annotations

import itertools
import socket
from datetime import timedelta

import torch.distributed as dist

from odb_core.ranks import liveness
from odb_core.ranks.liveness import Liveness


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_failed_key_of_an_earlier_attempt_is_not_read_by_the_next(monkeypatch):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    serial = 10_000  # a transport number, the same in either run: only the token tells the runs apart
    agent.set(f"odb/liveness/aaa/{serial}/failed", "rank 1 stopped answering ODB's heartbeat (attempt 0)")
    seen = {}
    for attempt in ("aaa", "bbb"):
        monkeypatch.setattr(liveness, "_SERIAL", itertools.count(serial))
        heart = Liveness(rank=0, world_size=2, timeout_s=5.0, attempt=attempt)
        try:
            assert heart.prefix == f"odb/liveness/{attempt}/{serial}"
            heart.beat_once(1, {})
            seen[attempt] = heart.failure
        finally:
            heart.stop(5.0)
    assert "attempt 0" in str(seen["aaa"])  # the run that wrote it reads it: the key is where the heartbeat looks
    assert seen["bbb"] is None  # another run's token: before, every run's keys were odb/liveness/<serial>


def _gloo_rank(rank: int, port: int, out) -> None:
    import os
    import time

    from odb_core.ranks.sync import GlooTransport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    transport = GlooTransport(timeout_s=30.0, liveness_timeout_s=1.0)
    time.sleep(3.0)  # three liveness timeouts of beats: a peer watched under another prefix would be "silent"
    out.put((rank, transport.liveness.prefix, repr(transport.liveness.failure)))
    transport.close()
    dist.destroy_process_group()


def two_gloo_ranks(target, reports: int) -> list:
    """Run `target(rank, port, out)` in two spawned processes of one Gloo group; the first `reports` items they put."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    out, port = context.Queue(), free_port()
    ranks = [context.Process(target=target, args=(rank, port, out)) for rank in range(2)]
    for process in ranks:
        process.start()
    results = [out.get(timeout=120) for _ in range(reports)]
    for process in ranks:
        process.join(30)
    return results


def test_gloo_ranks_share_one_token_and_see_each_other_s_beats():
    (_, prefix0, failure0), (_, prefix1, failure1) = sorted(two_gloo_ranks(_gloo_rank, reports=2))
    assert prefix0 == prefix1 and not prefix0.startswith("odb/liveness/-/")
    assert failure0 == failure1 == "None"


def _rank_that_leaves_after_the_group(rank: int, port: int, out) -> None:
    import os
    import time

    from odb_core.ranks.sync import GlooTransport, PeerError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    if rank == 1:  # takes part in the group's creation, then dies before the token's broadcast
        dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        os._exit(0)
    start = time.monotonic()
    try:
        GlooTransport(timeout_s=30.0, liveness_timeout_s=1.0)
        out.put(("built", ""))
    except PeerError as error:
        out.put((f"PeerError after {time.monotonic() - start:.1f}s", str(error)))
    except Exception as error:  # before: the broadcast's own error, its group left behind
        out.put((type(error).__name__, str(error)))


def test_a_peer_that_dies_before_the_token_s_broadcast_is_a_peer_error():
    [(what, message)] = two_gloo_ranks(_rank_that_leaves_after_the_group, reports=1)
    assert what.startswith("PeerError after"), (what, message)
    assert float(what.split()[-1].rstrip("s")) < 30  # the peer's sockets closed: no timeout waited
    assert "rank 0: ODB metadata token broadcast failed" in message and "a peer rank probably died" in message


def test_a_courier_closed_from_its_own_thread_does_not_wait_for_itself():
    """The collector may finalize a dropped loader on the courier's thread (NOTE [ A dropped loader ends its
    threads ]); before, stop() joined the current thread there: RuntimeError, and the group was never destroyed."""
    from odb_core.ranks.sync import _Courier

    courier = _Courier()
    assert courier.run(lambda: courier.stop(1.0), lambda: None) is True
    courier._thread.join(5.0)
    assert not courier._thread.is_alive()  # it ended after the call it was in
