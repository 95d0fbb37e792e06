"""Multi-rank HF adapter scenarios, launched by tests/test_hf_distributed.py on 2 CPU ranks (gloo).

The main launch (`accelerate launch`, the CPU recipe of docs/guides/hf-trainer.md) runs every scenario; each
writes its facts to `--out` and the tests assert on them. Scenarios:
  grads-*   : float64, lr = 0, every optimizer step's synchronised gradient (rank 0) and every rank's StepInfos,
              global planning (the default) and rank-local (`-local`, and `grads-idle` whose uneven ranks run IDLE);
              `grads-fsdp-*`: the same under FSDP2, full shard (see CpuFSDPTrainer);
  odb/std   : ODB and a plain Trainer on real chat text, same samples and epochs; eval loss, steps per rank;
  resumed   : the ODB run resumed in a new Trainer from the checkpoint of the `--kill` launch (below);
  refusals  : what ODBCallback refuses on 2 ranks (no use_cpu=True on this GPU-less machine, per-rank token
              normalisation, train() after evaluate()): the error messages;
  grads-target: as grads-*, with samples_per_step (optimizer steps of a variable number of micro-batches);
  schedule-*: two epochs with warm-up and decay (samples_per_step, and G = 2): the LR of every step, the final LR,
              the progress bar's total and position at the last step, the real optimizer steps.
`--kill` (its own torchrun launch, or plain python for one process) runs the ODB run until the checkpoint at
STOP_AT (mid-epoch) is on disk on every rank, then every rank SIGKILLs itself, as a lost node takes a job down.
`--positions` (its own torchrun launch): `positions-full` trains with attention dropout and G = 2, saving after every
optimizer step; `positions-epoch-end` and `positions-dropout` resume from the checkpoint at epoch 0's last step and
from one inside epoch 1 (G8 at every checkpoint position, tests/test_hf_resume.py on one process).
Nothing here works around torch or transformers: a resumed multi-process CPU run needs what odb_hf does itself
(NOTE [ Indexed CPU devices in torch.load ] in odb_core/resume/checkpoints.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))
import hf_support  # noqa: E402
from odb_core.data.collate import PadCollator  # noqa: E402
from odb_hf import ODBCallback, ODBSetupError  # noqa: E402

STOP_AT = 5
E2E = dict(learning_rate=1e-2, num_train_epochs=3, warmup_steps=2, weight_decay=0.0, lr_scheduler_type="linear",
           max_grad_norm=1.0, logging_steps=1, use_cpu=True, seed=0, report_to=[], disable_tqdm=True,
           per_device_eval_batch_size=16, eval_strategy="epoch", save_strategy="steps", save_steps=STOP_AT)
FSDP2 = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})
# No trainer.evaluate() before train(): in transformers 5.6.2 it registers the bare model with accelerate, and
# train() then skips the DDP wrap, so gradients are not synchronised (ODBCallback refuses to train then).


class KillAt(TrainerCallback):
    """Once the checkpoint at STOP_AT is on disk on every rank (ODB's on_save ran before this one), SIGKILL."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == STOP_AT:
            if dist.is_initialized():
                dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


class CpuFSDPTrainer(Trainer):
    """accelerate 1.16 turns FSDP on only for accelerator backends (MULTI_GPU, ...): on CPU a Trainer with
    `fsdp=...` silently runs DDP. This test-only class gives the Trainer's accelerator the state a GPU run gets
    (distributed type FSDP, the plugin built from the same TrainingArguments); from there on the FSDP2 code
    (fully_shard, the reduce-scatter over gloo, the Trainer's FSDP branches) is accelerate's and torch's own."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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
          strategy: str = "random", planning: str = "global", fsdp: bool = False, **odb_options) -> None:
    infos, recorder = [], hf_support.GradRecorder()
    args = TrainingArguments(output_dir=str(out / name), gradient_accumulation_steps=accumulation_steps,
                             learning_rate=0.0, optim="sgd", max_grad_norm=0.0, num_train_epochs=1, report_to=[],
                             save_strategy="no", logging_steps=1000, use_cpu=True, seed=0, disable_tqdm=True,
                             lr_scheduler_type="constant", train_sampling_strategy=strategy, **(FSDP2 if fsdp else {}))
    odb = ODBCallback(token_budget=budget, window=16, planning=planning, observer=lambda i: infos.append(record(i)),
                      **odb_options)
    trainer = (CpuFSDPTrainer if fsdp else Trainer)(
        model=model, args=args, train_dataset=hf_support.ListDataset(samples),
        data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb, recorder])
    trainer.train()
    facts = {"infos": infos, "steps": trainer.state.global_step, "wrapped": type(trainer.model_wrapped).__name__}
    (out / f"{name}.rank{rank()}.json").write_text(json.dumps(facts))
    if rank() == 0:
        torch.save(recorder.steps, out / f"{name}.grads.pt")


def train_chat(name: str, out: Path, data: Path, odb: bool, resume: str | None = None, kill: bool = False,
               samples: int | None = None, epochs: int = 3) -> None:
    infos: list = []
    args = TrainingArguments(output_dir=str(out / name), gradient_accumulation_steps=2,
                             per_device_train_batch_size=8, **{**E2E, "num_train_epochs": epochs})
    callbacks: list = []
    if odb:
        callbacks.append(ODBCallback(token_budget=1024, window=64, observer=lambda i: infos.append(record(i))))
    if kill:
        callbacks.append(KillAt())
    train = hf_support.ListDataset(hf_support.load_samples(data / "train.json")[:samples])
    held_out = hf_support.ListDataset(hf_support.load_samples(data / "eval.json"))
    trainer = Trainer(model=hf_support.tiny_llama(seed=0), args=args, train_dataset=train, eval_dataset=held_out,
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    after = trainer.evaluate()["eval_loss"]
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    odb_logs = [{k: v for k, v in e.items() if k.startswith("odb/")} for e in trainer.state.log_history
                if any(k.startswith("odb/") for k in e)]
    facts = {"eval_after": after, "steps": trainer.state.global_step, "losses": losses,
             "infos": infos, "odb_logs": odb_logs, "epoch": trainer.state.epoch}
    (out / f"{name}.rank{rank()}.json").write_text(json.dumps(facts))
    if rank() == 0:
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / f"{name}.params.pt")


def position_run(name: str, out: Path, data: Path, resume: Path | None = None) -> None:
    """Attention dropout 0.1, G = 2, two epochs; saving after every optimizer step unless resumed."""
    infos: list = []
    args = TrainingArguments(output_dir=str(out / name), gradient_accumulation_steps=2, learning_rate=1e-2,
                             num_train_epochs=2, report_to=[], use_cpu=True, save_strategy="no" if resume else "steps",
                             save_steps=1, logging_steps=1, seed=0, disable_tqdm=True, lr_scheduler_type="linear")
    odb = ODBCallback(token_budget=320, window=16, observer=lambda i: infos.append(record(i)))
    trainer = Trainer(model=hf_support.tiny_llama(seed=0, attention_dropout=0.1), args=args,
                      train_dataset=hf_support.ListDataset(hf_support.load_samples(data / "train.json")[:41]),
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb])
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    facts = {"steps": trainer.state.global_step, "epoch": trainer.state.epoch, "losses": losses, "infos": infos,
             "resumed_from": int(resume.name.removeprefix("checkpoint-")) if resume else None}
    (out / f"{name}.rank{rank()}.json").write_text(json.dumps(facts))


def positions(out: Path, data: Path) -> None:
    """The uninterrupted run, then two resumed runs: from epoch 0's last step and from a step inside epoch 1."""
    position_run("positions-full", out, data)
    saved = {int(p.name.removeprefix("checkpoint-")): json.loads((p / f"odb_loader_rank{rank()}.json").read_text())
             for p in (out / "positions-full").glob("checkpoint-*")}
    epoch_end = min(k for k, state in saved.items() if (state["position"] or {}).get("epoch_complete"))
    inside = min(k for k, state in saved.items() if state["epoch"] == 1 and not state["position"]["epoch_complete"])
    position_run("positions-epoch-end", out, data, out / "positions-full" / f"checkpoint-{epoch_end}")
    position_run("positions-dropout", out, data, out / "positions-full" / f"checkpoint-{inside}")


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
    (out / f"{name}.rank{rank()}.json").write_text(json.dumps(facts))


def refused(build) -> str | None:
    """The ODBSetupError message of `build()` (None if it raised none)."""
    try:
        build()
    except ODBSetupError as exc:
        return str(exc)
    return None


def refusals(out: Path, data: Path) -> None:
    """What ODBCallback refuses on 2 ranks: TrainingArguments without use_cpu=True on this GPU-less machine
    (accelerate counts 1 process per rank), average_tokens_across_devices=False, and train() after evaluate()
    (transformers then skips the DDP wrap)."""
    samples = hf_support.ListDataset(hf_support.load_samples(data / "train.json")[:16])
    collator = PadCollator(pad_token_id=hf_support.PAD)

    def trainer(**overrides) -> Trainer:
        args = TrainingArguments(output_dir=str(out / "refusals"), report_to=[], save_strategy="no",
                                 disable_tqdm=True, **overrides)
        return Trainer(model=hf_support.tiny_llama(), args=args, train_dataset=samples, eval_dataset=samples,
                       data_collator=collator, callbacks=[ODBCallback(token_budget=1024)])

    evaluated = trainer(use_cpu=True, max_steps=1)
    evaluated.evaluate()
    facts = {"args_world_size": TrainingArguments(output_dir=str(out / "refusals"), report_to=[]).world_size,
             "no_use_cpu": refused(lambda: trainer()),
             "per_rank_tokens": refused(lambda: trainer(use_cpu=True, average_tokens_across_devices=False)),
             "evaluated_first": refused(evaluated.train)}
    (out / f"refusals.rank{rank()}.json").write_text(json.dumps(facts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill", action="store_true", help="run `killed`: SIGKILL after the save at STOP_AT")
    parser.add_argument("--samples", type=int, default=None, help="training samples of the --kill run")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the --kill run")
    parser.add_argument("--positions", action="store_true", help="only the resumes from every checkpoint position")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    if ns.kill:
        train_chat("killed", ns.out, ns.data, odb=True, kill=True, samples=ns.samples, epochs=ns.epochs)
        raise RuntimeError(f"the run ended before its checkpoint at step {STOP_AT}")
    if ns.positions:
        positions(ns.out, ns.data)
        dist.barrier()
        dist.destroy_process_group()  # as below: Gloo groups left to interpreter teardown can abort the process
        return
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
    train_chat("resumed", ns.out, ns.data, odb=True, resume=str(ns.out / "killed" / f"checkpoint-{STOP_AT}"))
    for planning in ("global", "local"):
        grads(f"grads-fsdp-{planning}", hf_support.tiny_llama(dtype=torch.float64), samples, ns.out, 3,
              planning=planning, fsdp=True)
    refusals(ns.out, ns.data)
    dist.barrier()
    if rank() == 0:
        (ns.out / "done").write_text("ok")
    # every rank passed the barrier: destroy the groups now, since Gloo groups left to interpreter teardown can
    # abort the process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
