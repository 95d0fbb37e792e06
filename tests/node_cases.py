"""Two nodes of two ranks: the scenarios of tests/test_node_rounds.py, run on virtual ranks or as a real Gloo job.

    python tests/node_cases.py rank OUT_DIR   # one rank of the Gloo job; RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_*
                                              # from the environment, as torchrun sets them (started by `run_job`)
    python tests/node_cases.py rank OUT_DIR MERGED_STATE   # resume map-join from merged states, on this layout

Every scenario skews the shards across nodes: `map-*` in sample lengths (node 1 reads long samples) or in counts
(a sampler that gives node 0 most samples), `stream-*` in counts of per-rank streams. A rank runs the epoch,
saves its state after `save_after` steps, and replays the rest from that state on a new loader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import torch  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

from conftest import LengthDataset  # noqa: E402
from dist_cases import REPO_ROOT, _wait_all, child_env, free_port  # noqa: E402
from odb_core import Item, ODBConfig, ODBDataLoader  # noqa: E402

WORLD, NODE = 4, 2
SIZE = 240
STREAM_COUNTS = (100, 80, 40, 30)  # node 0 reads most of the stream
SAMPLER_BLOCKS = ((0, 80), (80, 140), (140, 165), (165, 180))  # node 0 reads most of the dataset
SAVE_AFTER = 3


def scenario_names() -> list[str]:
    return ["map-join", "map-non-join", "stream-join", "stream-non-join"]


def map_length(index: int) -> int:
    """Node 1 (ranks 2 and 3 under ODB's sharding, index % 4) reads samples four times longer."""
    return 10 + (index * 53) % 90 if index % WORLD < NODE else 100 + (index * 53) % 400


def stream_length(rank: int, k: int) -> int:
    return 8 + (k * 37 + rank * 101) % (120 if rank < NODE else 500)


def node_config(name: str, nproc_per_node: int | None = NODE, planning: str = "global") -> ODBConfig:
    return ODBConfig(token_budget=1024, window=32, min_window=16, join=name.endswith("-join") and "non" not in name,
                     nproc_per_node=nproc_per_node, seed=5, planning=planning)


class RankStream(IterableDataset):
    """One rank's own stream (`shard_iterable=False`): its k-th sample is tagged k x W + rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        for k in range(STREAM_COUNTS[self.rank]):
            n = stream_length(self.rank, k)
            yield {"input_ids": torch.arange(n) % 97 + 3, "labels": torch.arange(n) % 97 + 3}


def scenario_loader(name: str, rank: int, transport: Any, nproc_per_node: int | None = NODE,
                    planning: str = "global") -> ODBDataLoader:
    config = node_config(name, nproc_per_node, planning)
    if name.startswith("stream"):
        return ODBDataLoader(RankStream(rank), config=config, transport=transport, shard_iterable=False)
    sampler = None if name == "map-join" else list(range(*SAMPLER_BLOCKS[rank]))
    return ODBDataLoader(LengthDataset([map_length(i) for i in range(SIZE)]), config=config, transport=transport,
                         sampler=sampler)


def read_items(name: str, read: list[int]) -> list[Item]:
    """A rank's read indices as the planner's items, in reading order."""
    if name.startswith("stream"):
        return [Item(i, stream_length(i % WORLD, i // WORLD)) for i in read]
    return [Item(i, map_length(i)) for i in read]


def emitted(rank_record: dict[str, Any]) -> list[int]:
    return [i for step in rank_record["steps"] for i in step]


class Job:
    """One rank's scenario: the epoch, its state after `save_after` steps, the rest replayed from that state."""

    def __init__(self, name: str, rank: int, transport: Any, save_after: int | None,
                 nproc_per_node: int | None = NODE) -> None:
        self.name, self.rank, self.transport, self.save_after = name, rank, transport, save_after
        self.nproc_per_node = nproc_per_node

    def rank_epoch(self) -> dict[str, Any]:
        loader = scenario_loader(self.name, self.rank, self.transport, self.nproc_per_node)
        steps, state = [], None
        for batch in loader:
            steps.append(list(batch.info.indices))
            if len(steps) == self.save_after:
                state = loader.state_dict()
        m = loader.metrics
        record: dict[str, Any] = {
            "steps": steps, "not_emitted": list(loader.last_report.not_emitted), "read": self._read(loader),
            "metrics": {"rounds": m.rounds, "moved_samples": m.moved_samples, "moved_bytes": m.moved_bytes,
                        "sync_bytes": m.sync_bytes, "sync_seconds": m.sync_seconds}}
        loader.close()
        if state is not None:
            again = scenario_loader(self.name, self.rank, self.transport, self.nproc_per_node)
            again.load_state_dict(state)
            record.update(state=state, resumed=[list(batch.info.indices) for batch in again])
            again.close()
        return record

    def _read(self, loader: ODBDataLoader) -> list[int]:
        if self.name.startswith("stream"):
            return [k * WORLD + self.rank for k in range(STREAM_COUNTS[self.rank])]
        return [int(i) for i in loader.sampler]


# -- the Gloo job ---------------------------------------------------------------------------------------------------
def run_rank(out_dir: Path, merged: Path | None = None) -> None:
    """One process of the job, the layout from LOCAL_WORLD_SIZE (nproc_per_node=None): every scenario in turn, or
    with `merged` (every rank's map-join state, merged) the rest of that epoch resumed elastically."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    if merged is None:
        records = {name: Job(name, rank, None, SAVE_AFTER, nproc_per_node=None).rank_epoch()
                   for name in scenario_names()}
        records["leave"] = leave_and_go_on(rank)
    else:
        loader = scenario_loader("map-join", rank, None, nproc_per_node=None)
        loader.load_state_dict(json.loads(merged.read_text()))
        records = {"resumed": [list(batch.info.indices) for batch in loader], "nodes": loader.layout.n_nodes}
        loader.close()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


def leave_and_go_on(rank: int) -> list[int]:
    """Rank 2 (the first of the second node) leaves a map-join epoch after 2 steps; then every rank runs the next
    epoch (NOTE [ Leaving an epoch ]). Returns [steps taken in the left epoch, steps of the next one]."""
    loader = scenario_loader("map-join", rank, None, nproc_per_node=None)
    taken = 0
    for taken, _ in enumerate(loader, start=1):
        if rank == 2 and taken == 2:
            break
    steps = sum(1 for _ in loader)
    loader.close()
    return [taken, steps]


def run_job(tmp_dir: Path, timeout_s: float, per_node: int = NODE,
            merged: Path | None = None) -> dict[int, dict[str, Any]]:
    """Launch the 4 ranks with torchrun's variables for nodes of `per_node` ranks; their records by rank."""
    out_dir, port = tmp_dir / "out", free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    logs, procs = [tmp_dir / f"rank{r}.log" for r in range(WORLD)], []
    extra = [str(merged)] if merged is not None else []
    for rank, log in enumerate(logs):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(WORLD),
                        LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with log.open("wb") as sink:
            procs.append(subprocess.Popen([sys.executable, __file__, "rank", str(out_dir), *extra], env=env,
                                          cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    timed_out = _wait_all(procs, timeout_s)
    output = "\n".join(log.read_text(errors="replace") for log in logs)
    codes = [p.returncode for p in procs]
    assert not timed_out and codes == [0] * WORLD, f"job failed ({timed_out=}, {codes=}):\n{output[-6000:]}"
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)}


if __name__ == "__main__":
    if sys.argv[1:2] != ["rank"]:
        raise SystemExit(__doc__)
    run_rank(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
