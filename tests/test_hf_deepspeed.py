"""The HF adapter with `TrainingArguments(deepspeed=<config with an odb section>)`: the config path of odb_deepspeed.

Unit tests build Trainers in this process (nothing trains); the slow tests assert on one 2-rank torchrun launch of
tests/hf_ds_worker.py (HF Trainer + DeepSpeed ZeRO-2 over gloo on CPU, ~50 s when the machine is idle).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import hf_support
from odb_core.data.collate import PadCollator
from odb_hf import ODBCallback, ODBSetupError, ODBTrainer, ODBTrainerMixin
from odb_hf.checks import check_engine, check_process_count
from test_properties import reference_windows

pytest_plugins = ["hf_fixtures"]
ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "deepspeed" / "zero2_odb.json"
LAUNCH_TIMEOUT_S = 420
SAMPLES = [{"input_ids": [2, 5, 6, 7], "labels": [-100, 5, 6, 7]}] * 4


@pytest.fixture(autouse=True)
def _no_leaked_deepspeed(monkeypatch):
    """Later tests in this process must not run DeepSpeed: accelerate's Accelerator sets
    os.environ["ACCELERATE_USE_DEEPSPEED"] for good (every later TrainingArguments would then build a DeepSpeed
    plugin), and TrainingArguments(deepspeed=...) registers a process-wide weakref."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # restored to its value before (unset) after the test
    yield
    unset_hf_deepspeed_config()


def ds_config(**odb) -> dict:
    config = json.loads(CONFIG.read_text())
    config["odb"].update(odb)
    return config


def make_args(tmp_path, deepspeed, **overrides) -> TrainingArguments:
    options = dict(output_dir=str(tmp_path), deepspeed=deepspeed, per_device_train_batch_size=1,
                   gradient_accumulation_steps=2, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    return TrainingArguments(**{**options, **overrides})


def build(args, callback, trainer_class=Trainer):
    return trainer_class(model=hf_support.tiny_llama(), args=args, train_dataset=hf_support.ListDataset(SAMPLES),
                         data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[callback])


def test_misspelled_key_in_the_odb_section_of_training_arguments_raises_before_training(tmp_path):
    config = ds_config()
    config["odb"]["token_budgt"] = config["odb"].pop("token_budget")
    args = make_args(tmp_path, config)  # neither transformers nor DeepSpeed looks inside the section
    for make in (lambda: build(args, ODBCallback(token_budget=16384)), lambda: ODBCallback.from_deepspeed_config(args)):
        with pytest.raises(ODBSetupError, match=r"TrainingArguments.deepspeed: unknown key 'token_budgt'.*"
                                                r"did you mean 'token_budget'"):
            make()


def test_from_deepspeed_config_takes_the_shipped_config_file_settings(tmp_path):
    callback = ODBCallback.from_deepspeed_config(str(CONFIG))
    assert callback.enabled and callback.settings.config.token_budget == 16384
    assert callback.settings.given == {"token_budget": 16384, "cost": "padded", "join": True, "seed": 0}
    assert not callback.settings.extras.keys() & {"shuffle", "num_workers"}  # the section's loader keys
    args = make_args(tmp_path, str(CONFIG))
    trainer = build(args, ODBCallback.from_deepspeed_config(args))
    assert trainer.is_deepspeed_enabled and isinstance(trainer, ODBTrainerMixin)


def test_callback_adopts_the_section_settings_it_leaves_unset(tmp_path):
    callback = ODBCallback(token_budget=16384, window=32)
    trainer = build(make_args(tmp_path, ds_config(cost="tokens")), callback)
    assert isinstance(trainer, ODBTrainerMixin)
    assert callback.settings.given == {"token_budget": 16384, "cost": "tokens", "join": True, "seed": 0, "window": 32}


def test_a_setting_in_both_the_callback_and_the_section_must_be_equal(tmp_path):
    args = make_args(tmp_path, ds_config(window=16))
    with pytest.raises(ODBSetupError, match=r"token_budget=1024 in ODBCallback but odb.token_budget=16384"):
        build(args, ODBCallback(token_budget=1024))
    with pytest.raises(ODBSetupError, match=r"window=8 in ODBCallback but odb.window=16"):
        ODBCallback.from_deepspeed_config(args, window=8)
    assert ODBCallback.from_deepspeed_config(args, window=16, observer=print).settings.given["window"] == 16


def test_section_shuffle_num_workers_and_epochs_must_agree_with_training_arguments(tmp_path):
    sequential = make_args(tmp_path, ds_config(shuffle=True), train_sampling_strategy="sequential")
    with pytest.raises(ODBSetupError, match=r"odb.shuffle=true .*train_sampling_strategy='sequential'"):
        build(sequential, ODBCallback.from_deepspeed_config(sequential))
    workers = make_args(tmp_path, ds_config(num_workers=0), dataloader_num_workers=1)
    with pytest.raises(ODBSetupError, match=r"odb.num_workers=0 .*dataloader_num_workers=1"):
        build(workers, ODBCallback(token_budget=16384))
    epochs = make_args(tmp_path, ds_config(epochs=2), num_train_epochs=3)
    with pytest.raises(ODBSetupError, match=r"odb.epochs=2 .*num_train_epochs=3"):
        build(epochs, ODBCallback.from_deepspeed_config(epochs))


def test_disabled_section_turns_odb_off_for_a_callback_built_from_the_config(tmp_path, caplog):
    args = make_args(tmp_path, ds_config(enabled=False))
    callback = ODBCallback.from_deepspeed_config(args)
    with caplog.at_level(logging.WARNING, logger="odb_hf.attach"):
        trainer = build(args, callback)
    assert type(trainer) is Trainer and not hasattr(trainer, "odb") and not callback.enabled
    assert "ODB is off: odb.enabled is false" in caplog.text
    control = SimpleNamespace(should_training_stop=False, should_epoch_stop=False)
    for event in ("on_train_begin", "on_step_end", "on_epoch_end", "on_save", "on_train_end"):
        assert getattr(callback, event)(args, trainer.state, control) is None  # no ODB run to act on
    assert control == SimpleNamespace(should_training_stop=False, should_epoch_stop=False)  # nor did it steer


def test_disabled_section_refuses_an_explicit_callback_and_an_odb_trainer_class(tmp_path):
    with pytest.raises(ODBSetupError, match=r"odb.enabled=false in TrainingArguments.deepspeed, but the "
                                            r"ODBCallback asks for ODB"):
        build(make_args(tmp_path, ds_config(enabled=False)), ODBCallback(token_budget=16384))
    args = make_args(tmp_path, ds_config(enabled=False))  # one Trainer per TrainingArguments under DeepSpeed
    with pytest.raises(ODBSetupError, match=r"ODBTrainer mixes in ODB"):
        build(args, ODBCallback.from_deepspeed_config(args), ODBTrainer)
    with pytest.raises(ODBSetupError, match=r"the DeepSpeed config has no 'odb' section"):
        ODBCallback.from_deepspeed_config({"train_micro_batch_size_per_gpu": 1})


def test_trainer_and_torch_distributed_must_count_the_same_processes():
    """The refusal names the real cause (no device backend without use_cpu=True) and the fix; DeepSpeed only when
    the Trainer runs it (the 2-rank refusals are checked in test_hf_distributed.py and below)."""
    check_process_count(1, deepspeed=False)  # one process, no process group
    for deepspeed in (False, True):
        with pytest.raises(ODBSetupError, match=r"counts 2 process\(es\) but torch.distributed runs 1 ranks.*"
                                                r"use_cpu=True") as error:
            check_process_count(2, deepspeed=deepspeed)
        assert ("DeepSpeed" in str(error.value)) == deepspeed


def test_summed_deepspeed_gradients_are_refused():
    summed = SimpleNamespace(is_deepspeed_enabled=True, model_wrapped=SimpleNamespace(gradient_average=False))
    with pytest.raises(ODBSetupError, match="gradient_allreduce_op='sum'"):
        check_engine(summed)
    check_engine(SimpleNamespace(is_deepspeed_enabled=True, model_wrapped=SimpleNamespace(gradient_average=True)))


# -- 2 ranks, HF Trainer + DeepSpeed ZeRO-2 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def ds_run(chat_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_ds")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TORCH_EXTENSIONS_DIR": str(out / "torch_extensions"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "tests" / "hf_ds_worker.py"), "--data", str(chat_data.train_file.parent), "--out", str(out)]
    try:
        result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:  # torchrun's agent stops both ranks when it is killed
        pytest.fail(f"2-rank HF + DeepSpeed run hung for {LAUNCH_TIMEOUT_S} s:\n{str(exc.stderr)[-6000:]}")
    assert result.returncode == 0 and (out / "done").exists(), result.stdout[-3000:] + result.stderr[-6000:]
    return out


def facts(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_the_trainer_runs_deepspeed_zero2_with_the_odb_key_in_its_config(ds_run):
    for name in ("grads", "train"):
        for rank in facts(ds_run, name):
            assert (rank["engine"], rank["zero_stage"], rank["dp_world_size"]) == ("DeepSpeedEngine", 2, 2)
            assert rank["odb_in_engine_config"] and rank["engine_ga"] == 2 and rank["trainer_processes"] == 2


@pytest.mark.slow
def test_ranks_run_the_same_number_of_optimizer_steps_with_uneven_data(ds_run):
    for name in ("grads", "train"):
        ranks = facts(ds_run, name)
        assert ranks[0]["steps"] == ranks[1]["steps"] == ranks[0]["global_steps"] == ranks[1]["global_steps"] > 0
        assert len(ranks[0]["infos"]) == len(ranks[1]["infos"]) == 2 * ranks[0]["steps"]  # G = 2
    assert sum(info["idle"] for info in facts(ds_run, "grads")[1]["infos"]) >= 1  # rank 1 ran out first


@pytest.mark.slow
def test_every_sample_is_used_once_per_epoch(ds_run):
    import hf_ds_worker

    infos = [info for rank in facts(ds_run, "train") for info in rank["infos"]]
    for epoch in range(2):
        used = sorted(i for info in infos if info["epoch"] == epoch for i in info["indices"])
        assert used == list(range(hf_ds_worker.TRAIN_SAMPLES)), epoch


@pytest.mark.slow
@pytest.mark.parametrize(("name", "accumulation"), [("grads", 2), ("grads-global", 2), ("grads-target", None)])
def test_step_gradient_equals_the_big_batch_token_mean_under_deepspeed(ds_run, chat_data, name, accumulation):
    """Trainer + DeepSpeed (scale_wrt_gas=False, loss x W, DeepSpeed's mean over W) with num_items_in_batch =
    window_tokens: every step's gradient is the float64 single-process gradient of the step's token mean, with
    rank-local planning (IDLE micro-batches on the short rank), global planning (samples moved), and
    samples_per_step=6 (a variable number of micro-batches per step; the boundary set at each step's last)."""
    ranks = facts(ds_run, name)
    samples = hf_support.uneven_ranks(chat_data.train[:41])
    steps = hf_support.steps_of(ranks[0]["infos"] + ranks[1]["infos"], accumulation)
    if accumulation is None:  # the step target really varies the step, and every rank runs the same micro-batches
        micro = [[(i["epoch"], i["step"]) for i in rank["infos"]] for rank in ranks]
        assert micro[0] == micro[1]
        assert len({i["window_steps"] for i in ranks[0]["infos"]}) > 1
        for epoch in sorted({i["epoch"] for i in ranks[0]["infos"]}):  # each step closes where the rule says
            pairs = [(a, b) for a, b in zip(*(rank["infos"] for rank in ranks)) if a["epoch"] == epoch]
            sizes = [len(a["indices"]) + len(b["indices"]) for a, b in pairs]
            windows = [a["window_steps"] for a, _ in pairs if a["window_index"] == 0]
            assert windows == reference_windows(sizes, 6), (epoch, sizes, windows)
    assert sorted(i for indices in steps.values() for i in indices) == list(range(len(samples)))
    grads = torch.load(ds_run / f"{name}.pt")
    assert len(grads) == len(steps) == ranks[0]["steps"]
    model = hf_support.tiny_llama(dtype=torch.float64)
    error = max(hf_support.max_relative_error(got, hf_support.reference_gradient(model, [samples[i] for i in steps[k]]))
                for got, k in zip(grads, sorted(steps)))
    print(f"HF Trainer + DeepSpeed ZeRO-2, W=2, {name}: max relative gradient error {error:.2e} over "
          f"{len(grads)} steps")
    assert error <= 1e-6  # ZeRO keeps fp32 gradient partitions: the floor is one fp32 rounding (~6e-8)


@pytest.mark.slow
def test_token_mean_loss_decreases_under_deepspeed(ds_run):
    losses = facts(ds_run, "train")[0]["losses"]
    assert facts(ds_run, "train")[1]["losses"] == losses  # the Trainer logs the all-rank step mean
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.4, losses


@pytest.mark.slow
def test_a_trainer_that_counts_one_process_on_two_ranks_is_refused(ds_run):
    """Without use_cpu=True on a GPU-less machine, accelerate counts 1 process per rank under DeepSpeed."""
    for rank in facts(ds_run, "naive"):
        assert rank["args_world_size"] == 1 and rank["args_process_index"] == 0
        assert "counts 1 process(es) but torch.distributed runs 2 ranks" in rank["error"]
        assert "the Trainer still runs DeepSpeed" in rank["error"] and "pass use_cpu=True" in rank["error"]
