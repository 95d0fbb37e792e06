"""PadCollator: lists, arrays and tensors of the same ids give the same batch, on every padding path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odb_core.data.collate import CollateError, PadCollator, run_collate

ROWS = [[5, 6, 7], [8], [9, 10, 11, 12]]
LABELS = [[-100, 6, 7], [8], [-100, -100, 11, 12]]
EXPECTED_IDS = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 11, 12]])
EXPECTED_LABELS = torch.tensor([[-100, 6, 7, -100], [8, -100, -100, -100], [-100, -100, 11, 12]])
EXPECTED_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize("kind", [list, np.array, torch.tensor])
def test_ragged_rows_pad_the_same_whatever_their_container(kind):
    batch = PadCollator()([{"input_ids": kind(i), "labels": kind(l)} for i, l in zip(ROWS, LABELS, strict=True)])
    assert batch["input_ids"].dtype == torch.long and batch["labels"].dtype == torch.long
    assert torch.equal(batch["input_ids"], EXPECTED_IDS)
    assert torch.equal(batch["labels"], EXPECTED_LABELS)
    assert torch.equal(batch["attention_mask"], EXPECTED_MASK)


def test_equal_length_rows_are_stacked_and_a_tensor_with_grad_still_pads():
    same = PadCollator(pad_token_id=3)([{"input_ids": torch.tensor([1, 2])}, {"input_ids": [4, 5]}])
    assert torch.equal(same["input_ids"], torch.tensor([[1, 2], [4, 5]]))
    assert torch.equal(same["attention_mask"], torch.ones(2, 2, dtype=torch.long))
    weights = [torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)]
    mixed = PadCollator()([{"input_ids": [1, 2], "position_ids": [0, 1], "w": 1.0},
                           {"input_ids": [4], "position_ids": [0], "w": 2.0}])
    assert torch.equal(mixed["position_ids"], torch.tensor([[0, 1], [0, 0]]))
    assert torch.equal(mixed["w"], torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert PadCollator._pad(weights, 2, 0).tolist() == [[1.0, 1.0], [1.0, 0.0]]


def test_a_field_longer_than_input_ids_and_multi_axis_rows_pad_as_pad_sequence_does():
    longer = PadCollator()([{"input_ids": [1, 2], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    assert torch.equal(longer["labels"], torch.tensor([[1, 2, 3], [4, -100, -100]]))
    assert torch.equal(longer["input_ids"], torch.tensor([[1, 2], [4, 0]]))
    rows = [[[0, 1, 2], [0, 1, 2]], [[0, 1, 2], [0, 1, 2]]]  # L x 2 features per token: not rope positions
    multi = PadCollator()([{"input_ids": [1, 2], "token_type_ids": r} for r in rows])
    reference = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True)
    assert torch.equal(multi["token_type_ids"], reference)


def test_multi_axis_rope_positions_batch_as_axes_by_batch_by_length():
    """Qwen2-VL's (3, L) position ids per sample: (3, B, L), right-padded with 0 (NOTE [ Vision fields in a batch ];
    before, (B, 3, L), padded along the axes; tests/test_multimodal.py runs the model on them)."""
    rows = [[[0, 1], [0, 1], [0, 1]], [[0, 1, 2], [0, 1, 1], [0, 2, 2]]]  # as lists, of two lengths
    multi = PadCollator()([{"input_ids": [1, 2], "position_ids": rows[0]},
                           {"input_ids": [1, 2, 3], "position_ids": torch.tensor(rows[1])}])
    assert torch.equal(multi["position_ids"], torch.tensor([[[0, 1, 0], [0, 1, 2]], [[0, 1, 0], [0, 1, 1]],
                                                            [[0, 1, 0], [0, 2, 2]]]))


def test_equal_length_tensors_stack_in_their_dtype_and_a_shorter_field_is_still_padded():
    rows = [torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([4, 5, 6], dtype=torch.int32)]
    batch = PadCollator()([{"input_ids": r.long(), "labels": r[:2], "token_type_ids": r} for r in rows])
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert torch.equal(batch["attention_mask"], torch.ones(2, 3, dtype=torch.long))
    assert torch.equal(batch["labels"], torch.tensor([[1, 2, -100], [4, 5, -100]], dtype=torch.int32))
    assert batch["token_type_ids"].dtype == torch.int32  # stacked as the rows are, as pad_sequence keeps them
    assert torch.equal(batch["token_type_ids"], torch.stack(rows))


def test_a_subclass_s_own_padding_is_used_for_equal_length_tensors_too():
    class ToEight(PadCollator):
        @staticmethod
        def _pad(values, length, value):
            return PadCollator._pad(values, 8, value)

    same = [{"input_ids": torch.tensor([1, 2, 3])}, {"input_ids": torch.tensor([4, 5, 6])}]
    assert ToEight()(same)["input_ids"].shape == (2, 8) and PadCollator()(same)["input_ids"].shape == (2, 3)
    with pytest.raises(ValueError):  # an empty group fails as it always did
        PadCollator()([])


@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int32, torch.int64), (torch.int32, torch.int64, torch.int32),
                                    (torch.int64, torch.bool, torch.int64), (torch.uint8, torch.float32, torch.uint8),
                                    (torch.int16, torch.int8, torch.int16)])
@pytest.mark.parametrize("middle", ["same length", "shorter", "a list"])
def test_stacking_equal_ends_gives_what_pad_sequence_gives(dtypes, middle):
    # the stacked fast path looks at the first and last rows only and lets torch.stack check the rest: whatever
    # the rows between them, each field must be what pad_sequence makes of the rows (lists read as int64)
    rows = [torch.arange(1, 5).to(dtypes[0]), torch.arange(5, 9).to(dtypes[1]), torch.arange(9, 13).to(dtypes[2])]
    if middle == "shorter":
        rows[1] = rows[1][:2]
    elif middle == "a list":
        rows[1] = rows[1].tolist()
    tensors = [torch.as_tensor(row, dtype=torch.long) if isinstance(row, list) else row for row in rows]
    lengths = torch.tensor([len(row) for row in rows])

    def padded(pad):  # where the pad value does not fit the first row's dtype (-100 in uint8 labels), pad_sequence
        try:  # refuses, and PadCollator widens the rows to int64 instead of refusing or wrapping around
            return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=pad)
        except RuntimeError:
            return torch.nn.utils.rnn.pad_sequence([t.long() for t in tensors], batch_first=True, padding_value=pad)

    batch = PadCollator()([{"input_ids": row, "labels": row} for row in rows])
    expected = {key: padded(pad) for key, pad in (("input_ids", 0), ("labels", -100))}
    expected["attention_mask"] = (torch.arange(4) < lengths[:, None]).long()
    assert batch.keys() == expected.keys()
    for key, value in expected.items():
        assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key


def test_equal_length_ids_of_two_integer_dtypes_stack_like_one_dtype_even_with_a_pad_id_they_cannot_hold():
    # no padding is needed, so the pad id's range does not matter: int16 ids alone were always stacked this way
    # (padding them with pad_sequence refuses 50256 for int16 even where no row is padded)
    rows = [torch.tensor([1, 2, 3], dtype=torch.int16), torch.tensor([4, 5, 6], dtype=torch.int8),
            torch.tensor([7, 8, 9], dtype=torch.int16)]
    batch = PadCollator(pad_token_id=50256)([{"input_ids": row} for row in rows])
    assert batch["input_ids"].dtype == torch.int16
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int16))
    assert torch.equal(batch["attention_mask"], torch.ones(3, 3, dtype=torch.long))


def test_a_field_missing_from_one_sample_is_named_by_that_sample_s_index():
    ids = torch.arange(4)
    with pytest.raises(CollateError, match=r"could not batch sample 11 \(of samples \[10, 11, 12\]\): field "
                                           r"'labels' is missing from it"):
        run_collate(PadCollator(), [{"input_ids": ids, "labels": ids}, {"input_ids": ids},
                                    {"input_ids": ids, "labels": ids}], [10, 11, 12])


def test_multi_axis_rows_of_the_ids_length_are_not_widened_along_their_last_axis():
    # (3, L) rows with L = 4 > 3: rope positions batch as (3, B, 4) (NOTE [ Vision fields in a batch ]); another
    # field of that shape, as pad_sequence stacks it, (B, 3, 4); before, the padding of a field "shorter than
    # input_ids" then widened the last axis to (B, 3, 5) with a column of zeros
    rows = [torch.arange(4).repeat(3, 1), torch.arange(4).repeat(3, 1) + 1]
    batch = PadCollator()([{"input_ids": torch.arange(4), "position_ids": r, "token_type_ids": r} for r in rows])
    assert torch.equal(batch["position_ids"], torch.stack(rows, dim=1))
    assert torch.equal(batch["token_type_ids"], torch.stack(rows))


def test_the_attention_mask_is_made_on_the_ids_device():
    for lengths in ((4, 4), (4, 2)):  # stacked, padded
        batch = PadCollator()([{"input_ids": torch.arange(n, device="meta")} for n in lengths])
        assert batch["attention_mask"].device == batch["input_ids"].device == torch.device("meta")


def test_a_collator_that_builds_its_own_samples_around_pad_collator_gets_no_wrong_index():
    """A user's collator that reorders (or flattens pairs) before PadCollator: the failing sample's place in its
    list is not one in ODB's group, so no index is named from it; the group is."""
    ids = torch.arange(4)

    def reversed_copies(samples):
        return PadCollator()([dict(s) for s in reversed(samples)])

    with pytest.raises(CollateError, match=r"raised FieldError on samples \[10, 11, 12\]: field 'labels' is missing "
                                           r"from it .*\(one of the samples its collator built from these\)"):
        run_collate(reversed_copies, [{"input_ids": ids}, {"input_ids": ids, "labels": ids},
                                      {"input_ids": ids, "labels": ids}], [10, 11, 12])


def test_a_sample_the_collator_added_is_not_named_by_an_index_of_the_group():
    """An IDLE step has no indices; a user's collator that adds a sample of its own (found by identity at a place
    past the group) used to fail inside the error's own handling with a bare IndexError."""
    ids = torch.arange(4)
    extra = {"input_ids": ids}

    def with_one_of_mine(samples):
        return PadCollator()(list(samples) + [extra])

    with pytest.raises(CollateError, match=r"raised FieldError on samples \[\]: field 'labels' is missing"):
        run_collate(with_one_of_mine, [{"input_ids": ids, "labels": ids}], [])
