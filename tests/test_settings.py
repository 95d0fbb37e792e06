"""The one settings parser and the one step counter that every adapter uses (odb_core.settings.settings, odb_core.steps.metrics).

Pure checks, no framework needed: each adapter's source names keys its own way, the rules are the same.
"""

from __future__ import annotations

import pytest

from conftest import LengthDataset
from odb_core import ODBDataLoader
from odb_core.settings.ds_section import DEEPSPEED_SECTION
from odb_core.settings.settings import POSITIVE_INT, SettingsSource, combine, read_settings
from odb_core.steps.metrics import LoaderMetrics, StepCounts
from odb_llamafactory.settings import LLAMAFACTORY, ODBConfigError

SOURCES = [  # (source, the same settings as written there, how an error names `window`)
    (DEEPSPEED_SECTION, {"enabled": True, "token_budget": 64, "window": 8}, "odb.window"),
    (LLAMAFACTORY, {"odb": True, "odb_token_budget": 64, "odb_window": 8}, "odb_window"),
]


@pytest.mark.parametrize(("source", "values", "window"), SOURCES)
def test_every_source_yields_the_same_config_and_names_keys_as_the_user_wrote_them(source, values, window):
    settings = read_settings(values, source)
    assert settings.enabled and settings.config.token_budget == 64 and settings.config.window == 8
    assert settings.given == {"token_budget": 64, "window": 8}
    bad = {k: (0 if k.endswith("window") else v) for k, v in values.items()}
    with pytest.raises(source.error, match=rf"^{window}=0 is invalid: it must be an int >= 1"):
        read_settings(bad, source)
    typo = {**values, source.prefix + "windw": 8}
    with pytest.raises(source.key_error, match=rf"unknown key '{source.prefix}windw' \(did you mean "
                                               rf"'{source.prefix}window'\?\) in {source.where}"):
        read_settings(typo, source)


def test_a_field_the_framework_owns_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="odb.accumulation_steps is not allowed: .*gradient_accumulation_steps"):
        read_settings({"enabled": True, "token_budget": 8, "accumulation_steps": 2}, DEEPSPEED_SECTION)
    with pytest.raises(ODBConfigError, match="odb_seed is not an odb key: LLaMA-Factory's seed"):
        read_settings({"odb": True, "odb_token_budget": 8, "odb_seed": 1}, LLAMAFACTORY)


def test_derived_values_fill_only_the_fields_the_user_left_unset():
    settings = read_settings({"enabled": True, "token_budget": 64, "seed": 7}, DEEPSPEED_SECTION)
    config = settings.derive(accumulation_steps=4, seed=123)
    assert (config.accumulation_steps, config.seed, config.token_budget) == (4, 7, 64)
    assert settings.derive() is settings.config  # nothing derived: the very config the source gave


def test_a_switched_off_source_is_checked_and_needs_no_budget():
    off = read_settings({"odb": False, "odb_window": 8}, LLAMAFACTORY)
    assert not off.enabled and off.config is None and off.given == {"window": 8}
    with pytest.raises(ODBConfigError, match="odb_window=0"):
        read_settings({"odb": False, "odb_window": 0}, LLAMAFACTORY)


def test_two_places_combine_only_when_every_field_set_in_both_agrees():
    mine_source = SettingsSource(where="ODBCallback", budget="optional", keys={"length_slack": POSITIVE_INT})
    section = read_settings({"enabled": True, "token_budget": 64, "window": 8}, DEEPSPEED_SECTION)
    mine = read_settings({"token_budget": 64, "cost": "tokens", "length_slack": 2}, mine_source)
    both = combine(mine, section)
    assert both.given == {"token_budget": 64, "window": 8, "cost": "tokens"} and both.extras == {"length_slack": 2}
    assert (both.config.window, both.config.cost) == (8, "tokens")
    assert combine(read_settings({}, mine_source), section).config is section.config  # adopted as it is
    with pytest.raises(ValueError, match="window=4 in ODBCallback but odb.window=8 in the DeepSpeed config"):
        combine(read_settings({"window": 4}, mine_source), section)


def test_step_counts_delta_is_the_count_of_the_steps_in_between():
    loader = ODBDataLoader(LengthDataset([5, 9, 13, 30, 2, 7, 11, 4] * 3), token_budget=40)
    infos = [batch.info for batch in loader]
    counts = [StepCounts()]
    for info in infos:
        counts.append(counts[-1].add(info))
    middle = StepCounts()
    for info in infos[2:5]:
        middle = middle.add(info)
    assert counts[5] - counts[2] == middle
    metrics = LoaderMetrics(token_budget=40, world_size=1)
    metrics.restore(loader.metrics.snapshot())
    assert metrics.counts == counts[-1] and metrics.summary() == loader.metrics.summary()
    assert metrics.budget_utilization == counts[-1].budget_utilization(40, 1) > 0
