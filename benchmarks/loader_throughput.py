"""Loader overhead: ODB against a plain DataLoader with the same workers and a fixed batch of 16.

The dataset is trivial (fixed-length samples, no tokenization), so this measures the loader machinery alone:
per-sample transport from workers, grouping, alignment and collation. Both loaders run back to back in one
process, several times, and the ratio of medians is reported (the machines are shared and noisy).

    python -m benchmarks.loader_throughput [--workers 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils.data import DataLoader

from odb_core import ODBDataLoader

SEQ = 64
BATCH = 16


class Trivial(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 20_000

    def __getitem__(self, index: int) -> dict:
        ids = torch.full((SEQ,), index % 1000, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}


def samples_per_second(loader, count_samples) -> float:
    start = time.perf_counter()
    n = sum(count_samples(batch) for batch in loader)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = Trivial()
    plain, odb = [], []
    for _ in range(args.repeats):
        plain.append(samples_per_second(
            DataLoader(dataset, batch_size=BATCH, num_workers=args.workers), lambda b: b["input_ids"].shape[0]))
        odb.append(samples_per_second(
            ODBDataLoader(dataset, token_budget=BATCH * SEQ, num_workers=args.workers),
            lambda b: b.info.local_samples))
    result = {"workers": args.workers, "plain_samples_per_s": round(statistics.median(plain)),
              "odb_samples_per_s": round(statistics.median(odb)),
              "ratio": round(statistics.median(odb) / statistics.median(plain), 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
