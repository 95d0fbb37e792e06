"""The HF adapter on 2 CPU ranks (gloo): G2, G6 (DDP and FSDP2) and G8 through the Trainer, ODB vs plain Trainer.

One launch (tests/hf_dist_worker.py, started with the CPU `accelerate launch` recipe of docs/guides/hf-trainer.md)
runs every scenario, so the two processes import transformers once; each test below checks one guarantee on the
facts it wrote. A second, shorter launch (torchrun) trains until a mid-epoch checkpoint and is SIGKILLed there;
the main launch resumes from it. The same kill and resume runs with one process (plain python, then in this one).
A third launch (torchrun, `--positions`) resumes a run with dropout from an epoch's last step and from inside an
epoch.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_support
import hf_dist_worker
from test_properties import reference_windows

pytest_plugins = ["hf_fixtures"]
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "hf_dist_worker.py")
GUIDE = ROOT / "docs" / "guides" / "hf-trainer.md"
TOLERANCE = 1e-6
GRAD_SCENARIOS = {"grads-ga1": 1, "grads-ga3": 3, "grads-lora": 3, "grads-ga3-local": 3, "grads-idle": 3,
                  "grads-uneven-global": 3, "grads-fsdp-global": 3, "grads-fsdp-local": 3,
                  "grads-target": None}  # None: samples_per_step
UNEVEN = ("grads-idle", "grads-uneven-global")
SINGLE = dict(samples=64, epochs=2)  # the one-process kill and resume: a shorter run


def run(command: list[str], timeout: float = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def accelerate_cpu_recipe(port: int) -> list[str]:
    """The guide's `accelerate launch` line for 2 CPU processes, as documented (plus a free port)."""
    line = next(line for line in GUIDE.read_text().splitlines()
                if line.startswith("accelerate launch") and "--num_processes 2" in line)
    *options, script = line.split()[2:]
    assert script == "train.py", line
    return [str(Path(sys.executable).with_name("accelerate")), "launch", *options, "--main_process_port", str(port)]


@pytest.fixture(scope="module")
def dist_run(chat_data, tmp_path_factory) -> Path:
    from resume_launch import free_port

    out, data = tmp_path_factory.mktemp("dist"), str(chat_data.train_file.parent)
    killed = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", WORKER,
                  "--data", data, "--out", str(out), "--kill"])
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-6000:]
    result = run([*accelerate_cpu_recipe(free_port()), WORKER, "--data", data, "--out", str(out)])
    assert result.returncode == 0 and (out / "done").exists(), result.stdout[-3000:] + result.stderr[-6000:]
    (out / "launch.stderr").write_text(result.stderr)
    return out


@pytest.fixture(scope="module")
def single_run(chat_data, tmp_path_factory) -> Path:
    """One process: killed by SIGKILL after its mid-epoch checkpoint, then the full and the resumed run here."""
    out, data = tmp_path_factory.mktemp("single"), chat_data.train_file.parent
    killed = run([sys.executable, WORKER, "--data", str(data), "--out", str(out), "--kill",
                  "--samples", str(SINGLE["samples"]), "--epochs", str(SINGLE["epochs"])])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-6000:]
    hf_dist_worker.train_chat("odb", out, data, odb=True, **SINGLE)
    checkpoint = out / "killed" / f"checkpoint-{hf_dist_worker.STOP_AT}"
    hf_dist_worker.train_chat("resumed", out, data, odb=True, resume=str(checkpoint), **SINGLE)
    return out


@pytest.fixture(scope="module")
def positions_run(chat_data, tmp_path_factory) -> Path:
    out, data = tmp_path_factory.mktemp("positions"), str(chat_data.train_file.parent)
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", WORKER,
                  "--data", data, "--out", str(out), "--positions"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def facts(out: Path, name: str, world_size: int = 2) -> list[dict]:
    return [json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in range(world_size)]


def grad_samples(chat_data, name: str) -> list[dict]:
    samples = chat_data.train[:41]
    return hf_support.uneven_ranks(samples) if name in UNEVEN else samples


@pytest.mark.parametrize("name", sorted(GRAD_SCENARIOS))
def test_step_gradient_equals_big_batch_token_mean_on_two_ranks(dist_run, chat_data, name):
    """Every optimizer step's synchronised gradient (W=2, GA=1/3, LoRA, IDLE, global and rank-local planning,
    samples moved between ranks; DDP and FSDP2 full shard) equals the float64 reference."""
    ranks = facts(dist_run, name)
    assert ranks[0]["wrapped"] == ("FSDPLlamaForCausalLM" if "fsdp" in name else "DistributedDataParallel")
    steps = hf_support.steps_of(ranks[0]["infos"] + ranks[1]["infos"], GRAD_SCENARIOS[name])
    samples = grad_samples(chat_data, name)
    assert sorted(i for indices in steps.values() for i in indices) == list(range(len(samples)))
    grads = torch.load(dist_run / f"{name}.grads.pt")
    assert len(grads) == len(steps) == ranks[0]["steps"]
    make = hf_support.tiny_lora if name == "grads-lora" else hf_support.tiny_llama
    model = make(dtype=torch.float64)
    error = max(hf_support.max_relative_error(got, hf_support.reference_gradient(model, [samples[i] for i in steps[key]]))
                for got, key in zip(grads, sorted(steps)))
    print(f"W=2 {name}: max relative gradient error {error:.2e} over {len(grads)} steps")
    assert error <= TOLERANCE


def test_steps_of_a_target_size_have_the_same_micro_batches_on_every_rank_and_come_near_the_target(dist_run):
    """samples_per_step=12 (NOTE [ Steps of a target size ]): every rank runs the same micro-batches per optimizer
    step, and each step closes where the rule says, over the micro-batches' samples on both ranks."""
    ranks = facts(dist_run, "grads-target")
    assert [(i["step"], i["window_index"], i["window_steps"]) for i in ranks[0]["infos"]] == \
        [(i["step"], i["window_index"], i["window_steps"]) for i in ranks[1]["infos"]]
    per_step: dict[int, list[int]] = {}
    for info in ranks[0]["infos"] + ranks[1]["infos"]:
        per_step.setdefault(info["step"] - info["window_index"], []).append(info["local_samples"])
    sizes = [sum(v) for _, v in sorted(per_step.items())]
    assert len(sizes) == ranks[0]["steps"] and sum(sizes) == 41 and any(i["window_steps"] > 1 for i in ranks[0]["infos"])
    for epoch in sorted({i["epoch"] for i in ranks[0]["infos"]}):
        pairs = [(a, b) for a, b in zip(ranks[0]["infos"], ranks[1]["infos"]) if a["epoch"] == epoch]
        micro = [a["local_samples"] + b["local_samples"] for a, b in pairs]
        windows = [a["window_steps"] for a, _ in pairs if a["window_index"] == 0]
        assert windows == reference_windows(micro, 12), (epoch, micro, windows)
    print(f"samples per optimizer step (target 12): {sizes}")


@pytest.mark.parametrize("name", ["schedule-target", "schedule-ga2"])
def test_lr_schedule_and_progress_bar_follow_the_real_step_count(dist_run, name):
    """NOTE [ Exact schedule ]: the run's real optimizer steps are planned before training; linear warm-up (3
    steps) and decay over exactly them, the LR ends at 0 after the last step, and the bar ends at 100 %."""
    ranks = facts(dist_run, name)
    real = ranks[0]["steps"]
    assert ranks[1]["steps"] == real == ranks[0]["max_steps"] > 6
    lrs = {int(k): v for k, v in ranks[0]["lrs"].items()}
    assert sorted(lrs) == list(range(1, real + 1))
    expected = {k: 1e-2 * (k - 1) / 3 if k - 1 < 3 else 1e-2 * (real - (k - 1)) / (real - 3) for k in lrs}
    for k in (1, 2, real // 2, real):  # first, in warm-up, middle, last step
        assert lrs[k] == pytest.approx(expected[k], rel=1e-6, abs=1e-12), (k, lrs[k], expected[k])
    assert ranks[0]["final_lr"] == 0.0
    assert ranks[0]["bar"][-1] == [real, real]


def test_idle_micro_batches_run_on_the_rank_that_ran_out(dist_run):
    """The rank-local uneven scenario really has IDLE steps (whose zero contribution the gradient test above
    proves); under global planning the same data keeps both ranks busy: rank 1 runs rank 0's samples."""
    idle = [sum(info["idle"] for info in rank["infos"]) for rank in facts(dist_run, "grads-idle")]
    assert idle[0] == 0 and idle[1] >= 1
    pooled = facts(dist_run, "grads-uneven-global")
    assert sum(info["idle"] for rank in pooled for info in rank["infos"]) < idle[1]


def test_ranks_run_the_same_number_of_optimizer_steps(dist_run):
    for name in [*GRAD_SCENARIOS, "odb", "resumed"]:
        ranks = facts(dist_run, name)
        assert ranks[0]["steps"] == ranks[1]["steps"] > 0, name
        assert len(ranks[0]["infos"]) == len(ranks[1]["infos"]), name


def test_odb_and_plain_trainer_reach_comparable_eval_loss(dist_run):
    """Same samples, same epochs, same optimizer: ODB's eval loss is within 5% of the plain Trainer's."""
    odb, plain = facts(dist_run, "odb")[0], facts(dist_run, "std")[0]
    assert odb["epoch"] == plain["epoch"] == hf_dist_worker.E2E["num_train_epochs"]
    losses = [odb["losses"][k] for k in sorted(odb["losses"], key=int)]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert odb["eval_after"] < math.log(hf_support.VOCAB) - 0.8
    assert abs(odb["eval_after"] - plain["eval_after"]) <= 0.05 * plain["eval_after"], (odb["eval_after"],
                                                                                         plain["eval_after"])


def check_resumed_run(out: Path, world_size: int) -> None:
    """The killed run's checkpoint is mid-epoch and the last one it wrote; the resumed run continues with exactly
    the batches, losses and final parameters of the uninterrupted run."""
    stop = hf_dist_worker.STOP_AT
    state = json.loads((out / "killed" / f"checkpoint-{stop}" / "trainer_state.json").read_text())
    assert state["global_step"] == stop and 0 < state["epoch"] % 1
    assert [p.name for p in (out / "killed").glob("checkpoint-*")] == [f"checkpoint-{stop}"]
    for resumed, full in zip(facts(out, "resumed", world_size), facts(out, "odb", world_size)):
        assert resumed["steps"] == full["steps"] > stop and resumed["losses"] == full["losses"]
        assert resumed["infos"] and resumed["infos"] == full["infos"][-len(resumed["infos"]):]
    a, b = torch.load(out / "odb.params.pt"), torch.load(out / "resumed.params.pt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= TOLERANCE


def test_resume_after_sigkill_mid_epoch_continues_exactly_on_two_processes(dist_run):
    """G8 through Trainer.train(resume_from_checkpoint=...) on 2 CPU ranks: transformers loads the optimizer
    state with map_location='cpu:0' there, which torch cannot restore without odb_hf's registration."""
    check_resumed_run(dist_run, world_size=2)


def test_resume_after_sigkill_mid_epoch_continues_exactly_on_one_process(single_run):
    check_resumed_run(single_run, world_size=1)


def check_resumed_position(out: Path, name: str) -> int:
    """The resumed run's losses after its checkpoint, batches (every rank's) and final step and epoch are the
    uninterrupted run's; returns the checkpoint's step."""
    for resumed, full in zip(facts(out, name), facts(out, "positions-full")):
        step = resumed["resumed_from"]
        assert (resumed["steps"], resumed["epoch"]) == (full["steps"], full["epoch"]), step
        assert sorted(resumed["losses"], key=int) == sorted(full["losses"], key=int)
        worst = max(abs(resumed["losses"][k] - full["losses"][k]) for k in resumed["losses"] if int(k) > step)
        assert worst <= TOLERANCE, (step, worst)
        assert resumed["infos"] and resumed["infos"] == full["infos"][-len(resumed["infos"]):]
    return step


def test_resume_from_the_last_step_of_an_epoch_continues_exactly_on_two_ranks(positions_run):
    """Issue 28, case 1 at W = 2: the checkpoint's states say `epoch_complete` for epoch 0 (NOTE [ Resuming at an
    epoch's end ]); the resumed Trainer used to find no batch and stop half-way, with exit code 0."""
    step = check_resumed_position(positions_run, "positions-epoch-end")
    for rank in range(2):
        state = json.loads((positions_run / "positions-full" / f"checkpoint-{step}" / f"odb_loader_rank{rank}.json")
                           .read_text())
        assert state["epoch"] == 0 and state["position"]["epoch_complete"]


def test_resume_with_dropout_continues_exactly_on_two_ranks(positions_run):
    """Issue 28, case 2 at W = 2: attention dropout 0.1, a checkpoint inside epoch 1; every rank's resumed run
    draws the same dropout masks (NOTE [ ODB draws nothing from the global RNG ])."""
    step = check_resumed_position(positions_run, "positions-dropout")
    assert 0 < step < facts(positions_run, "positions-full")[0]["steps"]


def test_without_use_cpu_the_refusal_names_the_missing_ddp_and_not_deepspeed(dist_run):
    """On CPU without TrainingArguments(use_cpu=True), transformers sets up no DDP (each rank alone on all data)."""
    for rank in facts(dist_run, "refusals"):
        assert rank["args_world_size"] == 1
        assert re.search(r"counts 1 process\(es\) but torch.distributed runs 2 ranks.*transformers sets up no DDP.*"
                         r"pass use_cpu=True", rank["no_use_cpu"]), rank["no_use_cpu"]
        assert "DeepSpeed" not in rank["no_use_cpu"]


def test_per_rank_normalisation_and_training_after_evaluate_are_refused_naming_the_cause(dist_run):
    for rank in facts(dist_run, "refusals"):
        assert rank["per_rank_tokens"].startswith("average_tokens_across_devices=False normalises each rank's loss "
                                                  "by its own tokens"), rank["per_rank_tokens"]
        assert rank["evaluated_first"].startswith("the model is not wrapped for data-parallel training, so gradients "
                                                  "would not be synchronised"), rank["evaluated_first"]
        assert "trainer.evaluate() ran before train()" in rank["evaluated_first"]


def test_rank_zero_says_once_per_training_run_that_odb_is_on(dist_run):
    """The start line of odb_core.settings.console, on stderr, from rank 0 only: one per ODB train() of the launch (the six
    DDP gradient scenarios, the step-target one, the two schedule ones, odb, resumed, the two FSDP2 ones; not the
    plain Trainer's)."""
    lines = [line for line in (dist_run / "launch.stderr").read_text().splitlines() if line.startswith("odb: on")]
    assert lines[0] == ("odb: on (HF Trainer), token budget 320 (padded cost), world 2, mode global planning + join, "
                        "accumulation 1")
    assert "odb: on (HF Trainer), token budget 320 (padded cost), world 2, mode global planning + join, optimizer " \
        "steps of ~12 samples" in lines
    assert len(lines) == 13 and lines[-1].startswith("odb: on (HF CpuFSDPTrainer), token budget 320"), lines


def test_odb_metrics_are_in_the_trainer_log(dist_run):
    logs = facts(dist_run, "odb")[0]["odb_logs"]
    assert logs and all(0 < entry["odb/budget_utilization"] <= 1 and 0 <= entry["odb/padding_ratio"] < 1
                        and entry["odb/samples_per_second"] > 0 for entry in logs)
    moved = [entry["odb/moved_fraction"] for entry in logs]  # global planning (the default) at W = 2
    assert all(0 <= f <= 1 for f in moved) and any(f > 0 for f in moved)
    assert all((entry["odb/moved_bytes"] > 0) == (entry["odb/moved_fraction"] > 0) for entry in logs)
