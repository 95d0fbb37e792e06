"""odb_llamafactory's YAML keys and launcher decisions: pure checks, no LLaMA-Factory needed (main venv)."""

from __future__ import annotations

import logging
import warnings

import pytest

from odb_llamafactory.launcher import ranks_env, torchrun_command, wants_torchrun
from odb_llamafactory.settings import ALLOWED_KEYS, ODBConfigError, check_compatible, pop_odb_settings

BASE = {"stage": "sft", "model_name_or_path": "m", "cutoff_len": 1024}


def test_odb_keys_are_removed_so_llamafactory_never_sees_them():
    config = {**BASE, "odb": True, "odb_token_budget": 4096, "odb_join": False, "odb_cost": "tokens",
              "odb_length_slack": 0.5}
    settings = pop_odb_settings(config)
    assert config == BASE
    assert settings.enabled and settings.config.token_budget == 4096
    assert settings.given == {"token_budget": 4096, "join": False, "cost": "tokens"}
    assert settings.extras == {"length_slack": 0.5}


def test_config_without_odb_keys_is_plain_llamafactory():
    config = dict(BASE)
    assert pop_odb_settings(config) is None and config == BASE


def test_unknown_odb_key_is_named_with_the_allowed_keys():
    with pytest.raises(ODBConfigError) as err:
        pop_odb_settings({**BASE, "odb": True, "odb_token_budget": 4096, "odb_tokenbudget": 1})
    message = str(err.value)
    assert "'odb_tokenbudget'" in message and "did you mean 'odb_token_budget'" in message
    assert all(key in message for key in ALLOWED_KEYS)


@pytest.mark.parametrize(("key", "owner"), [("odb_accumulation_steps", "gradient_accumulation_steps"),
                                            ("odb_seed", "seed"), ("odb_shuffle", "disable_shuffling"),
                                            ("odb_num_workers", "dataloader_num_workers")])
def test_settings_with_a_llamafactory_source_are_refused_with_that_source(key, owner):
    with pytest.raises(ODBConfigError, match=owner):
        pop_odb_settings({"odb": True, "odb_token_budget": 4096, key: 1})


def test_enabled_odb_requires_a_token_budget():
    with pytest.raises(ODBConfigError, match="odb_token_budget is required"):
        pop_odb_settings({"odb": True})


def test_odb_keys_without_the_switch_are_refused():
    with pytest.raises(ODBConfigError, match="add odb: true"):
        pop_odb_settings({"odb_token_budget": 4096})
    with pytest.raises(ODBConfigError, match="odb='yes' is invalid"):
        pop_odb_settings({"odb": "yes", "odb_token_budget": 4096})


def test_bad_values_name_the_yaml_key_even_when_odb_is_off():
    with pytest.raises(ODBConfigError, match=r"^odb_window=0 is invalid"):
        pop_odb_settings({"odb": False, "odb_window": 0})
    with pytest.raises(ODBConfigError, match=r"^odb_token_budget=-1 is invalid"):
        pop_odb_settings({"odb": True, "odb_token_budget": -1})
    with pytest.raises(ODBConfigError, match="odb_length_slack"):
        pop_odb_settings({"odb": True, "odb_token_budget": 8, "odb_length_slack": -1})
    assert not pop_odb_settings({"odb": False}).enabled


@pytest.mark.parametrize("conflict", [{"packing": True}, {"neat_packing": True}, {"stage": "pt"},
                                      {"use_asft_loss": True}, {"use_hyper_parallel": True}, {"use_dft_loss": True},
                                      {"use_eaft_loss": True},
                                      {"disable_shuffling": True, "train_sampling_strategy": "random"}])
def test_llamafactory_settings_that_bypass_odb_are_refused(conflict):
    settings = pop_odb_settings({"odb": True, "odb_token_budget": 4096})
    with pytest.raises(ODBConfigError, match=next(iter(conflict))):
        check_compatible({**BASE, **conflict}, settings)


def test_budget_below_cutoff_len_is_left_to_the_loaders_one_warning(odb_log, caplog):
    """A cutoff_len above the budget is a possibility, not a fact: nothing is warned before training. The loader
    warns once when a sample does run alone over the budget (tests/test_llamafactory.py), so the LLaMA-Factory
    path does not warn twice."""
    settings = pop_odb_settings({"odb": True, "odb_token_budget": 512})
    assert BASE["cutoff_len"] > 512  # the premise
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG):
        warnings.simplefilter("error")
        check_compatible(BASE, settings)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []  # nor through a logger (odb's too)


def test_torchrun_relaunch_targets_this_module_in_every_rank():
    env = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "MASTER_PORT": "29555"}
    assert wants_torchrun(env, lambda: 0)
    assert wants_torchrun({"NPROC_PER_NODE": "2"}, lambda: 0)
    assert wants_torchrun({}, lambda: 8)  # several accelerators: LLaMA-Factory's own rule
    assert not wants_torchrun({**env, "LOCAL_RANK": "0"}, lambda: 8)  # a launched rank never re-launches
    assert not wants_torchrun({}, lambda: 1)
    command = torchrun_command(["cfg.yaml", "odb_join=false"], env, lambda: 0, port=1)
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert command[command.index("--nproc-per-node") + 1] == "2"
    assert command[command.index("--master-port") + 1] == "29555"
    assert command[-5:] == ["-m", "odb_llamafactory.launcher", "train", "cfg.yaml", "odb_join=false"]


def test_streaming_names_the_dataloader_workers_it_needs_and_refuses_max_samples(tmp_path):
    """LLaMA-Factory 0.9.5 streams a local file as dataloader_num_workers shards (0: an empty stream), and refuses
    max_samples with streaming; ODB reads any number >= 1 of shards (tests/test_resume_streaming.py). A hub dataset
    streams by itself, with 0 workers too (before, it was refused)."""
    import json

    (tmp_path / "dataset_info.json").write_text(json.dumps(
        {"local": {"file_name": "chat.json"}, "hub": {"hf_hub_url": "org/chat"}}))
    settings = pop_odb_settings({"odb": True, "odb_token_budget": 4096})
    streaming = {**BASE, "streaming": True, "max_steps": 10, "dataset_dir": str(tmp_path), "dataset": "hub, local"}
    with pytest.raises(ODBConfigError, match=r"streaming: true needs dataloader_num_workers: 1 or more for local:"):
        check_compatible(streaming, settings)
    with pytest.raises(ODBConfigError, match=r"max_samples does not work with streaming: true"):
        check_compatible({**streaming, "dataloader_num_workers": 2, "max_samples": 1000}, settings)
    for workers in (1, 2, 4):
        check_compatible({**streaming, "dataloader_num_workers": workers, "max_samples": None}, settings)
    check_compatible({**streaming, "dataset": "hub"}, settings)
    with pytest.raises(ODBConfigError, match=r"1 or more for local:"):  # an evaluation file streams the same way
        check_compatible({**streaming, "dataset": "hub", "eval_dataset": "local"}, settings)
    check_compatible({**streaming, "dataset_dir": "ONLINE", "dataset": "org/chat"}, settings)


def test_a_layer_wise_optimizer_is_refused_only_beside_a_step_target():
    """GaLore's and APOLLO's layer-wise hooks step the optimizer and the scheduler at every backward pass; a step
    target runs several backward passes per optimizer step (LLaMA-Factory refuses them with G > 1 for that)."""
    target = pop_odb_settings({"odb": True, "odb_token_budget": 4096, "odb_samples_per_step": 64})
    for name in ("galore", "apollo"):
        layerwise = {f"use_{name}": True, f"{name}_layerwise": True}
        with pytest.raises(ODBConfigError, match=rf"^{name}_layerwise: true conflicts with odb_samples_per_step"):
            check_compatible({**BASE, **layerwise}, target)
        check_compatible({**BASE, **layerwise}, pop_odb_settings({"odb": True, "odb_token_budget": 4096}))
        check_compatible({**BASE, f"{name}_layerwise": True}, target)  # inert without use_{name}


def test_the_ranks_get_the_allocator_settings_llamafactory_s_launcher_gives_them():
    """llamafactory/launcher.py sets both under OPTIM_TORCH (on by default) for every rank it starts."""
    tuned = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}
    assert ranks_env({"A": "1"}) == {"A": "1", **tuned}
    assert ranks_env({"OPTIM_TORCH": "0", "A": "1"}) == {"OPTIM_TORCH": "0", "A": "1"}


@pytest.mark.parametrize("variable", ["USE_RAY", "USE_MCA"])
def test_ray_and_mca_are_refused_from_the_variables_llamafactory_reads(variable):
    """LLaMA-Factory takes both from the environment: a `use_mca` key alone is reset to false by its parser, and
    `use_ray` is no key at all. Before, the keys were checked and the variables were not."""
    settings = pop_odb_settings({"odb": True, "odb_token_budget": 4096})
    with pytest.raises(ODBConfigError, match=rf"^{variable}=1 conflicts with odb: true"):
        check_compatible(BASE, settings, env={variable: "1"})
    check_compatible(BASE, settings, env={variable: "0"})
    check_compatible({**BASE, "use_mca": True}, settings, env={})
