"""Single-process loader behaviour: coverage, budget, determinism, model-ready batches."""

from __future__ import annotations

import pytest
import torch

from odb_core import ODBDataLoader


def _epoch(loader):
    return [(b.info.indices, b["input_ids"].shape) for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_index_appears_exactly_once_per_epoch(small_dataset, num_workers):
    loader = ODBDataLoader(small_dataset, token_budget=2048, num_workers=num_workers, shuffle=True)
    seen = [i for b in loader for i in b.info.indices]
    assert sorted(seen) == list(range(len(small_dataset)))


def test_padded_groups_stay_within_budget(small_dataset):
    loader = ODBDataLoader(small_dataset, token_budget=2048)
    for batch in loader:
        rows, width = batch["input_ids"].shape
        assert rows * width <= 2048 or rows == 1
        assert batch["attention_mask"].sum() == batch.info.local_input_tokens


def test_batches_do_not_depend_on_num_workers_or_prefetch(small_dataset):
    runs = [_epoch(ODBDataLoader(small_dataset, token_budget=2048, num_workers=w, prefetch_steps=p, shuffle=True))
            for w, p in [(0, 0), (2, 2), (1, 0)]]
    assert runs[0] == runs[1] == runs[2]


def test_seed_and_epoch_change_the_order(small_dataset):
    loader = ODBDataLoader(small_dataset, token_budget=2048, shuffle=True, seed=1)
    first, second = _epoch(loader), _epoch(loader)
    other_seed = _epoch(ODBDataLoader(small_dataset, token_budget=2048, shuffle=True, seed=2))
    assert first != second and first != other_seed


def test_supervised_tokens_follow_the_causal_shift(small_dataset):
    loader = ODBDataLoader(small_dataset, token_budget=2048)
    for batch in loader:
        expected = int((batch["labels"][:, 1:] != -100).sum())
        assert batch.info.local_tokens == batch.info.global_tokens == batch.info.window_tokens == expected
