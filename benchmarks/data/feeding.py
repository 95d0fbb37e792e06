"""The workloads of `python -m benchmarks.overlap` and `python -m benchmarks.buffer_memory` (issue 27): datasets
whose `__getitem__` is the processing DataLoader workers run, with what the benchmark needs to know of them.

  * `sleep` (`SlowSamples`): lognormal token lengths (mean 900, CV 1.0, capped at 16,384); each fetch first waits
    `process_ms` with the GIL released (image decoding's profile: native code in another process); with
    `payload_kb`, each sample also carries that many KiB of float32 `pixel_values` (moves that weigh what a VLM
    sample's do, on a device-bound run).
  * `tokenize` (`TokenizedChat`): real ChitChat conversations (>= 3 turns) templated and tokenized with the
    DeepSeek tokenizer in `__getitem__` (`chat_data.tokenize`, cut at 4096 tokens): real CPU-bound work.
  * `vlm` (`mm_mix.MMMixDataset`): the MM-Mix-like pipeline, real image processing (`Qwen2VLImageProcessorPil`)
    and chat templating in `__getitem__`; its processor is built once by `prepare` into a folder every rank reads.
  * `PixelRows` (buffer_memory): 1 MiB of float32 pixel rows per sample, made in `__getitem__`.

For the plain loader's fixed batch the benchmark needs the longest sample, known for real data only after
processing: `lengths` reads ChitChat's cached token lengths (`real_lengths.chitchat`, the same tokenization) and
processes the VLM samples once, cached under benchmarks/.cache/ per version of mm_mix.py. The supply side needs
seconds of processing per sample: `process_seconds` times `dataset[i]` in this one process, for every workload
(`nominal_seconds`: the sleep workload's wait alone).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import CACHE
from benchmarks.data import chat_data, mm_mix, real_lengths

WORKLOADS = ("sleep", "tokenize", "vlm")
MAX_LEN = 4096  # the tokenize workload's cut


class SlowSamples(torch.utils.data.Dataset):
    """Lognormal token lengths; each `__getitem__` first waits `process_ms` with the GIL released, and adds
    `payload_kb` KiB of `pixel_values` when asked."""

    def __init__(self, n: int, process_ms: float, mean: float = 900.0, cv: float = 1.0, cap: int = 16384,
                 seed: int = 0, payload_kb: int = 0) -> None:
        rng = np.random.default_rng(seed)
        sigma2 = math.log(1 + cv * cv)
        raw = rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n)
        self.lengths = np.clip(raw.round(), 8, cap).astype(int).tolist()
        self.process_s = process_ms / 1e3
        self.payload_floats = payload_kb * 256

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        time.sleep(self.process_s)
        n = self.lengths[index]
        ids = (torch.arange(n) * 7 + index) % 31000 + 3
        if not self.payload_floats:
            return {"input_ids": ids, "labels": ids.clone()}
        pixels = torch.full((self.payload_floats,), float(index % 255), dtype=torch.float32)
        return {"input_ids": ids, "labels": ids.clone(), "pixel_values": pixels}


class TokenizedChat(torch.utils.data.Dataset):
    """ChitChat conversations (>= 3 turns, in the package's order, repeated past the 3,462 there are) templated
    and tokenized in `__getitem__`; the tokenizer loads on first use, in the process that uses it."""

    def __init__(self, n: int) -> None:
        self.conversations = chat_data.conversations(min_turns=3)
        self.n = n
        self.tokenizer = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.tokenizer is None:
            self.tokenizer = chat_data.load_tokenizer()
        sample = chat_data.tokenize(self.conversations[index % len(self.conversations)], self.tokenizer, MAX_LEN)
        return {"input_ids": torch.tensor(sample["input_ids"]), "labels": torch.tensor(sample["labels"])}


class PixelRows(torch.utils.data.Dataset):
    """Samples of `tokens` token ids (a few hundred, varied) with one image of `rows` x `width` float32 pixel
    rows (1 MiB at 256 x 1024) and a consistent `image_grid_thw` (1, 16, rows / 16), all made in `__getitem__`
    so that the dataset itself holds nothing."""

    def __init__(self, n: int, rows: int = 256, width: int = 1024, tokens: int = 300) -> None:
        self.n, self.rows, self.width, self.tokens = n, rows, width, tokens

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        length = self.tokens + (index * 37) % self.tokens - self.tokens // 2
        ids = (torch.arange(length) * 11 + index) % 30000 + 3
        pixels = torch.full((self.rows, self.width), float(index % 255), dtype=torch.float32)
        return {"input_ids": ids, "labels": ids.clone(), "pixel_values": pixels,
                "image_grid_thw": torch.tensor([[1, 16, self.rows // 16]])}


def prepare(workload: str, folder: Path) -> None:
    """One-time set-up in the launching process: the VLM processor (tokenizer + image processor) in `folder`."""
    if workload == "vlm" and not (folder / "processor").exists():
        mm_mix.build_processor(folder / "processor")


def build(workload: str, samples: int, process_ms: float, folder: Path,
          payload_kb: int = 0) -> torch.utils.data.Dataset:
    """The workload's dataset of `samples` samples (`process_ms` and `payload_kb`: the sleep workload's wait and
    pixel bytes per sample)."""
    if workload == "sleep":
        return SlowSamples(samples, process_ms, payload_kb=payload_kb)
    if workload == "tokenize":
        return TokenizedChat(samples)
    if workload == "vlm":
        return mm_mix.MMMixDataset(folder / "processor", mm_mix.mm_mix_specs(samples, seed=0))
    raise ValueError(f"workload {workload!r}: choose one of {', '.join(WORKLOADS)}")


def lengths(workload: str, dataset: torch.utils.data.Dataset, workers: int = 2) -> list[int]:
    """Every sample's token count (`input_ids`) after processing."""
    if isinstance(dataset, SlowSamples):
        return dataset.lengths
    if workload == "tokenize":
        chitchat = real_lengths.chitchat(MAX_LEN)
        return [chitchat[k % len(chitchat)] for k in range(len(dataset))]
    version = hashlib.sha256(Path(mm_mix.__file__).read_bytes()).hexdigest()[:12]
    path = CACHE / f"feeding_{workload}_n{len(dataset)}_{version}.json"
    if path.exists():
        return json.loads(path.read_text())
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=workers, collate_fn=_token_counts)
    counts = [n for batch in loader for n in batch]
    CACHE.mkdir(exist_ok=True)
    path.write_text(json.dumps(counts))
    return counts


def _token_counts(samples: list[dict]) -> list[int]:
    return [int(s["input_ids"].numel()) for s in samples]


def nominal_seconds(dataset: torch.utils.data.Dataset) -> float | None:
    """The sleep workload's wait per sample, what the issue's supply formula was first given; None for the others."""
    return dataset.process_s if isinstance(dataset, SlowSamples) else None


def process_seconds(dataset: torch.utils.data.Dataset, count: int = 200) -> float:
    """Mean seconds of one `dataset[i]` in this process, over `count` indices spread over the dataset, after one
    untimed fetch (tokenizer and processor loading). The sleep workload is timed too: its wait is the nominal part
    (`nominal_seconds`), and a fetch also oversleeps and makes its tensors (2.13 ms for a 2 ms wait here)."""
    dataset[0]
    indices = np.linspace(0, len(dataset) - 1, min(count, len(dataset))).astype(int).tolist()
    start = time.perf_counter()
    for index in indices:
        dataset[index]
    return (time.perf_counter() - start) / len(indices)
