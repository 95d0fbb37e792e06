"""Loader sources: iterable datasets, persistent workers, epochs, patch-aware budgets, metrics."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import LengthDataset, lognormal_lengths
from odb_core import ODBDataLoader

ROOT = Path(__file__).resolve().parents[1]


class LengthStream(torch.utils.data.IterableDataset):
    def __init__(self, lengths) -> None:
        self.inner = LengthDataset(lengths)

    def __iter__(self):
        return (self.inner[i] for i in range(len(self.inner)))


def test_iterable_dataset_is_covered_once_and_independent_of_workers():
    stream = LengthStream(lognormal_lengths(200, 1.0, 64, seed=2, hi=512))
    runs = []
    for workers in (0, 2):
        loader = ODBDataLoader(stream, token_budget=1024, num_workers=workers, fetch_chunk=3)
        runs.append([b.info.indices for b in loader])
    assert runs[0] == runs[1]
    assert sorted(i for step in runs[0] for i in step) == list(range(200))


def test_persistent_workers_serve_several_epochs_with_set_epoch():
    dataset = LengthDataset(lognormal_lengths(120, 1.0, 64, seed=4, hi=512))
    loader = ODBDataLoader(dataset, token_budget=1024, num_workers=2, persistent_workers=True, shuffle=True)
    epochs = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        epochs.append([b.info.indices for b in loader])
    assert epochs[0] == epochs[2] != epochs[1]
    for run in epochs:
        assert sorted(i for step in run for i in step) == list(range(120))


class EpochShuffledStream(torch.utils.data.IterableDataset):
    """A user's stream that shuffles by `set_epoch`; sample i's tokens are all i + 3."""

    def __init__(self, n: int = 48) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(range(self.n))
        random.Random(self.epoch).shuffle(order)
        return ({"input_ids": [i + 3] * (4 + (i * 7) % 19)} for i in order)


def test_a_user_stream_s_epoch_reaches_persistent_workers_and_a_resume_in_a_later_epoch_is_exact():
    """NOTE [ A stream's epoch in persistent workers ]: before, the workers' copies read epoch 0's order in every
    epoch, and a resume inside epoch 1 (fresh workers) read epoch 1's: other batches, without an error."""
    def loader():
        return ODBDataLoader(EpochShuffledStream(), token_budget=96, num_workers=1, persistent_workers=True)

    def ids(batch):
        return [int(row[0]) - 3 for row in batch["input_ids"]]

    full, epochs = loader(), []
    for epoch in (0, 1):
        full.set_epoch(epoch)
        epochs.append([])
        for k, batch in enumerate(full):
            epochs[-1].append(ids(batch))
            if epoch == 1 and k == 2:
                state = full.state_dict()
    full.close()
    fresh = loader()  # fresh workers, which read epoch 1's order whatever the fix
    fresh.set_epoch(1)
    assert [ids(batch) for batch in fresh] == epochs[1] != epochs[0]
    fresh.close()
    resumed = loader()
    resumed.load_state_dict(state)
    assert [ids(batch) for batch in resumed] == epochs[1][3:]
    resumed.close()


class PatchDataset(torch.utils.data.Dataset):
    """VLM-style samples: a few text tokens plus image patches (rows of pixel_values) and their grid."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, index: int) -> dict:
        h, w = 2 * (1 + index % 4), 4
        ids = torch.arange(8 + index % 5)
        return {"input_ids": ids, "labels": ids, "pixel_values": torch.zeros(h * w, 6),
                "image_grid_thw": torch.tensor([[1, h, w]])}


def test_max_patches_caps_vision_rows_per_group_and_collates_vision_fields():
    loader = ODBDataLoader(PatchDataset(), token_budget=4096, max_patches=64)
    for batch in loader:
        assert batch["pixel_values"].shape[0] <= 64
        assert int(batch["image_grid_thw"].prod(dim=1).sum()) == batch["pixel_values"].shape[0]
        assert batch["image_grid_thw"].shape[0] == batch["input_ids"].shape[0]


def test_length_fn_replaces_the_default_cost():
    dataset = LengthDataset([10] * 40)
    loader = ODBDataLoader(dataset, token_budget=100, length_fn=lambda s: 50)
    assert all(b.info.local_samples == 2 for b in loader)


def test_metrics_report_utilization_padding_and_sync_traffic():
    dataset = LengthDataset(lognormal_lengths(300, 1.0, 64, seed=6, hi=512))
    loader = ODBDataLoader(dataset, token_budget=1024)
    steps = list(loader)
    summary = loader.metrics.summary()
    real = sum(b.info.local_input_tokens for b in steps)
    padded = sum(b["input_ids"].numel() for b in steps)
    assert summary["steps"] == len(steps) and summary["idle_steps"] == 0
    assert abs(summary["budget_utilization"] - real / (len(steps) * 1024)) < 1e-12
    assert abs(summary["padding_ratio"] - (1 - real / padded)) < 1e-12
    assert summary["sync_bytes"] > 0 and summary["rounds"] >= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reader_thread", [True, False])
def test_an_epoch_left_early_with_persistent_workers_leaves_the_next_epoch_whole(reader_thread):
    """A consumer that leaves an epoch after a few steps (a new iter(): NOTE [ Leaving an epoch ]) while the reader
    thread may still be reading the persistent workers' iterator: the next epoch reuses that iterator, and must
    yield what a fresh loader yields for it."""
    dataset = LengthDataset(lognormal_lengths(400, 1.0, 64, seed=4, hi=512))
    options = dict(token_budget=512, num_workers=2, persistent_workers=True, shuffle=True, window=64,
                   fetch_chunk=2, reader_thread=reader_thread)
    reference = ODBDataLoader(dataset, **options)
    reference.set_epoch(1)
    expected = [b.info.indices for b in reference]
    reference.close()
    loader = ODBDataLoader(dataset, **options)
    steps = iter(loader)
    for _ in range(3):
        next(steps)
    loader.set_epoch(1)
    assert [b.info.indices for b in loader] == expected
    assert sorted(i for step in expected for i in step) == list(range(400))
    loader.close()


class SizedPayloads(torch.utils.data.Dataset):
    """Samples whose `pixel_values` weigh 256 KiB, 512 KiB or 1 MiB by index, valued by the index."""

    SIZES = (1 << 18, 1 << 19, 1 << 20)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict:
        floats = self.SIZES[index % 3] // 4
        return {"input_ids": torch.arange(8) + 3, "pixel_values": torch.full((floats,), float(index))}


def assert_payloads_arrive(loader) -> None:
    """Every `SizedPayloads` sample arrives once through `loader`, its `pixel_values` as the dataset made them."""
    dataset, seen = SizedPayloads(), []
    for batch in loader:
        expected = torch.cat([dataset[i]["pixel_values"] for i in batch.info.indices])
        assert torch.equal(batch["pixel_values"], expected)
        seen += batch.info.indices
    assert sorted(seen) == list(range(len(dataset)))


def test_tensors_up_to_the_pipe_limit_are_pickled_and_larger_ones_travel_in_shared_memory():
    """NOTE [ The pipe or shared memory ]: a worker packs a tensor of up to 512 KiB into the pipe and hands a larger
    one over as a tensor (in shared memory); through the loader both arrive as the dataset made them."""
    from odb_core.data.sendable import PACK_LIMIT_BYTES, PackedTensor, pack_sample

    assert PACK_LIMIT_BYTES == 1 << 19
    dataset = SizedPayloads()
    kinds = [type(pack_sample(dataset[i])["pixel_values"]) for i in range(3)]
    assert kinds == [PackedTensor, PackedTensor, torch.Tensor]
    assert_payloads_arrive(ODBDataLoader(dataset, token_budget=64, num_workers=2, max_batch_size=2))


class PayloadStream(torch.utils.data.IterableDataset):
    """`SizedPayloads` as a stream (every worker reads it and keeps its own chunks)."""

    def __iter__(self):
        payloads = SizedPayloads()
        return (payloads[i] for i in range(len(payloads)))


def test_a_streams_tensors_of_every_size_arrive_as_the_dataset_made_them():
    """A stream's chunks are handed over like a map-style dataset's (`Handover.each`: small tensors packed, large
    ones moved on each worker's share lane, NOTE [ Sharing beside processing ]): through two workers every sample
    arrives once, with its values."""
    assert_payloads_arrive(ODBDataLoader(PayloadStream(), token_budget=64, num_workers=2, max_batch_size=2,
                                         fetch_chunk=3))


@pytest.mark.skipif(torch.accelerator.is_available(), reason="torch warns of pin_memory only without an accelerator")
def test_pin_memory_is_accepted_and_not_passed_on_to_the_workers_loader():
    """NOTE [ Pinned memory ]: the buffered samples are not pinned; torch's own DataLoader warns here, without an
    accelerator, when it is asked to pin (so the warning shows whether ODB passed the option on)."""
    import warnings

    dataset = LengthDataset([12] * 24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = torch.utils.data.DataLoader(dataset, num_workers=1, pin_memory=True, collate_fn=lambda x: x)
        list(plain)
    assert any("pin_memory" in str(w.message) for w in caught), "torch no longer warns: the check below is blind"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = ODBDataLoader(dataset, token_budget=64, num_workers=1, pin_memory=True)
        seen = sorted(i for batch in loader for i in batch.info.indices)
        loader.close()
    assert seen == list(range(24))
    assert not [w for w in caught if "pin_memory" in str(w.message)], [str(w.message) for w in caught]


OPEN_FILES_SCRIPT = """
import resource, sys, torch
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]) if sys.argv[2] != "hard" else hard))
from odb_core import ODBDataLoader
class Images(torch.utils.data.Dataset):  # 600 KiB of pixels each: over the pipe limit, one shared file apiece
    def __len__(self): return int(sys.argv[3])
    def __getitem__(self, i): return {"input_ids": torch.arange(8) + 3, "pixel_values": torch.full((600 * 256,), 1.0)}
loader = ODBDataLoader(Images(), token_budget=64, window=512, num_workers=2, max_batch_size=8)
seen = sum(len(batch.info.indices) for batch in loader)
print("read", seen, "soft limit", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _run_with_open_files(soft: int, hard: str, samples: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", OPEN_FILES_SCRIPT, str(soft), hard, str(samples)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_loader_raises_the_open_files_limit_its_buffered_shared_tensors_need():
    """NOTE [ The pipe or shared memory ]: 400 buffered samples each keep a shared-memory file open. Under a soft
    limit of 200 torch failed ("Too many open files"); the loader now raises the soft limit (the hard one allows
    it) to what its buffers may need, and reads them all."""
    from odb_core.data.sendable import open_files_needed

    done = _run_with_open_files(200, "hard", 400)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"read 400 soft limit {open_files_needed(1 << 30, 512)}" in done.stdout, done.stdout


def test_a_hard_limit_too_low_for_the_buffers_is_said_with_the_fixes():
    done = _run_with_open_files(300, "300", 40)  # few samples: the run itself fits
    assert done.returncode == 0, done.stderr[-2000:]
    assert "read 40 soft limit 300" in done.stdout
    warned = [line for line in done.stderr.splitlines() if line.startswith("odb: warning: this process may keep")]
    assert len(warned) == 1, done.stderr[-2000:]
    assert "may open only 300" in warned[0] and "max_buffer_bytes" in warned[0] and "file_system" in warned[0]


class RandomDraws(torch.utils.data.Dataset):
    """A dataset that draws in `__getitem__` (a random crop or template, say) and writes the draw into its ids."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        draw = int(torch.randint(0, 1_000_000, ()))
        ids = torch.tensor([draw % 1000 + 3, draw // 1000 + 3] + [3] * (3 + index % 9))
        return {"input_ids": ids, "labels": ids.clone()}


def worker_draws_by_rank() -> list[list[int]]:
    """Two virtual ranks, one forked worker each: the draws their workers made, in each rank's index order."""
    from odb_core import run_virtual_ranks

    def rank_run(rank, transport):
        loader = ODBDataLoader(RandomDraws(), token_budget=64, transport=transport, num_workers=1, shuffle=True,
                               seed=0, window=16, planning="local")  # each rank trains what its worker drew
        draws = {}
        try:
            for batch in loader:
                for index, row in zip(batch.info.indices, batch["input_ids"].tolist()):
                    draws[index] = row[0] - 3 + (row[1] - 3) * 1000
        finally:
            loader.close()
        return [draws[index] for index in sorted(draws)]

    return run_virtual_ranks(rank_run, 2, timeout_s=60.0)


def test_the_ranks_workers_draw_apart_and_the_same_in_every_run():
    """NOTE [ ODB draws nothing from the global RNG ]: the workers' seed is a function of (seed, epoch, rank), so
    random processing in `__getitem__` differs between ranks, as under the HF Trainer's `seed_worker` (before, the
    ranks' workers drew the same sequence), and repeats in a second run."""
    first, again = worker_draws_by_rank(), worker_draws_by_rank()
    assert first == again  # deterministic
    assert len(first[0]) == len(first[1]) == 32 and sorted(first[0]) != sorted(first[1]), first
