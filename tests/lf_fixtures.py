"""Offline LLaMA-Factory fixtures: a tiny random Qwen2 with a BPE tokenizer trained on real chitchat text, and a
dataset folder (dataset_info.json) with alpaca- and sharegpt-format records of real conversations.

Built in the main test environment (transformers, tokenizers, chitchat_dataset) and read by LLaMA-Factory in
.venv-lf from disk, as a user's local model and data would be.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.data import chat_data  # the one ChitChat reader

VOCAB = 1000
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def conversations(limit: int, skip: int = 0) -> list[list[str]]:
    """Real human-to-human conversations (one string per turn) with at least two turns."""
    return chat_data.turn_texts(2, skip + limit)[skip:]


def build_tokenizer(folder: Path) -> int:
    """Train a byte-level BPE on real text and save it as a transformers tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((t for c in conversations(800) for t in c), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return len(fast)


def build_model(folder: Path, vocab_size: int, seed: int = 0) -> None:
    """A tiny random Qwen2 (hidden 32, 2 layers) saved where LLaMA-Factory's model_name_or_path points."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(folder)


def build_datasets(folder: Path, n_alpaca: int = 96, n_sharegpt: int = 64) -> None:
    """dataset_info.json with `chitchat_alpaca` (one exchange) and `chitchat_sharegpt` (2-6 turns)."""
    folder.mkdir(parents=True, exist_ok=True)
    alpaca = [{"instruction": c[0], "input": "", "output": c[1]} for c in conversations(n_alpaca)]
    sharegpt = []
    for position, turns in enumerate(conversations(n_sharegpt, skip=n_alpaca)):
        turns = turns[: 2 * (1 + position % 3)]  # 2, 4 or 6 turns: varied lengths
        turns = turns[: len(turns) - len(turns) % 2]  # human/gpt pairs
        sharegpt.append({"conversations": [{"from": "human" if k % 2 == 0 else "gpt", "value": t}
                                           for k, t in enumerate(turns)]})
    (folder / "alpaca.json").write_text(json.dumps(alpaca))
    (folder / "sharegpt.json").write_text(json.dumps(sharegpt))
    info = {"chitchat_alpaca": {"file_name": "alpaca.json"},
            "chitchat_sharegpt": {"file_name": "sharegpt.json", "formatting": "sharegpt",
                                  "columns": {"messages": "conversations"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=1))


def build_all(root: Path) -> dict[str, Path]:
    model, data = root / "tiny-qwen2", root / "data"
    vocab = build_tokenizer(model)
    build_model(model, vocab)
    build_datasets(data)
    return {"model": model, "data": data}
