"""A worker's large tensors go through one shared region it reuses (`worker_regions=True`; NOTE [ A worker's region ]
in odb_core/data/worker_region.py; issue 27, design.md item 9).

Through real loaders and their worker processes: the batches are the ones without regions (dicts and `UserDict`s,
float, bfloat16, int and bool tensors, a transposed image and a list that go the file way beside them; W = 2 under
global planning, where moved samples travel in frames), persistent workers left early hand over every sample, a
region too small for what the rank holds falls back to files without waiting, and a killed worker is reported.
In one process, on real sockets and a real memory file: spans are reused first fit and joined when given back, a
span comes back only when the last view of it is dropped, a chunk that cannot be sent takes its tensors out of the
region, and a tensor that fits no span keeps its own.
"""

from __future__ import annotations

import gc
import hashlib
import array
import errno
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections import UserDict
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from odb_core import ODBDataLoader, WorkerDiedError
from odb_core.data import worker_files, worker_region
from odb_core.data.worker_files import FileInbox, attach, send_files
from odb_core.data.region_maps import RegionMaps, flush_borrowed, region_handle
from odb_core.data.sendable import Unsendable
from odb_core.data.worker_region import (ALIGN, LENT, MAX_SPANS, MIN_REGION, RegionSlot, give_back_address,
                                         offset_of, placed, region_size, regions_of, settled)
from odb_core.ranks.shared_handles import SharedHandle, from_handles, to_handles
from dist_cases import Case, child_pids, image_runs, mixed_lengths, run_job, wait_until
from test_worker_files import FeatureImages, Images, KeepSamples, check

pytestmark = [pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd_create here"),
              pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:Sparse invariant checks")]


class Mixed(Dataset):
    """Text of varied length with an image, a bool mask and an int grid: what a VLM sample holds."""

    def __init__(self, size: int = 96, pixels: int = 200_000) -> None:
        self.size, self.pixels = size, pixels

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        n = 20 + (index * 37) % 90
        return {"input_ids": torch.arange(n) % 50 + 1, "labels": torch.arange(n) % 50 + 1,
                "pixel_values": torch.full((self.pixels,), float(index)) + torch.arange(self.pixels) * 1e-3,
                "image_mask": torch.arange(3 * self.pixels) % (index + 2) == 0,  # bools, over the pipe's limit
                "image_grid_thw": torch.tensor([[1, index % 7 + 1, 16]])}


def digest(loader: ODBDataLoader, epochs: int = 1) -> tuple[str, int]:
    """A hash of every step's indices and tensors, and the steps."""
    h, steps = hashlib.sha256(), 0
    for _ in range(epochs):
        for batch in loader:
            steps += 1
            h.update(repr((batch.info.indices, batch.info.is_idle)).encode())
            for key in sorted(batch):
                value = batch[key]
                if isinstance(value, torch.Tensor):
                    h.update(key.encode() + repr((value.dtype, tuple(value.shape))).encode())
                    h.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest(), steps


def regions(loader: ODBDataLoader) -> RegionMaps:
    return loader._stream._watch.inbox.regions


@pytest.mark.parametrize("persistent", [False, True])
def test_batches_are_the_same_with_regions_as_without(persistent):
    runs = {}
    for on in (False, True):
        loader = ODBDataLoader(Mixed(), token_budget=600, num_workers=2, shuffle=True, window=32, worker_regions=on,
                               persistent_workers=persistent)
        runs[on] = digest(loader, epochs=2)
        if on:  # every image and mask (the tensors over the pipe's limit) went through a region, the last
            # epoch's through this inbox's (workers that are not persistent are new each epoch, with their inbox)
            assert regions(loader).mapped == 2 and regions(loader).tensors == 2 * (2 if persistent else 1) * 96
            assert loader._stream._watch.inbox.files == 0
        loader.close()
    assert runs[True] == runs[False] and runs[True][1] > 0


@pytest.mark.parametrize(("dataset", "context"), [(Images, "fork"), (FeatureImages, "fork"), (Images, "spawn"),
                                                   (Images, "forkserver")])
def test_a_workers_region_carries_its_contiguous_tensors_and_files_the_rest(dataset, context):
    """A transposed image goes the file way, the list's image and the Parameter torch's way; the contiguous
    bfloat16 map and int mask (and a `UserDict`'s ids and labels, which are not packed for the pipe) go through the
    region, with their values and dtypes (`check`)."""
    loader = ODBDataLoader(dataset(), token_budget=24, num_workers=2, collate_fn=KeepSamples(),
                           idle_sample=Images()[0], worker_regions=True, multiprocessing_context=context)
    samples = [sample for batch in loader for sample in batch["samples"]]
    assert sorted(check(sample) for sample in samples) == list(range(48))
    assert all(type(sample) is (UserDict if dataset is FeatureImages else dict) for sample in samples)
    assert loader._stream._watch.inbox.files == 48  # the transposed pixel_values
    assert regions(loader).tensors == (4 if dataset is FeatureImages else 2) * 48
    loader.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gloo_ranks_with_regions_run_the_batches_of_files_and_move_their_images_by_handle(tmp_path):
    """Real Gloo ranks under global planning, each with 2 forked workers and 1 MiB images: a moved sample's region
    tensor goes by a handle to the region, which the receiver uses in place; the steps are those of files."""
    runs = image_runs(tmp_path, {"regions": {"worker_regions": True}, "files": {"worker_regions": False}})
    # every step's image rows, their sum included (each row holds its sample's index), are the files' ones
    assert [runs["regions"][r]["epochs"] for r in (0, 1)] == [runs["files"][r]["epochs"] for r in (0, 1)]
    assert sum(e["moved_samples"] for r in (0, 1) for e in runs["regions"][r]["epochs"]) > 0
    assert any(s["pixel_sum"] > 0 for r in (0, 1) for e in runs["regions"][r]["epochs"] for s in e["steps"])
    for rank in (0, 1):  # no image's bytes went through the lane either way (frames carry them: 20x more)
        assert runs["regions"][rank]["lane_bytes_sent"] < 1.2 * runs["files"][rank]["lane_bytes_sent"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gloo_ranks_that_use_moved_spans_in_place_give_every_span_back_epoch_after_epoch(tmp_path):
    """Real Gloo ranks under global planning, persistent workers with regions of `MIN_REGION` (64 MiB) and ~1.6 MB
    images, five epochs: a moved image is used in place by the receiver, and its worker gets the span back from
    both ranks, never while either reads it (each step's pixel sum is its samples'). Were the receivers' halves
    lost, ~15 MiB a worker would stay taken each epoch and later images would take files: 102 of 257 did so when
    the receiver gave nothing back, against 3 here (a region that holds the rank's round, the next fill and the
    peer's moved images is sometimes full, as it may be)."""
    options = {"worker_regions": True, "max_buffer_bytes": MIN_REGION}
    case = Case(world_size=2, lengths=mixed_lengths(160), window=32, shuffle=True, first_image=40, epochs=5,
                num_workers=2, context="fork", image_width=512, persistent_workers=True, record_carried=True,
                options_by_rank={"0": options, "1": options})
    result = run_job(case, "env", tmp_path, timeout_s=300)
    assert not result.timed_out and result.returncodes == [0, 0], result.output[-4000:]
    assert sorted(result.records) == [0, 1], result.output[-4000:]
    moved = sum(e["moved_samples"] for r in (0, 1) for e in result.records[r]["epochs"])
    assert moved > 5 * 40  # of 5 x 120 images, about half move
    lane = sum(result.records[r]["lane_bytes_sent"] for r in (0, 1))
    assert lane < 16_384 * moved  # handles, not images (~1.6 MB each in a frame): the spans were lent
    for rank in (0, 1):
        epochs = result.records[rank]["epochs"]
        carried = epochs[-1]["carried"]
        assert carried["files"] <= 0.05 * carried["regions"], [e["carried"] for e in epochs]
        assert carried["regions"] >= 5 * 40  # most of its shard's 60 images each epoch
        steps = [s for e in epochs for s in e["steps"] if not s["is_idle"]]
        # each image row holds its sample's index: a span reused while a rank read it would change a step's sum
        assert [s["pixel_sum"] for s in steps] == [
            float(sum(i * 4 * case.lengths[i] * 512 for i in s["indices"] if i >= 40)) for s in steps]


def test_persistent_workers_left_early_give_their_dropped_chunks_spans_back():
    loader = ODBDataLoader(Images(), token_budget=24, num_workers=2, persistent_workers=True, prefetch_factor=4,
                           fetch_chunk=2, window=8, collate_fn=KeepSamples(), worker_regions=True)
    for batch in loader:  # leaves with chunks read ahead and dropped by the DataLoader
        check(batch["samples"][0])
        break
    seen = [check(sample) for batch in loader for sample in batch["samples"]]
    assert sorted(seen) == list(range(48))
    assert regions(loader).returned > 0  # the dropped chunks' messages were met, and their spans given back
    loader.close()


def test_a_region_smaller_than_what_the_rank_holds_falls_back_to_files_without_waiting():
    """One worker, a region of `MIN_REGION` (64 MiB) and a rank that holds ~150 MiB of images (a window of 48
    samples of 3.2 MB each, read before the first step): the tensors that find no span take a file each, and the
    batches are the same."""
    data = Mixed(size=96, pixels=800_000)
    runs = {}
    for on in (False, True):
        loader = ODBDataLoader(data, token_budget=600, num_workers=1, shuffle=True, window=48, worker_regions=on,
                               max_buffer_bytes=16 << 20)
        assert not on or region_size(regions_of(on, 16 << 20), 1) == MIN_REGION
        runs[on] = digest(loader)
        if on:
            assert regions(loader).tensors > 0 and loader._stream._watch.inbox.files > 0
        loader.close()
    assert runs[True] == runs[False]


@pytest.mark.parametrize("persistent", [False, True])
def test_a_run_resumed_with_regions_gives_the_batches_of_one_without(persistent):
    """Exact resume re-reads the saved round's samples by index, in the rank's process, and reads the rest through
    the workers' regions: the steps after the save are those of the run that never stopped, without regions."""
    options = dict(token_budget=600, num_workers=2, shuffle=True, window=32, persistent_workers=persistent)
    whole = [digest_steps(ODBDataLoader(Mixed(), worker_regions=False, **options))]
    loader = ODBDataLoader(Mixed(), worker_regions=True, **options)
    steps = iter(loader)
    head = [step_digest(next(steps)) for _ in range(5)]
    state = loader.state_dict()
    loader.close()
    resumed = ODBDataLoader(Mixed(), worker_regions=True, **options)
    resumed.load_state_dict(state)
    assert head + digest_steps(resumed) == whole[0] and len(whole[0]) > 5
    resumed.close()


def step_digest(batch) -> str:
    h = hashlib.sha256(repr((batch.info.indices, batch.info.is_idle)).encode())
    for key in sorted(batch):
        if isinstance(batch[key], torch.Tensor):
            h.update(batch[key].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest_steps(loader: ODBDataLoader) -> list[str]:
    return [step_digest(batch) for batch in loader]


def test_a_killed_worker_is_reported_with_regions():
    class Slow(Mixed):
        def __getitem__(self, index: int) -> dict:
            if index == 40:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__getitem__(index)

    loader = ODBDataLoader(Slow(), token_budget=600, num_workers=2, window=32, worker_regions=True)
    with pytest.raises(WorkerDiedError):
        for _ in loader:
            pass
    loader.close()


# -- in one process: the worker's region and the rank's mapping over real sockets ----------------------------------

@pytest.fixture
def pair(monkeypatch):
    """A worker's sender with a region, and the rank's inbox, in this one process."""
    box = FileInbox(1)
    monkeypatch.setattr(worker_files, "_SENDER", None)
    attach(box.ends[0], 0, MIN_REGION)
    yield box
    attach(box.ends[0], 0, 0)
    box.close()


def test_spans_are_reused_first_fit_and_come_back_only_when_the_last_view_is_dropped(pair):
    first = dict(pair.opened(send_files([(0, placed({"a": torch.ones(1000), "b": torch.full((100,), 2.0)}))])))[0]
    region = worker_region.worker_region()
    assert region is not None and pair.regions.mapped == 1
    assert torch.equal(first["a"], torch.ones(1000)) and torch.equal(first["b"], torch.full((100,), 2.0))
    view = first["a"][10:20]
    del first["a"]
    gc.collect()
    pair.regions.flush()
    held = region.place(torch.zeros(10))
    assert offset_of(held) == 4032 + 448  # a's span (4,000 bytes in 4,032) is held by the view: after b's
    del view
    gc.collect()
    pair.regions.flush()
    again = region.place(torch.zeros(10))
    assert offset_of(again) == 0  # a's span is back: first fit takes its start
    del first
    gc.collect()
    pair.regions.flush()
    region.release([held, again])
    region.release([again])  # twice: the second names no placement any more, and frees nothing
    region._take_back()  # b's span, given back by the rank when `first` went
    assert region._used == {} and region._free == [[0, MIN_REGION]]  # every span back, joined into one


def test_a_span_given_back_late_never_frees_a_later_placement_at_its_offset(pair):
    region = worker_region.worker_region()
    first = region.place(torch.ones(100))
    region.release([first])
    second = region.place(torch.full((100,), 2.0))
    assert offset_of(second) == offset_of(first) and second != first
    region.release([first])  # a duplicate, or a stale datagram: the offset now holds the second placement
    assert offset_of(region.place(torch.ones(100))) != offset_of(first) and len(region._used) == 2


def test_a_sample_that_cannot_be_sent_after_its_placement_gives_its_spans_back(pair):
    """`share_large` may fail after `placed` (a nested image and a full /dev/shm): the sample goes as an
    `Unsendable`, and its spans must not stay taken for the worker's life."""
    sample = placed({"x": torch.ones(1000), "y": torch.ones(2000)})
    region = worker_region.worker_region()
    assert len(region._used) == 2
    failure = Unsendable("field 'z' could not be put in shared memory")
    assert settled(sample, failure) is failure and region._used == {}
    kept = placed({"x": torch.ones(10)})
    assert settled(kept, kept) is kept and len(region._used) == 1  # a sample that goes keeps its spans


def _no_mapping_here(monkeypatch) -> None:
    """The kernel refuses this process's next mappings (ENOMEM: vm.max_map_count reached, or ulimit -v), while
    processes forked from it (DataLoader workers) still map."""
    here, real = os.getpid(), mmap.mmap

    def refused(*args, **kwargs):
        if os.getpid() == here:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", refused)


def test_a_rank_that_cannot_map_its_workers_region_says_which_why_and_what_to_do(pair, monkeypatch):
    _no_mapping_here(monkeypatch)  # the worker's region is made (the fixture), the rank's mapping is refused
    with pytest.raises(OSError) as caught:
        pair.opened(send_files([(0, placed({"x": torch.ones(1000)}))]))
    message = str(caught.value)
    assert caught.value.errno == errno.ENOMEM and "DataLoader worker 0's region, 64.0 MiB" in message
    assert "Cannot allocate memory" in message and "vm.max_map_count" in message and "worker_regions=False" in message


def test_a_rank_out_of_files_or_address_space_is_told_which_limit_to_raise(pair, monkeypatch):
    """mmap dup()s the descriptor first: a rank out of descriptors gets `ulimit -n`, not the mapping limits. And a real
    refusal: a process whose address space `ulimit -v` leaves no room for the region (no stand-in for mmap)."""
    real = mmap.mmap

    def out_of_files(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(mmap, "mmap", out_of_files)
    with pytest.raises(OSError) as caught:
        pair.opened(send_files([(0, placed({"x": torch.ones(1000)}))]))
    assert caught.value.errno == errno.EMFILE and "ulimit -n" in str(caught.value)
    assert "vm.max_map_count" not in str(caught.value) and "worker_regions=False" in str(caught.value)
    monkeypatch.setattr(mmap, "mmap", real)
    script = """
import errno, os, resource, socket
from odb_core.data.region_maps import RegionMaps
fd = os.memfd_create("region")
os.ftruncate(fd, 64 << 20)
size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) << 10
resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 20), resource.RLIM_INFINITY))
try:
    RegionMaps([socket.socketpair()[0]]).declare(0, fd, 64 << 20)
except OSError as exc:
    print(exc.errno == errno.ENOMEM, exc)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.startswith("True [Errno 12] DataLoader worker 0's region, 64.0 MiB, could not be mapped"), done
    assert "ulimit -v" in done.stdout and "worker_regions=False" in done.stdout


def test_a_receiver_that_cannot_map_a_lent_span_says_which_why_and_what_to_do(pair, monkeypatch):
    got = dict(pair.opened(send_files([(0, placed({"x": torch.arange(1000.0)}))])))[0]
    keep: list = []
    sent, _ = to_handles({"x": got["x"]}, keep)
    _no_mapping_here(monkeypatch)
    with pytest.raises(OSError) as caught:
        from_handles(pickle.loads(pickle.dumps(sent)))
    message = str(caught.value)
    assert caught.value.errno == errno.ENOMEM and "a peer rank's DataLoader worker's region" in message
    assert "vm.max_map_count" in message and "shared_memory_moves=False" in message


def test_a_loader_whose_rank_cannot_map_a_region_raises_that_error_and_leaves_no_worker(monkeypatch):
    before = set(child_pids(os.getpid()))
    _no_mapping_here(monkeypatch)
    loader = ODBDataLoader(Mixed(size=16), token_budget=600, num_workers=2, window=8, worker_regions=True)
    with pytest.raises(OSError, match=r"DataLoader worker \d's region, .* worker_regions=False") as caught:
        next(iter(loader))
    assert caught.value.errno == errno.ENOMEM and "vm.max_map_count" in str(caught.value)
    loader.close()
    gc.collect()
    assert wait_until(lambda: not set(child_pids(os.getpid())) - before, timeout_s=10.0)


def test_a_process_forked_from_the_rank_gives_back_none_of_its_spans(pair):
    """A child forked while the rank holds region tensors (an evaluation loader's workers) inherits them: when it
    drops them, the span must not come back to the worker, which would reuse it under the rank."""
    got = dict(pair.opened(send_files([(0, placed({"x": torch.ones(1000)}))])))[0]
    region = worker_region.worker_region()
    child = os.fork()
    if child == 0:  # the child drops the tensor and flushes: nothing may reach the worker
        code = 0
        try:
            del got["x"]
            gc.collect()
            pair.regions.flush()
        except BaseException:  # noqa: BLE001 - the parent sees the exit code
            code = 1
        os._exit(code)
    assert os.waitpid(child, 0)[1] == 0
    region._take_back()
    assert len(region._used) == 1  # still the rank's
    del got["x"]
    gc.collect()
    pair.regions.flush()
    region._take_back()
    assert region._used == {}


def _lent(pair) -> tuple[dict, torch.Tensor, dict, list]:
    """A sample the rank read (`pad`, then `x` in the next span), a view into its `x`, and that view after a move
    by handle within this process: the receiver's sample, and the owner's storages the lane keeps until the
    meeting."""
    got = dict(pair.opened(send_files([(0, placed({"pad": torch.ones(30), "x": torch.arange(1000.0)}))])))[0]
    view = got["x"][10:20]
    handle = region_handle(view)
    assert handle is not None and handle.offset == (128 + 40) // 4  # x's span after pad's 128 bytes, 10 floats in
    keep: list = []
    sent, handled = to_handles({"x": view}, keep)
    assert type(sent["x"]) is SharedHandle and handled == 40 and len(keep) == 1
    return got, view, from_handles(pickle.loads(pickle.dumps(sent))), keep


def _spans_taken() -> set[int]:
    region = worker_region.worker_region()
    region._take_back()
    return {offset for offset, _ in region._used.items()}


def test_a_view_into_a_span_goes_by_a_handle_to_its_place_in_the_region(pair):
    got, view, received, keep = _lent(pair)
    assert torch.equal(received["x"], torch.arange(10.0, 20.0))
    assert received["x"].data_ptr() != view.data_ptr()  # the receiver's own mapping of the region
    view.fill_(-1.0)  # the same memory: nothing was copied
    assert torch.equal(received["x"], torch.full((10,), -1.0))
    assert region_handle(torch.ones(3)) is None
    assert region_handle(received["x"]) is None  # a borrowed span is not the receiver's to lend on: a frame
    again: list = []  # a second field over the lent storage would be a second half from one receiver: a frame
    assert to_handles({"y": got["x"]}, again) == ({"y": got["x"]}, 0) and again == []


@pytest.mark.parametrize("first", ["owner", "receiver"])
def test_a_lent_span_is_freed_only_once_the_owner_and_the_receiver_have_both_let_go(pair, first):
    """Under global planning a moved sample's region tensor is used in place by the receiver: its worker must not
    reuse the span while either rank still reads it, and must get it back once both are done."""
    got, view, received, keep = _lent(pair)
    x_span = 128
    assert _spans_taken() == {0, x_span}

    def owner_lets_go() -> None:
        nonlocal got, view
        del got, view
        keep.clear()  # the meeting: every receiver has opened what it got
        gc.collect()
        pair.regions.flush()

    def receiver_lets_go() -> None:
        received.clear()
        gc.collect()
        flush_borrowed()

    (owner_lets_go if first == "owner" else receiver_lets_go)()
    assert x_span in _spans_taken()  # one half back: the span stays taken
    again = worker_region.worker_region().place(torch.full((1000,), 7.0))
    assert offset_of(again) not in (0, x_span)
    if first == "owner":
        assert torch.equal(received["x"], torch.arange(10.0, 20.0))  # what the receiver reads is still its sample's
    (receiver_lets_go if first == "owner" else owner_lets_go)()
    assert _spans_taken() == {offset_of(again)}  # both halves back: pad's and x's spans are free


def test_two_halves_of_one_side_never_free_a_lent_span(pair):
    """The owner's half comes on the chunks' socket and a receiver's on the worker's own: a half sent twice (an
    interrupted send sent again) must not stand for the other rank's."""
    region = worker_region.worker_region()
    span = region.place(torch.ones(100))
    for _ in range(2):
        pair._mine[0].send(array.array("q", [span | LENT]).tobytes())  # from the rank's end of the pair
    region._take_back()
    assert offset_of(span) in region._used
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for _ in range(2):
        sender.sendto(array.array("q", [span | LENT]).tobytes(), give_back_address(os.fstat(region.fd).st_ino))
    region._take_back()
    assert offset_of(span) not in region._used  # a receiver's half came too
    sender.close()


def test_a_worker_that_cannot_make_its_region_says_so_and_takes_files(pair, monkeypatch, caplog):
    """No `memfd_create` (macOS, an old libc) or no memory for the region: the worker warns once, naming the cause,
    and its tensors take files; nothing fails."""
    def refused(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refused)
    with caplog.at_level(logging.WARNING, logger="odb"):
        attach(pair.ends[0], 0, MIN_REGION)
    assert worker_region.worker_region() is None
    assert "worker 0 could not make its region of 64 MiB (OSError" in caplog.text and "Function not" in caplog.text
    sample = {"x": torch.ones(1000)}
    assert placed(sample) is sample  # the file way


def test_a_worker_that_takes_no_halves_back_lends_nothing(pair, monkeypatch):
    """A worker whose own socket could not be bound would never get a receiver's half: its tensors go in frames."""
    monkeypatch.setattr(worker_region, "_bound", lambda name: None)
    attach(pair.ends[0], 0, MIN_REGION)  # a new region, without a socket of its own
    got = dict(pair.opened(send_files([(0, placed({"x": torch.arange(1000.0)}))])))[0]
    assert pair.regions.tensors == 1 and region_handle(got["x"]) is None
    keep: list = []
    assert to_handles(got, keep) == (got, 0) and keep == []


def test_a_chunk_that_cannot_be_sent_takes_its_tensors_out_of_the_region(pair):
    sample = placed({"x": torch.arange(5000.0), "n": 3})
    assert type(sample["x"]) is RegionSlot
    pair.close()  # the rank left
    out = send_files([(0, sample)])
    assert type(out[0][1]["x"]) is torch.Tensor and torch.equal(out[0][1]["x"], torch.arange(5000.0))
    assert worker_region.worker_region()._used == {}


def test_a_tensor_larger_than_the_region_keeps_its_own_memory_and_the_region_its_size(pair):
    big = torch.ones(MIN_REGION // 4 + 1)  # one element more than the region, placed first
    assert placed({"big": big})["big"] is big
    region = worker_region.worker_region()
    assert region.size == MIN_REGION and offset_of(region.place(torch.ones(10))) == 0
    assert offset_of(region.place(torch.ones(10))) == ALIGN


def test_a_chunk_lists_at_most_max_spans_and_its_other_tensors_go_as_their_own(pair):
    chunk = [(k, placed({"x": torch.full((4,), float(k))})) for k in range(MAX_SPANS + 5)]
    sent = send_files(chunk)
    assert all(type(s["x"]) is RegionSlot for _, s in sent[:MAX_SPANS])
    assert all(type(s["x"]) is torch.Tensor for _, s in sent[MAX_SPANS:])
    assert len(worker_region.worker_region()._used) == MAX_SPANS  # the others' spans were given back
    got = pair.opened(sent)
    assert all(torch.equal(s["x"], torch.full((4,), float(k))) for k, s in got)


def test_a_skipped_message_still_maps_the_region_it_declares_and_gives_its_spans_back(pair):
    dropped = send_files([(0, placed({"x": torch.ones(1000)}))])  # declares the region; never read
    kept = send_files([(1, placed({"x": torch.full((1000,), 2.0)}))])
    got = pair.opened(kept)
    assert torch.equal(got[0][1]["x"], torch.full((1000,), 2.0))
    assert pair.regions.mapped == 1 and pair.regions.returned == 1 and pair.skipped == 1
    pair.regions.flush()
    region = worker_region.worker_region()
    region._take_back()
    assert offset_of(dropped[0][1]["x"].span) not in region._used  # the dropped chunk's span is free again
