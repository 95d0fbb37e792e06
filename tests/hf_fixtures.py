"""Session fixtures for the HF adapter tests (loaded with `pytest_plugins = ["hf_fixtures"]`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import hf_support


@dataclass(frozen=True)
class ChatData:
    tokenizer: Path
    train: list[dict]
    eval: list[dict]
    train_file: Path
    eval_file: Path


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> ChatData:
    """A BPE vocabulary trained on real chitchat conversations, and tokenized train/eval chat samples."""
    folder = tmp_path_factory.mktemp("chat")
    tokenizer = hf_support.train_tokenizer(folder / "tokenizer.json", n_conversations=800)
    train = hf_support.chat_samples(tokenizer, 256, max_len=160)
    held_out = hf_support.chat_samples(tokenizer, 48, max_len=160, skip=1000)
    hf_support.save_samples(train, folder / "train.json")
    hf_support.save_samples(held_out, folder / "eval.json")
    return ChatData(tokenizer, train, held_out, folder / "train.json", folder / "eval.json")
