"""G6 exact loss: `odb_core.steps.loss` on its own, and through the HF Trainer in one process against the float64
big-batch reference (the 2-rank cases are in test_hf_distributed.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hf_support
from odb_core.data.collate import PadCollator
from odb_core.steps.loss import TokenLossScale, causal_lm_loss_sum, step_normalizer
from odb_hf import ODBCallback, ODBSetupError, ODBTrainerMixin, ODBTrainerTraits, causal_lm_loss

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


# -- exact or loud: every loss set-up is exact or refused (docs/guides/hf-trainer.md, the table of cases) --------
class PerSequenceMean(torch.nn.Module):
    """Takes **kwargs (so the Trainer passes num_items_in_batch) but averages its loss per sequence, ignoring it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        if labels is None:
            return {"logits": logits}
        return {"loss": per_sequence_loss_func({"logits": logits}, labels), "logits": logits}


class BatchMeanTrainer(Trainer):
    """A user override that drops num_items_in_batch: the model returns each micro-batch's own token mean."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs)


class PassThroughTrainer(Trainer):
    calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        PassThroughTrainer.calls += 1
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def per_sequence_loss_func(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func that averages per sequence and ignores num_items_in_batch."""
    logits, supervised = outputs["logits"], labels[:, 1:] != -100
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                           reduction="none")
    return ((ce * supervised).sum(1) / supervised.sum(1).clamp(min=1)).mean()


def train_frozen(tmp_path, model, samples, trainer_class=Trainer, arguments=None, **trainer_kwargs):
    """GA = 2, lr = 0: the recorded step gradients (wrapper prefix `inner.` removed) and each step's indices;
    `arguments`: more TrainingArguments."""
    infos, recorder = [], hf_support.GradRecorder()
    trainer = trainer_class(model=model, args=frozen_args(tmp_path, 2, label_names=["labels"], **(arguments or {})),
                            train_dataset=hf_support.ListDataset(samples),
                            data_collator=PadCollator(pad_token_id=hf_support.PAD),
                            callbacks=[ODBCallback(token_budget=320, window=32, observer=infos.append), recorder],
                            **trainer_kwargs)
    trainer.train()
    grads = [{name.removeprefix("inner."): g for name, g in step.items()} for step in recorder.steps]
    records = [{"epoch": i.epoch, "step": i.step, "indices": list(i.indices)} for i in infos]
    return grads, hf_support.steps_of(records, 2)


@pytest.mark.parametrize(("make", "whose"), [
    (lambda inner: (inner, dict(trainer_class=BatchMeanTrainer)), r"BatchMeanTrainer.compute_loss is not divided"),
    (lambda inner: (inner, dict(compute_loss_func=per_sequence_loss_func)), r"compute_loss_func is not divided"),
    (lambda inner: (PerSequenceMean(inner), {}), r"PerSequenceMean's loss is not divided"),
], ids=["override-batch-mean", "loss-func-per-sequence", "model-per-sequence"])
def test_a_loss_that_ignores_num_items_in_batch_is_refused_naming_whose_it_is(chat_data, tmp_path, make, whose):
    model, kwargs = make(hf_support.tiny_llama(dtype=torch.float64))
    with pytest.raises(ODBSetupError, match=whose + r".*the step's gradient would not be the per-token mean; "
                                             r"(divide the summed token loss|return the summed token loss|"
                                             r"set PerSequenceMean.accepts_loss_kwargs = False)"):
        train_frozen(tmp_path, model, chat_data.train[:24], **kwargs)


def divided_by_a_number(outputs, labels, num_items_in_batch=None):
    """The summed token loss divided by N as a Python number: exact, but N is not in the graph."""
    logits = outputs["logits"]
    total = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                              reduction="sum")
    return total / num_items_in_batch.item()


def test_a_loss_divided_by_the_count_as_a_number_is_told_to_divide_by_the_tensor(chat_data, tmp_path):
    """ODB checks the division through N's gradient, which `.item()` cuts: before, the refusal said only that the
    loss was "e.g. a mean per micro-batch", which it is not."""
    with pytest.raises(ODBSetupError, match=r"compute_loss_func is not divided .* If it does divide, but by "
                                            r"num_items_in_batch\.item\(\), float\(\) or int\(\), divide by the "
                                            r"tensor itself"):
        train_frozen(tmp_path, hf_support.tiny_llama(dtype=torch.float64), chat_data.train[:24],
                     compute_loss_func=divided_by_a_number)


COMPILED = {"torch_compile": True, "torch_compile_backend": "aot_eager"}  # no C++ compiler needed on CPU


def test_a_compiled_model_trains_the_token_mean_with_its_first_step_checked_eagerly(chat_data, tmp_path):
    """`torch_compile=True`: the first step's check differentiates the loss through num_items_in_batch with
    `retain_graph`, which a compiled backward refuses ("compiled with non-empty donated buffers"): every ODB run
    failed at its first step (a review's run). The checked micro-batches now run eagerly, the rest compiled."""
    samples, model = chat_data.train[:24], hf_support.tiny_llama(dtype=torch.float64)
    grads, steps = train_frozen(tmp_path, model, samples, arguments=COMPILED)
    assert len(grads) == len(steps) > 1  # steps after the checked one ran compiled
    assert check_against_reference(model, samples, grads, steps) <= TOLERANCE
    with pytest.raises(ODBSetupError, match=r"compute_loss_func is not divided"):  # and the check still tells
        train_frozen(tmp_path, hf_support.tiny_llama(dtype=torch.float64), samples, arguments=COMPILED,
                     compute_loss_func=per_sequence_loss_func)


def test_a_per_sequence_model_declared_without_loss_kwargs_gets_the_exact_token_mean(chat_data, tmp_path):
    """The fix the refusal names: accepts_loss_kwargs = False, then ODB computes the loss from the logits."""
    samples, model = chat_data.train[:24], PerSequenceMean(hf_support.tiny_llama(dtype=torch.float64))
    model.accepts_loss_kwargs = False
    grads, steps = train_frozen(tmp_path, model, samples)
    assert check_against_reference(model.inner, samples, grads, steps) <= TOLERANCE


def test_an_override_that_odb_would_bypass_is_refused_and_causal_lm_loss_keeps_it_exact(chat_data, tmp_path):
    """A model without loss kwargs: ODB's own loss would skip PassThroughTrainer.compute_loss, so it refuses; with
    compute_loss_func=odb_hf.causal_lm_loss the override runs and every step is the exact token mean."""
    samples, model = chat_data.train[:24], hf_support.LogitsOnly(hf_support.tiny_llama(dtype=torch.float64))
    with pytest.raises(ODBSetupError, match=r"PassThroughTrainer.compute_loss is overridden, but LogitsOnly's forward "
                                            r"takes no loss kwargs.*compute_loss_func=odb_hf.causal_lm_loss"):
        train_frozen(tmp_path, model, samples, PassThroughTrainer)
    PassThroughTrainer.calls = 0
    grads, steps = train_frozen(tmp_path, model, samples, PassThroughTrainer, compute_loss_func=causal_lm_loss)
    assert PassThroughTrainer.calls == 2 * len(steps)
    assert check_against_reference(model.inner, samples, grads, steps) <= TOLERANCE


def test_a_compute_loss_declared_bypassed_is_skipped_and_the_loss_stays_exact(chat_data, tmp_path):
    """`ODBTrainerTraits(bypassed_compute_loss=...)` (odb_llamafactory's VLM path): for a model without loss kwargs
    ODB computes the exact loss from the logits and the declared override does not run."""

    class Declared(ODBTrainerMixin, PassThroughTrainer):
        odb_traits = ODBTrainerTraits(owns_data=True, bypassed_compute_loss=(PassThroughTrainer,))

    samples, model = chat_data.train[:24], hf_support.LogitsOnly(hf_support.tiny_llama(dtype=torch.float64))
    PassThroughTrainer.calls = 0
    grads, steps = train_frozen(tmp_path, model, samples, Declared)
    assert PassThroughTrainer.calls == 0
    assert check_against_reference(model.inner, samples, grads, steps) <= TOLERANCE


def test_a_compute_loss_above_the_mixin_is_refused_when_the_trainer_is_built(chat_data, tmp_path):
    class Above(ODBTrainerMixin, Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(ODBSetupError, match=r"Above.compute_loss is defined above ODBTrainerMixin"):
        train_frozen(tmp_path, hf_support.tiny_llama(), chat_data.train[:8], Above)


def test_the_shared_loss_reads_logits_from_every_output_form_and_divides_by_the_given_tokens():
    """odb_core.steps.loss.logits_of / causal_lm_loss (odb_hf.causal_lm_loss; odb_deepspeed.token_weighted_loss reads
    logits the same way): a tensor, a mapping, an output object, a return_dict=False tuple."""
    from types import SimpleNamespace

    from odb_core.steps.loss import logits_of

    logits, labels = torch.randn(2, 5, 7, dtype=torch.float64), torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 1, 2]])
    for output in (logits, {"logits": logits}, SimpleNamespace(logits=logits), (logits,)):
        assert logits_of(output) is logits
    total, tokens = causal_lm_loss_sum(logits, labels), int((labels[:, 1:] != -100).sum())
    assert torch.equal(causal_lm_loss({"logits": logits}, labels, torch.tensor(10.0)), total / 10.0)
    assert torch.allclose(causal_lm_loss((logits,), labels), total / tokens)
    with pytest.raises(TypeError, match="expected logits or a model output with .logits, got list"):
        logits_of([logits])
