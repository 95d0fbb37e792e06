"""One rank of the CPU training-throughput benchmark (launched by `lib/cpu_training` under torchrun, gloo).

Every method trains the same tiny Llama (from a config, fixed seed, SDPA attention) for one epoch over the same
samples through the HF Trainer, under the same memory bound L_max, and the methods alternate within one launch
(`--repeats` rounds of every method), so that machine load hits all of them alike:

  standard     per_device_train_batch_size = L_max // longest sample, padding collator (pads to the batch max)
  odb          `ODBCallback(token_budget=L_max)` (cost `padded`), the same padding collator
  packing      padding-free packing: rows of samples packed next-fit (random order) up to L_max tokens,
               batch size 1, flattened with position ids (`DataCollatorWithFlattening` layout)
  odb_tokens   `ODBCallback(token_budget=L_max, cost="tokens")` with `DataCollatorWithFlattening`

Rank 0 writes one JSON record per (method, repeat): wall time of `trainer.train()` between two barriers, optimizer
steps, samples and real tokens trained.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.data.workloads import Listed, lognormal

METHODS = ("standard", "odb", "packing", "odb_tokens")
PAD = 0


def make_samples(n: int, mean: float, hi: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for length in lognormal(n, 1.0, mean=mean, lo=8, hi=hi, seed=seed):
        ids = torch.from_numpy(rng.integers(3, vocab, size=length))
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def pack(samples: list[dict], budget: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Next-fit packing in a seeded random order; each row restarts position ids at every sample and masks the
    first label of each sample (the `DataCollatorWithFlattening` layout)."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    rows, current, total = [], [], 0
    for i in order:
        n = len(samples[i]["input_ids"])
        if current and total + n > budget:
            rows.append(current)
            current, total = [], 0
        current.append(samples[i])
        total += n
    if current:
        rows.append(current)
    from transformers import DataCollatorWithFlattening

    flatten = DataCollatorWithFlattening(return_position_ids=True)
    return [{k: v[0] for k, v in flatten(row).items()} for row in rows]


def stack_rows(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def tiny_llama(vocab: int, hidden: int, layers: int, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max_len, pad_token_id=PAD, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def build_trainer(method: str, samples: list[dict], ns: argparse.Namespace, out: Path):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from odb_core.data.collate import PadCollator
    from odb_hf import ODBCallback

    longest = max(len(s["input_ids"]) for s in samples)
    common = dict(output_dir=str(out / method), num_train_epochs=1, learning_rate=1e-3, warmup_steps=0,
                  lr_scheduler_type="constant", logging_steps=10**6, save_strategy="no", report_to=[],
                  use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    model = tiny_llama(ns.vocab, ns.hidden, ns.layers, ns.token_budget)
    if method == "standard":
        args = TrainingArguments(per_device_train_batch_size=max(ns.token_budget // longest, 1), **common)
        return Trainer(model=model, args=args, train_dataset=Listed(samples), data_collator=PadCollator(PAD))
    if method == "packing":
        args = TrainingArguments(per_device_train_batch_size=1, **common)
        rows = pack(samples, ns.token_budget, seed=0)
        return Trainer(model=model, args=args, train_dataset=Listed(rows), data_collator=stack_rows)
    args = TrainingArguments(**common)
    cost = "tokens" if method == "odb_tokens" else "padded"
    collator = DataCollatorWithFlattening(return_position_ids=True) if cost == "tokens" else PadCollator(PAD)
    return Trainer(model=model, args=args, train_dataset=Listed(samples), data_collator=collator,
                   callbacks=[ODBCallback(token_budget=ns.token_budget, cost=cost)])


def timed_epoch(method: str, samples: list[dict], ns: argparse.Namespace, out: Path) -> dict:
    trainer = build_trainer(method, samples, ns, out)
    dist.barrier()
    start = time.perf_counter()
    trainer.train()
    dist.barrier()
    seconds = time.perf_counter() - start
    tokens = sum(len(s["input_ids"]) for s in samples)
    return {"method": method, "seconds": seconds, "optimizer_steps": trainer.state.global_step,
            "samples": len(samples), "real_tokens": tokens,
            "samples_per_s": len(samples) / seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=1200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="standard,odb")
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--mean", type=float, default=64.0)
    parser.add_argument("--hi", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    methods = [m for m in ns.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    samples = make_samples(ns.samples, ns.mean, ns.hi, ns.vocab, seed=0)
    records = []
    for repeat in range(ns.repeats):
        for method in methods:
            record = timed_epoch(method, samples, ns, ns.out)
            records.append({**record, "repeat": repeat})
    if dist.get_rank() == 0:
        ns.out.mkdir(parents=True, exist_ok=True)
        setup = {k: v for k, v in vars(ns).items() if k != "out"}
        setup["world_size"] = dist.get_world_size()
        setup["standard_batch"] = max(ns.token_budget // max(len(s["input_ids"]) for s in samples), 1)
        (ns.out / "training.json").write_text(json.dumps({"setup": setup, "records": records}, indent=2))
    dist.destroy_process_group()
    os._exit(0)  # do not wait for Trainer/accelerate atexit hooks of every repeat


if __name__ == "__main__":
    main()
