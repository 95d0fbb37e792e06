"""The GPU script's time-to-quality part: Standard against ODB at the same optimizer step, on real text.

Real ChitChat conversations tokenized with the DeepSeek tokenizer (`benchmarks.data.chat_split`: the ids
compacted to the 2,047 most frequent, so that every model scale can embed them), split into train and held-out.
Both methods train the same fresh model (`build_model`, fixed seed) with AdamW at the same LR (linear warm-up over
the first `warmup` steps, then constant), under the same memory bound L_max, with the same optimizer step of
`samples_per_step` samples and the exact per-token mean loss of that step:
  * standard: `DataLoader(batch_size = L_max // cutoff, shuffle=True)`, accumulating `samples_per_step // B`
    micro-batches per step, each micro-batch's summed token loss divided by the step's supervised tokens;
  * odb:      `ODBDataLoader(token_budget=L_max, samples_per_step=...)`, each micro-batch's summed token loss
    divided by `StepInfo.window_tokens`, the optimizer stepping at the window's last micro-batch.
Every `eval_every` optimizer steps (and after the last) the held-out token-mean loss is measured; training seconds
exclude the evaluations. The figure is `benchmarks.lib.time_to_quality`'s: seconds to Standard's final eval loss.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from benchmarks.data.chat_split import prepare_split
from benchmarks.lib.time_to_quality import time_to_quality
from odb_core import ODBDataLoader
from odb_core.data.collate import PadCollator, supervised_tokens
from odb_core.steps.loss import causal_lm_loss_sum


def load_text(out: Path, train: int, held_out: int, cutoff: int) -> dict:
    import json

    return json.loads(prepare_split(out, train, held_out, cutoff).read_text())


def as_tensors(samples: list[dict]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.tensor(v) for k, v in s.items()} for s in samples]


class Clock:
    """Training seconds (evaluation excluded) and the eval curve."""

    def __init__(self) -> None:
        self.start, self.paused, self.points = time.perf_counter(), 0.0, []

    def evaluate(self, model, held_out: list[dict], device: torch.device, step: int, samples: int) -> float:
        sync(device)
        stopped = time.perf_counter()
        model.eval()
        total = tokens = 0.0
        collate = PadCollator()
        with torch.no_grad():
            for i in range(0, len(held_out), 8):
                batch = collate(held_out[i : i + 8])
                inputs = {k: v.to(device) for k, v in batch.items()}
                total += float(causal_lm_loss_sum(model(**{k: v for k, v in inputs.items() if k != "labels"}).logits,
                                                  inputs["labels"]))
                tokens += supervised_tokens(batch, [])
        model.train()
        loss = total / tokens
        self.points.append({"step": step, "seconds": stopped - self.start - self.paused, "samples": samples,
                            "eval_loss": loss})
        self.paused += time.perf_counter() - stopped
        return loss

    @property
    def seconds(self) -> float:
        """Training seconds so far (evaluations excluded)."""
        return time.perf_counter() - self.start - self.paused


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def micro_batches(method: str, train: list[dict], token_budget: int, cutoff: int, samples_per_step: int,
                  epoch: int, odb_max_batch_size: int | None):
    """Yields (batch, normaliser, ends_step) for one epoch of either method."""
    if method == "odb":
        loader = ODBDataLoader(train, token_budget=token_budget, samples_per_step=samples_per_step, shuffle=True,
                               seed=0, max_batch_size=odb_max_batch_size)
        loader.set_epoch(epoch)
        for batch in loader:
            yield batch, batch.info.window_tokens, batch.info.ends_window
        return
    size = max(token_budget // cutoff, 1)
    accumulation = max(samples_per_step // size, 1)
    loader = DataLoader(train, batch_size=size, shuffle=True, collate_fn=PadCollator(),
                        generator=torch.Generator().manual_seed(epoch))
    staged: list = []
    for batch in loader:
        staged.append(batch)
        if len(staged) == accumulation:
            yield from _standard_step(staged)
            staged = []
    if staged:
        yield from _standard_step(staged)


def _standard_step(staged: list):
    tokens = sum(supervised_tokens(b, []) for b in staged)
    for k, batch in enumerate(staged):
        yield batch, tokens, k == len(staged) - 1


def train_to_quality(method: str, data: dict, build_model, device: torch.device, ns: argparse.Namespace) -> dict:
    train, held_out = as_tensors(data["train"]), as_tensors(data["eval"])
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ns.lr, fused=device.type == "cuda")
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(ns.warmup, 1)))
    clock, steps, samples, stopped = Clock(), 0, 0, False
    clock.evaluate(model, held_out, device, 0, 0)
    for epoch in range(ns.epochs):
        for batch, normaliser, ends_step in micro_batches(method, train, ns.token_budget, ns.cutoff,
                                                          ns.samples_per_step, epoch, ns.odb_max_batch_size or None):
            inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
            labels = inputs.pop("labels")
            loss = causal_lm_loss_sum(model(**inputs).logits, labels) / max(normaliser, 1)
            loss.backward()
            samples += int(batch["input_ids"].shape[0])
            if not ends_step:
                continue
            optimizer.step()
            warmup.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps % ns.eval_every == 0:
                clock.evaluate(model, held_out, device, steps, samples)
            if clock.seconds > ns.max_seconds:
                stopped = True
                break
        if stopped:
            break
    if clock.points[-1]["step"] != steps:
        clock.evaluate(model, held_out, device, steps, samples)
    del model, optimizer
    return {"method": method, "optimizer_steps": steps, "samples": samples, "seconds": clock.points[-1]["seconds"],
            "eval_loss": clock.points[-1]["eval_loss"], "eval_curve": clock.points, "stopped_early": stopped,
            "samples_per_step_mean": samples / max(steps, 1)}


def run_quality(build_model, device: torch.device, ns: argparse.Namespace, log=print) -> dict:
    """Both methods, then the time-to-quality figure (None where a method never reaches the target)."""
    data = load_text(ns.data_dir, ns.train, ns.held_out, ns.cutoff)
    rows = {}
    for method in ("standard", "odb"):
        rows[method] = train_to_quality(method, data, build_model, device, ns)
        row = rows[method]
        log(f"quality {method:9s} {row['optimizer_steps']} steps, {row['seconds']:.1f} s, final eval loss "
            f"{row['eval_loss']:.4f}" + (" (stopped at --max-seconds)" if row["stopped_early"] else ""))
    quality = time_to_quality(rows)
    speedup = quality["speedup"]
    log("time to Standard's final eval loss: " + (f"ODB {speedup:.2f}x faster" if speedup else "ODB never reached it")
        + f"; to the worse final loss {quality['common_target']['eval_loss']:.4f}: "
          f"{quality['common_target']['speedup']:.2f}x")
    return {"time_to_quality": quality, "runs": list(rows.values()),
            "setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()
                      if k in ("train", "held_out", "cutoff", "token_budget", "samples_per_step", "lr", "warmup",
                               "epochs", "eval_every", "max_seconds", "odb_max_batch_size")}}
