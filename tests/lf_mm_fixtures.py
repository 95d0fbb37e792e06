"""Offline LLaMA-Factory multimodal fixtures, and the run recorder that also checks what reached the vision model.

Built in the main test environment (transformers, tokenizers, chitchat_dataset; benchmarks/data/mm_mix.py):
  * `build_model`: a tiny random Qwen2-VL (`mm_mix.tiny_qwen2_vl`) with a BPE vocabulary trained on real chitchat
    text and Qwen2-VL's vision special tokens, transformers' PIL image processor `Qwen2VLImageProcessorPil` (4..256
    visual tokens per image), and `Qwen2VLImageOnlyProcessor` as the folder's processor (NOTE below);
  * `build_dataset`: a sharegpt dataset (`dataset_info.json`) of real conversations over generated PNG images of
    varied resolutions (thumbnails, photos, text pages, receipts, charts), one or two `<image>`s per sample.

NOTE [ A processor without torchvision ]
LLaMA-Factory loads `AutoProcessor.from_pretrained(model_name_or_path)`. For a Qwen2-VL folder that is
transformers' `Qwen2VLProcessor`, whose third part, `Qwen2VLVideoProcessor` (like every video processor built on
`BaseVideoProcessor`), requires torchvision, which .venv-lf cannot have (odb_llamafactory/env/README.md). The load
then fails with ImportError, LLaMA-Factory logs "Failed to load processor" and preprocessing an image sample fails
with "Processor was not found" (docs/guides/llamafactory.md, Multimodal).
The folder therefore ships a processor class of its own, through transformers' public custom-code mechanism
(`auto_map` in processor_config.json, loaded with `trust_remote_code: true`): `Qwen2VLProcessor` minus the video
processor. LLaMA-Factory's Qwen2VLPlugin uses only its image processor and tokenizer for images. Nothing in
LLaMA-Factory or transformers is patched; an environment with torchvision needs none of this.

Run in .venv-lf (`python tests/lf_mm_fixtures.py CONFIG.yaml RECORD_DIR [key=value ...]`, or under torchrun: one
record per rank): tests/lf_train.py's record (RECORD_DIR/rank{r}.json), where each `micro` entry also says whether
the forward's rows were the observed micro-batch's samples and what vision inputs the model received
(`VisionRecorder`). With `deepspeed:` in the config, DeepSpeed's CPU shared-memory comm op is not built (NOTE
[ DeepSpeed's shm op in the tests ]).

NOTE [ DeepSpeed's shm op in the tests ]
On a CPU machine DeepSpeed 0.19.8 compiles a C++ op, `deepspeed_shm_comm`, in every process that initializes its
communication (`deepspeed.comm.torch.build_shm_op`): measured on 2 busy cores, 60 s in one process and 109 s in a
2-rank run the first time, 0.04 s from its cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) after.
The op only serves DeepSpeed's inference all-reduce; ZeRO training uses torch.distributed's gloo collectives
without it. A compile that is killed (a test timeout) leaves a lock in the cache that hangs every later run, so
the tests do not build it: `deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False`, as tests/ds_worker.py
and tests/hf_ds_worker.py do, and each run gets its own TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from odb_llamafactory.launcher import read_config, train

from lf_train import Recorder

PROCESSOR_MODULE = '''"""Qwen2VLProcessor without its video processor (video processors need torchvision)."""

from transformers import Qwen2VLProcessor


class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)
'''
PROCESSOR_CONFIG = {"processor_class": "Qwen2VLImageOnlyProcessor",
                    "auto_map": {"AutoProcessor": "processing_image_only.Qwen2VLImageOnlyProcessor"}}
KINDS = ("thumb", "photo", "page", "receipt", "thumb", "chart", "photo")  # mm_mix.RESOLUTIONS kinds, cycled


def build_model(folder: Path) -> None:
    """Tokenizer, image processor, image-only processor (NOTE above) and a tiny random Qwen2-VL in `folder`."""
    from benchmarks.data import mm_mix  # here, not at the top: the recorder side runs in .venv-lf

    processor = mm_mix.build_processor(folder)
    mm_mix.tiny_qwen2_vl(processor.tokenizer).save_pretrained(folder)
    (folder / "processing_image_only.py").write_text(PROCESSOR_MODULE)
    (folder / "processor_config.json").write_text(json.dumps(PROCESSOR_CONFIG, indent=1))


def build_dataset(folder: Path, n: int = 40, seed: int = 0) -> int:
    """`mm_chitchat` (sharegpt, `images` column) with `n` samples in `folder`, every 4th without an image; returns
    the number of images."""
    import numpy as np

    from benchmarks.data import mm_mix

    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    records, n_images = [], 0
    for k, turns in enumerate(mm_mix.chitchat_turns(n)):
        question, answer = turns[0][:200], turns[1][:300]
        kinds = KINDS[k % len(KINDS):][:2] if k % 5 == 2 else KINDS[k % len(KINDS):][:1]  # every 5th: two images
        if k % 4 == 3:  # every 4th: text only (the collator adds its fake image to a micro-batch of such samples)
            kinds = ()
        paths = []
        for j, kind in enumerate(kinds):
            path = folder / "images" / f"{k}-{j}.png"
            mm_mix.make_image(rng, kind, answer).save(path)
            paths.append(str(path))
        n_images += len(paths)
        records.append({"messages": [{"role": "user", "content": "<image>" * len(paths) + question},
                                     {"role": "assistant", "content": answer}], "images": paths})
    (folder / "mm_chitchat.json").write_text(json.dumps(records))
    info = {"mm_chitchat": {"file_name": "mm_chitchat.json", "formatting": "sharegpt",
                            "columns": {"messages": "messages", "images": "images"},
                            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                     "assistant_tag": "assistant"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return n_images


def build_all(root: Path, n: int = 40) -> dict:
    model, data = root / "tiny-qwen2-vl", root / "data"
    build_model(model)
    return {"model": model, "data": data, "n_images": build_dataset(data, n)}


# -- recorder (runs in .venv-lf) --------------------------------------------------------------------------------
def vision_facts(module, kwargs) -> dict:
    """What one training forward received: images, `pixel_values` rows, grid patches, `<|image_pad|>` tokens and
    the size of its padded `input_ids`."""
    grid, pixels = kwargs.get("image_grid_thw"), kwargs.get("pixel_values")
    return {"images": 0 if grid is None else int(grid.shape[0]),
            "grid_patches": 0 if grid is None else int(grid.prod(dim=-1).sum()),
            "pixel_rows": 0 if pixels is None else int(pixels.shape[0]),
            "image_tokens": int((kwargs["input_ids"] == module.config.image_token_id).sum()),
            "input_slots": int(kwargs["input_ids"].numel()),  # the padded input tensor the forward received
            "merge": module.config.vision_config.spatial_merge_size}


class VisionRecorder(Recorder):
    """tests/lf_train.py's record, for a model that is called without labels.

    Qwen2-VL declares `accepts_loss_kwargs = False`, so ODB's trainer calls it without `labels` and computes the
    loss itself. Each training forward is therefore matched to the k-th micro-batch the observer saw: its rows
    must be that micro-batch's samples from LLaMA-Factory's dataset (`rows_match`), whose stored labels give the
    independent float64 cross-entropy sum and supervised-token count. An IDLE micro-batch (a rank that ran out of
    data under join) is one zero-weight dummy row: it runs the forward and counts 0 tokens and 0 loss. `idle`,
    `text_only` (no row holds an image: the collator added its fake one) and `vision_facts` are added to each
    entry.
    """

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, train_dataloader=train_dataloader, **kwargs)
        self.dataset = train_dataloader.dataset

    def _forward(self, module, args, kwargs, output) -> None:
        if not module.training:
            return
        step = self.steps[len(self.micro)]
        samples = [self.dataset[i] for i in step["indices"]]
        input_ids = kwargs["input_ids"]
        if step["is_idle"]:
            self.micro.append({"ce_sum": 0.0, "tokens": 0, "rows_match": input_ids.shape[0] == 1, "idle": True,
                               "text_only": None, **vision_facts(module, kwargs)})
            return
        labels = torch.full_like(input_ids, -100)
        rows_match = input_ids.shape[0] == len(samples)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            rows_match = rows_match and input_ids[row, :n].tolist() == list(sample["input_ids"])
            labels[row, :n] = torch.tensor(sample["labels"])
        logits, labels = output.logits.detach().double(), labels[:, 1:]
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=-100, reduction="sum")
        self.micro.append({"ce_sum": float(ce), "tokens": int((labels != -100).sum()), "rows_match": rows_match,
                           "idle": False, "text_only": not any(sample.get("images") for sample in samples),
                           **vision_facts(module, kwargs)})


def main() -> None:
    config = read_config(sys.argv[1:2] + sys.argv[3:])
    if config.get("deepspeed"):  # NOTE [ DeepSpeed's shm op in the tests ]
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    recorder = VisionRecorder(Path(sys.argv[2]))
    train(config, callbacks=[recorder], observer=recorder.observe)


if __name__ == "__main__":
    main()
