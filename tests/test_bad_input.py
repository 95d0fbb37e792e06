"""Bad input through the real `ODBDataLoader`: every error surfaces in the trainer's `next()`, names the dataset
index, and keeps the original exception (DESIGN 6); accepted input variants still give model-ready batches.

Errors are checked inline (`prefetch_steps=0`) and through the background producer thread (`prefetch_steps=2`).
Samples are checked in the trainer process whatever `num_workers` is, so worker processes (`num_workers=2`) are
used where the error or the data starts in them: the user's `__getitem__`, and list/ndarray samples that cross
the worker pipe.
"""

from __future__ import annotations

import gc
import multiprocessing
import re
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LengthDataset
from odb_core import (CollateError, DatasetFetchError, ODBDataLoader, PadCollator, PeerError, SampleError,
                      run_virtual_ranks)

BAD_INDEX = 5
# (num_workers, prefetch_steps): inline, background thread, background thread over worker processes.
MODES = [pytest.param(0, 0, id="inline"), pytest.param(0, 2, id="thread"), pytest.param(2, 2, id="workers")]
IN_PROCESS_MODES = MODES[:2]


class PatchedDataset(torch.utils.data.Dataset):
    """Twelve good samples of length 8, with sample `BAD_INDEX` replaced by `bad` (picklable for workers)."""

    def __init__(self, bad) -> None:
        self.good, self.bad = LengthDataset([8] * 12), bad

    def __len__(self) -> int:
        return len(self.good)

    def __getitem__(self, index: int):
        return self.bad if index == BAD_INDEX else self.good[index]


class RaisingDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int):
        if index == BAD_INDEX:
            return load_broken_record(index)
        return {"input_ids": torch.arange(8)}


def load_broken_record(index: int):
    raise KeyError(f"record {index} is missing from the shard")


def first_batch(dataset, num_workers: int = 0, prefetch_steps: int = 0, **kwargs):
    loader = ODBDataLoader(dataset, token_budget=kwargs.pop("token_budget", 64), num_workers=num_workers,
                           prefetch_steps=prefetch_steps, **kwargs)
    try:
        return next(iter(loader))
    finally:
        loader.close()


# -- the sample contract -------------------------------------------------------------------------------------

BAD_SAMPLES = [
    pytest.param({"labels": torch.arange(8)}, "has no 'input_ids'", id="missing_input_ids"),
    pytest.param({"input_ids": torch.zeros(0, dtype=torch.long)}, "'input_ids' is empty", id="empty_input_ids"),
    pytest.param({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, "must be a 1-D", id="2d_input_ids_tensor"),
    pytest.param({"input_ids": np.zeros((2, 8), dtype=np.int64)}, "must be a 1-D", id="2d_input_ids_ndarray"),
    pytest.param({"input_ids": 7}, "must be a 1-D", id="scalar_input_ids"),
    pytest.param({"input_ids": torch.arange(8), "labels": torch.zeros(2, 8)}, "'labels' must be a 1-D",
                 id="2d_labels"),
    pytest.param({"input_ids": [3, 1.5, 7]}, r"'input_ids' must hold integer token ids, but it has a float element",
                 id="float_in_input_ids_list"),
    pytest.param({"input_ids": torch.arange(8, dtype=torch.float32)}, "integer token ids, but it has dtype torch.float32",
                 id="float_input_ids_tensor"),
    pytest.param({"input_ids": np.arange(8, dtype=np.float64)}, "integer token ids, but it has dtype float64",
                 id="float_input_ids_ndarray"),
    pytest.param({"input_ids": ["a", "b"]}, "integer token ids, but it has an element of type str",
                 id="str_input_ids"),
    pytest.param({"input_ids": torch.arange(8), "labels": [1.0] * 8}, "'labels' must hold integer token ids",
                 id="float_labels"),
    pytest.param({"input_ids": torch.arange(8), "labels": torch.arange(10)}, "'labels' has 10 entries but "
                 "'input_ids' has 8", id="labels_longer_than_ids"),
    pytest.param({"input_ids": torch.arange(8), "labels": torch.arange(7)}, "'labels' has 7 entries but "
                 "'input_ids' has 8", id="labels_shifted_in_advance"),
    pytest.param({"input_ids": list(range(8)), "labels": list(range(6))}, "'labels' has 6 entries",
                 id="labels_list_shorter"),
    pytest.param({"input_ids": torch.arange(8), "labels": torch.arange(8), "attention_mask": torch.ones(9)},
                 "'attention_mask' has 9 entries but 'input_ids' has 8", id="attention_mask_misaligned"),
    pytest.param({"input_ids": torch.arange(8), "position_ids": np.arange(3)}, "'position_ids' has 3 entries",
                 id="position_ids_misaligned"),
    pytest.param({"input_ids": torch.arange(8), "image_grid_thw": torch.tensor([1, 2])},
                 r"'image_grid_thw' must hold \(t, h, w\) integer triples", id="grid_not_triples"),
    pytest.param({"input_ids": torch.arange(8), "image_grid_thw": torch.tensor([[1.0, 2.5, 2.0]])},
                 r"'image_grid_thw' must hold \(t, h, w\) integer triples", id="grid_fractions"),
    pytest.param({"input_ids": torch.arange(8), "image_grid_thw": "1x2x2"}, "a str cannot be read as one",
                 id="grid_str"),
    pytest.param({"input_ids": torch.arange(8), "pixel_values": "img.png"}, "patches cannot be counted",
                 id="pixel_values_str"),
    pytest.param((torch.arange(8), torch.arange(8)), "expected a mapping", id="tuple_sample"),
    pytest.param(torch.arange(8), "expected a mapping", id="tensor_sample"),
]


@pytest.mark.parametrize(("num_workers", "prefetch_steps"), IN_PROCESS_MODES)
@pytest.mark.parametrize(("bad", "cause"), BAD_SAMPLES)
def test_malformed_sample_raises_sample_error_naming_its_index(bad, cause, num_workers, prefetch_steps):
    with pytest.raises(SampleError, match=rf"^sample {BAD_INDEX}: .*{cause}") as raised:
        first_batch(PatchedDataset(bad), num_workers, prefetch_steps)
    assert raised.value.index == BAD_INDEX


@pytest.mark.parametrize(("num_workers", "prefetch_steps"), MODES)
@pytest.mark.parametrize("as_type", [list, np.asarray], ids=["list", "ndarray"])
def test_list_and_ndarray_input_ids_give_model_ready_tensor_batches(as_type, num_workers, prefetch_steps):
    lengths = [3, 9, 5, 12, 7, 4]
    samples = [{"input_ids": as_type(list(range(1, n + 1))), "labels": as_type([-100] * 2 + list(range(n - 2)))}
               for n in lengths]
    loader = ODBDataLoader(samples, token_budget=64, num_workers=num_workers, prefetch_steps=prefetch_steps)
    seen = []
    for batch in loader:
        rows, width = batch["input_ids"].shape
        for key in ("input_ids", "labels", "attention_mask"):
            assert isinstance(batch[key], torch.Tensor) and batch[key].dtype == torch.long
            assert batch[key].shape == (rows, width)
        assert width == max(lengths[i] for i in batch.info.indices)
        assert int(batch["attention_mask"].sum()) == sum(lengths[i] for i in batch.info.indices)
        # Model-ready: the causal-LM loss runs on the labels as they are.
        logits = torch.zeros(rows, width, 50)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), batch["labels"][:, 1:].reshape(-1))
        seen.extend(batch.info.indices)
    assert sorted(seen) == list(range(len(lengths)))


def test_numpy_int32_input_ids_are_collated_as_int64():
    samples = [{"input_ids": np.arange(1, 6, dtype=np.int32), "labels": np.arange(1, 6, dtype=np.int32)},
               {"input_ids": np.arange(1, 3, dtype=np.int32), "labels": np.arange(1, 3, dtype=np.int32)}]
    batch = PadCollator()(samples)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert batch["labels"][1].tolist() == [1, 2, -100, -100, -100]


# -- user collate functions ----------------------------------------------------------------------------------

def collate_that_divides_by_zero(samples):
    return {"scale": len(samples) / 0}


@pytest.mark.parametrize(("num_workers", "prefetch_steps"), IN_PROCESS_MODES)
def test_collate_error_names_the_indices_and_chains_the_original_exception(num_workers, prefetch_steps):
    dataset = LengthDataset([8] * 6)
    with pytest.raises(CollateError, match=r"collate_fn raised ZeroDivisionError on samples \[") as raised:
        first_batch(dataset, num_workers, prefetch_steps, collate_fn=collate_that_divides_by_zero)
    message = str(raised.value)
    listed = [int(i) for i in message.split("on samples [")[1].split("]")[0].split(",")]
    assert listed and set(listed) <= set(range(len(dataset)))
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    rendered = "".join(traceback.format_exception(raised.value))
    assert "collate_that_divides_by_zero" in rendered
    assert "The above exception was the direct cause" in rendered


@pytest.mark.parametrize(("num_workers", "prefetch_steps"), IN_PROCESS_MODES)
@pytest.mark.parametrize("returned", [[1, 2], (torch.zeros(2),), torch.zeros(2, 3), None],
                         ids=["list", "tuple", "tensor", "none"])
def test_collate_returning_a_non_mapping_is_rejected_with_the_indices(returned, num_workers, prefetch_steps):
    with pytest.raises(CollateError, match=r"collate_fn returned \w+ for samples \[\d"):
        first_batch(LengthDataset([8] * 6), num_workers, prefetch_steps, collate_fn=lambda samples: returned)


# -- the user's dataset --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("num_workers", "prefetch_steps"), MODES)
def test_dataset_error_names_the_index_and_keeps_the_original(num_workers, prefetch_steps):
    with pytest.raises(DatasetFetchError) as raised:
        first_batch(RaisingDataset(), num_workers, prefetch_steps)
    message = str(raised.value)
    assert f"sample {BAD_INDEX}: dataset[{BAD_INDEX}] raised KeyError" in message
    assert "missing from the shard" in message
    if num_workers == 0:
        assert isinstance(raised.value.__cause__, KeyError)
        rendered = "".join(traceback.format_exception(raised.value))
    else:  # the DataLoader re-raises in the main process with the worker's formatted traceback in the message
        rendered = message
    assert "load_broken_record" in rendered


# How workers exit promptly (odb_core/epoch/reader.py): when fetching a chunk raises, `SampleReader` clears the exception's
# frames and drops the DataLoader iterator at once; otherwise it is freed only by the cyclic GC, whose `__del__`
# waits 5 s per worker before terminating it.

@pytest.mark.parametrize("failure", ["dataset_error", "sample_error"])
def test_worker_processes_exit_promptly_after_an_error(failure):
    lengths = [8] * 12
    lengths[BAD_INDEX] = 100
    dataset = RaisingDataset() if failure == "dataset_error" else LengthDataset(lengths)
    before = set(multiprocessing.active_children())
    with pytest.raises(DatasetFetchError if failure == "dataset_error" else SampleError):
        first_batch(dataset, num_workers=1, prefetch_steps=2, oversize="error")
    start = time.monotonic()
    gc.collect()
    while set(multiprocessing.active_children()) - before and time.monotonic() - start < 30:
        time.sleep(0.05)
    assert set(multiprocessing.active_children()) - before == set()
    assert time.monotonic() - start < 3.0



@pytest.mark.parametrize("prefetch_steps", [0, 2])
def test_worker_processes_exit_at_once_after_a_bad_sample_while_the_loader_lives(prefetch_steps):
    """A sample the checks refuse (here: no input_ids) raises SampleError from the reader; the reader releases
    the worker iterator on that path too, so the workers exit while the user still holds the loader (no GC, no
    close). Before, they lived until the loader was collected, and torch then waited 5 s per worker."""
    before = set(multiprocessing.active_children())
    loader = ODBDataLoader(PatchedDataset({"labels": torch.arange(8)}), token_budget=64, num_workers=2,
                           prefetch_steps=prefetch_steps)
    with pytest.raises(SampleError, match=rf"^sample {BAD_INDEX}: has no 'input_ids'"):
        list(loader)
    start = time.monotonic()
    while set(multiprocessing.active_children()) - before and time.monotonic() - start < 10:
        time.sleep(0.05)
    assert set(multiprocessing.active_children()) - before == set()
    assert time.monotonic() - start < 3.0
    loader.close()  # only now: the loader was referenced while the workers had to be gone



# Samples that cannot be pickled (NOTE [ Samples that cannot travel ] in odb_core/data/sendable.py): a worker's queue
# feeder used to print a traceback and drop the message, and the rank waited forever; a sample moving under
# move='send' raised a raw TypeError naming no index.

class LockedSample(torch.utils.data.Dataset):
    """Twelve samples; `BAD_INDEX` (or every one, `all_locked`) carries a lock, which cannot be pickled."""

    def __init__(self, all_locked: bool = False) -> None:
        self.good, self.all_locked = LengthDataset([8 + 3 * i for i in range(12)]), all_locked

    def __len__(self) -> int:
        return len(self.good)

    def __getitem__(self, index: int):
        sample = self.good[index]
        if self.all_locked or index == BAD_INDEX:
            sample = {**sample, "guard": threading.Lock()}
        return sample


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_sample_that_cannot_be_pickled_in_a_worker_raises_naming_the_index_instead_of_hanging(context):
    with pytest.raises(SampleError, match=rf"^sample {BAD_INDEX}: field 'guard' \(a lock\) cannot be pickled "
                                          r"\(TypeError: cannot pickle '_thread.lock' object\), so its DataLoader "
                                          r"worker cannot send it"):
        loader = ODBDataLoader(LockedSample(), token_budget=64, num_workers=2, multiprocessing_context=context)
        try:
            list(loader)
        finally:
            loader.close()


class GradSample(torch.utils.data.Dataset):
    """`BAD_INDEX` carries a tensor computed with autograd (at the top level, or in a list: the probe's two paths),
    which torch's reducer refuses in the queue's feeder thread: before, the chunk was dropped and the rank hung."""

    def __init__(self, nested: bool) -> None:
        self.good, self.nested = LengthDataset([8 + 3 * i for i in range(12)]), nested

    def __len__(self) -> int:
        return len(self.good)

    def __getitem__(self, index: int):
        sample = self.good[index]
        if index == BAD_INDEX:
            feats = torch.ones(4, requires_grad=True) * 2
            sample = {**sample, "feats": [feats] if self.nested else feats}
        return sample


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nested", [False, True])
def test_a_tensor_computed_with_autograd_in_a_worker_raises_naming_the_index_instead_of_hanging(nested):
    kind = "list" if nested else "Tensor"
    with pytest.raises(SampleError, match=rf"^sample {BAD_INDEX}: field 'feats' \(a {kind}\) cannot be pickled "
                                          r"\(RuntimeError: a tensor computed with autograd .*detach\(\) it\)"):
        loader = ODBDataLoader(GradSample(nested), token_budget=64, num_workers=2)
        try:
            list(loader)
        finally:
            loader.close()


def test_a_sample_that_cannot_be_pickled_names_its_index_when_it_moves_to_another_rank():
    def run(rank, transport):
        loader = ODBDataLoader(LockedSample(all_locked=True), token_budget=64, transport=transport, move="send")
        try:
            list(loader)
        except (SampleError, PeerError) as exc:
            return exc
        finally:
            loader.close()
        return None

    errors = run_virtual_ranks(run, 2, timeout_s=3)
    refused = [e for e in errors if isinstance(e, SampleError)]
    assert refused, errors
    message = str(refused[0])
    assert re.match(r"^sample \d+: field 'guard' \(a lock\) cannot be pickled .*, so it cannot move from rank "
                    r"\d to rank \d \(move='send'\)", message), message
    assert "use move='fetch'" in message


# -- oversize samples ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("num_workers", "prefetch_steps"), IN_PROCESS_MODES)
def test_oversize_sample_runs_alone_and_is_counted(num_workers, prefetch_steps):
    lengths = [8] * 12
    lengths[BAD_INDEX] = 100  # 100 > token_budget 64 on its own
    loader = ODBDataLoader(LengthDataset(lengths), token_budget=64, num_workers=num_workers,
                           prefetch_steps=prefetch_steps, oversize="alone")
    batches = list(loader)
    alone = [b for b in batches if BAD_INDEX in b.info.indices]
    assert len(alone) == 1 and alone[0].info.indices == (BAD_INDEX,)
    assert tuple(alone[0]["input_ids"].shape) == (1, 100)
    for batch in batches:
        if batch is not alone[0]:
            assert batch["input_ids"].numel() <= 64
    assert sorted(i for b in batches for i in b.info.indices) == list(range(len(lengths)))
    assert loader.metrics.oversize_samples == 1


@pytest.mark.parametrize(("num_workers", "prefetch_steps"), IN_PROCESS_MODES)
def test_oversize_sample_with_error_policy_raises_naming_its_index(num_workers, prefetch_steps):
    lengths = [8] * 12
    lengths[BAD_INDEX] = 100
    with pytest.raises(SampleError, match=rf"^sample {BAD_INDEX}: .*exceeds token_budget=64") as raised:
        first_batch(LengthDataset(lengths), num_workers, prefetch_steps, oversize="error")
    assert raised.value.index == BAD_INDEX


# -- length_fn -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("num_workers", "prefetch_steps"), IN_PROCESS_MODES)
@pytest.mark.parametrize("returned", [0, -3, 2.5, "8", None, True, np.int64(0)],
                         ids=["zero", "negative", "float", "str", "none", "bool", "np_zero"])
def test_length_fn_returning_a_non_positive_or_non_int_raises_naming_the_index(returned, num_workers,
                                                                              prefetch_steps):
    def length_fn(sample):
        return returned if int(sample["input_ids"][0]) == 3 + BAD_INDEX else 8

    # LengthDataset's first token of sample i is (i % 97) + 3, which identifies sample BAD_INDEX.
    with pytest.raises(SampleError, match=rf"^sample {BAD_INDEX}: length_fn returned"):
        first_batch(LengthDataset([8] * 12), num_workers, prefetch_steps, length_fn=length_fn)


@pytest.mark.parametrize(("num_workers", "prefetch_steps"), IN_PROCESS_MODES)
def test_length_fn_that_raises_is_reported_with_the_index_and_cause(num_workers, prefetch_steps):
    def length_fn(sample):
        return sample["num_tokens"]

    with pytest.raises(SampleError, match=r"^sample 0: length_fn raised KeyError") as raised:
        first_batch(LengthDataset([8] * 12), num_workers, prefetch_steps, length_fn=length_fn)
    assert isinstance(raised.value.__cause__, KeyError)


def test_accepted_length_fn_values_drive_the_grouping():
    # np.integer is accepted; a length_fn that doubles every cost halves the samples per padded group.
    loader = ODBDataLoader(LengthDataset([8] * 16), token_budget=64, prefetch_steps=0,
                           length_fn=lambda sample: np.int64(2 * len(sample["input_ids"])))
    assert {len(b.info.indices) for b in loader} == {4}


@pytest.mark.parametrize("sample,message", [({"input_ids": [3, 4], "labels": None}, "'labels' must be a 1-D"),
                                            ({"input_ids": None}, "'input_ids' must be a 1-D")])
def test_a_present_but_empty_field_is_refused_naming_it(sample, message):
    from odb_core.data.sample import SampleError, inspect_sample

    with pytest.raises(SampleError, match=rf"sample 3: {message}"):
        inspect_sample(3, sample, None)


TENSORS = st.builds(lambda dtype, shape: torch.zeros(shape, dtype=dtype),
                    st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.int16, torch.float32, torch.bool]),
                    st.sampled_from([(0,), (1,), (5,), (2, 3), ()]))


@settings(max_examples=400, deadline=None)
@given(ids=st.one_of(TENSORS, st.none(), st.just([1, 2])), labels=st.one_of(TENSORS, st.none(), st.just("absent")),
       vision=st.sampled_from([None, "pixel_values", "image_grid_thw"]),
       mask=st.one_of(TENSORS, st.just("absent")))
def test_the_inline_tensor_check_answers_as_the_general_checks_do(ids, labels, vision, mask):
    # inspect_sample answers a text sample of tensors inline; a length_fn sends it through the general checks,
    # which run before length_fn is called: both must accept the same samples, with equal facts, and refuse the
    # rest with the same message
    from odb_core.planning.budget import Item
    from odb_core.data.sample import inspect_sample

    sample = {"input_ids": ids} if labels == "absent" else {"input_ids": ids, "labels": labels}
    if not isinstance(mask, str):  # an aligned field beside them: checked inline too (NOTE [ Fields aligned ... ])
        sample["attention_mask"] = mask
    if vision == "pixel_values":
        sample[vision] = torch.zeros(4, 3)
    elif vision == "image_grid_thw":
        sample[vision] = torch.tensor([[1, 2, 2]])

    def outcome(length_fn):
        try:
            return inspect_sample(7, sample, length_fn)
        except SampleError as exc:
            return str(exc)

    inline = outcome(None)
    general = outcome(lambda s: len(s["input_ids"]))
    assert inline == general
    assert isinstance(inline, str) or (type(inline) is Item and inline == Item(7, len(ids), inline.patches))


class CountsBatchReads:
    """Reads a chunk with one `__getitems__` call, as HF `datasets` does, and counts the calls."""

    calls = 0

    def __getitems__(self, indices):
        self.calls += 1
        return [self[i] for i in indices]


class BatchReadDataset(CountsBatchReads, RaisingDataset):
    """`RaisingDataset` read in chunks: sample BAD_INDEX still fails."""


class BrokenBatchReads(RaisingDataset):
    """Every `dataset[i]` works, the chunk read alone fails."""

    def __getitem__(self, index: int):
        return {"input_ids": torch.arange(8)}

    def __getitems__(self, indices):
        raise RuntimeError("the batch reader lost its file handle")


CHUNKED_LENGTHS = [3 + (i * 7) % 29 for i in range(200)]


class BatchReadAll(CountsBatchReads, LengthDataset):
    def __init__(self) -> None:
        super().__init__(CHUNKED_LENGTHS)


@pytest.mark.parametrize("num_workers,prefetch_steps", MODES)
def test_a_chunk_read_with_getitems_still_names_the_failing_sample(num_workers, prefetch_steps):
    with pytest.raises(DatasetFetchError, match=rf"sample {BAD_INDEX}: dataset\[{BAD_INDEX}\] raised KeyError"):
        first_batch(BatchReadDataset(), num_workers=num_workers, prefetch_steps=prefetch_steps)


def test_a_broken_getitems_is_an_error_not_a_silent_second_read():
    with pytest.raises(DatasetFetchError, match=r"dataset.__getitems__ raised RuntimeError: the batch reader lost"):
        first_batch(BrokenBatchReads())


def test_getitems_is_used_in_chunks_and_gives_the_batches_of_single_reads():
    chunked, single = BatchReadAll(), LengthDataset(CHUNKED_LENGTHS)
    batches = [list(ODBDataLoader(d, token_budget=96, shuffle=True, prefetch_steps=0)) for d in (chunked, single)]
    assert [b.info.indices for b in batches[0]] == [b.info.indices for b in batches[1]]
    assert 0 < chunked.calls <= 200 // 64 + 1  # one call per in-process chunk of 64


def test_vision_layouts_accepted_before_are_still_accepted_with_their_patches():
    """The checks of 2026-12-07 refuse what cannot be counted; what was counted before still is: a grid of whole
    numbers stored as floats, an empty grid (a text row of a mixed table), and a list of per-image pixels that
    holds something without a shape (counted as the tensors among it, as the rest was before: 0)."""
    from odb_core.data.sample import inspect_sample

    ids = torch.arange(8)
    assert inspect_sample(1, {"input_ids": ids, "image_grid_thw": torch.tensor([[1.0, 2.0, 2.0]])}, None).patches == 4
    assert inspect_sample(1, {"input_ids": ids, "image_grid_thw": []}, None).patches == 0
    assert inspect_sample(1, {"input_ids": ids, "pixel_values": [torch.zeros(5, 3), None, "a.png"]}, None).patches == 5
    assert inspect_sample(1, {"input_ids": ids, "pixel_values": [[0.5, 0.5], [0.5, 0.5]]}, None).patches == 0
