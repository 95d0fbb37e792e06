"""`move="send"` against `move="fetch"` under global planning, on real Gloo ranks: the loader alone, no model.

    python -m benchmarks.move_modes [--worlds 2,4] [--workers 0,1] [--repeats 5]   # writes results/move_modes.{json,md}

Two map-style datasets of the same ChitChat conversations (`chat_data`: the first `--samples` (2,000) of the
3,462 with >= 3 turns, role markup, DeepSeek tokenizer, cut at 4096 tokens):
  * `pretokenized`: an HF `datasets.Dataset` of the token ids (saved with `save_to_disk`, each rank
    memory-maps it with `load_from_disk`, `set_format("torch")`): `__getitem__` is a cheap row read;
  * `tokenize`: the conversations' text, templated and tokenized with the DeepSeek tokenizer in `__getitem__`
    (`chat_data.tokenize`): the heavier processing a real pipeline runs per sample.
Each rank builds one `ODBDataLoader(token_budget=8192, planning="global", shuffle=True)` per move mode (default
`PadCollator`: padded `input_ids`/`labels` tensors) and iterates whole epochs; both modes run the same epochs
(`set_epoch`), alternating which goes first, after one untimed warm-up epoch each; with `--workers` > 0 the
workers are forked and persistent (`WORKER_OPTIONS`). Measured per epoch: samples/s
(all samples over the slowest rank's wall time), the trainer process's CPU seconds (`time.process_time`, workers
excluded), moved samples and moved bytes (send; fetch moves no bytes but runs `__getitem__` again on the
receiving rank). Reported: the median over repeats and its min-max; both modes emit the same batches (checked).
W processes share the machine's cores (2 here), so the figures are noisy and the absolute rates are not a node's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import RESULTS
from benchmarks.data import chat_data
from benchmarks.lib.localhost import free_port
from odb_core import ODBDataLoader

MODES = ("send", "fetch")
KINDS = ("pretokenized", "tokenize")
TOKEN_BUDGET = 8192
MAX_LEN = 4096
# Workers forked (what a torchrun rank gets on Linux; a process started by mp.spawn would spawn them, paying an
# interpreter start per worker and epoch) and kept across epochs, so that an epoch measures the steady state.
WORKER_OPTIONS = {"multiprocessing_context": "fork", "persistent_workers": True}


class TokenizingDataset(torch.utils.data.Dataset):
    """Conversations tokenized on the fly (template + DeepSeek tokenizer + truncation) in `__getitem__`."""

    def __init__(self, conversations: list[list[tuple[str, str]]]) -> None:
        self.conversations = conversations
        self.tokenizer = None  # loaded on first use, in the process that uses it

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.tokenizer is None:
            self.tokenizer = chat_data.load_tokenizer()
        sample = chat_data.tokenize(self.conversations[index], self.tokenizer, MAX_LEN)
        return {"input_ids": torch.tensor(sample["input_ids"]), "labels": torch.tensor(sample["labels"])}


def pretokenized(folder: Path):
    """The corpus as an HF `datasets.Dataset` on disk (built once by the launcher), read back as torch rows."""
    import datasets

    table = datasets.load_from_disk(str(folder / "pretokenized"))
    table.set_format("torch")
    return table


def save_pretokenized(folder: Path, samples: int) -> int:
    import datasets

    corpus = chat_data.build_corpus(n=samples, max_len=MAX_LEN)
    table = datasets.Dataset.from_dict({"input_ids": [s["input_ids"] for s in corpus.samples],
                                        "labels": [s["labels"] for s in corpus.samples]})
    table.save_to_disk(str(folder / "pretokenized"))
    return len(table)


def _epoch(loader: ODBDataLoader, epoch: int) -> dict:
    """One timed epoch; the batches' index lists are digested to check that both modes emit the same."""
    loader.set_epoch(epoch)
    before = (loader.metrics.moved_samples, loader.metrics.moved_bytes, loader.metrics.counts.local_samples)
    digest = hashlib.sha256()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in loader:
        digest.update(repr(batch.info.indices).encode())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    m = loader.metrics
    return {"wall": wall, "cpu": cpu, "moved_samples": m.moved_samples - before[0],
            "moved_bytes": m.moved_bytes - before[1], "samples": m.counts.local_samples - before[2],
            "digest": digest.hexdigest()}


def _rank(rank: int, world: int, port: int, folder: str, setup: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out: dict = {}
        for kind in setup["kinds"]:
            dataset = pretokenized(Path(folder)) if kind == "pretokenized" else \
                TokenizingDataset(chat_data.conversations(min_turns=3)[: setup["samples"]])
            for workers in setup["workers"]:
                options = WORKER_OPTIONS if workers else {}
                loaders = {mode: ODBDataLoader(dataset, token_budget=TOKEN_BUDGET, shuffle=True, move=mode,
                                               num_workers=workers, planning="global", **options) for mode in MODES}
                runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
                for mode in MODES:
                    _epoch(loaders[mode], 0)  # warm-up: tokenizer load, worker start, first Gloo calls
                for repeat in range(setup["repeats"]):
                    order = MODES if repeat % 2 == 0 else MODES[::-1]
                    for mode in order:
                        runs[mode].append(_epoch(loaders[mode], repeat + 1))
                out[f"{kind}/{workers}"] = runs
        Path(folder, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _summary(ranks: list[dict], key: str) -> dict:
    """Per mode: samples/s per epoch (all ranks' samples over the slowest rank), CPU, moves; median, min-max."""
    out = {}
    for mode in MODES:
        epochs = list(zip(*(r[key][mode] for r in ranks), strict=True))  # per repeat, every rank's facts
        rates = [sum(e["samples"] for e in rep) / max(e["wall"] for e in rep) for rep in epochs]
        cpu = [statistics.mean(e["cpu"] for e in rep) for rep in epochs]
        moved = [sum(e["moved_samples"] for e in rep) for rep in epochs]
        out[mode] = {"samples_per_s": statistics.median(rates), "range": [min(rates), max(rates)],
                     "trainer_cpu_s_per_epoch": statistics.median(cpu),
                     "moved_fraction": statistics.median(moved) / sum(e["samples"] for e in epochs[0]),
                     "moved_bytes_per_epoch": statistics.median(sum(e["moved_bytes"] for e in rep) for rep in epochs),
                     "per_repeat": rates}
    per_repeat = [f / s for f, s in zip(out["fetch"]["per_repeat"], out["send"]["per_repeat"], strict=True)]
    digests = {mode: [[e["digest"] for e in r[key][mode]] for r in ranks] for mode in MODES}
    return {**out, "fetch_over_send": statistics.median(per_repeat),
            "fetch_over_send_range": [min(per_repeat), max(per_repeat)],
            "same_batches": digests["send"] == digests["fetch"]}


def run_world(world: int, setup: dict, folder: str) -> list[dict]:
    port = free_port()
    mp.spawn(_rank, args=(world, port, folder, setup), nprocs=world, join=True)
    ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    rows = []
    for key in ranks[0]:
        kind, workers = key.split("/")
        rows.append({"world_size": world, "dataset": kind, "num_workers": int(workers), **_summary(ranks, key)})
    return rows


def markdown(result: dict) -> str:
    lines = [f"# send against fetch (`{result['command']}`)", "",
             f"{result['samples']} ChitChat samples, `L_max` {TOKEN_BUDGET}, global planning, {result['repeats']} "
             "repeats (median, min-max).", "",
             "| W | dataset | workers | send samples/s | fetch samples/s | fetch / send | moved fraction | "
             "send MB moved/epoch | trainer CPU s/epoch send / fetch | same batches |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s, f = r["send"], r["fetch"]
        lines.append(
            f"| {r['world_size']} | {r['dataset']} | {r['num_workers']} | {s['samples_per_s']:,.0f} "
            f"({s['range'][0]:,.0f}-{s['range'][1]:,.0f}) | {f['samples_per_s']:,.0f} ({f['range'][0]:,.0f}-"
            f"{f['range'][1]:,.0f}) | {r['fetch_over_send']:.2f} ({r['fetch_over_send_range'][0]:.2f}-"
            f"{r['fetch_over_send_range'][1]:.2f}) | {s['moved_fraction']:.2f} | {s['moved_bytes_per_epoch'] / 1e6:.1f} | "
            f"{s['trainer_cpu_s_per_epoch']:.2f} / {f['trainer_cpu_s_per_epoch']:.2f} | {r['same_batches']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--workers", default="0,1", help="DataLoader workers per rank, comma-separated")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--samples", type=int, default=2000, help="the first N ChitChat conversations (>= 3 turns)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    setup = {"kinds": args.kinds.split(","), "workers": [int(w) for w in args.workers.split(",")],
             "repeats": args.repeats, "samples": args.samples}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        samples = save_pretokenized(Path(folder), args.samples)
        rows = []
        for world in (int(w) for w in args.worlds.split(",")):
            rows += run_world(world, setup, folder)
            print(markdown({"command": "", "samples": samples, "repeats": args.repeats, "rows": rows[-len(
                setup["kinds"]) * len(setup["workers"]):]}), flush=True)
    command = " ".join(["python -m benchmarks.move_modes", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command.strip(), "samples": samples, "repeats": args.repeats, "token_budget": TOKEN_BUDGET,
              "rows": rows, "seconds": round(time.perf_counter() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "move_modes.json").write_text(json.dumps(result, indent=1))
    (args.out / "move_modes.md").write_text(markdown(result))
    print(f"wrote {args.out}/move_modes.json, move_modes.md ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
