"""One rank of the streaming scenarios behind tests/test_resume_streaming.py (gloo, W ranks).

Two streams whose ranks run dry at different times, one epoch each, join mode:
  * "hf": HF datasets streaming split by node (`to_iterable_dataset(num_shards=8)` + a shard-dependent filter,
    then `split_dataset_by_node`), loaded with shard_iterable=False;
  * "torch": a plain `IterableDataset` per rank with a rank-dependent share of the samples (shard_iterable=False).
For "hf" it also stops after `stop` steps, saves the state through JSON, and resumes it in a new loader
(replaying this rank's stream from its start, see docs/guarantees_resume.md). Results go to `out/stream.r{rank}.json`.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from resume_worker import BUDGET, N_SAMPLES, Tokens, hf_rank_stream  # noqa: E402


def _rows(batches) -> list[dict]:
    return [{"step": b.info.step, "idle": b.info.is_idle, "indices": list(b.info.indices),
             "idx": [] if b.info.is_idle else b["idx"].tolist()} for b in batches]


def _loader(stream) -> ODBDataLoader:
    return ODBDataLoader(stream, token_budget=BUDGET, window=24, shard_iterable=False, prefetch_steps=2)


def hf_scenario(rank: int, world_size: int, stop: int) -> dict:
    stream = hf_rank_stream(rank, world_size)
    kept = [int(row["idx"]) for row in stream]  # what this rank's split holds
    full = _rows(_loader(stream))
    first = _loader(stream)
    it = iter(first)
    head = _rows(next(it) for _ in range(stop))
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = _loader(stream)
    resumed.load_state_dict(state)
    return {"full": full, "resumed": head + _rows(resumed), "kept": kept}


def torch_scenario(rank: int, world_size: int) -> dict:
    mine = [i for i in range(N_SAMPLES) if i % world_size == rank and (i * 7919) % 100 >= 20 * rank]  # uneven ranks
    loader = _loader(Tokens(mine))
    return {"full": _rows(loader), "kept": mine, "moved": loader.metrics.moved_samples}


def main(out: str, rank: int, world_size: int, port: int, stop: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        result = {"hf": hf_scenario(rank, world_size, stop), "torch": torch_scenario(rank, world_size)}
        (Path(out) / f"stream.r{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
