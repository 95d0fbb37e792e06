"""Multi-rank HF adapter scenarios, launched once by tests/test_hf_distributed.py under torchrun (2 CPU ranks, gloo).

Every scenario writes its facts to `--out`; the tests assert on them. Scenarios:
  grads-*   : float64, lr = 0, every optimizer step's synchronised gradient (rank 0) and every rank's StepInfos,
              global planning (the default) and rank-local (`-local`, and `grads-idle` whose uneven ranks run IDLE);
  odb/std   : ODB and a plain Trainer on real chat text, same samples and epochs; eval loss, steps per rank;
  stopped/resumed: the ODB run stopped after STOP_AT steps, then resumed from that checkpoint in a new Trainer;
  grads-target: as grads-*, with samples_per_step (optimizer steps of a variable number of micro-batches);
  schedule-*: two epochs with warm-up and decay (samples_per_step, and G = 2): the LR of every step, the final LR,
              the progress bar's total and position at the last step, the real optimizer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))
import hf_support  # noqa: E402
from odb_core.collate import PadCollator  # noqa: E402
from odb_hf import ODBCallback  # noqa: E402

STOP_AT = 5
E2E = dict(learning_rate=1e-2, num_train_epochs=3, warmup_steps=2, weight_decay=0.0, lr_scheduler_type="linear",
           max_grad_norm=1.0, logging_steps=1, use_cpu=True, seed=0, report_to=[], disable_tqdm=True,
           per_device_eval_batch_size=16, eval_strategy="epoch", save_strategy="steps", save_steps=STOP_AT)
# No trainer.evaluate() before train(): in transformers 5.6.2 it registers the bare model with accelerate, and
# train() then skips the DDP wrap, so gradients are not synchronised (ODBCallback refuses to train then).


class StopAt(TrainerCallback):
    """Stops right after the checkpoint at STOP_AT is written (so the saved TrainerControl does not say stop)."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == STOP_AT:
            control.should_training_stop = True


def _restore_indexed_cpu(storage, location: str):
    return storage if location.startswith("cpu:") else None


# transformers 5.6.2 loads the optimizer state with map_location=args.device, which is "cpu:0" in multi-process
# CPU runs, and torch 2.13 cannot restore to "cpu:0" (an upstream issue, not ODB's). Teach torch.load that
# location, through torch's public registration API, so that the resume scenario can run on CPU.
torch.serialization.register_package(99, lambda obj: None, _restore_indexed_cpu)


def record(info) -> dict:
    return {"epoch": info.epoch, "step": info.step, "indices": list(info.indices), "idle": info.is_idle,
            "local_samples": info.local_samples, "window_index": info.window_index,
            "window_steps": info.window_steps, "window_samples": info.window_samples}


class BarWatch(TrainerCallback):
    """Added after the Trainer's ProgressCallback: the bar's total and position after every step (rank 0)."""

    def __init__(self, trainer) -> None:
        self.bar = next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == "ProgressCallback"), None)
        self.seen: list = []

    def on_step_end(self, args, state, control, **kwargs):
        bar = getattr(self.bar, "training_bar", None)
        if bar is not None:
            self.seen.append([bar.n, bar.total])


def grads(name: str, model, samples, out: Path, accumulation_steps: int, budget: int = 320,
          strategy: str = "random", planning: str = "global", **odb_options) -> None:
    infos, recorder = [], hf_support.GradRecorder()
    args = TrainingArguments(output_dir=str(out / name), gradient_accumulation_steps=accumulation_steps,
                             learning_rate=0.0, optim="sgd", max_grad_norm=0.0, num_train_epochs=1, report_to=[],
                             save_strategy="no", logging_steps=1000, use_cpu=True, seed=0, disable_tqdm=True,
                             lr_scheduler_type="constant", train_sampling_strategy=strategy)
    odb = ODBCallback(token_budget=budget, window=16, planning=planning, observer=lambda i: infos.append(record(i)),
                      **odb_options)
    trainer = Trainer(model=model, args=args, train_dataset=hf_support.ListDataset(samples),
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb, recorder])
    trainer.train()
    rank = dist.get_rank()
    (out / f"{name}.rank{rank}.json").write_text(json.dumps({"infos": infos, "steps": trainer.state.global_step}))
    if rank == 0:
        torch.save(recorder.steps, out / f"{name}.grads.pt")


def train_chat(name: str, out: Path, data: Path, odb: bool, resume: str | None = None, stop: bool = False):
    infos: list = []
    args = TrainingArguments(output_dir=str(out / name), gradient_accumulation_steps=2,
                             per_device_train_batch_size=8, **E2E)
    callbacks: list = [StopAt()] if stop else []
    if odb:
        callbacks.append(ODBCallback(token_budget=1024, window=64, observer=lambda i: infos.append(record(i))))
    train = hf_support.ListDataset(hf_support.load_samples(data / "train.json"))
    held_out = hf_support.ListDataset(hf_support.load_samples(data / "eval.json"))
    trainer = Trainer(model=hf_support.tiny_llama(seed=0), args=args, train_dataset=train, eval_dataset=held_out,
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    after = trainer.evaluate()["eval_loss"]
    rank = dist.get_rank()
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    odb_logs = [{k: v for k, v in e.items() if k.startswith("odb/")} for e in trainer.state.log_history
                if any(k.startswith("odb/") for k in e)]
    facts = {"eval_after": after, "steps": trainer.state.global_step, "losses": losses,
             "infos": infos, "odb_logs": odb_logs, "epoch": trainer.state.epoch}
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(facts))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / f"{name}.params.pt")


def schedule(name: str, out: Path, data: Path, accumulation_steps: int, **odb_options) -> None:
    infos: list = []
    args = TrainingArguments(output_dir=str(out / name), gradient_accumulation_steps=accumulation_steps,
                             learning_rate=1e-2, num_train_epochs=2, warmup_steps=3, lr_scheduler_type="linear",
                             logging_steps=1, use_cpu=True, seed=0, report_to=[], disable_tqdm=False,
                             save_strategy="no")
    odb = ODBCallback(token_budget=512, window=32, observer=lambda i: infos.append(record(i)), **odb_options)
    train = hf_support.ListDataset(hf_support.load_samples(data / "train.json")[:96])
    trainer = Trainer(model=hf_support.tiny_llama(seed=0), args=args, train_dataset=train,
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb])
    watch = BarWatch(trainer)
    trainer.add_callback(watch)
    trainer.train()
    lrs = {entry["step"]: entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry}
    facts = {"lrs": lrs, "final_lr": trainer.lr_scheduler.get_last_lr()[0], "steps": trainer.state.global_step,
             "max_steps": trainer.state.max_steps, "bar": watch.seen, "infos": infos}
    (out / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(facts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    samples = hf_support.load_samples(ns.data / "train.json")[:41]  # odd count: the ranks get 21 and 20 samples
    grads("grads-ga1", hf_support.tiny_llama(dtype=torch.float64), samples, ns.out, 1)
    grads("grads-ga3", hf_support.tiny_llama(dtype=torch.float64), samples, ns.out, 3)
    grads("grads-lora", hf_support.tiny_lora(dtype=torch.float64), samples, ns.out, 3)
    grads("grads-ga3-local", hf_support.tiny_llama(dtype=torch.float64), samples, ns.out, 3, planning="local")
    grads("grads-idle", hf_support.tiny_llama(dtype=torch.float64), hf_support.uneven_ranks(samples), ns.out, 3,
          budget=200, strategy="sequential", planning="local")
    grads("grads-uneven-global", hf_support.tiny_llama(dtype=torch.float64), hf_support.uneven_ranks(samples),
          ns.out, 3, budget=200, strategy="sequential")
    grads("grads-target", hf_support.tiny_llama(dtype=torch.float64), samples, ns.out, 1, samples_per_step=12)
    schedule("schedule-target", ns.out, ns.data, 1, samples_per_step=16)
    schedule("schedule-ga2", ns.out, ns.data, 2)
    train_chat("odb", ns.out, ns.data, odb=True)
    train_chat("std", ns.out, ns.data, odb=False)
    train_chat("stopped", ns.out, ns.data, odb=True, stop=True)
    train_chat("resumed", ns.out, ns.data, odb=True, resume=str(ns.out / "stopped" / f"checkpoint-{STOP_AT}"))
    dist.barrier()
    if os.environ.get("RANK") == "0":
        (ns.out / "done").write_text("ok")
    # every rank passed the barrier: destroy the groups now, since Gloo groups left to interpreter teardown can
    # abort the process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
