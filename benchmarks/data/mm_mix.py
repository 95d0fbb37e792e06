"""An offline vision-language fine-tuning pipeline shaped like the paper's MM-Mix (OCR, VQA, captions).

Everything is built locally, so it runs with no hub access:
  * a byte-level BPE tokenizer trained on real ChitChat text (`chitchat-dataset`), with Qwen2-VL's vision special
    tokens and a Qwen-style chat template (`build_processor`);
  * transformers' PIL image processor `Qwen2VLImageProcessorPil` (no torchvision), which turns each image into
    patch rows and a (t, h, w) grid; `VisionTextProcessor` then expands every `<|image_pad|>` into h*w/4 tokens;
  * a tiny `Qwen2VLForConditionalGeneration` built from a config (`tiny_qwen2_vl`);
  * generated images of varied, realistic resolutions: OCR pages with the answer's real text drawn on them,
    photo-like gradients with shapes, tall receipts and wide charts (`make_image`).

`MMMixDataset.__getitem__` is the processing a VLM input pipeline runs in DataLoader workers: chat template, image
processing and image-token expansion, truncation-free labels that supervise the assistant turns only. The
sample's true cost (text + visual tokens, and vision patches) is known only after it, which is ODB's point.

The mix (`mm_mix_specs`): about 80% short samples (a caption or a one-line VQA answer on a small image), 12% OCR
pages (a medium image, the answer is the page's text) and 8% long tail (two to four images or a long multi-turn
conversation over a large image).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.data import chat_data

IGNORE_INDEX = -100
VOCAB = 1024
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 256 * 28 * 28  # 4..256 visual tokens per image
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chitchat_turns(limit: int = 3000) -> list[list[str]]:
    """Real conversations (ChitChat, MIT) with at least two turns, as lists of turn texts."""
    return chat_data.turn_texts(2, limit)


def build_tokenizer(folder: Path):
    """A 1024-entry byte-level BPE trained on ChitChat, with the vision specials and the chat template, saved to
    `folder` (a `from_pretrained` path) and returned as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator((t for c in chitchat_turns(1500) for t in c), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=CHAT_TEMPLATE,
                                        extra_special_tokens={"image_token": "<|image_pad|>",
                                                              "video_token": "<|video_pad|>"})
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


@dataclass
class VisionTextProcessor:
    """Tokenizer + `Qwen2VLImageProcessorPil`, expanding each `<|image_pad|>` into its h*w/merge^2 visual tokens.

    This is what `Qwen2VLProcessor` does; that class also insists on a video processor, which needs torchvision
    (a CUDA build on PyPI that does not load beside CPU torch here), so the expansion is written out.
    """

    tokenizer: object
    images: object

    @classmethod
    def load(cls, folder: str | Path) -> "VisionTextProcessor":
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        return cls(AutoTokenizer.from_pretrained(str(folder)), Qwen2VLImageProcessorPil.from_pretrained(str(folder)))

    def __call__(self, text: str, images: list) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        out: dict[str, torch.Tensor] = {}
        if images:
            pixels = self.images(images=images, return_tensors="pt")
            grids = pixels["image_grid_thw"]
            pieces = text.split("<|image_pad|>")
            assert len(pieces) == len(images) + 1, "one <|image_pad|> per image"
            merged = [pieces[0]]
            for grid, piece in zip(grids, pieces[1:]):
                merged.append("<|image_pad|>" * int(grid.prod() // MERGE**2) + piece)
            text = "".join(merged)
            out = {"pixel_values": pixels["pixel_values"], "image_grid_thw": grids}
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        mm_types = (ids == tok.convert_tokens_to_ids("<|image_pad|>")).long()
        return {"input_ids": ids, "mm_token_type_ids": mm_types, **out}


def build_processor(folder: Path) -> VisionTextProcessor:
    """Tokenizer and `Qwen2VLImageProcessorPil` (4..256 visual tokens per image), saved to `folder`."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tokenizer(folder)
    images = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                      merge_size=MERGE)
    images.save_pretrained(str(folder))
    return VisionTextProcessor(tokenizer, images)


def tiny_qwen2_vl(tokenizer, seed: int = 0, hidden: int = 64, dtype: torch.dtype = torch.float32):
    """A 2-layer Qwen2-VL (hidden 64, vision depth 1) from a config, with the tokenizer's special-token ids."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default",
                     "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}, "pad_token_id": ids("<|endoftext|>"),
                     "eos_token_id": ids("<|im_end|>")},
        vision_config={"depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "hidden_size": hidden,
                       "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).to(dtype)


# -- images ---------------------------------------------------------------------------------------------------
RESOLUTIONS = {  # (width, height) choices per kind, from thumbnails to scanned pages
    "thumb": [(96, 96), (128, 96), (160, 120), (112, 160), (200, 150)],
    "photo": [(320, 240), (400, 300), (480, 360), (360, 480)],
    "page": [(420, 594), (595, 842), (612, 792)],
    "receipt": [(220, 700), (260, 900)],
    "chart": [(800, 300), (960, 400)],
}


def make_image(rng: np.random.Generator, kind: str, text: str = ""):
    """A generated RGB image of a realistic size for `kind`; pages and receipts carry `text` drawn in black."""
    from PIL import Image, ImageDraw

    width, height = RESOLUTIONS[kind][int(rng.integers(len(RESOLUTIONS[kind])))]
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    ramp = np.linspace(0.0, 1.0, height)[:, None, None]
    pixels = (top * (1 - ramp) + bottom * ramp).repeat(width, axis=1).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    if kind in ("page", "receipt"):
        draw.rectangle((8, 8, width - 8, height - 8), fill=(250, 250, 245))
        chars = max((width - 24) // 6, 8)
        lines = [text[k: k + chars] for k in range(0, len(text), chars)]
        for row, line in enumerate(lines[: (height - 24) // 12]):
            draw.text((12, 12 + 12 * row), line, fill=(0, 0, 0))
    else:
        for _ in range(int(rng.integers(2, 6))):
            x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
            box = (x0, y0, x0 + int(rng.integers(8, width // 2 + 9)), y0 + int(rng.integers(8, height // 2 + 9)))
            draw.ellipse(box, fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return image


# -- samples --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One conversation of the mix: which real turns to use and which images to generate."""

    kind: str  # caption | vqa | ocr | multi_image | long_chat
    conversation: int  # index into the ChitChat turn lists
    images: tuple[str, ...]  # image kinds, one per image
    turns: int  # conversation turns used (user/assistant alternating)
    seed: int


def mm_mix_specs(n: int, seed: int = 0, n_conversations: int = 3000) -> list[SampleSpec]:
    """`n` specs of an MM-Mix-like workload: many short samples, a tail of long multi-image or long-text ones."""
    rng = np.random.default_rng(seed)
    specs = []
    for k in range(n):
        draw, conv = rng.random(), int(rng.integers(n_conversations))
        if draw < 0.45:
            spec = SampleSpec("caption", conv, ("thumb",), 2, k)
        elif draw < 0.80:
            spec = SampleSpec("vqa", conv, (str(rng.choice(["thumb", "photo"])),), 2, k)
        elif draw < 0.92:
            spec = SampleSpec("ocr", conv, (str(rng.choice(["page", "receipt"])),), 2, k)
        elif draw < 0.96:
            kinds = tuple(str(x) for x in rng.choice(["photo", "chart", "thumb"], int(rng.integers(2, 5))))
            spec = SampleSpec("multi_image", conv, kinds, 2, k)
        else:
            spec = SampleSpec("long_chat", conv, ("page",), int(rng.integers(8, 20)), k)
        specs.append(spec)
    return specs


def _messages(spec: SampleSpec, turns: list[str], rng: np.random.Generator) -> tuple[list[dict], list]:
    """Chat messages and their images for one spec (the images come first in the first user turn)."""
    first = turns[0]
    answer = turns[1] if len(turns) > 1 else turns[0]
    if spec.kind == "caption":
        first, answer = "Describe the image.", answer[:120]
    elif spec.kind == "ocr":
        first = "Read the text on this page."
    images = [make_image(rng, kind, answer) for kind in spec.images]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": first}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    for k, text in enumerate(turns[2: spec.turns], start=2):
        messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": text})
    if messages[-1]["role"] == "user":
        messages.pop()
    return messages, images


def assistant_labels(input_ids: list[int], start_id: int, header: list[int], end_id: int) -> list[int]:
    """Labels that supervise each assistant reply (after `<|im_start|>assistant\\n`, up to `<|im_end|>`)."""
    labels = [IGNORE_INDEX] * len(input_ids)
    k = 0
    while k < len(input_ids):
        if input_ids[k] == start_id and input_ids[k + 1: k + 1 + len(header)] == header:
            k += 1 + len(header)
            while k < len(input_ids):
                labels[k] = input_ids[k]
                if input_ids[k] == end_id:
                    break
                k += 1
        k += 1
    return labels


class MMMixDataset(torch.utils.data.Dataset):
    """Processed VLM samples: `input_ids` (image tokens expanded), `labels`, `mm_token_type_ids`, `pixel_values`
    (patch rows x 1176) and `image_grid_thw` (images x 3), all computed in `__getitem__` (in the workers)."""

    def __init__(self, processor_folder: str | Path, specs: list[SampleSpec]) -> None:
        self.folder, self.specs = str(processor_folder), specs
        self._processor = None
        self._turns: list[list[str]] | None = None

    def __len__(self) -> int:
        return len(self.specs)

    def _load(self) -> None:  # lazily, once per worker process
        self._processor = VisionTextProcessor.load(self.folder)
        self._turns = chitchat_turns()
        tok = self._processor.tokenizer
        self._start, self._end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
        self._header = tok("assistant\n", add_special_tokens=False)["input_ids"]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._processor is None:
            self._load()
        spec = self.specs[index]
        messages, images = _messages(spec, self._turns[spec.conversation % len(self._turns)],
                                     np.random.default_rng(spec.seed))
        text = self._processor.tokenizer.apply_chat_template(messages, tokenize=False)
        out = self._processor(text, images)
        labels = assistant_labels(out["input_ids"].tolist(), self._start, self._header, self._end)
        return {"input_ids": out["input_ids"], "labels": torch.tensor(labels),
                "mm_token_type_ids": out["mm_token_type_ids"], "pixel_values": out["pixel_values"],
                "image_grid_thw": out["image_grid_thw"]}

