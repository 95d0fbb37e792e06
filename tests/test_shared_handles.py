"""Moved tensors that already lie in shared memory travel by handle between the ranks of one host (NOTE [ Moving
shared tensors by handle ] in odb_core/ranks/shared_handles.py; issue 27, item 4).

The batches and counters must be those of the frames, on virtual and real Gloo ranks, with the lane carrying
handles instead of the tensors' bytes; a received tensor must be the owner's (dtype, layout, values) and outlive
the owner's reference; ranks that cannot open each other's files, or that disagree on the setting, must fall back
to frames without a desync; a rank whose owner died mid-move must raise, and nothing may be left in /dev/shm.
"""

from __future__ import annotations

import errno
import gc
import os
import resource
import secrets
import threading
import time

import numpy as np
import pytest
import torch
from dist_cases import Case, ImagesFromDataset, image_runs, mixed_lengths, run_job

from odb_core import ODBDataLoader, PeerError, run_virtual_ranks
from odb_core.data.sendable import pack_sample
from odb_core.ranks.moves import pickle_samples
from odb_core.ranks.moves_ahead import _exchange
from odb_core.ranks.shared_handles import HandleRoutes, SharedHandle, _reads, from_handles, host_key, to_handles
from odb_core.ranks.virtual import VirtualHub, VirtualTransport

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or host_key() == 0,
                                reason="no /proc or /dev/shm here")


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
    complex_pair = torch.tensor([1 + 2j, 3 + 4j]).share_memory_()
    frames = {"a": torch_owned, "grad": torch.ones(4).share_memory_().requires_grad_(),
              "empty": torch.empty(0, 6).share_memory_(),  # its storage reports descriptor -1
              "negated": complex_pair.conj().imag,  # a lazily negated view: a handle would lose the sign
              "complex": complex_pair}  # a dtype the handles do not carry
    assert frames["negated"].is_neg()
    sample = {**frames, "b": torch.ones(4).share_memory_(), "c": [torch.ones(2).share_memory_()]}
    sent, handled = to_handles(sample, [])
    assert all(sent[key] is value for key, value in frames.items())
    assert type(sent["b"]) is SharedHandle and isinstance(sent["c"], list)
    assert handled == 16  # "c" is not at the top level: its list travels in the frame
    not_a_mapping = [torch.ones(3).share_memory_()]
    assert to_handles(not_a_mapping, []) == (not_a_mapping, 0)


def test_a_peer_reads_a_probe_only_through_the_right_key_and_token():
    probe = torch.UntypedStorage._new_shared(8)
    token = secrets.randbits(62) + 1
    torch.empty(0, dtype=torch.int64).set_(probe, 0, (1,)).fill_(token)
    key, fd = host_key(), probe._get_shared_fd()
    inode = os.fstat(fd).st_ino
    assert _reads(key, [key, os.getpid(), fd, inode, token])
    assert not _reads(key, [key, os.getpid(), fd, inode, token + 1])  # another process's file of that inode
    assert not _reads(key, [key ^ 1, os.getpid(), fd, inode, token])  # another host or /dev/shm
    assert not _reads(0, [0, os.getpid(), fd, inode, token])
    assert not _reads(key, [key, os.getpid(), 10_000, inode, token])  # no such descriptor


def test_a_path_that_leads_to_another_file_is_neither_read_nor_written(tmp_path):
    """A pid that names another process (another pid namespace, or a pid reused after the owner died) may lead to
    any file that process holds: it is refused before it is mapped, and left as it was."""
    small = tmp_path / "lock"
    small.write_bytes(b"abc")
    with small.open("r+b") as held:
        fd = held.fileno()
        assert not _reads(host_key(), [host_key(), os.getpid(), fd, os.fstat(fd).st_ino + 1, 1])
        with pytest.raises(ValueError, match="is not the owner's shared-memory file"):
            from_handles({"x": SharedHandle(os.getpid(), fd, os.fstat(fd).st_ino, 8, "torch.int64", (1,), (1,), 0)})
    assert small.read_bytes() == b"abc"  # not grown to 8 bytes, nothing written


def test_running_out_of_open_files_is_said_as_such_not_as_a_dead_peer():
    image = torch.full((8,), 3.0).share_memory_()
    sent, _ = to_handles({"x": image}, [])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)  # the descriptor the next open would take
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        with pytest.raises(OSError, match="ulimit -n") as raised:
            from_handles(dict(sent))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not isinstance(raised.value, PeerError) and raised.value.errno == errno.EMFILE
    assert torch.equal(from_handles(dict(sent))["x"], image)


def test_routes_follow_who_read_whose_probe():
    def open_routes(rank, transport):
        return HandleRoutes.open(transport, enabled=rank != 2)

    routes = run_virtual_ranks(open_routes, 3, timeout_s=30)
    assert [r.to for r in routes] == [(False, True, False), (True, False, False), (False, False, False)]
    alone = run_virtual_ranks(lambda rank, t: HandleRoutes.open(t, enabled=rank == 0), 2, timeout_s=30)
    assert all(not any(r.to) for r in alone)


def test_a_rank_that_may_receive_handles_raises_its_open_files_limit():
    """Each received tensor keeps a file open until it is freed: a rank that may receive handles raises its soft
    limit for them (NOTE [ The pipe or shared memory ]); one that may not, leaves it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 64
    want = min(low + 500, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        run_virtual_ranks(lambda rank, t: HandleRoutes.open(t, enabled=False, open_files=want), 2, timeout_s=30)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low
        routes = run_virtual_ranks(lambda rank, t: HandleRoutes.open(t, enabled=True, open_files=want), 2,
                                   timeout_s=30)
        assert all(r.receives for r in routes) and resource.getrlimit(resource.RLIMIT_NOFILE)[0] == want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class _TableLane:
    """A lane whose second all_gather returns a given who-read-whose table (one-way reads: a container that sees
    the host's pids but not the reverse, or `/proc` rules that let one process in and not the other)."""

    def __init__(self, rank: int, table: list[list[int]]) -> None:
        self.rank, self.world_size, self.table, self.calls = rank, len(table), table, 0

    def all_gather(self, values: list[int]) -> list[list[int]]:
        self.calls += 1
        return [list(values)] * self.world_size if self.calls == 1 else self.table


def test_routes_send_to_the_ranks_that_read_this_ranks_probe_not_to_those_it_read():
    table = [[0, 0, 0], [1, 0, 0], [0, 0, 0]]  # rank 1 read rank 0's probe; rank 0 read nobody's
    assert HandleRoutes.open(_TableLane(0, table), enabled=True).to == (False, True, False)
    assert HandleRoutes.open(_TableLane(1, table), enabled=True).to == (False, False, False)


def test_a_dict_subclass_keeps_its_type_and_its_handles_open():
    class Feature(dict):
        pass

    image = torch.full((8, 8), 3.0).share_memory_()
    sent, handled = to_handles(Feature(pixel_values=image, n=1), [])
    assert type(sent) is Feature and type(sent["pixel_values"]) is SharedHandle and handled == 256
    got = from_handles(sent)
    assert type(got) is Feature and torch.equal(got["pixel_values"], image) and got["n"] == 1


def test_plain_tuples_of_a_received_sample_are_left_alone():
    image = torch.ones(4, 4).share_memory_()
    sent, _ = to_handles({"pixel_values": image, "size": (4, 4), "crop": (0, 0, 2, 2, 1, 1, 0, 3)}, [])
    got = from_handles(dict(sent))
    assert got["size"] == (4, 4) and got["crop"] == (0, 0, 2, 2, 1, 1, 0, 3)
    assert torch.equal(got["pixel_values"], image)


def test_opening_handles_leaves_no_descriptor_behind_once_the_tensors_are_freed():
    image = torch.full((64, 64), 1.0).share_memory_()
    sent, _ = to_handles({"pixel_values": image}, [])
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        assert from_handles(dict(sent))["pixel_values"].sum().item() == 4096.0
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_the_host_key_changes_with_the_dev_shm_mount(monkeypatch):
    """Two containers of one kernel, each with a /dev/shm of its own, must not count as one host."""
    real, key = os.stat("/dev/shm"), host_key()

    class OtherMount:
        st_dev, st_ino = real.st_dev, real.st_ino + 1

    monkeypatch.setattr(os, "stat", lambda path, *a, **k: OtherMount() if path == "/dev/shm" else real)
    assert host_key() not in (key, 0)


def test_a_receiver_whose_owner_is_gone_raises_naming_the_file():
    handle = SharedHandle(pid=2**22 + 7, fd=3, inode=1, nbytes=8, dtype="torch.int64", shape=(1,), stride=(1,),
                          offset=0)
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


def _records(world: int, dataset_class: type | None = None, **options) -> list[dict]:
    def rank_body(rank, transport):
        dataset = (dataset_class or SharedImages)(mixed_lengths(240), 60)
        loader = ODBDataLoader(dataset, token_budget=2048, transport=transport, shuffle=True, window=32, **options)
        epochs = [[(batch.info, tuple((key, tuple(value.shape), value.flatten().tolist())
                                      for key, value in sorted(batch.items()) if isinstance(value, torch.Tensor)))
                   for batch in loader] for _ in range(2)]
        lane = loader._lane
        record = {"epochs": epochs, "moved_samples": loader.metrics.moved_samples,
                  "moved_bytes": loader.metrics.moved_bytes, "lane_bytes": lane.transport.stats.bytes_sent,
                  "lane_calls": lane.transport.stats.calls, "handles": any(lane.routes.to)}
        loader.close()
        return record

    return run_virtual_ranks(rank_body, world, timeout_s=60)


@pytest.mark.parametrize(("world", "options"), [(2, {}), (3, {}), (4, {"nproc_per_node": 2})],
                         ids=["W2", "W3", "2x2-nodes"])
def test_virtual_ranks_with_handles_run_the_batches_and_counters_of_the_frames(world, options):
    handles = _records(world, **options)
    frames = _records(world, shared_memory_moves=False, **options)
    assert [r["epochs"] for r in handles] == [r["epochs"] for r in frames]
    assert [r["moved_samples"] for r in handles] == [r["moved_samples"] for r in frames]
    for by_handle, by_frame in zip(handles, frames, strict=True):
        assert by_handle["handles"] and not by_frame["handles"]
        assert by_handle["moved_bytes"] == pytest.approx(by_frame["moved_bytes"], rel=0.01)
        assert by_handle["lane_bytes"] < by_frame["lane_bytes"] / 5  # the images stayed where they were
        assert by_handle["lane_calls"] > by_frame["lane_calls"]  # and the ranks met after those exchanges
    assert sum(r["moved_bytes"] for r in handles) > 1_000_000


def test_rounds_that_pass_no_handle_end_their_exchanges_without_a_meeting():
    """Samples without a shared file (text, or images read without workers) never go by handle, so the lane runs
    exactly the collectives it runs with handles off: no meeting after each exchange."""
    on = _records(2, ImagesFromDataset)
    off = _records(2, ImagesFromDataset, shared_memory_moves=False)
    assert [r["epochs"] for r in on] == [r["epochs"] for r in off]
    assert [r["lane_calls"] for r in on] == [r["lane_calls"] for r in off]
    assert [r["lane_bytes"] for r in on] == [r["lane_bytes"] for r in off]
    assert all(r["handles"] for r in on)  # the routes allow handles; no sample needed one


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
    let go at once (not kept by the exception's traceback, which the lane's future holds)."""
    keep = [torch.UntypedStorage._new_shared(64)]
    lane = VirtualTransport(VirtualHub(2, timeout_s=0.3), 0)
    with pytest.raises(PeerError):
        _exchange(lane, [None, None], keep, meet=True)
    assert keep == []


def test_a_receiver_that_fails_to_open_a_handle_still_meets_so_the_next_exchange_runs():
    """The receiver cannot map what it received (here a handle that names another file): it raises, but only
    after the ranks met, so both lanes stay in step and the next exchange carries its samples."""
    image = torch.full((4,), 5.0).share_memory_()
    fd = image.untyped_storage()._get_shared_fd()
    forged = {"x": SharedHandle(os.getpid(), fd, os.fstat(fd).st_ino + 1, 16, "torch.float32", (4,), (1,), 0)}
    hub, outcomes = VirtualHub(2, timeout_s=5), {}

    def run(rank: int, frames: list) -> None:
        lane = VirtualTransport(hub, rank)
        try:
            _exchange(lane, frames, [], meet=True)
            outcomes[rank, 1] = "ok"
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcomes[rank, 1] = type(exc).__name__
        outcomes[rank, 2] = _exchange(lane, [None, pickle_samples([{"y": 7}])] if rank == 0 else [None, None], [],
                                      meet=False)

    threads = [threading.Thread(target=run, args=(0, [None, pickle_samples([forged])])),
               threading.Thread(target=run, args=(1, [None, None]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert outcomes[0, 1] == "ok" and outcomes[1, 1] == "ValueError"
    assert outcomes[1, 2] == {0: [{"y": 7}]} and outcomes[0, 2] == {}


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


def test_a_rank_that_turned_handles_off_receives_every_byte_in_frames():
    """In one process every rank could open the others' files, so only the bytes show who sent handles to whom."""
    def received(setting) -> list[int]:
        def rank_body(rank, transport):
            loader = ODBDataLoader(SharedImages(mixed_lengths(180), 0), token_budget=2048, transport=transport,
                                   shuffle=True, window=32, shared_memory_moves=setting(rank))
            for _ in loader:
                pass
            got = loader._lane.transport.stats.bytes_received
            loader.close()
            return got

        return run_virtual_ranks(rank_body, 3, timeout_s=60)

    mixed, frames = received(lambda rank: rank != 1), received(lambda rank: False)
    assert mixed[1] >= 0.95 * frames[1] and mixed[1] > 1_000_000
    assert mixed[0] < 0.8 * frames[0]  # rank 0 still gets rank 2's images by handle


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gloo_ranks_with_workers_pass_images_by_handle_and_run_the_batches_of_the_frames(tmp_path):
    """Real Gloo ranks, each with 2 forked DataLoader workers that send 1 MiB images through shared-memory files
    (`worker_regions=False`; with regions: tests/test_worker_region.py)."""
    files = {"worker_regions": False}
    runs = image_runs(tmp_path, {"handles": {"shared_memory_moves": True, **files},
                                 "frames": {"shared_memory_moves": False, **files}})
    assert [runs["handles"][r]["epochs"] for r in (0, 1)] == [runs["frames"][r]["epochs"] for r in (0, 1)]
    assert sum(e["moved_samples"] for r in (0, 1) for e in runs["handles"][r]["epochs"]) > 0
    for rank in (0, 1):
        assert runs["handles"][rank]["lane_bytes_sent"] < runs["frames"][rank]["lane_bytes_sent"] / 20


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("regions", [False, True])  # handles to files, or to the workers' regions (lent spans)
def test_a_gloo_rank_killed_while_its_images_go_by_handle_gives_its_peer_a_peer_error(tmp_path, regions):
    options = {"worker_regions": regions}
    case = Case(world_size=2, lengths=mixed_lengths(240), window=32, shuffle=True, first_image=0, num_workers=2,
                context="fork", image_width=512, fault="kill-rank", fault_rank=1, fault_after=3, prefetch_steps=0,
                liveness_timeout_s=5.0, options_by_rank={"0": options, "1": options})
    result = run_job(case, "env", tmp_path, timeout_s=200)
    assert not result.timed_out, result.output[-4000:]
    survivor = result.records[0]
    assert survivor["is_peer_error"] and survivor["blocked_s"] < 30, survivor
