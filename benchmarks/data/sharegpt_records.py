"""ShareGPT V3's JSON file, record by record: the file is cut off mid-record, so it is parsed with
`json.JSONDecoder().raw_decode` and the truncated tail is dropped.

Read in both environments: by `real_lengths` in .venv and by `sharegpt_qwen` inside benchmarks/.venv-ref, which
has none of odb's packages. Standard library only (benchmarks/__init__.py NOTE [ Standard-library package inits ]).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def records(path: Path) -> Iterator[dict]:
    """Complete records of the (truncated) top-level JSON list, one by one."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield record
