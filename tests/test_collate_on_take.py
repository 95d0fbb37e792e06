"""A round keeps its steps' samples and counts, not collated batches; a step is collated when it is taken (NOTE [ A
step is collated when it is taken ] in odb_core/epoch/collation.py). Counting from the samples is exact for a
label-preserving collator (NOTE [ Label-preserving collators ] in odb_core/data/collate.py), and a collator that
masks labels itself is still counted on its own batch.

Before, the first `next()` of a round collated every slot of the round and held the batches until they were taken:
`test_a_round_collates_only_the_step_that_is_taken` saw the collator called once per step of the round.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LengthDataset
from dist_cases import wait_until
from odb_core import CollateError, ODBDataLoader, PadCollator, run_virtual_ranks
from odb_core.epoch.collate_ahead import COLLATE_THREAD
from odb_core.data.collate import (is_label_preserving, padded_tokens, sample_padded_tokens, sample_supervised_tokens,
                                   supervised_tokens)

# -- counting from the samples ---------------------------------------------------------------------------------

ROW_KINDS = ("list", "array", "tensor", "int32 tensor")


def as_kind(values: list[int], kind: str):
    if kind == "list":
        return list(values)
    if kind == "array":
        return np.asarray(values, dtype=np.int64)
    return torch.tensor(values, dtype=torch.int32 if kind == "int32 tensor" else torch.long)


@st.composite
def labelled_sample(draw, with_labels: bool):
    n = draw(st.integers(1, 24))
    ids = draw(st.lists(st.integers(1, 500), min_size=n, max_size=n))
    sample = {"input_ids": as_kind(ids, draw(st.sampled_from(ROW_KINDS)))}
    if with_labels:
        # runs of -100 (prompts, padding a dataset wrote itself) between supervised ids; labels may be shorter or
        # longer than the ids (PadCollator pads every field to the widest row)
        m = draw(st.integers(1, 28))
        labels = draw(st.lists(st.one_of(st.just(-100), st.integers(0, 500)), min_size=m, max_size=m))
        sample["labels"] = as_kind(labels, draw(st.sampled_from(ROW_KINDS)))
    return sample


@st.composite
def groups(draw):
    with_labels = draw(st.booleans())
    return draw(st.lists(labelled_sample(with_labels), min_size=1, max_size=6))


@settings(max_examples=300, deadline=None)
@given(groups())
def test_counts_from_the_samples_equal_the_counts_of_the_pad_collators_batch(samples):
    batch = PadCollator()(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    assert sample_supervised_tokens(samples) == supervised_tokens(batch, samples)
    assert sample_padded_tokens(lengths) == padded_tokens(batch, sum(lengths))


def test_only_collators_that_declare_it_are_label_preserving():
    class OwnPadding(PadCollator):  # may pad or mask its own way: not label-preserving unless it says so
        pass

    class Declared(PadCollator):
        preserves_labels = True

    class Forwarding:
        def __init__(self, inner) -> None:
            self.inner = inner

        @property
        def preserves_labels(self) -> bool:
            return is_label_preserving(self.inner)

        def __call__(self, samples):
            return self.inner(samples)

    assert is_label_preserving(PadCollator()) and is_label_preserving(Declared())
    assert is_label_preserving(Forwarding(PadCollator())) and not is_label_preserving(Forwarding(OwnPadding()))
    assert not is_label_preserving(OwnPadding()) and not is_label_preserving(lambda samples: samples)
    assert PadCollator.preserves_labels is True  # a subclass reset only its own attribute


# -- collating when a step is taken ----------------------------------------------------------------------------

class CountingPad(PadCollator):
    """PadCollator that counts its calls and keeps a weak reference to every batch it returned."""

    preserves_labels = True

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.outputs: list[weakref.ref] = []

    def __call__(self, samples):
        batch = Batch(super().__call__(samples))
        self.outputs.append(weakref.ref(batch))
        self.calls += 1  # counted once the batch exists (a collation ahead runs in another thread)
        return batch

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.outputs)


class Batch(dict):
    """A dict that can be weakly referenced."""


@pytest.mark.parametrize("collate_ahead", [False, True])
def test_a_round_collates_only_the_step_that_is_taken_and_the_next_one_ahead(collate_ahead):
    """Without collating ahead, a step is collated when it is taken; with it (the default: NOTE [ Collating the
    next step ahead ]), the step after it too, in a thread, and no other: at most one batch beside the consumer's."""
    collator = CountingPad()
    loader = ODBDataLoader(LengthDataset([8] * 64), token_budget=16, collate_fn=collator,
                           collate_ahead=collate_ahead)
    ahead = int(collate_ahead)
    steps = iter(loader)
    first = next(steps)
    assert first.info.round == 0
    assert wait_until(lambda: collator.calls == 1 + ahead, timeout_s=5.0)  # before: 32, the whole round
    del first
    for taken in range(2, 12):
        batch = next(steps)
        assert batch.info.round == 0
        assert wait_until(lambda: collator.calls == taken + ahead, timeout_s=5.0), collator.calls
        del batch
        assert collator.alive() == ahead  # the pipeline holds no collated batch but the one collated ahead
    rest = list(steps)
    assert collator.calls == 11 + len(rest) == 32
    assert collator.alive() == 0


def masking(samples):
    """A collator that masks labels itself: every label at an even position is not supervised."""
    batch = PadCollator()(samples)
    labels = batch["labels"].clone()
    labels[:, ::2] = -100
    return {**batch, "labels": labels}


def test_a_collator_that_masks_labels_is_counted_on_its_own_batch():
    dataset = LengthDataset([5 + (i * 7) % 23 for i in range(60)])

    def rank(r, transport):
        loader = ODBDataLoader(dataset, token_budget=64, collate_fn=masking, transport=transport)
        return [(b.info, supervised_tokens(b, ())) for b in loader]

    ranks = run_virtual_ranks(rank, 2)
    for steps in ranks:
        for info, counted in steps:
            assert info.local_tokens == counted
    for step, pair in enumerate(zip(*ranks, strict=True)):
        assert {info.global_tokens for info, _ in pair} == {sum(counted for _, counted in pair)}, step


CASES = {  # (lengths, options); the first has IDLE steps on both ranks
    "idle": ([100 if i % 2 == 0 else 4 for i in range(9)], dict(planning="local", max_batch_size=4)),
    "non_join": ([3 + (i * 13) % 41 for i in range(91)], dict(join=False)),
    "global": ([3 + (i * 13) % 41 for i in range(91)], dict(planning="global", shuffle=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_collator_counted_on_its_batch_yields_what_counting_from_the_samples_yields(case):
    # the same batches, StepInfo (padded tokens included) and metrics whichever way a step is counted, IDLE steps
    # and accumulation windows included
    lengths, options = CASES[case]
    dataset = LengthDataset(lengths)

    def rank(transport, collate_fn):
        loader = ODBDataLoader(dataset, token_budget=128, window=32, accumulation_steps=2, collate_fn=collate_fn,
                               transport=transport, **options)
        steps = [(b.info, {k: v.tolist() for k, v in b.items()}) for b in loader]
        counters = loader.metrics.snapshot()
        del counters["sync_seconds"]  # a wall time
        return steps, counters

    from_samples = run_virtual_ranks(lambda r, t: rank(t, PadCollator()), 2)
    on_batch = run_virtual_ranks(lambda r, t: rank(t, lambda samples: PadCollator()(samples)), 2)
    assert case != "idle" or all(any(info.is_idle for info, _ in steps) for steps, _ in from_samples)
    assert on_batch == from_samples


# -- errors ----------------------------------------------------------------------------------------------------

class FailsOnSample(PadCollator):
    """A label-preserving collator that refuses any group holding the `LengthDataset` sample `index` (< 97)."""

    preserves_labels = True

    def __init__(self, index: int) -> None:
        super().__init__()
        self.first_id = index + 3  # LengthDataset's first id of sample i is i % 97 + 3

    def __call__(self, samples):
        if any(int(s["input_ids"][0]) == self.first_id for s in samples):
            raise ValueError("refused")
        return super().__call__(samples)


BAD = 5


@pytest.mark.parametrize("prefetch_steps", [0, 2])
def test_a_collate_error_is_raised_by_the_next_of_its_own_step_and_frees_the_workers(prefetch_steps):
    dataset = LengthDataset([8] * 90)  # many buffers: the workers still have samples to read when it fails
    options = dict(token_budget=16, window=16, fetch_chunk=4)
    order = [batch.info.indices for batch in ODBDataLoader(dataset, **options)]
    position = next(k for k, indices in enumerate(order) if BAD in indices)
    assert 0 < position < 8  # in the first round (the plan does not depend on the collator)
    before = set(multiprocessing.active_children())
    loader = ODBDataLoader(dataset, collate_fn=FailsOnSample(BAD), num_workers=2, prefetch_steps=prefetch_steps,
                           **options)
    taken = []
    named = rf"collate_fn raised ValueError on samples \[[^\]]*\b{BAD}\b[^\]]*\]: refused"
    with pytest.raises(CollateError, match=named):
        for batch in loader:
            taken.append(batch.info.indices)
    assert taken == order[:position]  # every step before it was collated and handed out
    start = time.monotonic()
    while set(multiprocessing.active_children()) - before and time.monotonic() - start < 10:
        time.sleep(0.05)
    assert set(multiprocessing.active_children()) - before == set()
    assert time.monotonic() - start < 3.0
    loader.close()  # only now: the workers had to exit while the loader lived


def test_next_after_a_collate_error_raises_instead_of_ending_the_epoch_silently():
    """The collate error released the workers; a consumer that catches it and goes on must not see the rest of its
    shard as an ended stream (an epoch that quietly drops samples)."""
    class FailsOnTheSecondStep(PadCollator):
        preserves_labels = True  # counted from the samples: collated when a step is taken

        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __call__(self, samples):
            self.calls += 1
            if self.calls == 2:
                raise ValueError("bad batch")
            return super().__call__(samples)

    loader = ODBDataLoader(LengthDataset([16 + (i * 37) % 240 for i in range(600)]), token_budget=1024, window=64,
                           min_window=None, collate_fn=FailsOnTheSecondStep())
    it = iter(loader)
    next(it)
    with pytest.raises(CollateError):
        next(it)
    with pytest.raises(RuntimeError, match="can no longer be read"):
        for _ in it:
            pass
    loader.close()


class _FreedWhere(torch.utils.data.Dataset):
    """Text samples with a small image whose freeing records the name of the thread that freed it."""

    def __init__(self, n: int) -> None:
        self.n, self.freed_on = n, collections.Counter()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        ids = torch.arange(8 + index % 50) + 3
        sample = {"input_ids": ids, "labels": ids.clone(), "pixel_values": torch.ones(2, 4)}
        weakref.finalize(sample["pixel_values"], self._freed)
        return sample

    def _freed(self) -> None:
        self.freed_on[threading.current_thread().name] += 1


def test_a_taken_steps_samples_are_freed_on_the_collating_thread_not_the_consumers():
    """NOTE [ Collating the next step ahead ]: freeing a tensor releases the GIL, so the consumer that dropped a
    step's samples waited for the GIL once per tensor (0.40 s of a 17.6 s epoch, docs/benchmarks.md). The step
    goes to the collating thread with the next one, which drops it: before, every sample was freed on the
    consumer's thread; now most are (a round's first step, collated inline, is still freed by the consumer)."""
    dataset = _FreedWhere(300)
    loader = ODBDataLoader(dataset, token_budget=256, window=64)
    for _ in loader:
        time.sleep(0.001)
    loader.close()
    consumer = dataset.freed_on[threading.main_thread().name]
    collating = sum(n for name, n in dataset.freed_on.items() if name.startswith(COLLATE_THREAD))
    assert consumer + collating == len(dataset), dataset.freed_on
    assert collating > 2 * consumer, dataset.freed_on
