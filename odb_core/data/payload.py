"""The bytes a buffered sample holds: what `max_buffer_bytes` counts (NOTE [ Round sizes ])."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from odb_core.data.sendable import SHARE_DEPTH, PackedTensor


def payload_bytes(sample: Any) -> int:
    """The bytes of a sample's payloads: tensors and arrays (packed or not) among a mapping's values, and the elements
    of a list or tuple value, a number or bool (Python's or numpy's) counting 8 bytes: what `max_buffer_bytes` counts
    (NOTE [ Round sizes ]). A list of ids weighs what the int64 array it may become weighs (`compact_ids`,
    NOTE [ Arrow ids read as arrays ]), so a sample measures the same read through the workers or re-read by index on
    resume. Text's ids weigh a few kB, a VLM sample's `pixel_values` megabytes; strings count nothing. Tensors and
    arrays in nested mappings (HF's `BatchFeature` under a key) and lists or tuples count too, as deep as
    `share_large` walks them (`SHARE_DEPTH` levels): before, they weighed nothing, and the byte bound admitted a
    window of such images. Numbers deeper than a top-level list still count nothing, as before, so a sample without
    nested tensors or arrays weighs what it did (a saved fill replays as it was)."""
    if not isinstance(sample, Mapping):
        return 0
    return _nested_bytes(sample.values(), SHARE_DEPTH, level=0)


def _nested_bytes(values: Iterable[Any], depth: int, level: int) -> int:
    """`level` 0: a sample's values; 1: the elements of a top-level list or tuple; 2: anything deeper. A number or
    bool weighs 8 bytes at levels 0 and 1 (a top-level list of Python numbers at once), nothing deeper, as
    before nested tensors counted; tensors and arrays weigh their bytes at every level."""
    total = 0
    for value in values:
        kind = type(value)
        if kind is torch.Tensor or kind is PackedTensor or kind is np.ndarray:  # the common cases first
            total += _array_bytes(value)
        elif isinstance(value, list | tuple):
            if level == 0 and value and _all_numbers(value):  # ids as a list: one pass in C
                total += 8 * len(value)
            elif depth > 1:
                total += _nested_bytes(value, depth - 1, 1 if level == 0 else 2)
        elif isinstance(value, Mapping):
            total += _nested_bytes(value.values(), depth - 1, 2) if depth > 1 else 0
        elif level <= 1 or not isinstance(value, _NUMBERS):
            total += _array_bytes(value)
    return total


_NUMBERS = (int, float, np.number, np.bool_)


_PYTHON_NUMBERS = frozenset({int, float, bool})


def _all_numbers(values: list | tuple) -> bool:
    """Whether every element is a Python int, float or bool, which `_array_bytes` weighs 8 bytes: the set of the
    element types, made in C. Anything else (numpy scalars, 0-d arrays, strings) takes the per-element path,
    which weighs each as before."""
    return type(values[0]) in _PYTHON_NUMBERS and set(map(type, values)) <= _PYTHON_NUMBERS


def _array_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if type(value) is PackedTensor:
        return value.array.nbytes
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, _NUMBERS):  # bools too: a list of them may become int64
        return 8  # a list of numpy integers is compacted into int64 like one of ints (resume re-reads the list)
    return 0
