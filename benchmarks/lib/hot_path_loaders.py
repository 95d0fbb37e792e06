"""The hot-path benchmarks' datasets and loaders: `python -m benchmarks.hot_path`, `python -m
benchmarks.hot_path_instructions` and the fresh processes both start (peak RSS, instruction counts) build them here.

Datasets: `trivial` (`Trivial`), `arrow` and `tokenize` (`build`); loaders: the plain `DataLoader` and
`ODBDataLoader` of a row (`loaders`), and `LengthSorted`, the floor of any length-aware loader. `epoch_rate` runs
one epoch, optionally with a simulated GPU step (`Step`) between batches. benchmarks/hot_path.py's docstring
describes what each measures.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from odb_core import ODBDataLoader, PadCollator

BATCH = 16
SEQ = 64


class Trivial(torch.utils.data.Dataset):
    def __init__(self, n: int = 20_000) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        ids = torch.full((SEQ,), index % 1000, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}


class Tokenizing(torch.utils.data.Dataset):
    """Raw conversations, templated and tokenized on every fetch (the processing ODB waits for)."""

    def __init__(self, conversations: list, max_len: int = 4096) -> None:
        from benchmarks.data import chat_data

        self.conversations, self.max_len = conversations, max_len
        self.tokenizer = chat_data.load_tokenizer()

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> dict:
        from benchmarks.data import chat_data

        return chat_data.tokenize(self.conversations[index], self.tokenizer, self.max_len)


def build(name: str, samples: int, trivial_samples: int = 20_000):
    """(dataset, mean length) of a named shape (`trivial_samples`: the size of `trivial`, whatever `samples`)."""
    if name == "trivial":
        return Trivial(trivial_samples), SEQ
    from benchmarks.data import chat_data

    conversations = chat_data.conversations()[:samples]
    if name == "tokenize":
        data = Tokenizing(conversations)
        return data, statistics.fmean(len(data[i]["input_ids"]) for i in range(0, len(data), 10))
    import datasets

    corpus = chat_data.build_corpus(n=samples)
    arrow = datasets.Dataset.from_dict({"input_ids": [s["input_ids"] for s in corpus.samples],
                                        "labels": [s["labels"] for s in corpus.samples]})
    return arrow, statistics.fmean(corpus.lengths())


class LengthSorted:
    """The floor of any length-aware loader written in Python, for `trivial` without workers: each window of
    4,096 samples is read, its lengths looked at once, sorted by numpy and cut into batches of 16 in that order,
    each stacked by `default_collate`. No check, no budget, no ranks, no bookkeeping: whatever a loader that batches
    by observed length must do at the least, beyond what the plain loader does."""

    def __init__(self, dataset, window: int = 4096) -> None:
        self.dataset, self.window = dataset, window

    def __iter__(self):
        n = len(self.dataset)
        for start in range(0, n, self.window):
            samples = [self.dataset[i] for i in range(start, min(start + self.window, n))]
            lengths = np.fromiter((s["input_ids"].shape[0] for s in samples), np.int64, len(samples))
            order = np.argsort(-lengths, kind="stable").tolist()
            for k in range(0, len(order), BATCH):
                yield default_collate([samples[i] for i in order[k : k + BATCH]])


class Step:
    """A stand-in for a GPU training step between two batches: `LAUNCHES` short operator calls (a step's kernel
    launches; each releases the GIL and takes it back) and then `ms` milliseconds of waiting for the device (the
    GIL released), so that a background thread can overlap the wait and contend for the GIL around the launches.
    Only wall rates mean anything with a step."""

    LAUNCHES = 300

    def __init__(self, ms: float) -> None:
        self.seconds, self.x = ms / 1e3, torch.zeros(64)

    def __call__(self) -> None:
        for _ in range(self.LAUNCHES):
            torch.add(self.x, 1.0)
        time.sleep(self.seconds)


def epoch_rate(loader, count, step: Step | None = None) -> tuple[float, float, int]:
    """(samples per wall second, trainer-process CPU microseconds per sample, full garbage collections) of one
    epoch. The CPU time counts every thread of this process (ODB's producer included) and no worker process; with
    a `step`, the step's own CPU time is in it too, so only the wall rate is read then. A full collection walks
    the whole heap (~80 ms in this process); a loader triggers them by keeping newly made objects alive across
    collections, as any window of buffered samples does."""
    full = 0

    def on_collect(phase: str, info: dict) -> None:
        nonlocal full
        if phase == "stop" and info["generation"] == 2:
            full += 1

    gc.callbacks.append(on_collect)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        n = 0
        for batch in loader:
            n += count(batch)
            if step is not None:
                step()
        return n / (time.perf_counter() - start), 1e6 * (time.process_time() - cpu) / n, full
    finally:
        gc.callbacks.remove(on_collect)


def loaders(name: str, dataset, mean: float, workers: int, prefetch_steps: int | None = None,
            cost: str = "padded"):
    options = loader_options(workers)
    collate = None if name == "trivial" else PadCollator()
    plain = DataLoader(dataset, batch_size=BATCH, collate_fn=collate, **options)
    if prefetch_steps is not None:  # None: ODB's default
        options["prefetch_steps"] = prefetch_steps
    odb = ODBDataLoader(dataset, token_budget=int(BATCH * mean), cost=cost, collate_fn=collate or PadCollator(),
                        **options)
    return plain, odb


def loader_options(workers: int) -> dict:
    """DataLoader worker options shared by every loader of a row."""
    if not workers:
        return {"num_workers": 0}
    return {"num_workers": workers, "persistent_workers": True, "multiprocessing_context": "fork"}


def proc_status_kib(field: str) -> int:
    """A /proc/self/status memory field, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)
