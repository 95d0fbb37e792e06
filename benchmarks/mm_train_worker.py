"""One rank of a CPU HF Trainer run on the MM-Mix-like VLM workload, ODB or Standard (launched by torchrun).

    torchrun --nproc_per_node 2 benchmarks/mm_train_worker.py --processor DIR --out DIR --mode odb --mode std

Both modes train the same tiny Qwen2-VL (`mm_mix.tiny_qwen2_vl`, seed 0) on the same samples for the same epochs
with the same optimizer. Standard is the HF default: a fixed per-device batch, padded. ODB is `ODBCallback` under
the same token budget with a patch cap. Each rank writes `{mode}.rank{r}.json`: optimizer steps, logged losses,
held-out loss, wall time, samples and tokens per second, and how often the vision tower ran (a forward hook).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mm_mix  # noqa: E402


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


class VisionCalls:
    """Counts forward calls of the vision tower (IDLE dummies included)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.model.visual.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self.calls += 1


def train(mode: str, spec: RunSpec) -> dict:
    from transformers import Trainer, TrainingArguments

    from odb_core.collate import PadCollator
    from odb_hf import ODBCallback

    processor = mm_mix.VisionTextProcessor.load(spec.processor)
    train_set = mm_mix.MMMixDataset(spec.processor, mm_mix.mm_mix_specs(spec.n_train, seed=1))
    eval_set = mm_mix.MMMixDataset(spec.processor, mm_mix.mm_mix_specs(spec.n_eval, seed=2))
    model = mm_mix.tiny_qwen2_vl(processor.tokenizer, seed=0)
    vision = VisionCalls(model)
    infos: list[dict] = []
    callbacks = []
    if mode == "odb":
        callbacks.append(ODBCallback(token_budget=spec.token_budget, max_patches=spec.max_patches, window=256,
                                     observer=lambda i: infos.append({"indices": list(i.indices), "idle": i.is_idle,
                                                                      "patches": i.local_patches})))
    args = TrainingArguments(output_dir=str(spec.out / mode), per_device_train_batch_size=spec.batch_size,
                             per_device_eval_batch_size=8, num_train_epochs=spec.epochs, learning_rate=spec.learning_rate,
                             warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0,
                             logging_steps=1, use_cpu=True, seed=0, report_to=[], disable_tqdm=True,
                             save_strategy="no", eval_strategy="no", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set, callbacks=callbacks,
                      data_collator=PadCollator(pad_token_id=processor.tokenizer.pad_token_id))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    odb_logs = [{k: v for k, v in e.items() if k.startswith("odb/")} for e in trainer.state.log_history
                if "odb/budget_utilization" in e]
    tokens = sum(int(train_set[k]["input_ids"].numel()) for k in range(len(train_set))) * spec.epochs
    return {"mode": mode, "steps": trainer.state.global_step, "losses": losses, "seconds": seconds,
            "samples_per_second": len(train_set) * spec.epochs / seconds, "tokens_per_second": tokens / seconds,
            "eval_loss": trainer.evaluate()["eval_loss"], "vision_calls": vision.calls, "infos": infos,
            "odb_logs": odb_logs}


def parse(argv: list[str] | None = None) -> tuple[list[str], RunSpec]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processor", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", action="append", choices=["odb", "std"], required=True)
    parser.add_argument("--n-train", type=int, default=96)
    parser.add_argument("--n-eval", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--max-patches", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    ns = parser.parse_args(argv)
    spec = RunSpec(processor=ns.processor, out=ns.out, n_train=ns.n_train, n_eval=ns.n_eval, epochs=ns.epochs,
                   token_budget=ns.token_budget, max_patches=ns.max_patches, batch_size=ns.batch_size,
                   learning_rate=ns.learning_rate)
    return ns.mode, spec


def write(spec: RunSpec, facts: dict) -> None:
    (spec.out / f"{facts['mode']}.rank{dist.get_rank()}.json").write_text(json.dumps(facts))


def main() -> None:
    torch.set_num_threads(1)
    modes, spec = parse()
    for mode in modes:
        write(spec, train(mode, spec))


if __name__ == "__main__":
    main()
