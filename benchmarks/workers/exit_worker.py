"""One rank of the exit benchmark (`python -m benchmarks.exit_teardown`, under torchrun, gloo, CPU).

Trains a tiny Llama for a few optimizer steps through the HF Trainer with `TrainingArguments(use_cpu=True)`, with
`ODBCallback` (`--odb`) or as a plain Trainer, then ends the way `--end` says:
  none             returns with the process groups alive (what most training scripts do);
  destroy          `torch.distributed.destroy_process_group()` on every rank first;
  barrier-destroy  `dist.barrier()`, then `destroy_process_group()` (what the guides tell users).
After `train()` every rank writes `facts.rank<r>.json` to `--out`: its optimizer steps, the helper threads of ODB
still alive (`odb-*`) and its Gloo work threads (`pt_gloo_runloop`, two per process group that ran a collective),
which tests/test_clean_exit.py checks. The process's
exit status and its output are what the driver counts (NOTE [ Threads at interpreter exit ] in
odb_core/ranks/sync.py).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.data.workloads import Listed

VOCAB, PAD = 256, 0


def samples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(8, 96, size=n):
        ids = torch.from_numpy(rng.integers(3, VOCAB, size=int(length)))
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, pad_token_id=PAD)
    return LlamaForCausalLM(config)


def gloo_work_threads() -> int:
    """Gloo work threads of this process (`pt_gloo_runloop`, two per process group that ran a collective)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--odb", action="store_true", help="train with ODBCallback (else a plain Trainer)")
    parser.add_argument("--end", choices=["none", "destroy", "barrier-destroy"], default="none")
    parser.add_argument("--max-steps", type=int, default=-1, help="> 0: stop there (inside ODB's epoch: it is left)")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()

    from transformers import Trainer, TrainingArguments

    from odb_core.data.collate import PadCollator
    from odb_hf import ODBCallback

    args = TrainingArguments(output_dir=ns.out, use_cpu=True, per_device_train_batch_size=8, num_train_epochs=1,
                             max_steps=ns.max_steps, learning_rate=1e-3, save_strategy="no", report_to=[],
                             disable_tqdm=True, logging_steps=1000, seed=0)
    callbacks = [ODBCallback(token_budget=512)] if ns.odb else []
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Listed(samples(96, seed=0)),
                      data_collator=PadCollator(pad_token_id=PAD), callbacks=callbacks)
    trainer.train()
    odb_threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("odb-"))
    facts = {"rank": args.process_index, "steps": trainer.state.global_step, "odb_threads": odb_threads,
             "gloo_work_threads": gloo_work_threads()}
    Path(ns.out, f"facts.rank{args.process_index}.json").write_text(json.dumps(facts))
    if ns.end != "none" and dist.is_initialized():
        if ns.end == "barrier-destroy":
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
