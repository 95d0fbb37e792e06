"""One rank of a CPU HF Trainer run on the MM-Mix-like VLM workload (launched by torchrun).

    torchrun --nproc_per_node 2 -m benchmarks.workers.mm_train_worker --processor DIR --out DIR --mode odb --mode std

Every mode trains the same tiny Qwen2-VL (`mm_mix.tiny_qwen2_vl`, seed 0) on the same samples for the same epochs
with the same optimizer. `std` is the HF default: a fixed per-device batch, padded. `odb` is `ODBCallback` under
the same token budget with a patch cap. `--replay NAME=FILE` adds a mode NAME that trains on a fixed list of
batches per rank read from FILE (a JSON list per rank of lists of dataset indices): how benchmarks/mm_bench.py
runs the reference release's schedules, which it computes on lengths in the release's own environment.
`--samples-cache` (a `torch.save`d list of processed samples) replaces the image pipeline for the training set, so
that the timed region is training only. Modes run in the order given, `--repeats` times (methods alternating).
Each rank writes `{mode}.rank{r}.json` with the facts of the first repeat (optimizer steps, logged losses,
held-out loss, how often the vision tower ran, the ODB steps) and the timing of every repeat under "repeats".
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from benchmarks.data import mm_mix
from benchmarks.data.workloads import Listed
from benchmarks.lib.time_to_quality import eval_clock


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What one mode trains on and with."""

    processor: Path
    out: Path
    n_train: int
    n_eval: int
    epochs: int
    token_budget: int
    max_patches: int
    batch_size: int
    learning_rate: float
    window: int = 256
    hidden: int = 64
    samples_cache: Path | None = None
    replays: tuple[tuple[str, Path], ...] = ()
    samples_per_step: int = 0  # > 0: both modes take optimizer steps of this many samples (time to quality)
    eval_every: int = 0  # > 0: evaluate every this many optimizer steps and record the eval curve
    odb_max_batch_size: int = 0  # ODB's micro-batch cap (0: none)
    workers: int = 0  # DataLoader workers per rank, both modes
    worker_regions: bool | None = None  # ODB's workers place images in a region they reuse (None: ODB's default)


class RegionCount(TrainerCallback):
    """The most tensors the ODB loader's inbox has taken from its workers' regions, seen at each step's end (NOTE [
    A worker's region ]; 0 without workers or regions)."""

    def __init__(self, odb) -> None:
        self.odb, self.most = odb, 0

    def on_step_end(self, args, state, control, **kwargs) -> None:
        watch = self.odb.run.loader._stream._watch if self.odb.run is not None else None
        inbox = watch.inbox if watch is not None else None
        if inbox is not None:
            self.most = max(self.most, inbox.regions.tensors)


class VisionCalls:
    """Counts forward calls of the vision tower (IDLE dummies included)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.model.visual.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self.calls += 1


def replay_batches(schedule: Path) -> tuple[list[list[int]], list[int]]:
    """This rank's batches from `schedule`, cut to the shortest rank's count (ranks that run unequal step counts
    hang a DDP job), and the dataset indices all ranks train on after that cut."""
    ranks = json.loads(schedule.read_text())
    steps = min(len(rank) for rank in ranks)
    return ranks[dist.get_rank()][:steps], [i for rank in ranks for group in rank[:steps] for i in group]


@dataclass(frozen=True, kw_only=True)
class Data:
    """What every mode and repeat trains and evaluates on, loaded once per process."""

    processor: mm_mix.VisionTextProcessor
    train_set: torch.utils.data.Dataset
    eval_set: torch.utils.data.Dataset
    tokens: list[int]  # input_ids length of each training sample (for tokens/s)

    @classmethod
    def load(cls, spec: RunSpec) -> "Data":
        train_set = (Listed(torch.load(spec.samples_cache)[: spec.n_train]) if spec.samples_cache
                     else mm_mix.MMMixDataset(spec.processor, mm_mix.mm_mix_specs(spec.n_train, seed=1)))
        return cls(processor=mm_mix.VisionTextProcessor.load(spec.processor), train_set=train_set,
                   eval_set=mm_mix.MMMixDataset(spec.processor, mm_mix.mm_mix_specs(spec.n_eval, seed=2)),
                   tokens=[int(train_set[k]["input_ids"].numel()) for k in range(len(train_set))])


def train(mode: str, spec: RunSpec, data: Data) -> dict:
    from transformers import Trainer, TrainingArguments

    from odb_core.data.collate import PadCollator
    from odb_hf import ODBCallback

    class ReplayTrainer(Trainer):
        """Trains on fixed batches (lists of dataset indices) instead of the Trainer's sampler."""

        def __init__(self, *args, batches: list[list[int]], **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.batches = batches

        def get_train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(self.train_dataset, batch_sampler=self.batches,
                                               collate_fn=self.data_collator)

    processor, train_set = data.processor, data.train_set
    model = mm_mix.tiny_qwen2_vl(processor.tokenizer, seed=0, hidden=spec.hidden)
    vision = VisionCalls(model)
    infos: list[dict] = []
    callbacks: list = []
    step_options = {}
    if spec.samples_per_step:  # the same optimizer step for both modes (as in benchmarks.demo)
        step_options = {"samples_per_step": spec.samples_per_step, "max_batch_size": spec.odb_max_batch_size or None}
    odb, regions = None, None
    if mode == "odb":
        if spec.worker_regions is not None:  # NOTE [ A worker's region ]
            step_options = {**step_options, "worker_regions": spec.worker_regions}
        odb = ODBCallback(token_budget=spec.token_budget, max_patches=spec.max_patches, window=spec.window,
                          observer=lambda i: infos.append({"indices": list(i.indices), "idle": i.is_idle,
                                                           "patches": i.local_patches}), **step_options)
        callbacks.append(odb)
        regions = RegionCount(odb)
        callbacks.append(regions)
    accumulation = 1
    if spec.samples_per_step and mode == "std":
        world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; the Trainer sets up the process group later
        accumulation = max(spec.samples_per_step // (spec.batch_size * world), 1)
    clock = None
    if spec.eval_every:
        clock = eval_clock(odb, len(train_set))
        callbacks.append(clock)
    args = TrainingArguments(output_dir=str(spec.out / mode), per_device_train_batch_size=spec.batch_size,
                             per_device_eval_batch_size=8, num_train_epochs=spec.epochs,
                             learning_rate=spec.learning_rate, gradient_accumulation_steps=accumulation,
                             warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0,
                             logging_steps=1, use_cpu=True, seed=0, report_to=[], disable_tqdm=True,
                             save_strategy="no", eval_strategy="steps" if clock else "no",
                             eval_steps=spec.eval_every or None, dataloader_num_workers=spec.workers)
    common = {"model": model, "args": args, "train_dataset": train_set, "eval_dataset": data.eval_set,
              "callbacks": callbacks, "data_collator": PadCollator(pad_token_id=processor.tokenizer.pad_token_id)}
    if mode in dict(spec.replays):
        batches, trained = replay_batches(dict(spec.replays)[mode])
        trainer = ReplayTrainer(**common, batches=batches)
    else:
        trainer, trained = Trainer(**common), list(range(len(train_set)))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start - (clock.eval_seconds if clock else 0.0)
    if clock is not None and clock.points[-1]["step"] != trainer.state.global_step:
        trainer.evaluate()  # the last step is always evaluated
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    odb_logs = [{k: v for k, v in e.items() if k.startswith("odb/")} for e in trainer.state.log_history
                if "odb/budget_utilization" in e]
    tokens = sum(data.tokens[k] for k in trained) * spec.epochs
    return {"mode": mode, "steps": trainer.state.global_step, "losses": losses, "seconds": seconds,
            "samples_per_second": len(trained) * spec.epochs / seconds, "tokens_per_second": tokens / seconds,
            "eval_loss": clock.points[-1]["eval_loss"] if clock else trainer.evaluate()["eval_loss"],
            "vision_calls": vision.calls, "infos": infos,
            "odb_logs": odb_logs, "left_out": len(train_set) - len(trained),
            "eval_curve": clock.points if clock else None, "accumulation_steps": accumulation,
            "region_tensors": regions.most if regions is not None else 0}


def parse(argv: list[str] | None = None) -> tuple[list[str], int, RunSpec]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processor", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", action="append", choices=["odb", "std"], default=[])
    parser.add_argument("--n-train", type=int, default=96)
    parser.add_argument("--n-eval", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--max-patches", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--window", type=int, default=256, help="ODB window (samples)")
    parser.add_argument("--hidden", type=int, default=64, help="model hidden size")
    parser.add_argument("--samples-cache", type=Path, help="processed training samples (torch.save'd list)")
    parser.add_argument("--replay", action="append", default=[], metavar="NAME=FILE",
                        help="a mode NAME that trains on the batches per rank in FILE (JSON)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--samples-per-step", type=int, default=0, help="optimizer step in samples, both modes")
    parser.add_argument("--eval-every", type=int, default=0, help="optimizer steps between evaluations")
    parser.add_argument("--odb-max-batch-size", type=int, default=0, help="ODB's micro-batch cap (0: none)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank, both modes")
    parser.add_argument("--worker-regions", action=argparse.BooleanOptionalAction, default=None,
                        help="ODB: worker_regions=True (--no-worker-regions: False; neither: ODB's default)")
    ns = parser.parse_args(argv)
    replays = tuple((name, Path(file)) for name, _, file in (r.partition("=") for r in ns.replay))
    if any(not name or name in ("odb", "std") for name, _ in replays):
        parser.error("--replay takes NAME=FILE with a NAME other than odb and std")
    if not ns.mode and not replays:
        parser.error("give at least one --mode or --replay")
    spec = RunSpec(processor=ns.processor, out=ns.out, n_train=ns.n_train, n_eval=ns.n_eval, epochs=ns.epochs,
                   token_budget=ns.token_budget, max_patches=ns.max_patches, batch_size=ns.batch_size,
                   learning_rate=ns.learning_rate, window=ns.window, hidden=ns.hidden,
                   samples_cache=ns.samples_cache, replays=replays, samples_per_step=ns.samples_per_step,
                   eval_every=ns.eval_every, odb_max_batch_size=ns.odb_max_batch_size, workers=ns.workers,
                   worker_regions=ns.worker_regions)
    return ns.mode + [name for name, _ in replays], ns.repeats, spec


def write(spec: RunSpec, facts: dict) -> None:
    (spec.out / f"{facts['mode']}.rank{dist.get_rank()}.json").write_text(json.dumps(facts))


TIMING = ("seconds", "samples_per_second", "tokens_per_second")


def main() -> None:
    torch.set_num_threads(1)
    modes, repeats, spec = parse()
    data = Data.load(spec)
    first: dict[str, dict] = {}
    for _ in range(repeats):
        for mode in modes:
            facts = train(mode, spec, data)
            first.setdefault(mode, {**facts, "repeats": []})["repeats"].append({k: facts[k] for k in TIMING})
    for facts in first.values():
        write(spec, facts)
    dist.barrier()  # Gloo groups left to interpreter teardown can abort the process (pytorch/pytorch#190489)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
