"""NOTE [ Shared memory runs out ] (odb_core/data/sendable.py): a worker moves its tensors over the pipe limit into
shared memory itself, so that a full /dev/shm is an error naming the sample instead of a chunk dropped by the
queue's feeder thread and a rank that waits for it forever.

The end-to-end cases run a loader in a child process with a /dev/shm of its own (a tmpfs mounted in a new user
and mount namespace, `unshare -rm`); they are skipped where the machine does not allow one."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from collections import OrderedDict, UserDict, defaultdict
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from odb_core.data.sendable import (PACK_LIMIT_BYTES, PackedTensor, move_to_shared, pack_sample, share_large,
                                    unpack_sample)
from odb_core.data.sources import Handover

ROOT = Path(__file__).resolve().parents[1]


def test_share_large_puts_what_the_pipe_does_not_take_in_shared_memory():
    big = torch.arange(PACK_LIMIT_BYTES // 4 + 1, dtype=torch.float32)  # just over the limit
    frames = [torch.full((PACK_LIMIT_BYTES // 2,), 7, dtype=torch.int16), torch.ones(3)]
    sample = share_large(pack_sample({"input_ids": torch.arange(5), "pixel_values": big, "frames": frames}))
    assert type(sample["input_ids"]) is PackedTensor  # small: the pipe, untouched here
    assert sample["pixel_values"] is big and big.is_shared()
    assert torch.equal(big, torch.arange(PACK_LIMIT_BYTES // 4 + 1, dtype=torch.float32))  # values kept
    assert all(frame.is_shared() for frame in frames)  # tensors in a list value are sent as tensors too
    assert torch.equal(frames[0], torch.full((PACK_LIMIT_BYTES // 2,), 7, dtype=torch.int16))
    for other in ([1, 2], "text", None):
        assert share_large(other) is other


def test_share_large_looks_into_mappings_and_lists_and_leaves_what_torch_sends_its_own_way():
    """HF's processors return a `BatchFeature` (a UserDict); datasets nest images in dicts or lists; a parameter is
    a tensor subclass. Sparse and nested tensors have no storage to share: torch's own reducers send them."""
    pixels, frame, weight = torch.ones(1 << 18), torch.ones(3), torch.nn.Parameter(torch.ones(1 << 18))
    sparse = torch.eye(3).to_sparse()
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    sample = UserDict({"images": {"pixel_values": pixels}, "frames": [frame], "weight": weight, "ids": [1, 2, 3],
                       "sparse": sparse, "nested": nested})
    assert share_large(sample) is sample
    assert pixels.is_shared() and frame.is_shared() and weight.is_shared()
    assert torch.equal(pixels, torch.ones(1 << 18)) and sample["ids"] == [1, 2, 3]
    assert torch.equal(sparse.to_dense(), torch.eye(3)) and nested.is_nested



def test_a_move_keeps_each_tensors_values_layout_and_what_else_reads_its_memory():
    """`move_to_shared` points the one tensor at a new shared file: values and shape kept; a transpose over its
    whole storage and an `expand` keep their strides (an expand stays one element); a slice takes its own
    elements; a Parameter stays a Parameter requiring grad; a view and a numpy array over the old memory still
    read it."""
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    cases = {"transposed": base.clone().t(), "expanded": torch.tensor([5.0]).expand(1000),
             "sliced": torch.arange(100.0)[10:20], "flags": torch.tensor([True, False, True]),
             "parameter": torch.nn.Parameter(torch.ones(4))}
    expected = {name: tensor.detach().clone() for name, tensor in cases.items()}
    strides = {name: tensor.stride() for name, tensor in cases.items()}
    elsewhere = cases["transposed"].t()  # a view the dataset keeps
    as_numpy = cases["sliced"].numpy()
    for name, tensor in cases.items():
        left = move_to_shared(tensor)
        assert tensor.is_shared() and torch.equal(tensor.detach(), expected[name]), name
        assert left is not None and not left.is_shared(), name
    assert cases["transposed"].stride() == strides["transposed"] and cases["expanded"].stride() == (0,)
    assert cases["expanded"].untyped_storage().nbytes() == 4 and cases["sliced"].untyped_storage().nbytes() == 40
    assert type(cases["parameter"]) is torch.nn.Parameter and cases["parameter"].requires_grad
    assert not elsewhere.is_shared() and torch.equal(elsewhere, base.clone())
    assert (as_numpy == torch.arange(10.0, 20.0).numpy()).all()


def test_inference_tensors_and_conjugate_views_move_with_their_values():
    """A dataset that computes under `torch.inference_mode()` returns inference tensors, which refuse an in-place
    `set_` outside that mode; a conjugate (or negative) view carries a bit that a copy of its values must not get
    twice: torch's own move takes those."""
    with torch.inference_mode():
        features = torch.ones(1 << 18)
    waves = torch.arange(40.0).to(torch.complex64).mul(1 + 2j)[10:20].conj()
    expected = waves.resolve_conj().clone()
    sample = share_large(pack_sample({"features": features, "waves": [waves]}))
    assert sample["features"] is features and features.is_shared() and bool((features == 1).all())
    assert waves.is_shared() and torch.equal(waves.resolve_conj(), expected)


class _GatedImage(torch.Tensor):
    """An image whose move into shared memory (its `set_` to the new file, `move_to_shared`) first waits (up to
    10 s) for `gate`, and records whether it opened."""

    def set_(self, *args, **kwargs):
        self.opened = self.gate.wait(10)
        return super().set_(*args, **kwargs)


def test_a_workers_sample_moves_to_shared_memory_while_the_next_one_is_read():
    """NOTE [ Sharing beside processing ]: a worker hands a sample's large tensors to its share lane and reads
    (processes) the next sample meanwhile. The first image's move waits until the second sample's read has begun,
    and that read waits until the first image is in shared memory: both hold only if the move runs beside the
    read. Moved before the next read (in line), the move waits in vain (`opened` is False); moved after all the
    reads (the chunk at once), the read times out."""
    first = torch.ones(1 << 18).as_subclass(_GatedImage)  # 1 MiB: over the pipe limit
    first.gate = threading.Event()

    def pairs():
        yield 0, {"input_ids": torch.arange(4), "pixel_values": first}
        first.gate.set()
        deadline = time.monotonic() + 20
        while not first.is_shared():
            assert time.monotonic() < deadline, "the first image was not moved while the next sample was read"
            time.sleep(0.001)
        yield 1, {"input_ids": torch.arange(3), "pixel_values": torch.ones(1 << 18)}

    handed = Handover(pack=True).each(pairs())
    assert first.opened, "the first image was moved before the next sample was read, not beside it"
    assert [index for index, _ in handed] == [0, 1]
    assert all(sample["pixel_values"].is_shared() for _, sample in handed)
    assert all(type(sample["input_ids"]) is PackedTensor for _, sample in handed)


def _through_the_pipe(handed):
    """What the rank gets: the chunk pickled as the worker's queue feeder does, after the worker's memory is reused."""
    data = io.BytesIO()
    ForkingPickler(data, pickle.HIGHEST_PROTOCOL).dump(handed)
    reused = [torch.full((1 << 16,), -1.0) for _ in range(64)]  # what the worker's next reads would allocate
    del reused
    return [(index, unpack_sample(sample)) for index, sample in pickle.loads(data.getvalue())]


def _sevens(value):
    return bool((value == 7.0).all())


@pytest.mark.parametrize("order", ["moved, then packed", "packed, then moved", "a view, then the whole",
                                   "a view and the whole in one sample"])
def test_a_storage_two_fields_hold_reaches_the_rank_intact(order):
    """NOTE [ Sharing beside processing ]: `share_memory_()` moved a tensor's storage and freed the old memory
    under every other reader. An image held by two samples of a chunk, or by two fields of one sample, large
    (moved) in one and small enough in the other to be packed for the pipe, must reach the rank intact, in either
    order (reviews found the packed one corrupted in each order, and a worker crashed on the views; without the
    lane too)."""
    image = torch.full((PACK_LIMIT_BYTES // 8,), 7.0)  # 256 KiB: packed at the top level, moved when nested
    big = torch.full((1 << 20,), 7.0)  # 4 MiB: always moved
    samples = {"moved, then packed": [{"images": [image]}, {"pixel_values": image}],
               "packed, then moved": [{"pixel_values": image}, {"images": [image]}],
               "a view, then the whole": [{"thumb": big[:1000]}, {"pixel_values": big}],
               "a view and the whole in one sample": [{"pixel_values": big, "thumb": big[:1000]}]}[order]
    for handed in (Handover(pack=True).each(enumerate(samples)),
                   list(enumerate(Handover(pack=True).chunk(samples)))):
        for _, sample in _through_the_pipe(handed):
            for value in sample.values():
                assert all(_sevens(v) for v in (value if isinstance(value, list) else [value]))


def test_slices_of_one_preloaded_tensor_reach_the_rank_intact():
    """A view into a larger storage is moved in line, and only its own elements go into shared memory: the
    preloaded tensor stays where it is, for the next samples' slices (`share_memory_()` moved it whole)."""
    preloaded = torch.arange(4 << 18, dtype=torch.float32)  # 4 MiB; each sample a 1 MiB slice of it
    handed = Handover(pack=True).each((i, {"pixel_values": preloaded[i << 18 : (i + 1) << 18]}) for i in range(4))
    assert not preloaded.is_shared() and torch.equal(preloaded, torch.arange(4 << 18, dtype=torch.float32))
    assert all(s["pixel_values"].untyped_storage().nbytes() == 1 << 20 for _, s in handed)
    for i, sample in _through_the_pipe(handed):
        assert torch.equal(sample["pixel_values"], torch.arange(i << 18, (i + 1) << 18, dtype=torch.float32))


ALIASING = """
import io, pickle, sys, time, torch
from multiprocessing.reduction import ForkingPickler
from odb_core.data.sendable import unpack_sample
from odb_core.data.sources import Handover
images = [torch.full((1 << 21,), float(i)) for i in range(8)]  # 8 MiB each, moved on the share lane
def read_back(handed):
    data = io.BytesIO()
    ForkingPickler(data, pickle.HIGHEST_PROTOCOL).dump(handed)
    return [(i, unpack_sample(sample)) for i, sample in pickle.loads(data.getvalue())]
def kept_by_the_dataset():  # the dataset keeps a numpy view of each image it returns, and reads it for the next
    kept = None
    for i, image in enumerate(images):
        time.sleep(0.02)  # processing, while the lane moves the previous image
        seen = [float(kept.sum())] if kept is not None else []
        kept = image.numpy()
        yield i, {"pixel_values": image, "seen": torch.tensor(seen)}
def read_by_the_next():  # the next sample's processing reads the image the previous sample returned, which the
    prev = None  # lane may be moving meanwhile: the read must not lose its memory under it
    for i in range(8):
        seen = [float(prev.double().sum())] if prev is not None else []
        prev = torch.full((1 << 22,), float(i))  # 16 MiB
        yield i, {"pixel_values": prev, "seen": torch.tensor(seen)}
def numpy_beside():  # the sample holds its image and a numpy array over the image's memory
    for i, image in enumerate(images):
        yield i, {"pixel_values": image, "as_numpy": image.numpy()}
ok = True
for _ in range(5):
    cases = {"kept": (kept_by_the_dataset, 1 << 21), "read": (read_by_the_next, 1 << 22), "numpy": (numpy_beside, 0)}
    make, size = cases[sys.argv[1]]
    for i, sample in read_back(Handover(pack=True).each(make())):
        ok &= bool((sample["pixel_values"] == i).all())
        ok &= bool((sample["seen"] == (i - 1) * size).all()) if "seen" in sample else True
        ok &= bool((sample["as_numpy"] == i).all()) if "as_numpy" in sample else True
print("intact" if ok else "corrupted")
"""


@pytest.mark.parametrize("case", ["kept", "read", "numpy"])
def test_a_tensor_others_read_is_not_freed_under_them_by_its_move(case):
    """NOTE [ Sharing beside processing ]: the move points the sample's tensor at a new shared file and leaves its
    old memory to whatever else reads it: a dataset that keeps a numpy view of each image it returns and reads it
    while processing the next sample, after the lane moved it (`kept`); the next sample's processing reading the
    image itself while the lane moves it (`read`: the lane keeps the storage it left until that read has ended);
    and a numpy array over the image's memory in the same sample (`numpy`). Each read freed memory when the move
    freed it (`share_memory_()`, or without the lane's keeping for `read`) and crashed the worker, so the case runs
    in a child process."""
    # large blocks come from mmap and go back to the system when freed, so a read of freed memory faults
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run([sys.executable, "-c", ALIASING, case], env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "intact"), done.stderr[-2000:]


def test_a_samples_mapping_type_survives_the_pipe():
    """`unpack_sample` gives the mapping type the dataset returned: an OrderedDict or a defaultdict stays one
    (packing used to make a plain dict of it)."""
    samples = [OrderedDict(input_ids=torch.arange(5), pixel_values=torch.ones(1 << 18)),
               defaultdict(list, input_ids=torch.arange(3))]
    for _, sample in _through_the_pipe(Handover(pack=True).each(enumerate(samples))):
        assert type(sample) in (OrderedDict, defaultdict) and torch.equal(sample["input_ids"], torch.arange(
            5 if type(sample) is OrderedDict else 3))
    assert _through_the_pipe(Handover(pack=True).each([(1, samples[1])]))[0][1].default_factory is list


def test_handing_over_one_by_one_gives_what_handing_over_a_chunk_gives():
    """`each` (a worker's map-style reads, streams) and `chunk` (a dataset's own `__getitems__`) hand text over
    alike: ids compacted, small tensors packed."""
    samples = [{"input_ids": list(range(n)), "labels": list(range(n)), "mask": torch.ones(n)} for n in (3, 5, 2)]
    handover = Handover(pack=True, compact=True)
    one_by_one = handover.each(enumerate(samples))
    at_once = handover.chunk(samples)
    assert [index for index, _ in one_by_one] == [0, 1, 2]
    for (_, a), b in zip(one_by_one, at_once, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert type(a[key]) is type(b[key])
            left = a[key].array if type(a[key]) is PackedTensor else a[key]
            right = b[key].array if type(b[key]) is PackedTensor else b[key]
            assert (left == right).all()

SCRIPT = """
import sys, torch
from collections import UserDict
from odb_core import ODBDataLoader
class Images(torch.utils.data.Dataset):  # 1 MiB of pixels each: over the pipe limit, one shared file apiece
    def __len__(self): return 64
    def __getitem__(self, i):
        pixels = torch.full((1 << 18,), 1.0)
        if sys.argv[1] == "nested":  # as an HF processor's BatchFeature (a UserDict), the images one level down
            return UserDict({"input_ids": torch.arange(8) + 3, "images": {"pixel_values": pixels}})
        if sys.argv[1] == "sparse":  # moved by torch's reducer in the queue's feeder thread
            return {"input_ids": torch.arange(8) + 3, "mask": pixels.to_sparse()}
        if sys.argv[1] == "nestedtensor":  # moved by torch's reducer in the queue's feeder thread
            return {"input_ids": torch.arange(8) + 3, "parts": torch.nested.nested_tensor([pixels[:9], pixels[9:]])}
        if sys.argv[1] == "deep":  # 5 levels down: past what the worker moves itself
            return {"input_ids": torch.arange(8) + 3, "a": {"b": {"c": {"d": {"e": pixels}}}}}
        return {"input_ids": torch.arange(8) + 3, "pixel_values": pixels}
loader = ODBDataLoader(Images(), token_budget=64, window=64, num_workers=2, max_batch_size=8,
                       worker_regions=sys.argv[2:] == ["regions"])
try:
    print("read", sorted(i for batch in loader for i in batch.info.indices) == list(range(64)))
except Exception as exc:
    print("error", type(exc).__name__, exc)
"""


def _run_with_shm(size_mib: int, kind: str = "flat", regions: bool = False) -> subprocess.CompletedProcess:
    shell = (f"mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm && exec {sys.executable} -c \"$SCRIPT\" {kind}"
             + (" regions" if regions else ""))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SCRIPT": SCRIPT}
    return subprocess.run(["unshare", "-rm", "sh", "-c", shell], env=env, capture_output=True, text=True, timeout=90)


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None or sys.platform != "linux":
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


needs_namespace = pytest.mark.skipif(not _namespaces_allowed(), reason="no user and mount namespace here (unshare)")


@needs_namespace
@pytest.mark.parametrize(("kind", "fields"), [
    ("flat", ["'pixel_values' (a tensor of 1.0 MiB)"]),
    # a UserDict sample is not packed, so its small ids go through shared memory too, and fail first when
    # /dev/shm has not one page left
    ("nested", ["'images.pixel_values' (a tensor of 1.0 MiB)", "'input_ids' (a tensor of 0.0 MiB)"])])
def test_a_full_dev_shm_is_an_error_naming_the_sample_not_a_hang(kind, fields):
    """64 samples of 1 MiB into a 16 MiB /dev/shm: the rank buffers more than fits. Before, the feeder thread
    printed the failure, dropped the chunk, and the run hung until this test's timeout."""
    done = _run_with_shm(16, kind)
    assert done.returncode == 0, done.stderr[-2000:]
    error = done.stdout.strip()
    assert error.startswith("error SampleError sample "), (error, done.stderr[-2000:])
    assert any(f"field {field} could not be put in shared memory" in error for field in fields), (fields, error)
    for said in ("No space left on device", "/dev/shm holds 16 MiB", "--shm-size", "max_buffer_bytes"):
        assert said in error, (said, error)


@needs_namespace
@pytest.mark.parametrize(("kind", "field"), [
    ("sparse", "'mask' (a torch.sparse_coo torch.float32 tensor of shape (262144,))"),
    ("nestedtensor", "'parts' (a nested torch.float32 tensor of 2 parts)"),
    ("deep", "'a.b.c.d.e' (a torch.strided torch.float32 tensor of shape (262144,))")])
def test_a_full_dev_shm_met_in_the_queues_feeder_is_an_error_naming_the_sample(kind, field):
    """What the worker leaves to torch's reducer (a sparse or nested tensor, one deeper than `share_large` looks)
    is moved in the queue's feeder thread, where a full /dev/shm dropped the chunk and the rank hung until this
    test's timeout (NOTE [ A chunk the feeder cannot send ] in feeder.py)."""
    done = _run_with_shm(16, kind)
    assert done.returncode == 0, done.stderr[-2000:]
    error = done.stdout.strip()
    assert error.startswith("error SampleError sample "), (error, done.stderr[-2000:])
    assert f"field {field} could not be pickled to leave its DataLoader worker" in error, error
    for said in ("No space left on device", "/dev/shm holds 16 MiB", "--shm-size", "max_buffer_bytes"):
        assert said in error, (said, error)


@needs_namespace
@pytest.mark.parametrize("kind", ["flat", "deep"])  # (the default collator batches no sparse tensor)
def test_the_same_run_reads_every_sample_once_when_dev_shm_has_room(kind):
    done = _run_with_shm(256, kind)  # what the cases above miss is room, not the namespace
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "read True", (done.stdout, done.stderr[-2000:])



@needs_namespace
def test_a_workers_region_is_not_in_dev_shm_so_a_small_one_holds_top_level_images():
    """`worker_regions` (NOTE [ A worker's region ] in odb_core/data/worker_region.py): the region is an anonymous
    memory file, outside /dev/shm, so the 64 images that overflow a 16 MiB /dev/shm above are read; images one level
    down still take files of their own there, and still fail by name."""
    done = _run_with_shm(16, "flat", regions=True)
    assert done.returncode == 0 and done.stdout.strip() == "read True", (done.stdout, done.stderr[-2000:])
    nested = _run_with_shm(16, "nested", regions=True)
    assert nested.stdout.strip().startswith("error SampleError sample "), (nested.stdout, nested.stderr[-2000:])
    assert "'images.pixel_values' (a tensor of 1.0 MiB)" in nested.stdout
