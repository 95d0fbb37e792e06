"""The vision fields of a group, as `PadCollator` batches them for HF vision-language models.

NOTE [ Vision fields in a batch ]
HF's VLMs (Qwen2-VL and Qwen2.5-VL, LLaVA, LLaVA-NeXT) take a batch's images and videos as one run along dim 0,
in sample order, and assign them to the image or video tokens in that order; so `PadCollator` concatenates these
fields (`CONCATENATED`) over the samples that have them, and a group may mix text-only samples and samples with
images. What each part goes through first (`vision_part`):
  * a list of per-image tensors or arrays (a processor's output kept per image) is one part, concatenated;
  * an empty part (an empty cell that HF `datasets` reads as float32 `[]`, the text row of a mixed table) is left
    out: before, `torch.cat` promoted the other samples' int64 grids to float32 (and bfloat16 pixels to float32),
    and the model failed on the grid;
  * a grid (`image_grid_thw`, `video_grid_thw`) is read as int64 (t, h, w) rows, a flat triple too.
LLaVA-NeXT's `pixel_values` of (images, crops, 3, H, W) with different crop counts are padded with zeros to the
most crops (the model unpads by `image_sizes`). Qwen2-VL's multi-axis rope positions, `position_ids` of (3, L)
per sample (`get_rope_index`'s slice), are right-padded along L and batched as (3, B, L), the model's layout
(`mrope_positions`); before, they were padded along their first axis and stacked as (B, 3, L), which failed for
rows of different lengths and, for three equal ones, trained on wrong positions without an error. Families whose
images are batched per sample (Idefics3 and SmolVLM: (B, images, 3, H, W) with `pixel_attention_mask`) are not
covered: give them their processor's own collator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from odb_core.data.sample import sequence_length

GRIDS = ("image_grid_thw", "video_grid_thw")
CONCATENATED = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "image_sizes",
                "second_per_grid_ts")


def vision_part(key: str, value: Any) -> torch.Tensor:
    """One sample's `key` as the tensor its batch concatenates (see the NOTE above). A list of per-image arrays is
    stacked where each is one image or one row (LLaVA's (3, H, W), an `image_sizes` pair) and concatenated where
    each already has a leading axis of its own (Qwen2-VL's patch rows, LLaVA-NeXT's crops)."""
    if isinstance(value, list | tuple) and value and all(getattr(v, "shape", None) is not None for v in value):
        parts = [torch.as_tensor(v) for v in value]
        part = torch.stack(parts) if all(p.ndim in (0, 1, 3) for p in parts) else torch.cat(parts)
    else:
        part = torch.as_tensor(value)
    if key in GRIDS:
        part = part.reshape(-1, 3) if part.numel() % 3 == 0 else part
        return part.long() if part.is_floating_point() else part
    return part


def vision_parts(key: str, values: Sequence[Any]) -> list[torch.Tensor]:
    """The non-empty parts of one field over a group (one empty part where every sample's is empty), with
    LLaVA-NeXT's crops padded to the group's most."""
    parts = [vision_part(key, v) for v in values]
    kept = [p for p in parts if p.numel()] or parts[:1]
    if key == "pixel_values" and len(kept) > 1 and all(p.ndim == 5 for p in kept):
        crops = max(p.shape[1] for p in kept)
        kept = [p if p.shape[1] == crops else torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, crops - p.shape[1]))
                for p in kept]
    return kept


def rope_rows(values: Sequence[Any], ids: Sequence[Any]) -> bool:
    """Whether per-sample `position_ids` are multi-axis rope rows: (axes, L) with L the sample's own length (one
    look at the first row for the common 1-D case)."""
    first = values[0]
    if not (getattr(first, "ndim", None) == 2 or (type(first) is list and first and type(first[0]) is list)):
        return False
    shapes = [np.shape(v) for v in values]
    return all(len(s) == 2 and s[0] <= 4 and s[1] == sequence_length(i) for s, i in zip(shapes, ids, strict=True))


def batched_rope(values: Sequence[Any], longest: int) -> torch.Tensor:
    """(axes, L) rows right-padded with 0 along L and batched as (axes, B, longest)."""
    rows = [torch.as_tensor(v) for v in values]
    return torch.stack([torch.nn.functional.pad(r, (0, longest - r.shape[1])) for r in rows], dim=1)
