"""Run LLaMA-Factory SFT through odb_llamafactory's Python API and record what ODB did (runs in .venv-lf).

    python tests/lf_train.py CONFIG.yaml RECORD_DIR [key=value ...]      (or under torchrun, one record per rank)

Writes RECORD_DIR/rank{r}.json with:
  * steps: every StepInfo the ODB loader yielded on this rank (observer);
  * micro: for every training forward, the float64 sum of token cross-entropies and the supervised-token count,
    computed here from the model's logits and the labels it received (independent of the code under test);
  * losses: the loss the Trainer logged at each optimizer step; global_step: optimizer steps this rank ran;
  * dataset_size: samples in the training dataset LLaMA-Factory built;
  * engine: the optimizer the Trainer trains with (DeepSpeed's ZeRO optimizer under `deepspeed:`) and the world size.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import TrainerCallback

from odb_llamafactory.launcher import read_config, train


def engine_facts(optimizer) -> dict:
    """The optimizer class under accelerate's wrapper (`DeepSpeedZeroOptimizer` for ZeRO 1 and 2), whether it
    partitions gradients (ZeRO-2), and the number of ranks."""
    inner = getattr(optimizer, "optimizer", optimizer)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return {"optimizer": type(inner).__name__, "partition_gradients": getattr(inner, "partition_gradients", None),
            "world_size": world}


class Recorder(TrainerCallback):
    def __init__(self, folder: Path) -> None:
        self.folder, self.steps, self.micro, self.losses = folder, [], [], []

    def observe(self, info) -> None:
        self.steps.append(asdict(info))

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, optimizer=None, **kwargs):
        model.register_forward_hook(self._forward, with_kwargs=True)
        self.dataset_size = len(train_dataloader.dataset) if hasattr(train_dataloader.dataset, "__len__") else None
        self.engine = engine_facts(optimizer)

    def _forward(self, module, args, kwargs, output) -> None:
        if not module.training or kwargs.get("labels") is None:
            return
        logits, labels = output.logits.detach().double(), kwargs["labels"][:, 1:]
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=-100, reduction="sum")
        self.micro.append({"ce_sum": float(ce), "tokens": int((labels != -100).sum())})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append({"step": state.global_step, "loss": float(logs["loss"])})

    def on_train_end(self, args, state, control, **kwargs):
        rank = int(os.environ.get("RANK", "0"))
        record = {"rank": rank, "steps": self.steps, "micro": self.micro, "losses": self.losses,
                  "global_step": state.global_step, "dataset_size": self.dataset_size, "engine": self.engine}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{rank}.json").write_text(json.dumps(record))


def main() -> None:
    config = read_config(sys.argv[1:2] + sys.argv[3:])
    recorder = Recorder(Path(sys.argv[2]))
    train(config, callbacks=[recorder], observer=recorder.observe)


if __name__ == "__main__":
    main()
