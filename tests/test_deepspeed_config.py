"""The DeepSpeed config's `odb` section: validation, loading, and the checks `initialize` makes before DeepSpeed.

None of these tests starts DeepSpeed: every ODB check runs before `import deepspeed`.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

import odb_deepspeed
from odb_core import ODBConfig, ODBDataLoader
from odb_core.settings.ds_section import ALLOWED_KEYS, parse_odb_section, without_odb_section

EXAMPLE = Path(__file__).resolve().parents[1] / "configs/deepspeed/zero2_odb.json"


def _config(**odb) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
            "odb": {"enabled": True, "token_budget": 4096, **odb}}


def test_example_config_parses_to_a_valid_odb_config():
    section = parse_odb_section(str(EXAMPLE))
    assert section is not None and section.enabled
    config = section.derive(accumulation_steps=2)
    assert isinstance(config, ODBConfig) and config.token_budget == 16384 and config.accumulation_steps == 2
    assert section.extras["shuffle"] is True


def test_misspelled_key_is_rejected_naming_the_key_and_the_allowed_keys():
    with pytest.raises(ValueError) as error:
        parse_odb_section(_config(token_budgt=10))
    message = str(error.value)
    assert "'token_budgt'" in message and "did you mean 'token_budget'" in message
    assert all(key in message for key in ALLOWED_KEYS)


def test_typo_in_a_disabled_section_is_still_rejected():
    with pytest.raises(ValueError, match="'shufle'"):
        parse_odb_section({"odb": {"enabled": False, "token_budget": 8, "shufle": True}})


def test_accumulation_steps_comes_only_from_deepspeed():
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        parse_odb_section(_config(accumulation_steps=4))


@pytest.mark.parametrize(("odb", "needle"), [
    ({"enabled": "yes", "token_budget": 8}, "odb.enabled='yes'"),
    ({"token_budget": 8}, "odb.enabled=None"),
    ({"enabled": True}, "odb.token_budget is required"),
    ({"enabled": True, "token_budget": -1}, "odb.token_budget=-1"),
    ({"enabled": True, "token_budget": 8, "cost": "flops"}, "odb.cost='flops'"),
    ({"enabled": True, "token_budget": 8, "num_workers": -2}, "odb.num_workers=-2"),
    ({"enabled": True, "token_budget": 8, "shuffle": 1}, "odb.shuffle=1"),
])
def test_bad_values_name_the_field_and_the_fix(odb, needle):
    with pytest.raises(ValueError) as error:
        parse_odb_section({"odb": odb})
    assert needle in str(error.value)


def test_absent_section_parses_to_none_and_disabled_is_reported():
    assert parse_odb_section({"train_batch_size": 8}) is None
    assert parse_odb_section({"odb": {"enabled": False, "token_budget": 8}}).enabled is False


def test_config_loads_from_a_file_path_and_base64_like_deepspeed(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config(cost="tokens")))
    encoded = base64.urlsafe_b64encode(json.dumps(_config(cost="tokens")).encode()).decode()
    for source in (path, str(path), encoded):
        assert parse_odb_section(source).given == {"token_budget": 4096, "cost": "tokens"}


def test_odb_section_is_removed_from_a_copy_only():
    user = _config()
    stripped = without_odb_section(user)
    assert "odb" not in stripped and "odb" in user and stripped["gradient_accumulation_steps"] == 4


def test_initialize_validates_the_section_before_starting_deepspeed():
    with pytest.raises(ValueError, match="'token_budgt'"):
        odb_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=_config(token_budgt=1))


def test_the_deprecated_deepscale_config_argument_is_read_as_deepspeed_reads_it(tmp_path):
    """Before, the section of a config named by `args.deepscale_config` was not read: ODB stayed off, silently."""
    import argparse

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config(token_budgt=1)))
    with pytest.raises(ValueError, match="'token_budgt'"):
        odb_deepspeed.initialize(args=argparse.Namespace(deepscale_config=str(path)), model=torch.nn.Linear(2, 2))


def test_initialize_refuses_enabled_odb_without_training_data():
    with pytest.raises(ValueError, match="training_data is None"):
        odb_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=_config())


def test_initialize_refuses_a_fixed_batch_torch_dataloader():
    loader = torch.utils.data.DataLoader([{"input_ids": [1, 2]}], batch_size=4)
    with pytest.raises(TypeError, match="training_data=loader.dataset"):
        odb_deepspeed.initialize(model=torch.nn.Linear(2, 2), training_data=loader, config=_config())


def test_initialize_refuses_a_collate_fn_next_to_a_ready_odb_loader():
    loader = ODBDataLoader([{"input_ids": [1, 2]}], token_budget=8)
    with pytest.raises(ValueError, match="collate_fn= was given with a ready ODBDataLoader; pass it to ODBDataLoader"):
        odb_deepspeed.initialize(model=torch.nn.Linear(2, 2), training_data=loader, collate_fn=list, config=_config())


# -- odb.epochs: DeepSpeed's decaying schedule fitted to ODB's exact plan (NOTE [ Exact DeepSpeed schedule ]) ----

def _scheduler(kind: str, optimizer: torch.optim.Optimizer, guessed_total: int):
    from deepspeed.runtime import lr_schedules

    options = ({"warmup_min_lr": 0.0, "warmup_max_lr": 1.0} if kind == "WarmupDecayLR"
               else {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.01})
    return getattr(lr_schedules, kind)(optimizer, total_num_steps=guessed_total, warmup_num_steps=2,
                                       warmup_type="linear", **options)


@pytest.mark.parametrize("kind,end", [("WarmupDecayLR", 0.0), ("WarmupCosineLR", 0.01)])
@pytest.mark.parametrize("step", [{"accumulation_steps": 2}, {"samples_per_step": 12}], ids=["G2", "samples12"])
def test_odb_epochs_ends_a_decaying_deepspeed_schedule_exactly_at_the_last_step(kind, end, step):
    """A real loader (W = 1) and DeepSpeed's own scheduler, stepped at every optimizer-step boundary as the engine
    does: after `fit_schedule` the LR reaches the scheduler's end value exactly after the last step of the planned
    epochs, and not before it; the config's guess (1000) would have left it near its peak."""
    from odb_deepspeed.initialize import fit_schedule

    lengths = [8 + (i * 37) % 90 for i in range(80)]
    loader = ODBDataLoader([{"input_ids": torch.arange(1, n + 1)} for n in lengths], token_budget=256,
                           shuffle=True, **step)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = _scheduler(kind, optimizer, guessed_total=1000)
    fit_schedule(scheduler, loader, epochs=2)
    used = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            if batch.info.ends_window:
                used.append(optimizer.param_groups[0]["lr"])
                scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(end)  # after the last step: the end value
    assert min(used[2:]) > end  # every step after the warm-up trained above it


def test_odb_epochs_without_a_decaying_scheduler_is_refused_naming_the_fix():
    from odb_deepspeed.initialize import fit_schedule

    with pytest.raises(ValueError, match=r"odb.epochs=2 sets the scheduler's total_num_steps, but the DeepSpeed "
                                         r"config has no scheduler; use a scheduler section of type WarmupDecayLR"):
        fit_schedule(None, None, 2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=r"has a LambdaLR scheduler, which has no total_num_steps"):
        fit_schedule(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), None, 2)
    assert parse_odb_section({"odb": {"enabled": True, "token_budget": 64, "epochs": 3}}).extras["epochs"] == 3


def test_managed_gradient_accumulation_off_is_refused_before_deepspeed_starts():
    """With it off every engine.step() is an optimizer step: each took one micro-batch's share of the window's
    gradient, with no error (a review measured 16 optimizer steps for 8 windows at G = 2)."""
    config = {**_config(), "managed_gradient_accumulation": False}
    with pytest.raises(ValueError, match="managed_gradient_accumulation=false in the DeepSpeed config is not "
                                         "supported with odb"):
        parse_odb_section(config)
    assert parse_odb_section({**config, "odb": {"enabled": False, "token_budget": 8}}).enabled is False
    assert parse_odb_section({**_config(), "managed_gradient_accumulation": True}).enabled


def test_a_step_target_beside_deepspeed_accumulation_is_refused_naming_deepspeed_s_keys():
    with pytest.raises(ValueError, match=r"odb.samples_per_step=32 sets how many micro-batches each optimizer step "
                                         r"holds, but DeepSpeed's gradient accumulation is 4: set "
                                         r"gradient_accumulation_steps to 1"):
        parse_odb_section(_config(samples_per_step=32))
    assert parse_odb_section({**_config(tokens_per_step=4096), "gradient_accumulation_steps": 1}).enabled


def test_odb_epochs_applies_to_a_ready_loader_and_only_the_builder_s_keys_are_refused():
    from odb_deepspeed.initialize import _check_user_loader

    loader = ODBDataLoader([{"input_ids": [1, 2, 3]}] * 4, token_budget=4096, accumulation_steps=4)
    _check_user_loader(loader, parse_odb_section(_config(epochs=3)), 4)  # before: "odb.shuffle / odb.num_workers"
    with pytest.raises(ValueError, match=r"^odb.shuffle: set on your ODBDataLoader instead"):
        _check_user_loader(loader, parse_odb_section(_config(epochs=3, shuffle=True)), 4)
    loader.close()
