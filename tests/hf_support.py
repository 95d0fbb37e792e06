"""Helpers shared by the HF adapter tests and the torchrun worker: real chat data, a tiny Llama, references.

Data: real conversations from the `chitchat_dataset` package, tokenized with a small BPE vocabulary trained on
them with `tokenizers` (a compact vocabulary keeps the CPU model fast). Speaker B's turns are supervised; speaker
A's turns and the markup are masked with -100, as in chat SFT.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import TrainerCallback

from benchmarks.data import chat_data  # the one ChitChat reader

VOCAB = 1024
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>", "<a>", "<b>"]
PAD, BOS, EOS, SPEAKER_A, SPEAKER_B = 0, 2, 3, 4, 5


def train_tokenizer(path: Path, n_conversations: int = 1500) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((t for c in chat_data.turn_texts(2, n_conversations) for t in c), trainer)
    tokenizer.save(str(path))
    return path


def chat_samples(tokenizer_path: Path, n: int, max_len: int, skip: int = 0) -> list[dict[str, list[int]]]:
    """`n` processed samples (input_ids, labels) from conversations `skip`, `skip + 1`, ..."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    samples = []
    for position, turns in enumerate(chat_data.turn_texts(2, skip + n)[skip:], start=skip):
        ids, labels = [BOS], [-100]
        for k, text in enumerate(turns[: 2 + position % 5]):  # varied conversation depth: varied lengths
            tokens = [SPEAKER_A if k % 2 == 0 else SPEAKER_B] + tokenizer.encode(text).ids + [EOS]
            ids += tokens
            labels += [-100] + tokens[1:] if k % 2 else [-100] * len(tokens)
        samples.append({"input_ids": ids[:max_len], "labels": labels[:max_len]})
    return samples


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def save_samples(samples: list[dict], path: Path) -> None:
    path.write_text(json.dumps(samples))


def load_samples(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text())


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, hidden: int = 32, attention_dropout: float = 0.0):
    """A 2-layer Llama with eager attention; `attention_dropout` > 0 makes training draw from the global torch RNG."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
                         attention_dropout=attention_dropout)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).to(dtype)


class LogitsOnly(torch.nn.Module):
    """A model whose forward takes no loss kwargs (and no labels): the Trainer cannot pass num_items_in_batch."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None):
        return {"logits": self.inner(input_ids=input_ids, attention_mask=attention_mask).logits}


class GradRecorder(TrainerCallback):
    """Keeps every optimizer step's (synchronised, unclipped) gradients; FSDP2's sharded ones gathered whole (a
    collective: every rank records)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: full_tensor(p.grad).detach().clone() for n, p in model.named_parameters()
                           if p.requires_grad})


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (FSDP2 shards parameters and gradients), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def reference_gradient(model: torch.nn.Module, samples: list[dict], pad_token_id: int = PAD) -> dict[str, torch.Tensor]:
    """Gradient of the mean token CE over every supervised token of `samples`, one big padded batch, float64.

    The CE is computed here in float64 from the logits (not by the model's loss) so that the reference is
    independent of the code under test. Every field but `labels` goes to the model (VLMs: pixel values, grids).
    """
    from odb_core.data.collate import PadCollator

    batch = PadCollator(pad_token_id=pad_token_id)(samples)
    model.zero_grad(set_to_none=True)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.double()
    labels = batch["labels"][:, 1:].reshape(-1)
    token_ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels,
                                                 ignore_index=-100, reduction="sum")
    (token_ce / max(int((labels != -100).sum()), 1)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def max_relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """max over parameters of |got - ref|_inf / |ref|_inf (0 where both are zero)."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    worst = 0.0
    for name, r in ref.items():
        scale = float(r.abs().max())
        diff = float((got[name].to(r.dtype) - r).abs().max())
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


def steps_of(infos: list, accumulation_steps: int | None) -> dict[tuple[int, int], list[int]]:
    """Dataset indices of each optimizer step (epoch, step // G; with None, a step target: the step number of
    the window's first micro-batch), over every rank's StepInfos."""
    steps: dict[tuple[int, int], list[int]] = {}
    for info in infos:
        key = info["step"] // accumulation_steps if accumulation_steps else info["step"] - info["window_index"]
        steps.setdefault((info["epoch"], key), []).extend(info["indices"])
    return steps


def tiny_lora(seed: int = 0, dtype: torch.dtype = torch.float32):
    """`tiny_llama` with LoRA adapters on q/v; adapters start random (not B = 0) so every gradient is non-zero."""
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(seed=seed, dtype=dtype)
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config, autocast_adapter_dtype=False).to(dtype)


def uneven_ranks(samples: list[dict], n_long: int = 9) -> list[dict]:
    """Long and short samples alternating: in sequential order rank 0 (even positions) gets only long ones,
    one per micro-batch under a small budget, and rank 1 runs out of samples first, so it gets IDLE steps."""
    by_length = sorted(samples, key=lambda s: len(s["input_ids"]))
    longs, shorts = by_length[-n_long:], by_length[: n_long - 1]
    return [x for pair in zip(longs, shorts + [None]) for x in pair if x is not None]
