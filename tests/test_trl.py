"""TRL's SFTTrainer with ODBCallback: the example of docs/guides/trl.md, run as it is written there, is exact; packing
is refused. A tiny random Llama, a BPE tokenizer with a chat template and prompt-completion conversations of real
chitchat text (tests/lf_fixtures.py), float64, one process."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import lf_fixtures
from odb_core.steps.loss import causal_lm_loss_sum

if os.environ.get("MAKELEVEL") or os.environ.get("CI"):
    import trl  # noqa: F401  (requirements.txt pins it: make test must run these tests)
else:
    pytest.importorskip("trl", reason="trl is not installed: `make test` installs requirements.txt, which pins it")

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "trl.md"
BUDGET, G = 512, 2


def guide_example() -> dict:
    """The ```python block of the guide, executed: its names (train_sft)."""
    block = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(block, str(GUIDE), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("trl-tokenizer")
    lf_fixtures.build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pairs = lf_fixtures.conversations(60)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": c[0]}],
                                  "completion": [{"role": "assistant", "content": c[1]}]} for c in pairs])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).to(torch.float64), tokenizer, dataset


def test_the_guides_sft_example_logs_the_exact_token_mean_of_every_step(sft_setup, tmp_path):
    """lr = 0: the model stays as it is, so each step's logged loss can be recomputed from the step's micro-batches
    (the same ODB loader replays the epoch: G7) in float64, independently of TRL's fused loss."""
    model, tokenizer, dataset = sft_setup
    trainer = guide_example()["train_sft"](model, tokenizer, dataset, str(tmp_path), token_budget=BUDGET,
                                           learning_rate=0.0, logging_steps=1, num_train_epochs=1, use_cpu=True,
                                           report_to=[], save_strategy="no", disable_tqdm=True)
    assert type(trainer).__name__ == "ODBSFTTrainer"
    loader = trainer.odb.run.loader
    loader.set_epoch(0)
    micro = []
    with torch.no_grad():
        for batch in loader:
            labels = batch["labels"]
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            micro.append((float(causal_lm_loss_sum(logits.double(), labels)), int((labels[:, 1:] != -100).sum())))
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(micro) == G * len(logged) == G * trainer.state.global_step > G
    gap = 0.0
    for k, loss in enumerate(logged):
        window = micro[G * k:G * k + G]
        exact = sum(ce for ce, _ in window) / sum(n for _, n in window)
        assert loss == pytest.approx(exact, rel=1e-5), k  # TRL computes log-probs in float32
        gap = max(gap, abs(sum(ce / max(n, 1) for ce, n in window) / G - exact))
    assert gap > 1e-3, "the data should tell the token mean from a mean of micro-batch means"


def test_samples_over_the_budget_are_warned_once_and_fitting_samples_not_at_all(sft_setup, tmp_path, odb_log):
    """The guide's example with a budget below its longest sample: one warning naming the budget, the longest
    sample and the fix (before: none); with the guide's budget nothing is warned (the first test ran it)."""
    model, tokenizer, dataset = sft_setup
    options = dict(learning_rate=0.0, max_steps=2, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    fits = guide_example()["train_sft"](model, tokenizer, dataset, str(tmp_path / "fits"), token_budget=BUDGET,
                                        **options)
    longest = max(len(ids) for ids in fits.train_dataset["input_ids"])
    assert longest <= BUDGET and odb_log.over_budget() == []
    budget = longest // 2
    guide_example()["train_sft"](model, tokenizer, dataset, str(tmp_path / "over"), token_budget=budget, **options)
    warned = odb_log.over_budget()
    assert len(warned) == 1, warned
    assert re.search(rf"token_budget={budget} on (its|their) own \(the longest has {longest} tokens\)", warned[0])
    assert f"Raise token_budget to at least {longest}" in warned[0]


def test_packing_is_refused_with_the_alternatives(sft_setup, tmp_path):
    from trl import SFTConfig, SFTTrainer

    from odb_hf import ODBCallback, ODBSetupError

    model, tokenizer, dataset = sft_setup
    args = SFTConfig(output_dir=str(tmp_path), packing=True, max_length=128, use_cpu=True, report_to=[])
    with pytest.raises(ODBSetupError, match=r"SFTConfig\(packing=True\).*ODB would only batch equal rows.*"
                                            r"set packing=False and let ODB batch the samples.*padding_free=True"):
        SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                   callbacks=[ODBCallback(token_budget=BUDGET)])
