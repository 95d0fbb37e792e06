"""NOTE [ Compact buffered samples ]: lists of ids wait in the window as int64 arrays, whatever the collator;
`PadCollator` takes them, another collator gets lists again. The batches are the ones the lists give, the
dataset's dicts are left alone, the garbage collector has no buffered list to walk, and a sample that is not
integer ids is still refused naming its index."""

from __future__ import annotations

import gc

import datasets
import numpy as np
import pytest
import torch

from odb_core import ODBDataLoader, PadCollator, SampleError, run_virtual_ranks
from odb_core.data.sample import ID_FIELDS, compact_ids, is_compacted
from odb_core.data.sources import Handover, IndexedDataset, arrow_arrays, integer_columns

MODES = [pytest.param(0, 0, id="inline"), pytest.param(0, 2, id="thread"), pytest.param(2, 2, id="workers")]
LENGTHS = [41 + (i * 37) % 300 for i in range(120)]  # none of length 64 (the ids' own lists are told apart below)


def conversation(i: int, n: int) -> dict:
    return {"input_ids": [1000 + (i * 13 + t) % 3000 for t in range(n)],
            "labels": [-100] * (n // 3) + [1000 + (i + t) % 3000 for t in range(n - n // 3)]}


def as_arrow(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({key: [row[key] for row in rows] for key in ("input_ids", "labels")})


def epoch(dataset, collate_fn=None, num_workers: int = 0, prefetch_steps: int = 0, length_fn=None) -> list:
    loader = ODBDataLoader(dataset, token_budget=1024, collate_fn=collate_fn, num_workers=num_workers,
                           prefetch_steps=prefetch_steps, shuffle=True, length_fn=length_fn)
    try:
        return [(b.info.indices, {k: b[k] for k in ("input_ids", "labels", "attention_mask")}) for b in loader]
    finally:
        loader.close()


def ids_length(sample) -> int:
    """A `length_fn` that does not say it takes arrays: the window keeps the lists as the dataset gave them."""
    return len(sample["input_ids"])


def not_pad_collator(samples):
    """PadCollator behind another callable: ODB cannot know what it expects, so it hands the ids over as read
    (lists), whatever it buffered them as."""
    for sample in samples:
        for key in ID_FIELDS:
            assert key not in sample or type(sample[key]) is list, (key, type(sample[key]))
    return PadCollator()(samples)


@pytest.mark.parametrize(("num_workers", "prefetch_steps"), MODES)
@pytest.mark.parametrize("source", ["arrow", "dicts"])
def test_compacted_samples_give_the_batches_of_the_lists(source, num_workers, prefetch_steps):
    rows = [conversation(i, n) for i, n in enumerate(LENGTHS)]
    dataset = as_arrow(rows) if source == "arrow" else rows
    compact = epoch(dataset, num_workers=num_workers, prefetch_steps=prefetch_steps)
    as_read = epoch(dataset, collate_fn=not_pad_collator, length_fn=ids_length)  # a length_fn: nothing compacted
    assert [indices for indices, _ in compact] == [indices for indices, _ in as_read]
    assert sorted(i for indices, _ in compact for i in indices) == list(range(len(LENGTHS)))
    for (_, got), (_, want) in zip(compact, as_read, strict=True):
        for key in want:
            assert got[key].dtype == want[key].dtype == torch.long
            assert torch.equal(got[key], want[key]), key
    if source == "dicts":  # the dataset's own samples are not converted in place
        assert all(type(row["input_ids"]) is list and type(row["labels"]) is list for row in rows)


class CountsHeldLists(torch.utils.data.Dataset):
    """An Arrow dataset that, at each chunk read, counts the lists of ids alive in the process: while a window
    fills, the samples already read wait in it."""

    def __init__(self, lengths: list[int]) -> None:
        self.arrow, self.lengths = as_arrow([conversation(i, n) for i, n in enumerate(lengths)]), set(lengths)
        self.held: list[int] = []

    def __len__(self) -> int:
        return len(self.arrow)

    def __getitem__(self, index: int) -> dict:
        return self.arrow[index]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        self.held.append(sum(1 for o in gc.get_objects()
                             if type(o) is list and len(o) in self.lengths and type(o[0]) is int))
        return self.arrow.__getitems__(indices)


IDLE_LENGTHS = [100 if i % 2 == 0 else 4 for i in range(9)]  # IDLE steps on both ranks (test_collate_on_take.py)


@pytest.mark.parametrize("options", [dict(planning="local", max_batch_size=4, token_budget=128, accumulation_steps=2),
                                     dict(planning="global", shuffle=True, move="send", token_budget=1024)],
                         ids=["idle", "moves"])
def test_a_collator_that_does_not_take_arrays_gets_lists_in_idle_steps_and_moved_samples_too(options):
    """The zero-weight dummy of an IDLE step is made from a compacted sample, and a moved sample is pickled
    between ranks: both keep the mark, so the collator gets lists there too, and the batches are PadCollator's."""
    lengths = IDLE_LENGTHS if options["planning"] == "local" else LENGTHS
    rows = [conversation(i, n) for i, n in enumerate(lengths)]

    def rank(transport, collate_fn):
        loader = ODBDataLoader(rows, window=32, collate_fn=collate_fn, transport=transport, **options)
        try:
            steps = [(b.info.is_idle, b.info.indices, {k: b[k].tolist() for k in ("input_ids", "labels")})
                     for b in loader]
            return steps, loader.metrics.moved_samples
        finally:
            loader.close()

    as_lists = run_virtual_ranks(lambda r, t: rank(t, not_pad_collator), 2)
    assert as_lists == run_virtual_ranks(lambda r, t: rank(t, None), 2)
    if options["planning"] == "local":
        assert any(idle for steps, _ in as_lists for idle, _, _ in steps)
    else:
        assert all(moved > 0 for _, moved in as_lists)


def element_types(sample) -> dict:
    return {key: (type(value).__name__, type(value[0]).__name__) for key, value in sample.items() if key in ID_FIELDS}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("source", ["arrow", "dicts"])
def test_another_collator_gets_the_element_types_the_dataset_gave(source, num_workers):
    """A mask of bools and ids that are numpy integers are not compacted for a collator that gets lists: they
    would come back as Python ints, and `torch.tensor` of them would be int64, not bool or int32."""
    rows = [{**conversation(i, n), "attention_mask": [True] * n, "position_ids": [np.int32(t) for t in range(n)]}
            for i, n in enumerate(LENGTHS[:40])]
    dataset = datasets.Dataset.from_dict({key: [row[key] for row in rows] for key in rows[0]}) \
        if source == "arrow" else rows
    want = element_types(dataset[0])  # every row alike; Arrow gives Python ints for the int32 column
    assert want["attention_mask"] == ("list", "bool") and want["input_ids"] == ("list", "int")
    seen = []

    def collate(samples):
        seen.extend(element_types(sample) for sample in samples)
        return PadCollator()([{key: value for key, value in sample.items() if key != "position_ids"}
                              for sample in samples])

    loader = ODBDataLoader(dataset, token_budget=1024, collate_fn=collate, num_workers=num_workers)
    try:
        assert sum(len(b.info.indices) for b in loader) == 40
    finally:
        loader.close()
    assert len(seen) == 40 and all(types == want for types in seen), (want, seen[:2])


def test_ids_the_dataset_gives_as_arrays_reach_another_collator_as_arrays():
    """Only what ODB compacted becomes a list again: a dataset's own arrays stay arrays."""
    rows = [{key: np.asarray(value, dtype=np.int64) for key, value in conversation(i, n).items()}
            for i, n in enumerate(LENGTHS[:30])]
    seen = set()

    def collate(samples):
        seen.update(type(sample[key]) for sample in samples for key in ("input_ids", "labels"))
        return PadCollator()(samples)

    assert sorted(i for indices, _ in epoch(rows, collate_fn=collate) for i in indices) == list(range(30))
    assert seen == {np.ndarray}


@pytest.mark.parametrize("pad_collator", [True, False], ids=["PadCollator", "another_collator"])
def test_a_filling_window_holds_no_list_for_the_collector_to_walk(pad_collator):
    """Whatever the collator: a collator that does not take arrays gets the ids as lists again when it collates
    (`not_pad_collator` checks), while the window holds arrays. Before, its window held two lists per buffered
    sample: 0, 128, 256, 384 at the chunk reads."""
    dataset = CountsHeldLists([700 + i for i in range(200)])  # list lengths no other object in the process has
    loader = ODBDataLoader(dataset, token_budget=4096, window=200, min_window=None, prefetch_steps=0,
                           collate_fn=None if pad_collator else not_pad_collator)
    next(iter(loader))  # reads the whole window (in chunks of 64) before the first batch
    loader.close()
    assert dataset.held == [0, 0, 0, 0]  # chunks start after 0, 64, 128 and 192 samples are buffered


@pytest.mark.parametrize(("num_workers", "prefetch_steps"), MODES)
@pytest.mark.parametrize(("bad", "cause"), [
    ([3, 1.5, 7], "it has a float element"),
    ([3, None, 7], "it has an element of type NoneType"),
    ([[3, 4], [5, 6]], "it has an element of type list"),
])
def test_a_list_that_is_not_integer_ids_is_still_refused_naming_its_index(bad, cause, num_workers, prefetch_steps):
    rows = [conversation(i, 20) for i in range(12)]
    rows[5] = {"input_ids": bad}
    with pytest.raises(SampleError, match=rf"^sample 5: 'input_ids' must hold integer token ids, but {cause}"):
        epoch(rows, num_workers=num_workers, prefetch_steps=prefetch_steps)


def test_a_null_in_an_integer_arrow_column_is_refused_naming_its_index():
    rows = [conversation(i, 20) for i in range(12)]
    rows[7]["labels"][3] = None  # Arrow keeps the int64 column type and stores a null
    dataset = as_arrow(rows)
    assert integer_columns(dataset) == {"input_ids", "labels"}
    with pytest.raises(SampleError, match=r"^sample 7: 'labels' must hold integer token ids, but it has an element "
                                          r"of type NoneType"):
        epoch(dataset)


def test_integer_columns_trusts_only_an_integer_list_schema_of_hf_datasets():
    dataset = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1.5, 2.0]],
                                          "position_ids": [[[0, 1], [0, 1]]], "attention_mask": [[1, 1]]})
    assert integer_columns(dataset) == {"input_ids", "attention_mask"}
    assert integer_columns([{"input_ids": [1, 2]}]) == frozenset()


def test_compact_ids_converts_only_flat_integer_lists_under_known_keys():
    sample = {"input_ids": [5, 6], "labels": [True, False], "position_ids": [[0, 1]], "attention_mask": [],
              "other": [1, 2], "pixel_values": np.ones((2, 3), dtype=np.float32)}
    out = compact_ids(sample)
    assert out is not sample and type(sample["input_ids"]) is list
    assert out["input_ids"].dtype == np.int64 and out["input_ids"].tolist() == [5, 6]
    assert out["labels"].tolist() == [1, 0]  # bools are accepted as ids everywhere else too
    assert out["position_ids"] is sample["position_ids"] and out["attention_mask"] is sample["attention_mask"]
    assert out["other"] is sample["other"] and out["pixel_values"] is sample["pixel_values"]
    assert compact_ids({"input_ids": torch.arange(3)})["input_ids"].dtype == torch.long  # tensors stay tensors
    assert list(out) == list(sample)  # the keys keep their order


def test_a_compacted_sample_of_ids_and_plain_values_is_not_tracked_by_the_collector():
    # such a dict cannot be part of a cycle; untracked, a buffered one is neither walked nor promoted by the GC
    sample = {"input_ids": [5, 6], "labels": [5, 6], "source": "chat", "turns": 3}
    assert gc.is_tracked(sample) and not gc.is_tracked(compact_ids(sample))
    assert gc.is_tracked(compact_ids({"input_ids": [5, 6], "messages": ["a"]}))  # a list left as it is: tracked


def test_arrow_ids_are_read_as_int64_arrays_through_a_view_of_the_same_table():
    dataset = as_arrow([conversation(i, n) for i, n in enumerate(LENGTHS[:8])])
    view = arrow_arrays(dataset, integer_columns(dataset))
    assert view is not None and dataset.format["type"] is None  # the user's dataset keeps its format
    for row, want in zip(view.__getitems__([3, 1]), dataset.__getitems__([3, 1]), strict=True):
        assert list(row) == list(want)
        for key in want:
            assert type(row[key]) is np.ndarray and row[key].dtype == np.int64 and row[key].tolist() == want[key]


def test_a_format_a_column_selection_or_a_transform_the_user_set_keeps_the_dataset_as_it_is():
    dataset = as_arrow([conversation(i, 10) for i in range(4)])
    keys = integer_columns(dataset)
    assert arrow_arrays(dataset.with_format("torch"), keys) is None
    assert arrow_arrays(dataset.select_columns(["input_ids"]).with_format(None), frozenset({"input_ids"})) is not None
    hidden = dataset.with_format(None, columns=["input_ids"])  # `labels` stays hidden from the reader
    assert arrow_arrays(hidden, keys) is None
    assert arrow_arrays(dataset.with_transform(lambda batch: batch), keys) is None
    assert arrow_arrays(dataset, frozenset()) is None


def test_the_arrow_view_keeps_the_dataset_s_columns_their_order_and_other_values():
    rows = [conversation(i, n) for i, n in enumerate(LENGTHS[:40])]
    dataset = datasets.Dataset.from_dict({"source": [f"chat-{i}" for i in range(40)],
                                          "labels": [r["labels"] for r in rows],
                                          "input_ids": [r["input_ids"] for r in rows]})
    viewed = list(ODBDataLoader(dataset, token_budget=1024, shuffle=True))
    as_read = list(ODBDataLoader(dataset, token_budget=1024, shuffle=True, collate_fn=not_pad_collator))
    assert [b.info.indices for b in viewed] == [b.info.indices for b in as_read]
    for got, want in zip(viewed, as_read, strict=True):
        assert list(got) == list(want) == ["source", "labels", "input_ids", "attention_mask"]
        assert got["source"] == want["source"] == [f"chat-{i}" for i in got.info.indices]
        assert all(torch.equal(got[k], want[k]) for k in ("labels", "input_ids", "attention_mask"))


def test_a_null_row_in_an_integer_arrow_column_is_refused_naming_its_index():
    rows = [conversation(i, 20) for i in range(12)]
    rows[4]["input_ids"] = None
    assert arrow_arrays(as_arrow(rows), integer_columns(as_arrow(rows))) is not None  # read through the view
    with pytest.raises(SampleError, match=r"^sample 4: 'input_ids' must be a 1-D tensor, ndarray or list of token "
                                          r"ids, got NoneType"):
        epoch(as_arrow(rows))


def test_a_format_or_transform_set_after_the_loader_was_built_counts_from_the_next_epoch():
    dataset = as_arrow([conversation(i, 12) for i in range(10)])
    loader = ODBDataLoader(dataset, token_budget=1024)
    assert all(b["input_ids"].max() >= 1000 for b in loader)
    dataset.set_transform(lambda batch: {key: [[7] * len(row) for row in rows] for key, rows in batch.items()})
    assert [b["input_ids"].unique().tolist() for b in loader] == [[7]]  # the view was dropped with the transform


def test_ids_a_view_cannot_hold_and_rows_of_one_block_are_left_as_before():
    import pyarrow as pa

    big = datasets.Dataset(pa.table({"input_ids": pa.array([[1, 2**64 - 1], [3, 4]], type=pa.list_(pa.uint64()))}))
    assert integer_columns(big) == {"input_ids"} and arrow_arrays(big, integer_columns(big)) is None  # no wrap
    same = as_arrow([conversation(i, 16) for i in range(8)])  # equal lengths: numpy gives one 8 x 16 block
    indexed = IndexedDataset(same, Handover(compact=True, mark=True, integer_keys=integer_columns(same)))
    rows = [sample for _, sample in indexed.__getitems__(list(range(8)))]
    for row in rows:  # each holds its own row (a marked view of it at most), not the chunk's block
        for key in ("input_ids", "labels"):
            owner = row[key] if row[key].base is None else row[key].base
            assert owner.base is None and owner.nbytes == row[key].nbytes and is_compacted(row[key])
    assert [row["input_ids"].tolist() for row in rows] == same["input_ids"]
