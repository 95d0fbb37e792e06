"""GPU training throughput and peak memory: Standard fixed batching against ODB, one script, one GPU.

    python -m benchmarks.gpu.train_throughput                      # on a GPU: ~0.5B Qwen2-style model, bf16, SDPA
    python -m benchmarks.gpu.train_throughput --cpu-smoke          # tiny model on CPU (the CI check)
    python -m benchmarks.gpu.train_throughput --parts quality      # the time-to-quality part alone

Two parts (`--parts`, both by default): `throughput`, below, and `quality`: Standard and ODB trained on real text
at the same optimizer step, evaluated on a held-out split, and the wall-clock time each needs to reach Standard's
final eval loss (`benchmarks/gpu/quality.py`).

What it runs, for each workload (`sharegpt-like`: lognormal lengths CV 1.0, mean 1024, <= 8192; `mm-mix-like`:
80% short (mean 384) + 20% long (mean 1536) with a tail to 8192; token ids are random, labels = inputs) and each
method, one epoch over the same samples with a fresh model built from a config (fixed seed) and AdamW:
  * standard: `DataLoader(batch_size = L_max // longest sample, shuffle=True)` with the padding collator;
  * odb:      `ODBDataLoader(token_budget=L_max, shuffle=True)` with the same collator (cost `padded`).
Both respect the same memory bound: padded tokens per micro-batch <= L_max. The first `--warmup-steps` steps of
each run are not timed (allocator and kernel warm-up); a run stops early after `--max-seconds` of timed steps and
reports the throughput of what it ran. Measured: samples/s, real (non-pad) tokens/s, padded tokens/s, steps,
peak allocated memory (torch.cuda.max_memory_allocated), and ODB / Standard ratios.
The reference release is not included: it is not installable on a machine without network access.
Writes JSON to --out (default benchmarks/results/gpu_throughput.json, or gpu_smoke.json with --cpu-smoke); the
quality part's figure is its top-level `time_to_quality`.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks import CACHE, RESULTS
from benchmarks.data.chat_split import VOCAB as TEXT_VOCAB
from benchmarks.data.workloads import bimodal, lognormal
from benchmarks.gpu.quality import run_quality
from odb_core import ODBDataLoader
from odb_core.data.collate import PadCollator

PAD = 0


@dataclass(frozen=True, kw_only=True)
class Scale:
    """Model and data sizes of one run mode."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    token_budget: int
    samples: int
    length_scale: float  # multiplies the workloads' lengths (1.0 on GPU)
    dtype: str


GPU = Scale(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, token_budget=16384,
            samples=2000, length_scale=1.0, dtype="bfloat16")  # Qwen2.5-0.5B-shaped, ~494M parameters
CPU_SMOKE = Scale(hidden=32, layers=2, heads=2, kv_heads=2, intermediate=64, vocab=512, token_budget=1024,
                  samples=160, length_scale=1 / 16, dtype="float32")


def workload_lengths(name: str, scale: Scale, seed: int = 0) -> list[int]:
    if name == "sharegpt-like":
        raw = lognormal(scale.samples, 1.0, mean=1024.0, lo=16, hi=8192, seed=seed)
    elif name == "mm-mix-like":
        raw = bimodal(scale.samples, seed=seed)
    else:
        raise ValueError(f"unknown workload {name!r}; choose sharegpt-like or mm-mix-like")
    return [max(int(n * scale.length_scale), 4) for n in raw]


class TokenDataset(torch.utils.data.Dataset):
    """Random token ids of the given lengths (labels = inputs): only the lengths matter for throughput."""

    def __init__(self, lengths: list[int], vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.samples = [torch.from_numpy(rng.integers(3, vocab, size=n)) for n in lengths]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.samples[index]
        return {"input_ids": ids, "labels": ids}


def build_model(scale: Scale, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=scale.vocab, hidden_size=scale.hidden, intermediate_size=scale.intermediate,
                         num_hidden_layers=scale.layers, num_attention_heads=scale.heads,
                         num_key_value_heads=scale.kv_heads, max_position_embeddings=scale.token_budget,
                         tie_word_embeddings=True, pad_token_id=PAD)
    config._attn_implementation = "sdpa"
    with torch.device(device):  # built in place: no full-size CPU copy of a 0.5B model
        model = Qwen2ForCausalLM(config)
    return model.to(dtype=getattr(torch, scale.dtype))


def loader_for(method: str, dataset: TokenDataset, scale: Scale):
    collate = PadCollator(PAD)
    if method == "standard":
        batch = max(scale.token_budget // max(len(s) for s in dataset.samples), 1)
        return DataLoader(dataset, batch_size=batch, shuffle=True, collate_fn=collate,
                          generator=torch.Generator().manual_seed(0))
    return ODBDataLoader(dataset, token_budget=scale.token_budget, shuffle=True, seed=0, collate_fn=collate)


@dataclass
class RunResult:
    workload: str
    method: str
    steps: int
    timed_steps: int
    samples: int
    real_tokens: int
    padded_tokens: int
    seconds: float
    samples_per_s: float
    tokens_per_s: float
    padded_tokens_per_s: float
    peak_memory_gib: float | None
    complete_epoch: bool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_epoch(method: str, workload: str, dataset: TokenDataset, scale: Scale, device: torch.device,
                ns: argparse.Namespace) -> RunResult:
    model = build_model(scale, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    steps = timed = samples = real = padded = 0
    start = None
    complete = True
    for batch in loader_for(method, dataset, scale):
        if steps == ns.warmup_steps:
            _sync(device)
            start = time.perf_counter()
        inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        if start is not None:
            timed += 1
            mask = batch["attention_mask"]
            samples += mask.shape[0]
            real += int(mask.sum())
            padded += mask.numel()
            if time.perf_counter() - start > ns.max_seconds:
                complete = False
                break
    _sync(device)
    seconds = time.perf_counter() - start if start is not None else float("nan")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model, optimizer
    return RunResult(workload=workload, method=method, steps=steps, timed_steps=timed, samples=samples,
                     real_tokens=real, padded_tokens=padded, seconds=seconds, samples_per_s=samples / seconds,
                     tokens_per_s=real / seconds, padded_tokens_per_s=padded / seconds, peak_memory_gib=peak,
                     complete_epoch=complete)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, small workloads (CI check)")
    p.add_argument("--workloads", default="sharegpt-like,mm-mix-like")
    p.add_argument("--methods", default="standard,odb")
    p.add_argument("--samples", type=int, default=None, help="samples per workload (default: the mode's)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed steps per run (default 5 GPU, 1 CPU)")
    p.add_argument("--max-seconds", type=float, default=None, help="timed seconds per run before stopping early "
                                                                   "(default 75 GPU, 20 CPU smoke)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--parts", default="throughput,quality")
    q = p.add_argument_group("quality part (defaults: GPU / --cpu-smoke)")
    q.add_argument("--train", type=int, default=None, help="train conversations (2000 / 48)")
    q.add_argument("--held-out", type=int, default=None, help="held-out conversations (128 / 8)")
    q.add_argument("--cutoff", type=int, default=None, help="longest conversation in tokens (4096 / 128)")
    q.add_argument("--samples-per-step", type=int, default=None, help="optimizer step in samples (64 / 8)")
    q.add_argument("--lr", type=float, default=None, help="AdamW LR of both methods (3e-4 / 3e-3)")
    q.add_argument("--warmup", type=int, default=5, help="warm-up optimizer steps")
    q.add_argument("--epochs", type=int, default=None, help="epochs (3 / 1)")
    q.add_argument("--eval-every", type=int, default=None, help="optimizer steps between evaluations (5 / 2)")
    q.add_argument("--quality-seconds", type=float, default=None,
                   help="training seconds per method before stopping (120 / 30)")
    q.add_argument("--odb-max-batch-size", type=int, default=0, help="ODB's micro-batch cap (0: none)")
    ns = p.parse_args(argv)
    smoke = ns.cpu_smoke
    for name, gpu, cpu in (("train", 2000, 48), ("held_out", 128, 8), ("cutoff", 4096, 128),
                           ("samples_per_step", 64, 8), ("lr", 3e-4, 3e-3), ("epochs", 3, 1), ("eval_every", 5, 2),
                           ("quality_seconds", 120.0, 30.0)):
        if getattr(ns, name) is None:
            setattr(ns, name, cpu if smoke else gpu)
    ns.data_dir = CACHE / f"gpu_quality_{ns.train}_{ns.held_out}_{ns.cutoff}"
    ns.warmup_steps = ns.warmup_steps if ns.warmup_steps is not None else (1 if smoke else 5)
    ns.max_seconds = ns.max_seconds if ns.max_seconds is not None else (20.0 if smoke else 75.0)
    ns.out = ns.out or RESULTS / ("gpu_smoke.json" if smoke else "gpu_throughput.json")
    return ns


def main(argv: list[str] | None = None) -> dict:
    ns = parse(argv)
    scale = CPU_SMOKE if ns.cpu_smoke else GPU
    if ns.samples:
        scale = Scale(**{**asdict(scale), "samples": ns.samples})
    if ns.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --cpu-smoke for the tiny CPU check")
    parts = ns.parts.split(",")
    runs = []
    for workload in ns.workloads.split(",") if "throughput" in parts else ():
        dataset = TokenDataset(workload_lengths(workload, scale), scale.vocab)
        for method in ns.methods.split(","):
            result = train_epoch(method, workload, dataset, scale, device, ns)
            runs.append(asdict(result))
            mem = f", peak {result.peak_memory_gib:.1f} GiB" if result.peak_memory_gib is not None else ""
            print(f"{workload:14s} {method:9s} {result.samples_per_s:8.1f} samples/s {result.tokens_per_s:10.0f} "
                  f"tok/s over {result.timed_steps} steps ({result.seconds:.1f}s{mem})", flush=True)
    ratios = {}
    for workload in ns.workloads.split(","):
        by = {r["method"]: r for r in runs if r["workload"] == workload}
        if "standard" in by and "odb" in by:
            ratios[workload] = {"samples_per_s": by["odb"]["samples_per_s"] / by["standard"]["samples_per_s"],
                                "tokens_per_s": by["odb"]["tokens_per_s"] / by["standard"]["tokens_per_s"]}
    quality = None
    if "quality" in parts:
        quality_ns = argparse.Namespace(**{**vars(ns), "token_budget": scale.token_budget,
                                           "max_seconds": ns.quality_seconds})
        text_scale = Scale(**{**asdict(scale), "vocab": max(scale.vocab, TEXT_VOCAB)})  # the compacted ids
        quality = run_quality(lambda: build_model(text_scale, device), device, quality_ns)
    n_params = sum(p.numel() for p in build_model(scale, torch.device("meta")).parameters())
    result = {"command": "python -m benchmarks.gpu.train_throughput" + (" --cpu-smoke" if ns.cpu_smoke else ""),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "scale": asdict(scale), "parameters": n_params,
              "warmup_steps": ns.warmup_steps, "max_seconds": ns.max_seconds, "runs": runs,
              "odb_over_standard": ratios, "time_to_quality": quality and quality["time_to_quality"],
              "quality": quality}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(ratios, indent=2))
    return result


if __name__ == "__main__":
    main()
