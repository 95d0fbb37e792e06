"""Collation: the default padding collator and the checks applied to any user collator's output."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any, ClassVar

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

from odb_core.data.arenas import ArenaPool
from odb_core.data.sample import IGNORE_INDEX, INTEGER_DTYPES, sequence_length
from odb_core.data.vision_fields import CONCATENATED, batched_rope, rope_rows, vision_parts

CollateFn = Callable[[list[Any]], Any]
_IGNORE_INDEX = np.int64(IGNORE_INDEX)
SEQUENCE_PAD = {"input_ids": None, "labels": IGNORE_INDEX, "attention_mask": 0, "position_ids": 0,
                "token_type_ids": 0, "mm_token_type_ids": 0}


class CollateError(RuntimeError):
    """The collate function failed or returned something that is not a model-ready mapping."""


def _as_long(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(np.asarray(value), dtype=torch.long)


class FieldError(KeyError):
    """A field of one sample of a group that `PadCollator` cannot batch; `position` is the sample's place in the
    group, which `run_collate` turns into its dataset index."""

    def __init__(self, position: int, cause: str, sample: Any = None) -> None:
        super().__init__(cause)
        self.position, self.cause, self.sample = position, cause, sample

    def __str__(self) -> str:
        return self.cause


def _text_only_default(key: str, sample: Mapping[str, Any], position: int) -> torch.Tensor:
    if key == "mm_token_type_ids":
        return torch.zeros(len(sample["input_ids"]), dtype=torch.long)
    raise FieldError(position, f"field {key!r} is missing from it (present in other samples of the group)", sample)


class PadCollator:
    """Right-pads 1-D sequence fields to the group's longest sample and concatenates vision fields.

    `input_ids` is padded with `pad_token_id`, `labels` with -100, masks and position ids with 0; a missing
    `attention_mask` is created. Vision fields (`pixel_values`, `image_grid_thw`, video fields) are concatenated
    along dim 0 in sample order (NOTE [ Vision fields in a batch ] in vision_fields.py), so a group may mix
    text-only and image samples; a text-only sample's missing `mm_token_type_ids` are zeros (all text). Other
    fields must be in every sample and go through `torch.utils.data.default_collate`. It is label-preserving
    (NOTE [ Label-preserving collators ]); a subclass is not unless its own body says so (it may pad or mask its
    own way).
    """

    preserves_labels: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "preserves_labels" not in vars(cls):
            cls.preserves_labels = False

    def __init__(self, pad_token_id: int = 0) -> None:
        self.pad_token_id = pad_token_id
        self._arenas = ArenaPool()  # NOTE [ Reused collation memory ]

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        keys = list(dict.fromkeys(chain.from_iterable(samples)))  # every sample's keys, first seen first
        batch: dict[str, Any] = {}
        ids = [s["input_ids"] for s in samples]
        # equal-length tensors (hot path): stacked, no per-row lengths needed, unless a subclass pads its own way
        stacked = _stacked(ids) if type(self)._pad is PadCollator._pad else None
        if stacked is None:
            lengths = [sequence_length(v) for v in ids]
            longest = max(lengths)
        else:
            longest = stacked.shape[1]
        for key in keys:
            if key in CONCATENATED:  # NOTE [ Vision fields in a batch ] in vision_fields.py
                batch[key] = self._concatenated(vision_parts(key, [s[key] for s in samples if key in s]))
                continue
            if key == "input_ids":
                batch[key] = stacked if stacked is not None else self._pad_field(ids, longest, self.pad_token_id,
                                                                                  stack=False)
                continue
            values = [s[key] if key in s else _text_only_default(key, s, i) for i, s in enumerate(samples)]
            if key == "position_ids" and rope_rows(values, ids):  # Qwen2-VL's (3, L) rows: (3, B, L)
                batch[key] = batched_rope(values, longest)
            elif key in SEQUENCE_PAD:
                # ids not stacked (unequal lengths, or not tensors): the other fields skip the stack attempt, a
                # failed `torch.stack` costs ~15 µs; the padding path stacks equal-width rows of one dtype itself
                batch[key] = self._pad_field(values, longest, SEQUENCE_PAD[key], stack=stacked is not None)
            else:
                batch[key] = default_collate(values)
        if "attention_mask" not in batch:
            mask = (torch.ones(len(samples), longest, dtype=torch.long) if stacked is not None
                    else torch.from_numpy((np.arange(longest) < np.asarray(lengths)[:, None]).astype(np.int64)))
            device = batch["input_ids"].device  # the ids' device: a dataset that gives tensors on one
            batch["attention_mask"] = mask if device.type == "cpu" else mask.to(device)
        return batch

    def _concatenated(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The parts along dim 0, in memory reused across steps (NOTE [ Reused collation memory ])."""
        arenas = self.__dict__.get("_arenas")
        if arenas is None:  # a subclass that sets its own fields without calling this class's __init__
            arenas = self.__dict__.setdefault("_arenas", ArenaPool())
        return arenas.cat(parts)

    def release_memory(self) -> None:
        """Give back the concatenation memory no batch uses any more (NOTE [ Reused collation memory ])."""
        arenas = self.__dict__.get("_arenas")
        if arenas is not None:
            arenas.release()

    def _pad_field(self, values: list[Any], length: int, value: int, *, stack: bool) -> torch.Tensor:
        """`_pad`, or with this class's own padding and `stack=False`, the same without trying `torch.stack`."""
        if stack or type(self)._pad is not PadCollator._pad:
            return self._pad(values, length, value)
        return _pad_rows(values, length, value, stack=False)

    @staticmethod
    def _pad(values: list[Any], length: int, value: int) -> torch.Tensor:
        """Rows right-padded to `length` (or to the longest row, if a field is longer than `input_ids`) with
        `value`, as int64 unless the rows are tensors of another dtype (a subclass may pad its own way)."""
        return _pad_rows(values, length, value)


def _pad_rows(values: list[Any], length: int, value: int, *, stack: bool = True) -> torch.Tensor:
    """`PadCollator._pad`. Hot path: lists of ids and 1-D arrays/tensors are copied straight into one preallocated
    array (no tensor per row; equal-length tensors are stacked, unless `stack` is False because the caller knows
    the rows' lengths differ); anything else (rows of 2 or more axes, tensors numpy cannot view: grad, off the CPU)
    goes through `pad_sequence`, as before the fast paths existed."""
    if stack:
        stacked = _stacked(values)
        if stacked is not None and stacked.shape[1] >= length:
            return stacked
    kinds = {type(v) for v in values}  # lists, or int64 arrays (NOTE [ Compact buffered samples ]), or both
    if kinds <= {list, np.ndarray} and all(v.ndim == 1 and v.dtype == np.int64
                                           for v in values if type(v) is np.ndarray):
        try:
            return _rows_into_array(values, max(length, max(map(len, values))), value, np.int64)
        except (TypeError, ValueError):  # nested lists (e.g. multi-axis position ids): the general path
            pass
    rows = [_as_long(v) for v in values]
    if all(r.ndim == 1 for r in rows):
        width = max(length, max(r.shape[0] for r in rows))
        same_dtype = len({r.dtype for r in rows}) == 1
        if same_dtype and all(r.shape[0] == width for r in rows):
            return torch.stack(rows)
        try:
            arrays = [r.numpy() for r in rows]  # refuses tensors with grad, off the CPU, or numpy-less dtypes
        except (RuntimeError, TypeError):
            arrays = None
        if arrays is not None and same_dtype:
            return _rows_into_array(arrays, width, value, _holding(arrays[0].dtype, value))
    if not _fits(rows[0].dtype, value):  # -100 in uint8 labels: widen
        rows = [r.long() for r in rows]
    padded = pad_sequence(rows, batch_first=True, padding_value=value)
    if padded.ndim == 2 and padded.shape[1] < length:  # a 1-D field shorter than input_ids in every row (rows of
        # several axes are padded along their first, as `pad_sequence` does; their last is not the sequence's)
        padded = torch.nn.functional.pad(padded, (0, length - padded.shape[1]), value=value)
    return padded


def _stacked(values: list[Any]) -> torch.Tensor | None:
    """The rows stacked into one tensor if they are 1-D tensors of one shape, else None (the common case of a
    batch whose samples all have one length, answered with two shape looks in Python and the rest in C).

    `torch.stack` checks every row's shape itself and refuses a row that is not a tensor, so only the first and
    last rows are looked at first: a batch whose ends differ in length (most batches of unequal lengths; ODB's
    groups are sorted by length) never gets to the stack; ends of one length around a row of another cost one
    failed `stack` (~15 µs, against ~2 µs for reading every shape), which only happens when the group's order is not
    its ids' lengths (a `length_fn`). Rows of several dtypes are promoted by `stack`; the result is kept only when it
    has the first row's dtype, i.e. every row converted into it without loss, the values that the padding path
    (`pad_sequence`, which copies every row into the first row's dtype) gives. That path also refuses a pad value
    the dtype cannot hold, which a stack never needs: equal-length int8 and int16 ids with `pad_token_id=50256` are
    stacked, as int16 ids alone always were, where before this path they raised."""
    if not values:
        return None
    first, last = values[0], values[-1]
    if type(first) is not torch.Tensor or first.ndim != 1 or type(last) is not torch.Tensor \
            or first.shape != last.shape:
        return None
    try:
        out = torch.stack(values)
    except (RuntimeError, TypeError):  # a row of another length between the ends, or not a tensor
        return None
    return out if out.dtype == first.dtype else None


def _fits(dtype: torch.dtype, value: int) -> bool:
    """Whether an integer (or bool) `dtype` holds the pad value; other dtypes are left as they are."""
    if dtype == torch.bool:
        return value in (0, 1)
    try:
        info = torch.iinfo(dtype)
    except TypeError:
        return True
    return info.min <= value <= info.max


def _holding(dtype: np.dtype, value: int) -> np.dtype:
    """`dtype`, or int64 where an integer `dtype` cannot hold the pad value (uint8 labels padded with -100)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            return np.dtype(np.int64)
    return dtype


def _rows_into_array(rows: Sequence[Any], width: int, value: int, dtype: Any) -> torch.Tensor:
    """1-D rows (lists or arrays) copied into one array of `width` columns filled with `value`."""
    out = np.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def run_collate(collate_fn: CollateFn, samples: list[Any], indices: Sequence[int]) -> Mapping[str, Any]:
    """Call the collator and check that it returned a mapping; errors name the samples' dataset indices."""
    try:
        batch = collate_fn(samples)
    except FieldError as exc:  # PadCollator's, about one sample: named where it is known which of ours it is
        position = next((k for k, sample in enumerate(samples) if sample is exc.sample), None)
        if position is not None and position >= len(indices):  # one the collator added (an IDLE step has none)
            position = None
        if position is None and takes_id_arrays(collate_fn) and 0 <= exc.position < len(indices):
            position = exc.position  # PadCollator itself, or a wrapper over it that keeps the samples' order
        if position is None:  # a collator of the user's that reorders or builds its own samples around it
            raise CollateError(f"collate_fn raised FieldError on samples {list(indices)}: {exc.cause} (one of "
                               "the samples its collator built from these)") from exc
        raise CollateError(f"collate_fn could not batch sample {indices[position]} (of samples {list(indices)}): "
                           f"{exc.cause}") from exc
    except Exception as exc:
        raise CollateError(f"collate_fn raised {type(exc).__name__} on samples {list(indices)}: {exc}") from exc
    if not isinstance(batch, Mapping):
        raise CollateError(f"collate_fn returned {type(batch).__name__} for samples {list(indices)}; ODB needs a "
                           "mapping of model inputs (model(**batch)), e.g. a dict or BatchEncoding")
    return batch


def supervised_tokens(batch: Mapping[str, Any], samples: Sequence[Mapping[str, Any]]) -> int:
    """Supervised tokens the model will see: `labels[..., 1:] != -100` on the collated batch.

    Without `labels` in the batch, each sample counts `len(input_ids) - 1` (the collator-free causal LM case).
    """
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor):
        if labels.device.type == "cpu" and not labels.requires_grad:  # numpy is several times faster per call
            # the ufunc with an int64 scalar: `!=` with a Python int costs ~1 µs more per call, once per step
            return int(np.count_nonzero(np.not_equal(labels.numpy()[..., 1:], _IGNORE_INDEX)))
        return int((labels[..., 1:] != IGNORE_INDEX).sum())
    return sum(max(len(s["input_ids"]) - 1, 0) for s in samples)


def padded_tokens(batch: Mapping[str, Any], real_tokens: int) -> int:
    """Token slots the batch occupies (numel of `input_ids`), or the real tokens if it is not a tensor."""
    input_ids = batch.get("input_ids")
    return int(input_ids.numel()) if isinstance(input_ids, torch.Tensor) else real_tokens


def is_label_preserving(collate_fn: CollateFn) -> bool:
    """NOTE [ Label-preserving collators ]
    A collator whose `preserves_labels` attribute is `True` promises the layout of `PadCollator`'s batch in the
    two fields ODB counts: `labels` holds every sample's own labels right-padded with -100 (no `labels` when no
    sample has any), and `input_ids` every sample's ids right-padded to the group's longest. A step's supervised
    tokens (`supervised_tokens`) and padded tokens (`padded_tokens`) are then functions of its samples
    (`sample_supervised_tokens`, `sample_padded_tokens`; equal on every group, tests/test_collate_on_take.py), so
    a round counts its steps without collating them and collates each step when it is taken (NOTE [ A step is
    collated when it is taken ] in odb_core/epoch/collation.py). `PadCollator` declares it; a subclass does not
    inherit it (it may pad or mask its own way) unless its own body declares it; a wrapper that hands the
    samples to such a collator and returns its labels and ids untouched may forward it (an attribute or a
    property). Any other collator, and anything without the attribute (a function, HF's DataCollatorForSeq2Seq
    and LLaMA-Factory's collators, which may mask, shift or pad labels to a multiple), is not: its batches are
    counted on the batch itself. The adapters pass the framework's collator through; HF wraps it in its own
    RemoveColumnsCollator, which odb_hf forwards the promise through (`ColumnsRemoved`) when it wraps one that
    makes it. So only `PadCollator` and what a user declares count from the samples."""
    return getattr(collate_fn, "preserves_labels", False) is True


def takes_id_arrays(fn: Any) -> bool:
    """Whether `fn`, a collator or a `length_fn`, reads ids handed over as int64 arrays as it would the lists (NOTE
    [ Compact buffered samples ] in sample.py): `PadCollator` itself (a subclass may read the lists its own way), or
    a callable whose `takes_id_arrays` attribute is `True` (odb_hf's wrapper of HF's column remover over a
    `PadCollator`, LLaMA-Factory's padded length)."""
    return type(fn) is PadCollator or getattr(fn, "takes_id_arrays", False) is True


def sample_supervised_tokens(samples: Sequence[Mapping[str, Any]]) -> int:
    """`supervised_tokens` of a label-preserving collator's batch of `samples`, without the batch: each sample's
    `labels[1:] != -100` (padding is -100), or `len(input_ids) - 1` each when no sample has labels. A sample
    without labels among samples with labels counts nothing: `PadCollator` refuses that group when it collates.

    Hot path (once per step): equal-length tensor rows are stacked and counted as a batch is, other tensor or
    array rows are joined end to end and counted at once, less each row's first label (~9 and ~11 µs for 16 rows
    of 64 tokens, against ~4 for counting the collated batch; counted row by row, ~50)."""
    rows = [s["labels"] for s in samples if "labels" in s]
    if not rows:
        return sum(max(len(s["input_ids"]) - 1, 0) for s in samples)
    stacked = _stacked(rows)
    if stacked is not None:
        return supervised_tokens({"labels": stacked}, ())
    flat = _joined(rows)
    if flat is None:  # lists, or rows of several kinds
        return sum(_supervised_in_row(row) for row in rows)
    supervised = np.not_equal(flat, _IGNORE_INDEX)
    lengths = np.fromiter([row.shape[0] for row in rows], dtype=np.int64, count=len(rows))
    starts = (np.cumsum(lengths) - lengths)[lengths > 0]  # each non-empty row's first label, not shifted in
    return int(np.count_nonzero(supervised)) - int(np.count_nonzero(supervised[starts]))


def _joined(rows: list[Any]) -> np.ndarray | None:
    """The rows end to end as one array, if they are all arrays or all tensors numpy can view (CPU, no grad)."""
    kind = type(rows[0])
    if kind is np.ndarray:
        return np.concatenate(rows) if all(type(row) is np.ndarray for row in rows) else None
    if kind is not torch.Tensor:
        return None
    try:
        flat = torch.cat(rows)
    except (RuntimeError, TypeError):  # not all tensors, or on several devices
        return None
    return flat.numpy() if flat.is_cpu and not flat.requires_grad and flat.dtype in INTEGER_DTYPES else None


def _supervised_in_row(labels: Any) -> int:
    """`labels[1:] != -100` of one 1-D row: a list by `list.count` (in C), anything else by torch or numpy."""
    if type(labels) is list or type(labels) is tuple:
        n = len(labels)
        return n - 1 - labels.count(IGNORE_INDEX) + int(labels[0] == IGNORE_INDEX) if n else 0
    if isinstance(labels, torch.Tensor):
        return int((labels[1:] != IGNORE_INDEX).sum())
    return int(np.count_nonzero(np.not_equal(np.asarray(labels)[1:], _IGNORE_INDEX)))


def sample_padded_tokens(input_lengths: Sequence[int]) -> int:
    """`padded_tokens` of a label-preserving collator's batch, from its samples' input lengths: rows x longest."""
    return len(input_lengths) * max(input_lengths)
