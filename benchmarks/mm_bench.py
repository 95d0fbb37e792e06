"""MM-Mix-like VLM benchmark: budget and patch utilization, and CPU training throughput at W = 2.

    python -m benchmarks.mm_bench                                     # both parts (about 3 minutes, 2 cores)
    python -m benchmarks.mm_bench --parts quality --samples 600 --worlds 1,2 --no-reference   # a quick look

The samples are real processed VLM samples from benchmarks/data/mm_mix.py (chat template,
`Qwen2VLImageProcessorPil`, image-token expansion). What every batching method sees of a sample is what ODB observes
after the pipeline: its token count (text + visual tokens) and its vision-patch rows.

Parts:
  quality   every method's schedule of one epoch on W ranks from the observed (tokens, patches) of `--samples`
            samples (cached under benchmarks/.cache/): budget utilization (real tokens / (steps x W x L_max)),
            patch utilization (patch rows / (steps x W x max_patches)), binding-limit utilization (per slot,
            the larger of the two shares), padding, steps, dropped samples and patch-cap violations (groups of
            two or more samples above `max_patches`). Deterministic.
  training  the HF Trainer on 2 CPU gloo ranks (benchmarks/workers/mm_train_worker.py under torchrun) trains the
            tiny Qwen2-VL on the same processed samples, once per method and repeat, methods alternating; the
            samples are processed once before the launch, so the timed region is training only.
Methods: Standard (the largest fixed batch that fits the longest sample under both limits, shuffled, padded),
ODB (`odb_core.planning.simulate.simulate_epoch`, default settings with `max_patches`; the HF run uses `ODBCallback`), the
offline oracle (global sort, greedy next-fit under both limits) and the reference release (`online-dynamic-
batching` 0.1.2 in benchmarks/.venv-ref): default buffer and a 512-sample buffer, each given the patch counts (as
`odb_n_patches`, the field it reads) and the same `max_patches`, plus the 512-sample buffer without them (its
default, max_patches off). The training part replays the release's patch-capped schedules through the same
Trainer.
Output: <out>/mm_bench.json and <out>/mm_bench.md (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from benchmarks import CACHE, REPO_ROOT, RESULTS
from benchmarks.comparison import peers, reference_peer
from benchmarks.comparison.schedule import CostModel, Schedule, deal_round_robin, measure
from benchmarks.data import mm_mix
from benchmarks.lib.oracle import oracle_groups
from benchmarks.lib.time_to_quality import time_to_quality
from odb_core.data.sharding import shard
from odb_core.planning.budget import Item, build_budget
from odb_core.planning.simulate import simulate_epoch
from odb_core.settings.config import ODBConfig

PARTS = ("quality", "training", "time_to_quality")
# the release's runs: name -> (buffer_size, whether it is given the patch counts and max_patches)
REFERENCE_RUNS = {"reference_default": (None, True), "reference_buffer512": (512, True),
                  "reference_buffer512_no_cap": (512, False)}
REPLAYED = ("reference_default", "reference_buffer512")  # the training part replays the patch-capped runs
LABELS = {"standard": "Standard fixed batch", "odb": "ODB (padded, patch cap)", "oracle": "Offline oracle",
          "reference_default": "Reference release, default buffer, max_patches",
          "reference_buffer512": "Reference release, buffer 512, max_patches",
          "reference_buffer512_no_cap": "Reference release, buffer 512, no max_patches (its default)"}


# -- observed facts ----------------------------------------------------------------------------------------------
def _facts_of(batch: list[dict]) -> list[tuple[int, int]]:
    return [(int(s["input_ids"].numel()), int(s["pixel_values"].shape[0])) for s in batch]


def observe(processor: Path, n: int, seed: int, workers: int = 2) -> np.ndarray:
    """(tokens, patch rows) of the first `n` samples of `mm_mix_specs(n, seed)`, as the pipeline emits them.
    Cached per version of mm_mix.py (the pipeline), so that a changed pipeline is observed afresh."""
    version = hashlib.sha256(Path(mm_mix.__file__).read_bytes()).hexdigest()[:12]
    path = CACHE / f"mm_mix_facts_n{n}_s{seed}_{version}.json"
    if path.exists():
        return np.asarray(json.loads(path.read_text()), dtype=np.int64).reshape(-1, 2)
    dataset = mm_mix.MMMixDataset(processor, mm_mix.mm_mix_specs(n, seed=seed))
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=workers, collate_fn=_facts_of)
    facts = [pair for batch in loader for pair in batch]
    CACHE.mkdir(exist_ok=True)
    path.write_text(json.dumps(facts))
    return np.asarray(facts, dtype=np.int64)


def describe(facts: np.ndarray) -> dict:
    tokens, patches = facts[:, 0], facts[:, 1]
    return {"samples": len(facts), "tokens_mean": float(tokens.mean()),
            "tokens_cv": float(tokens.std() / tokens.mean()),
            "tokens_p50": float(np.percentile(tokens, 50)), "tokens_p99": float(np.percentile(tokens, 99)),
            "tokens_max": int(tokens.max()), "patches_mean": float(patches.mean()), "patches_max": int(patches.max()),
            "visual_token_share": float((patches // mm_mix.MERGE**2).sum() / tokens.sum())}


# -- methods -----------------------------------------------------------------------------------------------------
def fixed_batch(facts: np.ndarray, token_budget: int, max_patches: int) -> int:
    """Standard's batch: the largest B whose padded batch fits both limits even for the largest sample."""
    return max(min(token_budget // int(facts[:, 0].max()), max_patches // max(int(facts[:, 1].max()), 1)), 1)


def config(token_budget: int, max_patches: int) -> ODBConfig:
    return ODBConfig(token_budget=token_budget, max_patches=max_patches)


def standard(facts: np.ndarray, world: int, token_budget: int, max_patches: int) -> Schedule:
    order = peers.permutation(len(facts), 0)
    return deal_round_robin(peers.chunks(order, fixed_batch(facts, token_budget, max_patches)), world)


def items(facts: np.ndarray) -> list[Item]:
    return [Item(i, int(t), int(p)) for i, (t, p) in enumerate(facts)]


def odb(facts: np.ndarray, world: int, token_budget: int, max_patches: int) -> Schedule:
    every = items(facts)
    streams = [[every[it.index] for it in rank] for rank in shard(facts[:, 0], world, 0)]
    plan = simulate_epoch(streams, config(token_budget, max_patches))
    return Schedule([[g.indices if g else None for g in rank] for rank in plan.steps])


def oracle(facts: np.ndarray, world: int, token_budget: int, max_patches: int) -> Schedule:
    groups = oracle_groups(items(facts), build_budget(config(token_budget, max_patches)))
    return deal_round_robin([g.indices for g in groups], world)


def reference(buffer_size: int | None, capped: bool) -> Callable[[np.ndarray, int, int, int], Schedule]:
    """The release on the token counts; `capped`: also the patch counts (its `odb_n_patches`) and `max_patches`."""
    def run(facts: np.ndarray, world: int, token_budget: int, max_patches: int) -> Schedule:
        setting = peers.Setting(lengths=facts[:, 0].tolist(), world_size=world, token_budget=token_budget,
                                attention_alpha=0.0)
        patches = facts[:, 1].tolist() if capped else None
        return reference_peer.run(setting, buffer_size, patches, max_patches)[0]

    return run


def methods(with_reference: bool) -> dict[str, Callable[[np.ndarray, int, int, int], Schedule]]:
    chosen = {"standard": standard, "odb": odb, "oracle": oracle}
    if with_reference:
        chosen.update({name: reference(*run) for name, run in REFERENCE_RUNS.items()})
    return chosen


def patch_measures(schedule: Schedule, facts: np.ndarray, token_budget: int, max_patches: int) -> dict:
    """Patch utilization, the worst group's patch rows / max_patches, groups of 2+ samples over the cap, and the
    binding-limit utilization: the mean over slots of max(padded tokens / L_max, patch rows / max_patches), the
    share of whichever limit binds (an empty slot counts 0)."""
    groups = schedule.groups()
    sums = [int(facts[list(g), 1].sum()) for g in groups]
    binding = [max(len(g) * int(facts[list(g), 0].max()) / token_budget, s / max_patches)
               for g, s in zip(groups, sums)]
    slots = schedule.n_steps * schedule.world_size
    return {"patch_utilization": sum(sums) / (slots * max_patches) if slots else 0.0,
            "binding_utilization": sum(binding) / slots if slots else 0.0,
            "max_patch_ratio": max(sums, default=0) / max_patches,
            "patch_violations": sum(1 for g, s in zip(groups, sums) if len(g) > 1 and s > max_patches)}


def run_quality(facts: np.ndarray, worlds: Sequence[int], token_budget: int, max_patches: int,
                with_reference: bool, log: Callable[[str], None]) -> list[dict]:
    rows = []
    for world in worlds:
        for name, method in methods(with_reference).items():
            started = time.perf_counter()
            schedule = method(facts, world, token_budget, max_patches)
            quality = measure(schedule, facts[:, 0].tolist(), token_budget, CostModel("padded")).as_dict()
            rows.append({"method": name, "world_size": world, **quality,
                         **patch_measures(schedule, facts, token_budget, max_patches),
                         "seconds": round(time.perf_counter() - started, 2)})
            log(f"  W={world:<3} {name:<20} utilization {quality['budget_utilization']:.3f} patch utilization "
                f"{rows[-1]['patch_utilization']:.3f} binding {rows[-1]['binding_utilization']:.3f} steps "
                f"{quality['steps']} dropped {quality['dropped']} patch violations {rows[-1]['patch_violations']}")
    return rows


# -- training ----------------------------------------------------------------------------------------------------
def _training_set(args: argparse.Namespace, work: Path) -> tuple[list, np.ndarray, int]:
    """Process the training samples once into `work` (the image pipeline stays out of the timed region): the
    samples, their (tokens, patches) facts and Standard's fixed batch under both limits."""
    mm_mix.build_processor(work / "processor")
    dataset = mm_mix.MMMixDataset(work / "processor", mm_mix.mm_mix_specs(args.train_samples, seed=1))
    samples = [dataset[k] for k in range(len(dataset))]
    torch.save(samples, work / "samples.pt")
    facts = np.asarray(_facts_of(samples), dtype=np.int64)
    return samples, facts, fixed_batch(facts, args.token_budget, args.max_patches)


def _launch_workers(args: argparse.Namespace, work: Path, samples: list, batch: int, options: list[str],
                    log: Callable[[str], None], note: str) -> None:
    """`mm_train_worker` on 2 gloo ranks (torchrun) over the processed samples in `work`, with `options` added."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "benchmarks.workers.mm_train_worker", "--processor", str(work / "processor"), "--out", str(work),
               "--n-train", str(len(samples)), "--n-eval", str(args.train_eval_samples),
               "--token-budget", str(args.token_budget), "--max-patches", str(args.max_patches),
               "--batch-size", str(batch), "--window", str(config(args.token_budget, args.max_patches).window),
               "--hidden", str(args.hidden), "--samples-cache", str(work / "samples.pt"), *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    log(f"  {len(samples)} samples, Standard B = {batch}{note}: {shlex.join(command[3:])}")
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=args.train_timeout)
    if done.returncode != 0:
        raise RuntimeError(f"mm_train_worker failed: {done.stdout[-2000:]}{done.stderr[-4000:]}")


def run_training(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """Launch `mm_train_worker` on 2 gloo ranks; every method, `--train-repeats` times, alternating."""
    with tempfile.TemporaryDirectory(prefix="mm_bench_") as tmp:
        work = Path(tmp)
        samples, facts, batch = _training_set(args, work)
        options = ["--epochs", "1", "--repeats", str(args.train_repeats), "--mode", "std", "--mode", "odb"]
        replayed = {}
        if not args.no_reference:
            for name in REPLAYED:
                schedule = reference(*REFERENCE_RUNS[name])(facts, 2, args.token_budget, args.max_patches)
                (work / f"{name}.json").write_text(json.dumps([[list(g) for g in rank if g]
                                                               for rank in schedule.steps]))
                replayed[name] = patch_measures(schedule, facts, args.token_budget, args.max_patches)
                options += ["--replay", f"{name}={work / name}.json"]
        _launch_workers(args, work, samples, batch, options, log, f", {args.train_repeats} repeats")
        modes = ["std", "odb", *replayed]
        ranks = {m: [json.loads((work / f"{m}.rank{r}.json").read_text()) for r in range(2)] for m in modes}
    return {"samples": len(samples), "standard_batch": batch, "hidden": args.hidden, "repeats": args.train_repeats,
            "workload": describe(facts), "methods": summarise(ranks), "reference_patch_measures": replayed}


def run_time_to_quality(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """Standard and ODB on 2 gloo ranks at the same optimizer step (`--ttq-samples-per-step`, rounded to Standard's
    B x W x GA; Standard by gradient accumulation, ODB by `samples_per_step`), evaluated on the held-out samples
    every `--ttq-eval-every` steps: `benchmarks.lib.time_to_quality` of the two eval curves (training seconds,
    evaluation excluded)."""
    with tempfile.TemporaryDirectory(prefix="mm_ttq_") as tmp:
        work = Path(tmp)
        samples, _, batch = _training_set(args, work)
        # Standard's step is B x W x GA; ODB gets exactly that many samples per step, with micro-batches of at
        # most Standard's B (as in benchmarks.demo: a micro-batch bigger than the step would make every step one)
        step = batch * 2 * max(round(args.ttq_samples_per_step / (batch * 2)), 1)
        cap = args.ttq_odb_max_batch_size or batch
        _launch_workers(args, work, samples, batch, ["--epochs", str(args.ttq_epochs), "--samples-per-step",
                                                     str(step), "--eval-every", str(args.ttq_eval_every),
                                                     "--odb-max-batch-size", str(cap), "--mode", "std",
                                                     "--mode", "odb"], log, "")
        rows = {name: json.loads((work / f"{mode}.rank0.json").read_text())
                for name, mode in (("standard", "std"), ("odb", "odb"))}
    figure = time_to_quality(rows)
    speedup = figure["speedup"]
    log("  time to Standard's final eval loss: " + (f"ODB {speedup:.2f}x faster" if speedup else "never reached by ODB")
        + f"; to the worse final loss: {figure['common_target']['speedup']:.2f}x")
    return {"samples": len(samples), "standard_batch": batch, "epochs": args.ttq_epochs,
            "samples_per_step": step, "odb_max_batch_size": cap,
            "time_to_quality": figure,
            "runs": {name: {k: row[k] for k in ("steps", "seconds", "eval_loss", "eval_curve", "accumulation_steps")}
                     for name, row in rows.items()}}


def summarise(ranks: dict[str, list[dict]]) -> dict:
    """Per method: steps, throughput (median over repeats) and the per-repeat ratio to Standard."""
    base = [r["samples_per_second"] for r in ranks["std"][0]["repeats"]]
    out = {}
    for mode, (first, second) in ranks.items():
        runs = first["repeats"]
        ratios = [r["samples_per_second"] / b for r, b in zip(runs, base)]
        out[mode] = {"steps": [first["steps"], second["steps"]], "left_out": first["left_out"],
                     "samples_per_second": statistics.median(r["samples_per_second"] for r in runs),
                     "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
                     "vs_standard": statistics.median(ratios), "vs_standard_min": min(ratios),
                     "vs_standard_max": max(ratios), "first_loss": first["losses"][0],
                     "last_loss": first["losses"][-1], "eval_loss": first["eval_loss"]}
    return out


# -- report ------------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    lines = [f"# MM-Mix-like VLM benchmark\n\nCommand: `{result['command']}`; L_max = {result['token_budget']} "
             f"padded tokens, max_patches = {result['max_patches']} patch rows per micro-batch.\n"]
    if "workload" in result:
        w = result["workload"]
        lines += [f"Workload: {w['samples']} samples, tokens mean {w['tokens_mean']:.0f} (CV {w['tokens_cv']:.2f}, "
                  f"p50 {w['tokens_p50']:.0f}, p99 {w['tokens_p99']:.0f}, max {w['tokens_max']}), patch rows mean "
                  f"{w['patches_mean']:.0f} (max {w['patches_max']}), visual tokens {w['visual_token_share']:.0%} "
                  f"of all tokens.\n",
                  "| W | method | budget utilization | patch utilization | binding-limit utilization | steps | "
                  "padding | dropped | patch-cap violations | max patches / cap |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in result["quality"]:
            lines.append(f"| {row['world_size']} | {LABELS[row['method']]} | {row['budget_utilization']:.3f} | "
                         f"{row['patch_utilization']:.3f} | {row['binding_utilization']:.3f} | {row['steps']} | "
                         f"{row['padding_ratio']:.3f} | "
                         f"{row['dropped']} | {row['patch_violations']} | {row['max_patch_ratio']:.2f} |")
    if "training" in result:
        t = result["training"]
        names = {"std": "Standard", "odb": "ODB", **{k: LABELS[k] + " (replayed)" for k in REPLAYED}}
        lines += ["", f"Training, W = 2: {t['samples']} samples, 1 epoch, hidden {t['hidden']}, Standard B = "
                  f"{t['standard_batch']}, median of {t['repeats']} repeats.\n",
                  "| method | samples/s | tokens/s | steps (rank 0, 1) | samples left out | vs Standard (median, "
                  "min-max) | loss first / last | held-out loss |", "|---|---|---|---|---|---|---|---|"]
        for mode, m in t["methods"].items():
            lines.append(f"| {names[mode]} | {m['samples_per_second']:.1f} | {m['tokens_per_second']:,.0f} | "
                         f"{m['steps'][0]}, {m['steps'][1]} | {m['left_out']} | {m['vs_standard']:.2f}x "
                         f"({m['vs_standard_min']:.2f}-{m['vs_standard_max']:.2f}) | {m['first_loss']:.2f} / "
                         f"{m['last_loss']:.2f} | {m['eval_loss']:.3f} |")
    if "time_to_quality" in result:
        t = result["time_to_quality"]
        q = t["time_to_quality"]
        lines += ["", f"Time to quality, W = 2: {t['samples']} samples, {t['epochs']} epochs, optimizer step of "
                  f"{t['samples_per_step']} samples (Standard B = {t['standard_batch']} x GA "
                  f"{t['runs']['standard']['accumulation_steps']}; ODB `samples_per_step`, micro-batch cap "
                  f"{t['odb_max_batch_size']}); target = Standard's final eval loss "
                  f"{q['target_eval_loss']:.4f}.\n",
                  "| method | optimizer steps | train s | final eval loss | s to target |", "|---|---|---|---|---|"]
        for name in ("standard", "odb"):
            run, reached = t["runs"][name], q[name]["seconds_to_target"]
            lines.append(f"| {name} | {run['steps']} | {run['seconds']:.1f} | {run['eval_loss']:.4f} | "
                         + (f"{reached:.1f}" if reached is not None else "never") + " |")
        common = q["common_target"]
        lines.append(f"\nODB / Standard time to the target: "
                     + (f"{q['speedup']:.2f}x" if q["speedup"] else "ODB never reached it")
                     + f"; to the worse final loss ({common['eval_loss']:.4f}): {common['speedup']:.2f}x")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--samples", type=int, default=8000, help="samples for the quality part")
    p.add_argument("--worlds", default="1,2,8")
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--max-patches", type=int, default=16384)
    p.add_argument("--no-reference", action="store_true", help="skip the reference release")
    p.add_argument("--train-samples", type=int, default=400)
    p.add_argument("--train-eval-samples", type=int, default=32)
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--train-timeout", type=float, default=1800)
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the trained model")
    p.add_argument("--ttq-epochs", type=int, default=3, help="time_to_quality part: epochs")
    p.add_argument("--ttq-samples-per-step", type=int, default=32,
                   help="time_to_quality part: optimizer step (rounded to a multiple of Standard's B x W)")
    p.add_argument("--ttq-eval-every", type=int, default=3, help="time_to_quality part: steps between evaluations")
    p.add_argument("--ttq-odb-max-batch-size", type=int, default=0,
                   help="time_to_quality part: ODB's micro-batch cap (0: Standard's micro-batch)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        raise SystemExit(f"unknown parts {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    if not args.no_reference:
        missing = reference_peer.ensure_env(create=True)
        if missing is not None:
            raise SystemExit(f"reference release unavailable ({missing.reason}); pass --no-reference")
    given = argv if argv is not None else sys.argv[1:]
    result: dict = {"command": ("python -m benchmarks.mm_bench " + shlex.join(given)).strip(),
                    "token_budget": args.token_budget, "max_patches": args.max_patches}
    started = time.perf_counter()
    log = functools.partial(print, flush=True)
    if "quality" in parts:
        with tempfile.TemporaryDirectory(prefix="mm_proc_") as tmp:
            mm_mix.build_processor(Path(tmp))
            facts = observe(Path(tmp), args.samples, seed=0)
        result["workload"] = describe(facts)
        log(f"batch quality on {len(facts)} observed samples:")
        result["quality"] = run_quality(facts, [int(w) for w in args.worlds.split(",")], args.token_budget,
                                        args.max_patches, not args.no_reference, log)
    if "training" in parts:
        log("CPU training throughput (W=2):")
        result["training"] = run_training(args, log)
    if "time_to_quality" in parts:
        log("time to quality (W=2):")
        result["time_to_quality"] = run_time_to_quality(args, log)
    result["seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mm_bench.json").write_text(json.dumps(result, indent=1))
    (args.out / "mm_bench.md").write_text(markdown(result))
    log(markdown(result))
    log(f"wrote {args.out}/mm_bench.json, mm_bench.md ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
