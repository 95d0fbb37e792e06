"""LLaMA-Factory's SFT run (`llamafactory.train.tuner.run_exp`) with odb_hf's ODB trainer, in this process.

NOTE [ Which trainer LLaMA-Factory builds ]
`llamafactory/train/sft/workflow.py::run_sft` builds `CustomSeq2SeqTrainer` by its module-global name, with the
template's collator and the tokenized dataset. `ODBSeq2SeqTrainer` below is that class with odb_hf's
`ODBTrainerMixin` first in its MRO; for the duration of one `run_exp` call the workflow module's global name
points to it (restored afterwards, also on error). The `ODBCallback` passed in the callbacks, built by
`ODBCallback.from_settings` from the validated `odb_*` keys (their `ODBConfig` is the one the loader gets), then
attaches as in any Trainer (odb_hf NOTE [ Attaching ODB to a Trainer ]): ODB owns the training dataloader, and the
loss is normalised by the step's supervised tokens over all ranks and accumulation micro-batches (odb_hf NOTE
[ Exact loss under the HF Trainer ]). `callback.attached` tells whether it took effect.
CustomSeq2SeqTrainer overrides `_get_train_sampler` only for `disable_shuffling`, which ODB honours itself
(`train_sampling_strategy: sequential`, set by the launcher), so `ODBSeq2SeqTrainer` declares that ODB owns it, in
its one declaration to ODB, `odb_traits = ODBTrainerTraits(owns_data=True, ...)`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import llamafactory.train.sft.workflow as sft_workflow
from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
from llamafactory.train.tuner import run_exp
from transformers import TrainerCallback

from odb_core.settings.settings import ODBSettings
from odb_hf import ODBCallback, ODBTrainerMixin, ODBTrainerTraits

PAD_MULTIPLE = 8  # run_sft builds its collator with pad_to_multiple_of=8 when training


class ODBSeq2SeqTrainer(ODBTrainerMixin, CustomSeq2SeqTrainer):
    """LLaMA-Factory's SFT trainer with ODB batches and exact token-weighted loss (needs an `ODBCallback`)."""

    # owns_data: this class's _get_train_sampler override is ODB's own (odb_hf.checks). bypassed_compute_loss:
    # LLaMA-Factory sets model_accepts_loss_kwargs = False for models with a processor (VLMs); ODB then computes the
    # loss itself, skipping CustomSeq2SeqTrainer.compute_loss, which only adds use_asft_loss (refused with odb: true).
    # adapter: the start line says "odb: on (LLaMA-Factory), token budget ...".
    odb_traits = ODBTrainerTraits(owns_data=True, bypassed_compute_loss=(CustomSeq2SeqTrainer,),
                                  adapter="LLaMA-Factory")

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("ODB shards and orders the training data itself; no training sampler is used")


class CollatorPaddedLength:
    """Cost length of a sample as LLaMA-Factory's collator pads it: `len(input_ids)` rounded up to a multiple of
    `PAD_MULTIPLE`, so that a `padded` budget bounds the tensors actually built (module-level: picklable). It reads
    only the ids' length, so the window may hold them as arrays (NOTE [ Compact buffered samples ])."""

    takes_id_arrays = True

    def __call__(self, sample: Mapping[str, Any]) -> int:
        return math.ceil(len(sample["input_ids"]) / PAD_MULTIPLE) * PAD_MULTIPLE


@contextlib.contextmanager
def odb_sft_trainer() -> Iterator[None]:
    """Make `run_sft` build `ODBSeq2SeqTrainer` inside the block (see the NOTE above)."""
    if sft_workflow.CustomSeq2SeqTrainer is not CustomSeq2SeqTrainer:
        raise RuntimeError(f"llamafactory.train.sft.workflow.CustomSeq2SeqTrainer is already replaced by "
                           f"{sft_workflow.CustomSeq2SeqTrainer!r}; ODB cannot wrap another patch")
    sft_workflow.CustomSeq2SeqTrainer = ODBSeq2SeqTrainer
    try:
        yield
    finally:
        sft_workflow.CustomSeq2SeqTrainer = CustomSeq2SeqTrainer


def build_callback(settings: ODBSettings, observer: Any = None) -> ODBCallback:
    """The `ODBCallback` for validated, enabled settings; `observer` receives every yielded `StepInfo`."""
    length_fn = CollatorPaddedLength() if settings.config.cost != "tokens" else None
    return ODBCallback.from_settings(settings, **settings.extras, length_fn=length_fn, observer=observer)


def run(config: dict[str, Any], settings: ODBSettings | None, callbacks: Sequence[TrainerCallback] = (),
        observer: Any = None) -> None:
    """`run_exp(config)` with ODB when `settings.enabled` (config holds no odb keys any more)."""
    if settings is None or not settings.enabled:
        run_exp(args=config, callbacks=list(callbacks))
        return
    callback = build_callback(settings, observer)
    with odb_sft_trainer():
        run_exp(args=config, callbacks=[*callbacks, callback])
    if not callback.attached:  # run_sft always builds the trainer, training or not
        raise RuntimeError("odb: true had no effect: LLaMA-Factory ran without building its SFT Trainer")
