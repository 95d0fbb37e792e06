"""A round keeps its steps' samples and counts, not collated batches; a step is collated when it is taken (NOTE [ A
step is collated when it is taken ] in odb_core/epoch/collation.py). Counting from the samples is exact for a
label-preserving collator (NOTE [ Label-preserving collators ] in odb_core/data/collate.py), and a collator that
masks labels itself is still counted on its own batch.

Before, the first `next()` of a round collated every slot of the round and held the batches until they were taken:
`test_a_round_collates_only_the_step_that_is_taken` saw the collator called once per step of the round.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_core import PadCollator
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
