"""Moved tensors that already lie in shared memory travel by handle between the ranks of one host (NOTE [ Moving
shared tensors by handle ] in odb_core/ranks/shared_handles.py; issue 27, item 4).

The batches and counters must be those of the frames, on virtual and real Gloo ranks, with the lane carrying
handles instead of the tensors' bytes; a received tensor must be the owner's (dtype, layout, values) and outlive
the owner's reference; ranks that cannot open each other's files, or that disagree on the setting, must fall back
to frames without a desync; a rank whose owner died mid-move must raise, and nothing may be left in /dev/shm.
"""

from __future__ import annotations

import os
import secrets
import threading
import time

import numpy as np
import pytest
import torch
from dist_cases import Case, ImagesFromDataset, mixed_lengths, run_job

from odb_core import ODBDataLoader, PeerError, run_virtual_ranks
from odb_core.data.sendable import pack_sample
from odb_core.ranks.moves import pickle_samples
from odb_core.ranks.moves_ahead import _exchange
from odb_core.ranks.shared_handles import HandleRoutes, SharedHandle, _reads, from_handles, host_key, to_handles
from odb_core.ranks.virtual import VirtualHub, VirtualTransport

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or host_key() == 0,
                                reason="no /proc or /dev/shm here")


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_a_shared_tensor_goes_by_handle_and_comes_back_as_the_owners_memory_with_its_layout():
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10).share_memory_()
    view = base[1:5, ::3]  # an offset and strides of its own
    sample = {"pixel_values": view, "input_ids": torch.arange(5), "grid": np.arange(3)}
    keep: list = []
    sent, handled = to_handles(sample, keep)
    assert type(sent["pixel_values"]) is SharedHandle and sent["input_ids"] is sample["input_ids"]
    assert sample["pixel_values"] is view  # the owner's sample is not changed
    assert handled == view.numel() * 8 and keep == [base.untyped_storage()]
    got = from_handles(dict(sent))["pixel_values"]
    assert got.dtype == view.dtype and got.shape == view.shape and got.stride() == view.stride()
    assert torch.equal(got, view)
    del sample, view, base, sent
    keep.clear()  # the owner lets its storage go: the receiver's mapping still holds the memory
    assert got.sum().item() == sum(float(r * 10 + c) for r in range(1, 5) for c in range(0, 10, 3))


def test_only_tensors_in_a_shared_file_go_by_handle():
    torch_owned = torch.ones(4)  # not shared: its bytes travel in the frame
    grads = torch.ones(4, requires_grad=True)
    sample = {"a": torch_owned, "b": grads.detach().share_memory_(), "c": [torch.ones(2).share_memory_()]}
    sent, handled = to_handles(sample, [])
    assert sent["a"] is torch_owned and type(sent["b"]) is SharedHandle and isinstance(sent["c"], list)
    assert handled == 16  # "c" is not at the top level: its list travels in the frame
    not_a_mapping = [torch.ones(3).share_memory_()]
    assert to_handles(not_a_mapping, []) == (not_a_mapping, 0)


def test_a_peer_reads_a_probe_only_through_the_right_key_and_token():
    probe = torch.UntypedStorage._new_shared(8)
    token = secrets.randbits(62) + 1
    torch.empty(0, dtype=torch.int64).set_(probe, 0, (1,)).fill_(token)
    key, fd = host_key(), probe._get_shared_fd()
    assert _reads(key, [key, os.getpid(), fd, token])
    assert not _reads(key, [key, os.getpid(), fd, token + 1])  # a pid of another process (another pid namespace)
    assert not _reads(key, [key ^ 1, os.getpid(), fd, token])  # another host or /dev/shm
    assert not _reads(0, [0, os.getpid(), fd, token])
    assert not _reads(key, [key, os.getpid(), 10_000, token])  # no such descriptor


def test_routes_follow_who_read_whose_probe_and_every_rank_meets_alike():
    def open_routes(rank, transport):
        return HandleRoutes.open(transport, enabled=rank != 2)

    routes = run_virtual_ranks(open_routes, 3, timeout_s=30)
    assert [r.to for r in routes] == [(False, True, False), (True, False, False), (False, False, False)]
    assert all(r.meet for r in routes)
    alone = run_virtual_ranks(lambda rank, t: HandleRoutes.open(t, enabled=rank == 0), 2, timeout_s=30)
    assert [r.meet for r in alone] == [False, False] and all(not any(r.to) for r in alone)


def test_a_receiver_whose_owner_is_gone_raises_naming_the_file():
    handle = SharedHandle(pid=2**22 + 7, fd=3, nbytes=8, dtype="torch.int64", shape=(1,), stride=(1,), offset=0)
    with pytest.raises(PeerError, match=r"could not be opened .* probably died mid-move"):
        from_handles({"pixel_values": handle})


class SharedImages(ImagesFromDataset):
    """Image samples whose `pixel_values` lie in shared memory, as DataLoader workers deliver tensors over the
    pipe's limit (here without workers, so that the virtual ranks of one process can run)."""

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        if "pixel_values" in sample:
            sample["pixel_values"] = torch.full((64, 1024), float(index)).share_memory_()
        return sample


def _records(world: int, **options) -> list[dict]:
    def rank_body(rank, transport):
        loader = ODBDataLoader(SharedImages(mixed_lengths(240), 60), token_budget=2048, transport=transport,
                               shuffle=True, window=32, **options)
        epochs = [[(batch.info, tuple((key, tuple(value.shape), value.flatten().tolist())
                                      for key, value in sorted(batch.items()) if isinstance(value, torch.Tensor)))
                   for batch in loader] for _ in range(2)]
        lane = loader._lane
        record = {"epochs": epochs, "moved_samples": loader.metrics.moved_samples,
                  "moved_bytes": loader.metrics.moved_bytes, "lane_bytes": lane.transport.stats.bytes_sent,
                  "handles": any(lane.routes.to)}
        loader.close()
        return record

    return run_virtual_ranks(rank_body, world, timeout_s=60)


@pytest.mark.parametrize(("world", "options"), [(2, {}), (3, {}), (4, {"nproc_per_node": 2})],
                         ids=["W2", "W3", "2x2-nodes"])
def test_virtual_ranks_with_handles_run_the_batches_and_counters_of_the_frames(world, options):
    before = _shm_names()
    handles = _records(world, **options)
    frames = _records(world, shared_memory_moves=False, **options)
    assert [r["epochs"] for r in handles] == [r["epochs"] for r in frames]
    assert [r["moved_samples"] for r in handles] == [r["moved_samples"] for r in frames]
    for by_handle, by_frame in zip(handles, frames, strict=True):
        assert by_handle["handles"] and not by_frame["handles"]
        assert by_handle["moved_bytes"] == pytest.approx(by_frame["moved_bytes"], rel=0.01)
        assert by_handle["lane_bytes"] < by_frame["lane_bytes"] / 5  # the images stayed where they were
    assert sum(r["moved_bytes"] for r in handles) > 1_000_000
    assert _shm_names() == before


def test_ranks_that_disagree_on_the_setting_run_the_batches_of_the_frames():
    """Rank 1 turns handles off: nobody sends it handles nor receives any from it, ranks 0 and 2 still pass
    theirs, and every rank meets after each exchange, so the epoch runs without a desync or a hang."""
    def rank_body(rank, transport):
        loader = ODBDataLoader(SharedImages(mixed_lengths(180), 0), token_budget=2048, transport=transport,
                               shuffle=True, window=32, shared_memory_moves=rank != 1)
        steps = [(batch.info.indices, batch["pixel_values"].sum().item()) for batch in loader]
        to = loader._lane.routes.to
        loader.close()
        return steps, to

    mixed = run_virtual_ranks(rank_body, 3, timeout_s=60)
    plain = run_virtual_ranks(lambda rank, transport: [
        (b.info.indices, b["pixel_values"].sum().item())
        for b in ODBDataLoader(SharedImages(mixed_lengths(180), 0), token_budget=2048, transport=transport,
                               shuffle=True, window=32, shared_memory_moves=False)], 3, timeout_s=60)
    assert [to for _, to in mixed] == [(False, False, True), (False, False, False), (True, False, False)]
    assert [steps for steps, _ in mixed] == plain


def test_an_exchange_whose_peer_never_comes_lets_the_storages_go():
    """The lane's peer died before the exchange: the collective raises, and the storages held for the handles are
    released with the failed job (`keep` is not kept alive by the lane)."""
    keep = [torch.UntypedStorage._new_shared(64)]
    lane = VirtualTransport(VirtualHub(2, timeout_s=0.3), 0)
    with pytest.raises(PeerError):
        _exchange(lane, [None, None], keep, meet=True)
    assert len(keep) == 1  # the caller's list: released with the job that held it


def _slowly() -> str:
    time.sleep(0.5)
    return "read"


class SlowToUnpickle:
    """Half a second to unpickle: the receiver opens the handle after it, while the owner has long sent."""

    def __reduce__(self):
        return _slowly, ()


def test_the_owner_holds_its_storages_until_a_slow_receiver_has_opened_them():
    """Without the meeting after the exchange the owner would let its storage go at once, and the receiver, still
    unpickling, would find its descriptor closed (or another file in its place)."""
    keep: list = []
    image = torch.full((256, 256), 7.0).share_memory_()
    sent, _ = to_handles({"slow": SlowToUnpickle(), "pixel_values": image}, keep)
    pickled = pickle_samples([pack_sample(sent, limit_bytes=None)])
    del sent, image  # `keep` is all that holds the storage on the owner's side now
    hub, got, ended = VirtualHub(2, timeout_s=10), {}, {}

    def owner() -> None:
        _exchange(VirtualTransport(hub, 0), [None, pickled], keep, meet=True)
        ended["owner"] = time.monotonic()

    def receiver() -> None:
        got.update(_exchange(VirtualTransport(hub, 1), [None, None], [], meet=True))
        ended["receiver"] = time.monotonic()

    threads = [threading.Thread(target=owner), threading.Thread(target=receiver)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert keep == []  # let go once the ranks met
    [sample] = got[0]
    assert sample["slow"] == "read" and torch.equal(sample["pixel_values"], torch.full((256, 256), 7.0))
    assert ended["owner"] >= ended["receiver"] - 0.2  # the owner waited for the slow receiver


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gloo_ranks_with_workers_pass_images_by_handle_and_run_the_batches_of_the_frames(tmp_path):
    """Real Gloo ranks, each with 2 forked DataLoader workers that send 1 MiB images through shared memory."""
    runs = {}
    for name, on in (("handles", True), ("frames", False)):
        options = {"shared_memory_moves": on}
        case = Case(world_size=2, lengths=mixed_lengths(160), window=32, shuffle=True, first_image=40, epochs=2,
                    num_workers=2, context="fork", image_width=512, options_by_rank={"0": options, "1": options})
        result = run_job(case, "env", tmp_path / name, timeout_s=300)
        assert not result.timed_out and sorted(result.records) == [0, 1], result.output[-4000:]
        runs[name] = result.records
    assert [runs["handles"][r]["epochs"] for r in (0, 1)] == [runs["frames"][r]["epochs"] for r in (0, 1)]
    assert sum(e["moved_samples"] for r in (0, 1) for e in runs["handles"][r]["epochs"]) > 0
    for rank in (0, 1):
        assert runs["handles"][rank]["lane_bytes_sent"] < runs["frames"][rank]["lane_bytes_sent"] / 20


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_gloo_rank_killed_while_its_images_go_by_handle_gives_its_peer_a_peer_error(tmp_path):
    case = Case(world_size=2, lengths=mixed_lengths(240), window=32, shuffle=True, first_image=0, num_workers=2,
                context="fork", image_width=512, fault="kill-rank", fault_rank=1, fault_after=3, prefetch_steps=0,
                liveness_timeout_s=5.0)
    result = run_job(case, "env", tmp_path, timeout_s=200)
    assert not result.timed_out, result.output[-4000:]
    survivor = result.records[0]
    assert survivor["is_peer_error"] and survivor["blocked_s"] < 30, survivor
