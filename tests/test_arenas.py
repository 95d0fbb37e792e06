"""Concatenations into reused memory (NOTE [ Reused collation memory ] in odb_core/data/arenas.py): the same values
as `torch.cat`, memory that some tensor still refers to never written again, and memory nothing refers to reused
instead of faulted in anew."""

from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core import ODBDataLoader, PadCollator
from odb_core.data.arenas import ArenaPool

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


def parts_of(rows: list[int], trailing: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand((n, *trailing), generator=generator) * 100).to(dtype) for n in rows]


def holds(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether the two tensors' bytes overlap."""
    a, b = tensor.data_ptr(), other.data_ptr()
    return a < b + other.nbytes and b < a + tensor.nbytes


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 40), min_size=1, max_size=6), trailing=st.sampled_from([(), (3,), (2, 5)]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_the_values_dtype_and_shape_are_torch_cats(rows, trailing, dtype, seed):
    pool = ArenaPool(min_bytes=0)
    kept = []
    for round_ in range(3):  # fresh arenas, then reused ones (the earlier results dropped), then one held
        parts = parts_of(rows, trailing, dtype, seed + round_)
        out = pool.cat(parts)
        expected = torch.cat(parts, dim=0)
        assert out.dtype == expected.dtype and out.shape == expected.shape
        assert torch.equal(out, expected)
        if round_ == 1:
            kept.append(out)
    assert torch.equal(kept[0], torch.cat(parts_of(rows, trailing, dtype, seed + 1), dim=0))


def test_memory_a_tensor_still_refers_to_is_never_written_again():
    pool = ArenaPool(min_bytes=0)
    first = pool.cat(parts_of([30, 40], (8,), torch.float32, 0))
    tail = first[50:]  # a view of the memory, the batch itself dropped
    as_array = first[:5].numpy()  # a numpy array over it
    snapshot_tail, snapshot_array = tail.clone(), as_array.copy()
    del first
    for seed in range(1, 8):
        out = pool.cat(parts_of([30, 40], (8,), torch.float32, seed))
        assert not holds(out, tail) and not holds(out, torch.from_numpy(as_array))
        del out
    assert torch.equal(tail, snapshot_tail) and np.array_equal(as_array, snapshot_array)


def test_memory_nothing_refers_to_is_reused():
    pool = ArenaPool(min_bytes=0)
    first = pool.cat(parts_of([30, 40], (8,), torch.float32, 0))
    address = first.data_ptr()
    del first
    again = pool.cat(parts_of([20, 10], (8,), torch.float32, 1))  # smaller: fits the same arena
    assert again.data_ptr() == address
    assert len(pool._held) == 1


def test_with_every_arena_in_use_it_is_a_plain_concatenation():
    pool = ArenaPool(arenas=2, min_bytes=0)
    held = [pool.cat(parts_of([10, 10], (4,), torch.float32, seed)) for seed in range(4)]
    assert len(pool._held) == 2
    for seed, out in enumerate(held):  # the two past the arenas are fresh tensors, all four intact
        assert torch.equal(out, torch.cat(parts_of([10, 10], (4,), torch.float32, seed)))
    assert not any(holds(a, b) for i, a in enumerate(held) for b in held[i + 1:])


def test_a_larger_concatenation_replaces_a_free_arena_too_small_for_it():
    pool = ArenaPool(arenas=1, min_bytes=0)
    small = pool.cat(parts_of([4], (4,), torch.float32, 0))
    del small
    large = pool.cat(parts_of([400], (4,), torch.float32, 1))
    assert len(pool._held) == 1 and pool._held[0].memory.nbytes >= large.nbytes
    assert torch.equal(large, torch.cat(parts_of([400], (4,), torch.float32, 1)))


@pytest.mark.parametrize("case", ["mixed dtypes", "grad", "small", "trailing shapes differ", "a 0-D part",
                                  "sparse"])
def test_what_an_arena_cannot_hold_goes_to_torch_cat(case):
    pool = ArenaPool(min_bytes=0 if case != "small" else 1 << 20)
    parts = parts_of([3, 4], (2,), torch.float32, 0)
    if case == "mixed dtypes":
        parts[1] = parts[1].to(torch.float64)
    if case == "grad":
        parts[0].requires_grad_(True)
    if case in ("trailing shapes differ", "a 0-D part"):
        parts[1] = torch.zeros(4, 3) if case == "trailing shapes differ" else torch.tensor(1.0)
        with pytest.raises(RuntimeError):  # torch.cat's own error, as before
            pool.cat(parts)
        return
    if case == "sparse":
        parts = [p.to_sparse() for p in parts]
    out = pool.cat(parts)
    expected = torch.cat(parts, dim=0)
    if case == "sparse":
        out, expected = out.to_dense(), expected.to_dense()
    assert out.dtype == expected.dtype and torch.equal(out.detach(), expected.detach())
    assert out.requires_grad == expected.requires_grad
    assert not pool._held


def test_release_forgets_every_arena_and_leaves_what_is_in_use_intact():
    pool = ArenaPool(min_bytes=0)
    kept = pool.cat(parts_of([10], (4,), torch.float32, 0))
    dropped = pool.cat(parts_of([10], (4,), torch.float32, 1))
    del dropped
    pool.release()
    assert not pool._held
    after = pool.cat(parts_of([10], (4,), torch.float32, 2))
    assert not holds(after, kept)
    assert torch.equal(kept, torch.cat(parts_of([10], (4,), torch.float32, 0)))


def test_release_while_the_pool_is_busy_returns_at_once():
    """A loader finalized by a garbage collection inside `_lease`, on the thread that holds the lock, releases its
    collator's pool: that must not wait for the lock its own thread holds."""
    pool = ArenaPool(min_bytes=0)
    pool.cat(parts_of([10], (4,), torch.float32, 0))
    with pool._lock:
        pool.release()  # would block for ever with a blocking acquire
    assert len(pool._held) == 1


def test_threads_collating_at_once_get_their_own_memory():
    pool = ArenaPool(min_bytes=0)
    results: dict[int, list[torch.Tensor]] = {}

    def collate(seed: int) -> None:
        """Each thread keeps its latest result while it makes the next, then checks and drops it, so arenas are
        reused while other threads lease theirs; every 5th result is kept to the end."""
        kept, previous = [], None
        for i in range(40):
            out = pool.cat(parts_of([50, 50], (16,), torch.float32, seed * 100 + i))
            if previous is not None:
                assert not holds(out, previous[1])
                assert torch.equal(previous[1], torch.cat(parts_of([50, 50], (16,), torch.float32, previous[0])))
            previous = (seed * 100 + i, out)
            if i % 5 == 0:
                kept.append(previous)
        results[seed] = kept

    threads = [threading.Thread(target=collate, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1, 2, 3]
    for outs in results.values():
        for key, out in outs:
            assert torch.equal(out, torch.cat(parts_of([50, 50], (16,), torch.float32, key)))


def test_a_copied_or_pickled_collator_starts_without_arenas():
    collator = PadCollator()
    samples = [{"input_ids": torch.arange(5), "pixel_values": torch.ones(400, 1176)} for _ in range(2)]
    batch = collator(samples)
    assert len(collator._arenas._held) == 1
    for other in (copy.deepcopy(collator), pickle.loads(pickle.dumps(collator))):
        assert not other._arenas._held
        assert torch.equal(other(samples)["pixel_values"], batch["pixel_values"])


class PixelSamples(torch.utils.data.Dataset):
    """Samples of a few tokens and ~1.2 MB of pixel rows each (past the pool's 1 MiB), values set by the index."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> dict:
        n = 8 + index % 13
        pixels = torch.full((256 + (index % 3) * 16, 1176), float(index), dtype=torch.float32)
        return {"input_ids": torch.arange(n) + 3, "labels": torch.arange(n) + 3, "pixel_values": pixels}


@pytest.mark.parametrize("keep", [False, True])
def test_the_loaders_batches_carry_their_samples_pixels_whatever_the_consumer_keeps(keep):
    """Through the loader, with the next step collated ahead in its thread: every batch's pixel rows are its
    samples', in order, when each batch is checked as it comes and dropped (the arenas reused) and when every batch
    is kept to the end (the pool falls back to fresh memory)."""
    dataset = PixelSamples()
    loader = ODBDataLoader(dataset, token_budget=256, window=32, min_window=16, max_batch_size=6)
    collator = loader._ctx.collate_fn
    kept, seen, most_held = [], [], 0
    for batch in loader:
        indices = list(batch.info.indices)
        expected = torch.cat([dataset[i]["pixel_values"] for i in indices])
        assert torch.equal(batch["pixel_values"], expected)
        seen += indices
        most_held = max(most_held, len(collator._arenas._held))
        if keep:
            kept.append((indices, batch["pixel_values"]))
        del batch
    assert sorted(seen) == list(range(len(dataset)))
    for indices, pixels in kept:
        assert torch.equal(pixels, torch.cat([dataset[i]["pixel_values"] for i in indices]))
    assert 1 <= most_held <= collator._arenas.arenas
    assert not collator._arenas._held  # the epoch's end forgot them; kept batches still hold theirs (checked above)
    loader.close()
