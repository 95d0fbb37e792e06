"""The time-to-quality text: ChitChat tokenized once with the DeepSeek tokenizer, split into train and held-out.

The ids are compacted to the `VOCAB - 1` most frequent in the split (the rest become `UNK`), so that a small model
of any scale embeds them. Cached as `<out>/data.json`, keyed by (train, held-out, cutoff). `make demo`
(benchmarks/demo.py) and the GPU script's quality part (benchmarks/gpu/quality.py) train on it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

UNK = 0
VOCAB = 2048


def prepare_split(out: Path, train: int, held_out: int, cutoff: int) -> Path:
    """Tokenize ChitChat once (cached); compact the ids to the VOCAB-1 most frequent (rest -> UNK)."""
    path = out / "data.json"
    if path.exists() and json.loads(path.read_text())["key"] == [train, held_out, cutoff]:
        return path
    from benchmarks.data.chat_data import conversations, load_tokenizer, tokenize

    print(f"tokenizing {train + held_out} ChitChat conversations with the DeepSeek tokenizer ...", flush=True)
    tokenizer = load_tokenizer()
    raw = [tokenize(c, tokenizer, cutoff) for c in conversations(min_turns=3)[: train + held_out]]
    counts = Counter(t for s in raw for t in s["input_ids"])
    remap = {t: k + 1 for k, (t, _) in enumerate(counts.most_common(VOCAB - 1))}
    samples = [{"input_ids": [remap.get(t, UNK) for t in s["input_ids"]],
                "labels": [remap.get(t, UNK) if t != -100 else -100 for t in s["labels"]]} for s in raw]
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": [train, held_out, cutoff], "train": samples[:train],
                                "eval": samples[train:]}))
    return path
