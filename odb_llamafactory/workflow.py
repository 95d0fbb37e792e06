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

    def get_train_dataloader(self) -> Any:
        length_fn = self.odb.settings.extras.get("length_fn") if self.odb is not None else None
        if isinstance(length_fn, CollatorLength):  # before the loader's workers take a copy of it
            length_fn.count_fakes(self.data_collator)
        return super().get_train_dataloader()


class CollatorLength:
    """Cost length of a sample as LLaMA-Factory's collator builds its row (module-level: picklable): `len(input_ids)`,
    plus the tokens of the fake image (and audio) the collator may add to a micro-batch without one
    (NOTE [ The collator's fake image ]), rounded up to `pad_multiple` (`PAD_MULTIPLE` for the `padded` and
    `attention` costs, so that the budget bounds the tensors actually built; 1 for `tokens`). It reads only the ids'
    length and whether the sample holds images, videos or audios, so the window may hold the ids as arrays
    (NOTE [ Compact buffered samples ])."""

    takes_id_arrays = True

    def __init__(self, pad_multiple: int) -> None:
        self.pad_multiple = pad_multiple
        self.fake_image_tokens = self.fake_audio_tokens = 0  # set by `count_fakes` before the loader starts

    def count_fakes(self, collator: Any) -> None:
        """NOTE [ The collator's fake image ]
        LLaMA-Factory's multimodal collator (0.9.5, `MultiModalDataCollatorForSeq2Seq`), under a template whose
        plugin has an image token, appends a fake image's tokens (a white 64 x 64 image: 6 tokens with Qwen2-VL's
        processor) to the first row of a micro-batch that holds no image and no video, so that the vision tower
        runs on every rank (ZeRO-3 and FSDP hang otherwise); likewise a fake audio where no row holds one. The batch
        is then padded to that row: ODB's groups of text-only samples, sized to the budget, came out a few tokens
        per row over it. So each sample without an image and a video is costed with the fake image's tokens (and
        without an audio, the fake audio's): a micro-batch of such samples stays within the budget whichever row
        gets them, and one that holds an image pays a few tokens per text row that it does not use. The counts
        come from the collator's own template, processor and tokenizer, the steps it takes to build the fake;
        a template without multimodal tokens counts 0 (text-only runs are costed as before)."""
        plugin = getattr(getattr(collator, "template", None), "mm_plugin", None)
        if plugin is None:
            return
        from PIL import Image  # here: only a multimodal template gets this far
        from llamafactory.extras.constants import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER

        tokenizer, processor = collator.tokenizer, collator.processor

        def fake_tokens(placeholder: str, images: list, audios: list) -> int:
            messages = plugin.process_messages([{"role": "user", "content": placeholder}], images, [], audios,
                                               processor)
            ids = tokenizer.encode(messages[0]["content"], add_special_tokens=False)
            ids, _ = plugin.process_token_ids(ids, None, images, [], audios, tokenizer, processor)
            return len(ids)

        if plugin.image_token is not None:
            self.fake_image_tokens = fake_tokens(IMAGE_PLACEHOLDER, [Image.new("RGB", (64, 64), (255, 255, 255))], [])
        if getattr(plugin, "audio_token", None) is not None:
            import numpy as np

            self.fake_audio_tokens = fake_tokens(AUDIO_PLACEHOLDER, [], [np.zeros(1600)])

    def __call__(self, sample: Mapping[str, Any]) -> int:
        length = len(sample["input_ids"])
        if self.fake_image_tokens and not sample.get("images") and not sample.get("videos"):
            length += self.fake_image_tokens
        if self.fake_audio_tokens and not sample.get("audios"):
            length += self.fake_audio_tokens
        return math.ceil(length / self.pad_multiple) * self.pad_multiple


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
    length_fn = CollatorLength(PAD_MULTIPLE if settings.config.cost != "tokens" else 1)
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
