"""What the engine reads off one processed sample: its cost facts, checked with errors that name the index.

NOTE [ Observed cost ]
A sample's cost is known only after the user's pipeline ran (tokenization, templates, truncation, image-token
expansion). The default cost length is `len(input_ids)`; vision patches are the rows of `pixel_values`, or the sum
of t*h*w over `image_grid_thw`, plus the same for a video's `pixel_values_videos` and `video_grid_thw`, and are
capped per group by `max_patches` (a row is one patch in Qwen2-VL's layout; in LLaVA's (images, 3, H, W) it is one
image, and in LLaVA-NeXT's (images, crops, 3, H, W) one image of all its crops). A user `length_fn(sample) -> int`
replaces the default length. Supervised tokens are those of the collated batch, `labels[..., 1:] != -100` (the
causal shift), so that whatever the collator does to labels is what is counted; a label-preserving collator's are
counted from the samples, to the same number (NOTE [ Label-preserving collators ] in collate.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from odb_core.data.sendable import Unsendable
from odb_core.planning.budget import Item, SampleError

IGNORE_INDEX = -100
LengthFn = Callable[[Mapping[str, Any]], int]


def sequence_length(value: Any) -> int | None:
    """Length of a 1-D token sequence given as a tensor, ndarray, list or tuple; None if it is not 1-D."""
    if type(value) is list:  # the common cases first: this runs per sample
        return len(value)
    if type(value) is torch.Tensor:
        shape = value.shape
        return shape[0] if len(shape) == 1 else None
    if isinstance(value, torch.Tensor | np.ndarray):
        shape = value.shape
        return int(shape[0]) if len(shape) == 1 else None
    if isinstance(value, list | tuple):
        return len(value)
    return None


def count_patches(sample: Mapping[str, Any]) -> int:
    """Vision patches of a sample, images and videos: for each, the `*_grid_thw` products if present, else rows of
    its pixels (summed over the images where they are a list or tuple of per-image arrays). Before, videos counted
    0, and `max_patches` did not bound them. Raises ValueError or TypeError where a field cannot say
    (`inspect_sample` names the sample)."""
    return _patches(sample, "image_grid_thw", "pixel_values") + _patches(sample, "video_grid_thw",
                                                                        "pixel_values_videos")


def _patches(sample: Mapping[str, Any], grid_key: str, pixels_key: str) -> int:
    grid = sample.get(grid_key)
    if grid is not None:
        try:
            grid = torch.as_tensor(grid)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{grid_key!r} must hold (t, h, w) integer triples; a {type(grid).__name__} "
                             f"cannot be read as one ({exc})") from exc
        if grid.numel() == 0:  # a text-only row of a mixed dataset ([] from HF datasets reads as float32)
            return 0
        if grid.is_floating_point() and grid.numel() % 3 == 0 and bool((grid == grid.round()).all()):
            grid = grid.long()  # whole numbers stored as floats (a table column cast to float): counted as before
        if grid.is_floating_point() or grid.is_complex() or grid.dtype == torch.bool or grid.numel() % 3:
            raise ValueError(f"{grid_key!r} must hold (t, h, w) integer triples, got {grid.dtype} of shape "
                             f"{tuple(grid.shape)}")
        rows = grid.reshape(-1, 3).tolist()  # a few triples: Python's arithmetic beats tiny tensor ops
        if any(size < 0 for row in rows for size in row):
            raise ValueError(f"{grid_key!r} has a negative size")
        return sum(t * h * w for t, h, w in rows)
    pixels = sample.get(pixels_key)
    if pixels is None:
        return 0
    if isinstance(pixels, list | tuple):
        return sum(_rows(image, pixels_key) for image in pixels if getattr(image, "shape", None) is not None)  # others:
    return _rows(pixels, pixels_key)  # 0, as before (nested lists, PIL images, None)


def _rows(pixels: Any, key: str) -> int:
    shape = getattr(pixels, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) >= 1 else 0
    raise TypeError(f"{key!r} must be a tensor or array (or a list of them, one per image), got "
                    f"{type(pixels).__name__}, whose patches cannot be counted")


INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})  # one lookup, hot path


def non_integer(value: Any) -> str | None:
    """Why a 1-D token sequence is not integer ids (a float or other dtype, a non-int element), or None.

    Tensors and arrays are checked by dtype; a list is summed (one C loop, ~5 ns per token): any float element
    makes the sum a float, any non-number raises TypeError."""
    if isinstance(value, torch.Tensor):
        if value.dtype in INTEGER_DTYPES:
            return None
        return None if not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool) \
            else f"dtype {value.dtype}"
    if isinstance(value, np.ndarray):
        return None if value.dtype.kind in "iu" else f"dtype {value.dtype}"
    try:
        total = sum(value)
    except TypeError:
        return f"an element of type {next(type(v).__name__ for v in value if not isinstance(v, int | np.integer))}"
    return None if isinstance(total, int | np.integer) else f"a {type(total).__name__} element"


def _checked_length(index: int, key: str, value: Any) -> int:
    """Length of a 1-D sequence of integer token ids under `key`; raises `SampleError` otherwise (hot path: one
    shape and one dtype look for a tensor or array, one C-level sum for a list)."""
    kind = type(value)
    if kind is torch.Tensor:  # the common cases first, answered without the general path's calls
        shape = value.shape
        if len(shape) == 1 and value.dtype in INTEGER_DTYPES:
            return shape[0]
    elif kind is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu":
        return value.shape[0]
    n = sequence_length(value)
    if n is None:
        raise SampleError(index, _not_1d(key, value))
    wrong = non_integer(value)
    if wrong is not None:
        raise SampleError(index, _not_integer(key, wrong))
    return n


def _not_1d(key: str, value: Any) -> str:
    if key == "labels":
        return "'labels' must be a 1-D sequence like 'input_ids'"
    return ("'input_ids' must be a 1-D tensor, ndarray or list of token ids, got "
            f"{type(value).__name__} of shape {getattr(value, 'shape', '?')}")


def _not_integer(key: str, wrong: str) -> str:
    return (f"'{key}' must hold integer token ids, but it has {wrong}; convert it (e.g. torch.as_tensor(ids, "
            "dtype=torch.long)) after checking where the floats come from, instead of letting them be truncated")


def inspect_sample(index: int, sample: Any, length_fn: LengthFn | None) -> Item:
    """Check one sample and return its planning facts. Raises `SampleError` naming `index` and the cause.

    Hot path (once per sample read): a text sample whose ids are 1-D integer tensors and that has no vision field
    and no `length_fn` is answered inline, with one shape and one dtype look per field and no call into the
    general checks below, which give every other sample (and every error) its answer."""
    if type(sample) is not dict and not isinstance(sample, Mapping):
        if type(sample) is Unsendable:  # a worker could not send it (NOTE [ Samples that cannot travel ])
            raise SampleError(index, sample.cause)
        raise SampleError(index, f"expected a mapping with 'input_ids', got {type(sample).__name__}")
    ids, labels = sample.get("input_ids"), sample.get("labels", _ABSENT)
    if (type(ids) is torch.Tensor and length_fn is None and (labels is _ABSENT or type(labels) is torch.Tensor)
            and sample.get("image_grid_thw") is None and sample.get("pixel_values") is None
            and sample.get("video_grid_thw") is None and sample.get("pixel_values_videos") is None):
        shape = ids.shape
        if (len(shape) == 1 and shape[0] > 0 and ids.dtype in INTEGER_DTYPES
                and (labels is _ABSENT or (labels.shape == shape and labels.dtype in INTEGER_DTYPES))):
            if len(sample) > (1 if labels is _ABSENT else 2):  # other fields: the aligned ones' lengths
                for key in _BESIDE_LABELS:
                    value = sample.get(key)
                    if value is not None and (type(value) is not torch.Tensor or value.shape != shape):
                        _check_aligned(index, sample, shape[0])  # another kind, or a length to name
                        break
            return _new_item(Item, (index, shape[0], 0, 0, False))
    if "input_ids" not in sample:
        raise SampleError(index, f"has no 'input_ids' (keys: {sorted(sample)})")
    n_input = _checked_length(index, "input_ids", sample["input_ids"])
    if n_input == 0:
        raise SampleError(index, "'input_ids' is empty")
    if "labels" in sample:
        _checked_length(index, "labels", sample["labels"])
    _check_aligned(index, sample, n_input)
    length = n_input
    if length_fn is not None:
        try:
            length = length_fn(sample)
        except Exception as exc:
            raise SampleError(index, f"length_fn raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(length, int | np.integer) or isinstance(length, bool) or length <= 0:
            raise SampleError(index, f"length_fn returned {length!r}; it must return a positive int")
    try:
        patches = count_patches(sample)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise SampleError(index, str(exc)) from exc
    return Item(index, int(length), patches)


ALIGNED_FIELDS = ("labels", "attention_mask", "position_ids", "token_type_ids", "mm_token_type_ids")
_BESIDE_LABELS = ALIGNED_FIELDS[1:]


def _check_aligned(index: int, sample: Mapping[str, Any], n_input: int) -> None:
    """NOTE [ Fields aligned with the ids ]
    `labels`, `attention_mask`, 1-D `position_ids`, `token_type_ids` and `mm_token_type_ids` hold one entry per
    token of `input_ids` (a causal LM shifts its labels itself). A row of another length is a pipeline's bug
    (labels built before image-token expansion or truncation, or shifted in advance): padded as it was, it trained
    on misaligned or missing targets without a word, or failed in the model with a shape error naming no sample.
    So it is a `SampleError` naming the field and both lengths. A field of two or more axes (multi-axis position
    ids) is left to the collator."""
    for key in ALIGNED_FIELDS:
        value = sample.get(key)
        if value is None:
            continue
        kind = type(value)
        if kind is torch.Tensor or kind is np.ndarray:  # the common cases: one shape look
            shape = value.shape
            n = shape[0] if len(shape) == 1 else None
        elif isinstance(value, list | tuple) and value and hasattr(value[0], "__len__"):  # per-axis rows
            continue
        else:
            n = sequence_length(value)
        if n is not None and n != n_input:
            raise SampleError(index, f"'{key}' has {n} entries but 'input_ids' has {n_input}; every sequence field "
                                     "holds one entry per token of 'input_ids' (build labels after truncation and "
                                     "image-token expansion; the model shifts them itself; an encoder-decoder "
                                     "model's labels are the decoder's, but ODB's loss and counts are a causal "
                                     "LM's)")


_ABSENT = object()
_new_item = tuple.__new__  # Item's fields in order, without the named tuple's Python-level __new__ (0.1 µs less)


ID_FIELDS = ("input_ids", "labels", "attention_mask", "position_ids", "token_type_ids", "mm_token_type_ids")
ID_KEYS = frozenset(ID_FIELDS)
_COMPACTED = {"odb": "ids compacted from a list"}
ID_DTYPE = np.dtype(np.int64, metadata=_COMPACTED)  # int64 (equal to it), marked: `restore_id_lists` knows them


def compact_ids(sample: Any, integer_keys: frozenset[str] = frozenset(), mark: bool = False) -> Any:
    """NOTE [ Compact buffered samples ]
    A window buffers thousands of samples; as Python lists of ints a token costs ~36 bytes, and the cyclic garbage
    collector walks every element of every buffered list whenever a collection runs (a plain DataLoader frees its
    batch before one triggers; ODB holds the window across many). Unless a `length_fn` that may need the lists
    reads the samples, the stream hands each 1-D list of integer ids under an `ID_FIELDS` key over as an int64
    ndarray instead: 8 bytes per token, nothing for the collector to walk, a memcpy when padded, and a cheaper
    pickle from worker processes. A `length_fn` that reads only lengths says so (`takes_id_arrays = True`, as
    LLaMA-Factory's `CollatorLength`). ODB's own `PadCollator` takes the arrays (`collate.takes_id_arrays`:
    also behind the HF Trainer's column remover), where the conversion costs what padding from the list cost
    before (one C pass). Any other collator (HF's `DataCollatorForSeq2Seq`, LLaMA-Factory's, TRL's, a user's
    function) gets lists again, the values the dataset gave, when it collates a step (`restore_id_lists`, in
    `Collation`; ~5 µs per 1,000 ids, far less than the collector's walks it saves): it sees what it saw before,
    while the window holds arrays. For it (`mark`) only lists of Python ints are compacted (`_only_ints`: a list
    of bools or of numpy integers would come back as ints, another tensor dtype), and the arrays' dtype is int64
    marked as made from a list (`ID_DTYPE`, numpy dtype metadata: equal to int64 everywhere, kept by pickling and
    copies), so that only what ODB compacted becomes a list again. Lists that are empty, nested or not all
    integers stay lists, so `inspect_sample` reports them exactly as before; the dataset's own dict is never
    modified (a new one is built). The new dict is built key by key rather than copied: a dict that holds only
    arrays, numbers and strings is then untracked by the collector, so a buffered sample adds nothing to what a
    full collection walks or to the count of promoted objects that triggers one (docs/benchmarks.md, "The
    loader's hot path"). Under `integer_keys` (columns whose Arrow schema holds integers, see
    `sources.integer_columns`) the per-element check is skipped: a float cannot be there, and a null makes the
    conversion fail, leaving the list to the checks."""
    if type(sample) is not dict:
        return sample
    arrays = {}
    for key, value in sample.items():  # a sample has few keys: cheaper than looking every ID_FIELDS key up
        if type(value) is list and key in ID_KEYS and value and (
                key in integer_keys or (_only_ints(value) if mark else non_integer(value) is None)):
            try:  # ~13 µs per 1,000 ids: less than np.array(value), which infers a dtype first
                arrays[key] = np.fromiter(value, dtype=ID_DTYPE if mark else np.int64, count=len(value))
            except (TypeError, ValueError, OverflowError):  # nested, or an id beyond int64: left to the checks
                continue
    return {key: arrays.get(key, value) for key, value in sample.items()} if arrays else sample


def _only_ints(value: list) -> bool:
    """Whether the list holds Python ints, which `restore_id_lists` gives back as they were: its sum is an `int`
    (a float or a numpy integer anywhere makes it another type; ~5 ns per element) and its ends are ints, not
    bools (a mask of bools; a bool among ints inside the list is not looked for)."""
    try:
        total = sum(value)
    except TypeError:
        return False
    return type(total) is int and type(value[0]) is int and type(value[-1]) is int


def is_compacted(value: Any) -> bool:
    """Whether `value` is an id array that ODB made from a list (`compact_ids`, NOTE [ Arrow ids read as arrays ])."""
    return type(value) is np.ndarray and value.dtype.metadata == _COMPACTED


def restore_id_lists(sample: Any) -> Any:
    """The sample with each id array ODB made from a list a list again (Python ints, the values the dataset gave),
    for a collator that does not take arrays (NOTE [ Compact buffered samples ]); a new dict, or `sample` itself
    when it holds none."""
    if type(sample) is not dict:
        return sample
    restored = None
    for key, value in sample.items():
        if is_compacted(value):
            if restored is None:
                restored = dict(sample)
            restored[key] = value.tolist()
    return sample if restored is None else restored


def as_dummy(sample: Mapping[str, Any]) -> dict[str, Any]:
    """A zero-weight copy of a real sample: every label is -100, so it contributes no loss and no gradient."""
    dummy = dict(sample)
    reference = sample.get("labels", sample["input_ids"])
    if isinstance(reference, torch.Tensor):
        dummy["labels"] = torch.full_like(reference, IGNORE_INDEX, dtype=torch.long)
    elif isinstance(reference, np.ndarray):  # compacted ids stay marked, to become a list again as the ids do
        dtype = ID_DTYPE if is_compacted(reference) else np.int64
        dummy["labels"] = np.full(reference.shape, IGNORE_INDEX, dtype=dtype)
    else:
        dummy["labels"] = [IGNORE_INDEX] * len(reference)
    return dummy


def input_tokens(sample: Mapping[str, Any]) -> int:
    """Real (unpadded) input tokens of one sample."""
    return int(sequence_length(sample["input_ids"]) or 0)
