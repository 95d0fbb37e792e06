"""The HF Trainer with `TrainingArguments(deepspeed=<config with an odb section>)` on 2 CPU ranks (gloo, ZeRO-2).

Launched once by tests/test_hf_deepspeed.py under torchrun, with its own TORCH_EXTENSIONS_DIR. Every scenario
writes its facts to `--out`; the tests assert on them:
  grads : float64, SGD at lr 0, uneven ranks (rank-local planning: rank 1 runs IDLE micro-batches), G = 2: every
          optimizer step's full gradient, read with deepspeed.utils.safe_get_full_grad right before DeepSpeed's step
          (rank 0); grads-global: the same under global planning (samples move between ranks);
  train : real chat text, AdamW, 2 epochs, shuffled, an odd sample count: losses, steps, every rank's StepInfos;
  naive : TrainingArguments without use_cpu=True, where accelerate counts 1 process per rank (see the NOTE):
          the error ODBCallback raises when the Trainer is built.

NOTE [ accelerate + DeepSpeed without a GPU ]
TrainingArguments(deepspeed=...) without use_cpu=True, on a machine without a GPU: accelerate 1.16 finds no device
backend, leaves it unset and counts num_processes = 1, process_index = 0 on every rank, while DeepSpeed runs 2
ranks over gloo (the "naive" scenario; ODBCallback refuses it). With use_cpu=True accelerate sets up gloo for
every rank (MULTI_CPU) and the Trainer still runs DeepSpeed (is_deepspeed_enabled, a DeepSpeedEngine): the
grads and train scenarios run that way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import deepspeed  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import hf_support  # noqa: E402
from odb_core.data.collate import PadCollator  # noqa: E402
from odb_hf import ODBCallback, ODBSetupError  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else init_distributed compiles it (~3 min)
CONFIG = REPO / "configs" / "deepspeed" / "zero2_odb.json"
GRADS_ODB = {"token_budget": 200, "window": 16, "shuffle": False}
TRAIN_ODB = {"token_budget": 480, "window": 64}
TRAIN_SAMPLES = 97  # odd: the ranks get 49 and 48 samples
# Batch size 1 and G = 2: what zero2_odb.json says (the Trainer checks). use_cpu: see the NOTE above.
COMMON = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, report_to=[], disable_tqdm=True,
              save_strategy="no", seed=0, use_cpu=True)


class GradTap(TrainerCallback):
    """Records the synchronised full gradient right before each DeepSpeed optimizer step.

    accelerate calls `engine.step()` inside `backward` at the accumulation boundary, before any optimizer event, so
    the tap wraps the engine's `step` on this instance (test instrumentation only).
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.steps = trainer, []

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        step = engine.step

        def tapped_step(*a, **k):
            self.steps.append({n: deepspeed.utils.safe_get_full_grad(p).detach().to(torch.float64).clone()
                               for n, p in engine.module.named_parameters() if p.requires_grad})
            return step(*a, **k)

        engine.step = tapped_step


def record(info) -> dict:
    return {"epoch": info.epoch, "step": info.step, "indices": list(info.indices), "idle": info.is_idle,
            "window_index": info.window_index, "window_steps": info.window_steps,
            "window_samples": info.window_samples}


def write_config(out: Path, name: str, odb: dict, accumulation_steps: int = 2) -> Path:
    config = json.loads(CONFIG.read_text())
    config["odb"].update(odb)
    config["gradient_accumulation_steps"] = accumulation_steps
    path = out / f"{name}.rank{os.environ['RANK']}.ds_config.json"  # before the process group exists
    path.write_text(json.dumps(config))
    return path


def engine_facts(trainer: Trainer) -> dict:
    engine = trainer.model_wrapped
    return {"engine": type(engine).__name__, "odb_in_engine_config": "odb" in engine.config,
            "zero_stage": engine.zero_optimization_stage(), "dp_world_size": engine.dp_world_size,
            "engine_ga": engine.gradient_accumulation_steps(), "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps, "trainer_processes": trainer.accelerator.num_processes}


def grads(out: Path, samples: list[dict], name: str = "grads", planning: str = "local", **odb: int) -> None:
    """With `odb` (samples_per_step) the step holds a variable number of micro-batches: the config and the
    Trainer then accumulate 1 (NOTE [ Steps of a target size under the HF Trainer ])."""
    infos: list = []
    accumulation = 1 if odb else COMMON["gradient_accumulation_steps"]
    config = write_config(out, name, {**GRADS_ODB, "planning": planning, **odb}, accumulation)
    args = TrainingArguments(output_dir=str(out / name), deepspeed=str(config),
                             optim="sgd", learning_rate=0.0, lr_scheduler_type="constant", num_train_epochs=1,
                             train_sampling_strategy="sequential", logging_steps=1000,
                             **{**COMMON, "gradient_accumulation_steps": accumulation})
    odb = ODBCallback.from_deepspeed_config(args, observer=lambda i: infos.append(record(i)))
    trainer = Trainer(model=hf_support.tiny_llama(dtype=torch.float64), args=args,
                      train_dataset=hf_support.ListDataset(hf_support.uneven_ranks(samples)),
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb])
    tap = GradTap(trainer)
    trainer.add_callback(tap)
    trainer.train()
    facts = {"infos": infos, "steps": trainer.state.global_step, **engine_facts(trainer)}
    (out / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(facts))
    if dist.get_rank() == 0:
        torch.save(tap.steps, out / f"{name}.pt")


def train(out: Path, samples: list[dict]) -> None:
    infos: list = []
    args = TrainingArguments(output_dir=str(out / "train"), deepspeed=str(write_config(out, "train", TRAIN_ODB)),
                             learning_rate=1e-2, num_train_epochs=2, warmup_steps=2, lr_scheduler_type="linear",
                             logging_steps=1, **COMMON)
    odb = ODBCallback.from_deepspeed_config(args, observer=lambda i: infos.append(record(i)))
    trainer = Trainer(model=hf_support.tiny_llama(seed=0), args=args, train_dataset=hf_support.ListDataset(samples),
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    facts = {"infos": infos, "steps": trainer.state.global_step, "losses": losses, "epoch": trainer.state.epoch,
             **engine_facts(trainer)}
    (out / f"train.rank{dist.get_rank()}.json").write_text(json.dumps(facts))


def naive(out: Path) -> None:
    """TrainingArguments(deepspeed=...) without use_cpu=True on this GPU-less machine (see the NOTE above)."""
    args = TrainingArguments(output_dir=str(out / "naive"), deepspeed=str(CONFIG), **{**COMMON, "use_cpu": False})
    facts: dict = {"args_world_size": args.world_size, "args_process_index": args.process_index}
    try:
        Trainer(model=hf_support.tiny_llama(), args=args, train_dataset=hf_support.ListDataset([]),
                callbacks=[ODBCallback.from_deepspeed_config(args)])
        facts["error"] = None
    except ODBSetupError as exc:
        facts["error"] = str(exc)
    (out / f"naive.rank{dist.get_rank()}.json").write_text(json.dumps(facts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    samples = hf_support.load_samples(ns.data / "train.json")
    grads(ns.out, samples[:41])
    grads(ns.out, samples[:41], name="grads-global", planning="global")
    grads(ns.out, samples[:41], name="grads-target", planning="global", samples_per_step=6)
    train(ns.out, samples[:TRAIN_SAMPLES])
    naive(ns.out)
    dist.barrier()
    if dist.get_rank() == 0:
        (ns.out / "done").write_text("ok")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # do not wait in atexit handlers for a peer that will never arrive
    # this rank finished: destroy its groups now, since Gloo groups left to interpreter teardown can abort the
    # process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489)
    dist.destroy_process_group()
