"""Config validation: `ODBConfig` rejects every bad field value at construction, naming the field (STYLE 5), and
`ODBDataLoader` rejects unknown or conflicting arguments instead of silently ignoring them (STYLE 14)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from torch.utils.data import DistributedSampler, IterableDataset, SequentialSampler

from conftest import LengthDataset
from odb_core import LocalTransport, ODBConfig, ODBDataLoader

# (field, bad value, extra fields that make only this field wrong)
BAD_VALUES: list[tuple[str, Any, dict[str, Any]]] = [
    ("token_budget", 0, {}),
    ("token_budget", -1, {}),
    ("token_budget", 1.5, {}),
    ("token_budget", "16384", {}),
    ("token_budget", None, {}),
    ("cost", "flops", {}),
    ("cost", "Padded", {}),
    ("attention_alpha", -0.1, {"cost": "attention"}),
    ("attention_alpha", float("nan"), {"cost": "attention"}),
    ("attention_alpha", 0.5, {"cost": "padded"}),
    ("attention_alpha", 0.5, {"cost": "tokens"}),
    ("max_patches", 0, {}),
    ("max_patches", -3, {}),
    ("max_patches", 2.5, {}),
    ("max_batch_size", 0, {}),
    ("max_batch_size", 1.0, {}),
    ("window", 0, {}),
    ("window", -1, {}),
    ("window", 8.0, {}),
    ("min_window", 0, {}),
    ("min_window", 8.0, {}),
    ("min_window", True, {}),
    ("round_growth", 1, {}),
    ("round_growth", 0.5, {}),
    ("round_growth", float("inf"), {}),
    ("round_growth", True, {}),
    ("round_growth", "2", {}),
    ("round_growth", 1025, {}),
    ("pool_window", 0, {}),
    ("pool_window", 16384.0, {}),
    ("pool_window", True, {}),
    ("max_buffer_bytes", 0, {}),
    ("max_buffer_bytes", 1.5e9, {}),
    ("join", 1, {}),
    ("join", "false", {}),
    ("join", None, {}),
    ("oversize", "drop", {}),
    ("oversize", "truncate", {}),
    ("accumulation_steps", 0, {}),
    ("accumulation_steps", 2.0, {}),
    ("samples_per_step", 0, {}),
    ("samples_per_step", 32.0, {}),
    ("samples_per_step", 32, {"accumulation_steps": 2}),  # a step target sets the micro-batches itself
    ("tokens_per_step", -5, {}),
    ("tokens_per_step", 4096, {"samples_per_step": 32}),  # one target, not two
    ("planning", "pooled", {}),
    ("planning", None, {}),
    ("nproc_per_node", 0, {}),
    ("nproc_per_node", 2.0, {}),
    ("nproc_per_node", True, {}),
    ("move", "copy", {}),
    ("move", True, {}),
    ("seed", 1.5, {}),
    ("seed", "0", {}),
    ("shuffle_steps", "no", {}),
    ("shuffle_steps", 0, {}),
    ("prefetch_steps", -1, {}),
    ("prefetch_steps", 1.5, {}),
    ("fetch_chunk", 0, {}),
    ("fetch_chunk", 2.5, {}),
    ("reader_thread", 1, {}),
    ("reader_thread", "yes", {}),
    ("collate_ahead", 0, {}),
    ("collate_ahead", "no", {}),
    ("plan_ahead", 1, {}),
    ("plan_ahead", "yes", {}),
    ("overlap_moves", 1, {}),
    ("overlap_moves", "yes", {}),
    ("shared_memory_moves", 1, {}),
    ("shared_memory_moves", "no", {}),
    ("worker_regions", 1, {}),
    ("worker_regions", "yes", {}),
    ("sync_timeout_s", 0, {}),
    ("sync_timeout_s", -5.0, {}),
    ("sync_timeout_s", float("nan"), {}),
    ("liveness_timeout_s", 0, {}),
    ("liveness_timeout_s", "5", {}),
    ("worker_timeout_s", -1.0, {}),
    ("worker_timeout_s", float("nan"), {}),
]


@pytest.mark.parametrize(("field", "value", "extra"), BAD_VALUES, ids=lambda v: repr(v)[:20])
def test_bad_config_value_raises_value_error_naming_the_field(field, value, extra):
    arguments = {"token_budget": 1024, **extra, field: value}
    with pytest.raises(ValueError, match=rf"ODBConfig\.{field}="):
        ODBConfig(**arguments)


def test_every_config_field_has_a_rejected_value_above():
    # A new field must come with its validation and a line in BAD_VALUES.
    assert {name for name, _, _ in BAD_VALUES} == {f.name for f in dataclasses.fields(ODBConfig)}


# Proposed fix (odb_core/settings/config.py): an `_is_int(v)` helper, `isinstance(v, int) and not isinstance(v, bool)`, for
# the int fields, and an `isinstance(v, int | float) and not isinstance(v, bool)` check before comparing the float
# fields, so that a wrong type raises the same field-naming ValueError.

@pytest.mark.parametrize(("field", "value"), [("token_budget", True), ("window", True), ("seed", False),
                                              ("accumulation_steps", True), ("sync_timeout_s", "30")])
def test_wrongly_typed_config_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ODBConfig\.{field}="):
        ODBConfig(**{"token_budget": 1024, field: value})


def test_error_message_names_the_value_and_the_allowed_range():
    with pytest.raises(ValueError, match=r"ODBConfig\.window=0 is invalid: it must be an int >= 1"):
        ODBConfig(token_budget=1024, window=0)


def test_token_budget_is_required_and_fields_are_keyword_only():
    with pytest.raises(TypeError):
        ODBConfig()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ODBConfig(1024)  # type: ignore[misc]


def test_config_is_frozen():
    config = ODBConfig(token_budget=1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.token_budget = 2048  # type: ignore[misc]


def test_valid_edge_values_are_accepted():
    config = ODBConfig(token_budget=1, cost="attention", attention_alpha=0.0, max_patches=1, max_batch_size=1,
                       window=1, join=False, oversize="error", accumulation_steps=1, seed=-7, shuffle_steps=False,
                       prefetch_steps=0, fetch_chunk=1, sync_timeout_s=0.001, worker_timeout_s=0.0)
    assert config.window == 1 and config.prefetch_steps == 0


# -- ODBDataLoader arguments ---------------------------------------------------------------------------------

@pytest.fixture
def dataset() -> LengthDataset:
    return LengthDataset([8] * 16)


def test_loader_rejects_unknown_keyword_arguments_by_name(dataset):
    with pytest.raises(TypeError, match=r"unknown arguments \['batch_size', 'max_input_length'\]"):
        ODBDataLoader(dataset, token_budget=64, batch_size=4, max_input_length=64)


def test_loader_passes_config_fields_through_and_validates_them(dataset):
    loader = ODBDataLoader(dataset, token_budget=64, window=32, cost="tokens", accumulation_steps=2)
    assert (loader.config.window, loader.config.cost, loader.config.accumulation_steps) == (32, "tokens", 2)
    with pytest.raises(ValueError, match=r"ODBConfig\.window="):
        ODBDataLoader(dataset, token_budget=64, window=0)


def test_loader_needs_a_token_budget_or_a_config(dataset):
    with pytest.raises(TypeError, match="token_budget"):
        ODBDataLoader(dataset)


@pytest.mark.parametrize("conflict", [{"token_budget": 64}, {"window": 16}, {"cost": "tokens"}])
def test_loader_rejects_config_together_with_individual_config_fields(dataset, conflict):
    with pytest.raises(TypeError, match="either config"):
        ODBDataLoader(dataset, config=ODBConfig(token_budget=64), **conflict)


# Proposed fix (odb_core/epoch/loader.py, ODBDataLoader.__init__): default `seed` and `join` to None, fill in 0 / True
# only when building the config from arguments, and add `seed is not None or join is not None` to the conflict
# check of the `config is not None` branch.

@pytest.mark.parametrize("conflict", [{"join": False}, {"seed": 7}])
def test_loader_rejects_config_together_with_seed_or_join(dataset, conflict):
    with pytest.raises(TypeError, match="either config"):
        ODBDataLoader(dataset, config=ODBConfig(token_budget=64), **conflict)


def test_loader_rejects_a_sampler_together_with_shuffle(dataset):
    with pytest.raises(ValueError, match="mutually exclusive"):
        ODBDataLoader(dataset, token_budget=64, sampler=SequentialSampler(dataset), shuffle=True)


def test_loader_rejects_a_distributed_sampler_for_another_world_size(dataset):
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="num_replicas=2"):
        ODBDataLoader(dataset, token_budget=64, sampler=sampler, transport=LocalTransport())


class _Stream(IterableDataset):
    def __iter__(self):
        return iter([])


def test_loader_rejects_a_sampler_for_an_iterable_dataset():
    with pytest.raises(ValueError, match="IterableDataset"):
        ODBDataLoader(_Stream(), token_budget=64, sampler=SequentialSampler(range(4)))


def test_loader_rejects_a_dataset_that_is_neither_sized_nor_iterable():
    class Unsized:
        def __getitem__(self, index):
            return {"input_ids": [1, 2]}

    with pytest.raises(TypeError, match="neither an IterableDataset nor sized"):
        ODBDataLoader(Unsized(), token_budget=64)


def test_move_fetch_is_refused_for_an_iterable_dataset():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter([{"input_ids": [1, 2]}])

    with pytest.raises(ValueError, match="move='fetch'"):
        ODBDataLoader(Stream(), token_budget=64, move="fetch")
