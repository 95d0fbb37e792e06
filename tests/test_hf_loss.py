"""G6 exact loss: `odb_core.loss` on its own, and through the HF Trainer in one process against the float64
big-batch reference (the 2-rank cases are in test_hf_distributed.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hf_support
from odb_core.collate import PadCollator
from odb_core.loss import TokenLossScale, causal_lm_loss_sum, step_normalizer
from odb_hf import ODBCallback

pytest_plugins = ["hf_fixtures"]
TOLERANCE = 1e-6


def frozen_args(tmp_path, accumulation_steps: int, **overrides) -> TrainingArguments:
    """lr = 0: parameters never move, so every step's gradient can be checked against the same model."""
    options = dict(output_dir=str(tmp_path), gradient_accumulation_steps=accumulation_steps, learning_rate=0.0,
                   optim="sgd", max_grad_norm=0.0, num_train_epochs=1, report_to=[], save_strategy="no",
                   logging_steps=1000, use_cpu=True, seed=0, lr_scheduler_type="constant", disable_tqdm=True)
    options.update(overrides)
    return TrainingArguments(**options)


def run_odb_gradients(model, samples, args, token_budget=320):
    infos: list = []
    recorder = hf_support.GradRecorder()
    odb = ODBCallback(token_budget=token_budget, window=32, observer=infos.append)
    trainer = Trainer(model=model, args=args, train_dataset=hf_support.ListDataset(samples),
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb, recorder])
    trainer.train()
    records = [{"epoch": i.epoch, "step": i.step, "indices": list(i.indices)} for i in infos]
    return recorder.steps, hf_support.steps_of(records, args.gradient_accumulation_steps)


def check_against_reference(model, samples, grads, steps) -> float:
    assert len(grads) == len(steps) > 1
    worst = 0.0
    for got, key in zip(grads, sorted(steps)):
        ref = hf_support.reference_gradient(model, [samples[i] for i in steps[key]])
        worst = max(worst, hf_support.max_relative_error(got, ref))
    return worst


@pytest.mark.parametrize("accumulation_steps", [1, 3])
def test_step_gradient_equals_big_batch_token_mean_single_process(chat_data, tmp_path, accumulation_steps):
    samples = chat_data.train[:40]
    model = hf_support.tiny_llama(dtype=torch.float64)
    grads, steps = run_odb_gradients(model, samples, frozen_args(tmp_path, accumulation_steps))
    error = check_against_reference(model, samples, grads, steps)
    print(f"W=1 GA={accumulation_steps}: max relative gradient error {error:.2e} over {len(grads)} steps")
    assert error <= TOLERANCE


def _micro_batches(samples, sizes):
    """Split samples into consecutive padded micro-batches of the given sizes (0 = IDLE: one all -100 sample)."""
    out, start = [], 0
    for size in sizes:
        group = samples[start : start + size] if size else [{**samples[0], "labels": [-100] * len(samples[0]["labels"])}]
        out.append(PadCollator(pad_token_id=hf_support.PAD)(group))
        start += size
    return out


def test_token_loss_scale_reproduces_the_global_token_mean_under_averaging(chat_data):
    """W=2 ranks x G=3 micro-batches (one IDLE), DDP-style average over ranks and per-micro-batch division by G:
    the summed gradient equals the gradient of the mean CE over all supervised tokens."""
    samples = chat_data.train[:10]
    model = hf_support.tiny_llama(dtype=torch.float64)
    ranks = [_micro_batches(samples[:6], [2, 3, 1]), _micro_batches(samples[6:], [3, 1, 0])]
    window = sum(int((b["labels"][:, 1:] != -100).sum()) for rank in ranks for b in rank)
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank in ranks:
        for batch in rank:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            scale = TokenLossScale(window_tokens=window, world_size=2, micro_batch_divisor=3)
            (scale.apply(causal_lm_loss_sum(logits, batch["labels"])) / 3).backward()
            for n, p in model.named_parameters():
                total[n] += p.grad / 2  # DDP averages the two ranks
    reference = hf_support.reference_gradient(model, samples)
    # Not float64 end to end: LlamaRMSNorm computes in float32 whatever the model dtype, so batch shapes that change
    # the BLAS summation order (micro-batches vs one big batch) move results by ~1e-8 relative on some CPUs.
    assert hf_support.max_relative_error(total, reference) <= TOLERANCE


def test_idle_and_empty_steps_give_zero_loss_not_nan():
    logits = torch.randn(1, 5, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.full((1, 5), -100)
    loss = TokenLossScale(window_tokens=0, world_size=2).apply(causal_lm_loss_sum(logits, labels))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    assert step_normalizer(0) == 1 and step_normalizer(17) == 17
    with pytest.raises(ValueError, match="window_tokens"):
        step_normalizer(-1)
    with pytest.raises(ValueError, match="world_size"):
        TokenLossScale(window_tokens=4, world_size=0)


def test_causal_loss_sum_counts_the_same_tokens_as_the_loader():
    logits = torch.randn(2, 4, 5, dtype=torch.bfloat16)
    labels = torch.tensor([[1, 2, -100, 3], [-100, -100, 4, -100]])
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 5), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100, reduction="sum")
    got = causal_lm_loss_sum(logits, labels)
    assert got.dtype == torch.float32 and torch.allclose(got, expected)
