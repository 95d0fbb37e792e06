"""`run_virtual_ranks`: W ranks as threads of one process over a `VirtualHub` (odb_core/ranks/virtual.py)."""

from __future__ import annotations

import pytest

from odb_core import PeerError, VirtualTransport, run_virtual_ranks


def test_every_rank_runs_on_its_own_transport_and_results_come_back_in_rank_order():
    def gather(rank: int, transport) -> list[list[int]]:
        assert (transport.rank, transport.world_size) == (rank, 3)
        return transport.all_gather([rank, 10 * rank])

    assert run_virtual_ranks(gather, 3) == [[[0, 0], [1, 10], [2, 20]]] * 3


def test_a_rank_error_is_reraised_and_its_peers_fail_at_their_next_exchange_instead_of_hanging():
    peers: list[BaseException] = []

    def rank_main(rank: int, transport) -> None:
        if rank == 1:
            raise ValueError("rank 1 failed")
        try:
            transport.all_gather([rank])
        except PeerError as exc:
            peers.append(exc)
            raise

    with pytest.raises(ValueError, match="rank 1 failed"):
        run_virtual_ranks(rank_main, 3, timeout_s=0.5)
    assert len(peers) == 2


def test_an_instrumented_transport_class_is_built_for_every_rank():
    class Counted(VirtualTransport):
        pass

    assert run_virtual_ranks(lambda rank, transport: type(transport).__name__, 2, transport_class=Counted) == [
        "Counted", "Counted"]


def test_a_world_without_ranks_is_refused():
    with pytest.raises(ValueError, match="world_size=0"):
        run_virtual_ranks(lambda rank, transport: None, 0)
