"""One rank of a training loop that is killed and restarted, for tests/test_resume_kill.py and
tests/test_resume_streaming.py.

The loop consumes ODB batches for a few epochs. After each step it appends the step to a JSONL log, (with W > 1)
runs a barrier as DDP's gradient all-reduce would, and saves `{"g": steps so far, "loader": state_dict()}` to
`state.r{rank}.g{g}.json` atomically (write, then rename), keeping the last three. `die_at=g` SIGKILLs the process
at global step g, before or after that step's save. `resume="exact"` reloads this rank's own state,
`resume="merged"` every old rank's state through `merge_states` (elastic); both restart from the newest step that
every old rank saved (for an elastic resume, the newest at an optimizer-step boundary). Also runnable by hand:
`python tests/resume_worker.py --help`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from conftest import LengthDataset, lognormal_lengths  # noqa: E402
from odb_core import ODBDataLoader  # noqa: E402
from odb_core.resume.resume import merge_states  # noqa: E402

N_SAMPLES = 240
BUDGET = 1024


@dataclass(frozen=True)
class Job:
    """What one rank runs (picklable, so the test can start ranks in a forkserver)."""

    out: str
    rank: int
    world_size: int
    port: int
    data: str = "map"  # "map" (LengthDataset), "hf" (HF streaming split by node)
    join: bool = True
    epochs: int = 2
    accumulation_steps: int = 1
    run: str = "run"  # log name of this launch
    die_at: int | None = None
    die_before_save: bool = True
    resume: str | None = None  # None, "exact", "merged"
    old_world_size: int | None = None  # world size of the states to resume from (default: world_size)


class Tokens(torch.utils.data.IterableDataset):
    """A plain iterable of the LengthDataset samples `indices`, for uneven per-rank streams."""

    def __init__(self, indices: list[int]) -> None:
        self.inner, self.indices = LengthDataset(lognormal_lengths(N_SAMPLES, 1.0, 96, seed=7, hi=900)), indices

    def __iter__(self):
        for i in self.indices:
            yield {**self.inner[i], "idx": torch.tensor(i)}


def hf_rank_stream(rank: int, world_size: int, n: int = N_SAMPLES, num_shards: int = 8):
    """HF streaming data split by node, with ranks of uneven size (a filter drops a rank-dependent share)."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    lengths = lognormal_lengths(n, 1.0, 96, seed=9, hi=900)
    table = datasets.Dataset.from_dict({"input_ids": [[3 + (7 * k + i) % 90 for k in range(m)]
                                                      for i, m in enumerate(lengths)], "idx": list(range(n))})
    stream = table.to_iterable_dataset(num_shards=num_shards)
    drop = [0, 50, 20, 35]  # percent dropped from shard s by s % 4; split_dataset_by_node deals shards strided
    keep = [(i * 2654435761) % 100 >= drop[(i * num_shards // n) % 4] for i in range(n)]
    stream = stream.filter(lambda row: keep[row["idx"]]).with_format("torch")
    return split_dataset_by_node(stream, rank=rank, world_size=world_size)


def build_loader(job: Job, transport=None) -> ODBDataLoader:
    options = dict(token_budget=BUDGET, window=32, join=job.join, accumulation_steps=job.accumulation_steps,
                   prefetch_steps=2, seed=5, transport=transport)
    if job.data == "map":
        dataset = LengthDataset(lognormal_lengths(N_SAMPLES, 1.0, 96, seed=7, hi=900))
        return ODBDataLoader(dataset, shuffle=True, **options)
    if job.data == "hf":
        stream = hf_rank_stream(job.rank, job.world_size)
        return ODBDataLoader(stream, shard_iterable=False, **options)
    raise ValueError(job.data)


def record(g: int, batch) -> dict:
    i = batch.info
    return {"g": g, "epoch": i.epoch, "step": i.step, "indices": list(i.indices), "idle": i.is_idle,
            "window_tokens": i.window_tokens, "global_tokens": i.global_tokens, "global_samples": i.global_samples,
            "shape": list(batch["input_ids"].shape),
            "idx": batch["idx"].tolist() if "idx" in batch and not i.is_idle else None}


def common_step(out: Path, world_size: int, multiple_of: int = 1) -> int:
    """The newest step (a multiple of `multiple_of`) that every rank of the killed run saved."""
    saved = [{int(p.name.split(".g")[1].split(".")[0]) for p in out.glob(f"state.r{rank}.g*.json")}
             for rank in range(world_size)]
    common = set.intersection(*saved)
    return max((g for g in common if g % multiple_of == 0), default=0)


def load_state(job: Job, loader: ODBDataLoader, out: Path) -> int:
    old_world = job.old_world_size or job.world_size
    g = common_step(out, old_world, 1 if job.resume == "exact" else job.accumulation_steps)
    if g == 0:
        return 0
    saved = [json.loads((out / f"state.r{r}.g{g}.json").read_text()) for r in range(old_world)]
    if job.resume == "exact":
        loader.load_state_dict(saved[job.rank]["loader"])
    else:
        loader.load_state_dict(merge_states([s["loader"] for s in saved]))
    (out / f"resumed.{job.run}.json").write_text(json.dumps({"g": g}))
    return g


def save_state(out: Path, rank: int, g: int, loader: ODBDataLoader) -> None:
    path = out / f"state.r{rank}.g{g}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"g": g, "loader": loader.state_dict()}))
    os.replace(tmp, path)  # atomic: a kill leaves the old file or the new one, never half of one
    stale = out / f"state.r{rank}.g{g - 3}.json"
    if stale.exists():
        stale.unlink()


def main(job: Job) -> None:
    torch.set_num_threads(1)
    out = Path(job.out)
    if job.world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}", rank=job.rank,
                                world_size=job.world_size, timeout=timedelta(seconds=60))
    loader = build_loader(job)
    g = load_state(job, loader, out) if job.resume else 0
    with open(out / f"log.{job.run}.r{job.rank}.jsonl", "w") as log:
        while loader.epoch < job.epochs:
            for batch in loader:
                g += 1
                log.write(json.dumps(record(g, batch)) + "\n")
                log.flush()
                if job.world_size > 1:
                    dist.barrier()  # the lockstep DDP's gradient all-reduce imposes
                if g == job.die_at and job.die_before_save:
                    os.kill(os.getpid(), signal.SIGKILL)
                save_state(out, job.rank, g, loader)
                if g == job.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
    (out / f"done.{job.run}.r{job.rank}.json").write_text(json.dumps({"g": g, **asdict(job)}))
    loader.close()
    if job.world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind in (("out", str), ("rank", int), ("world_size", int), ("port", int), ("data", str),
                       ("epochs", int), ("accumulation_steps", int), ("run", str), ("die_at", int),
                       ("resume", str), ("old_world_size", int)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(Job, name, None),
                            required=name in ("out", "rank", "world_size", "port"))
    parser.add_argument("--non-join", action="store_true")
    parser.add_argument("--die-after-save", action="store_true")
    ns = vars(parser.parse_args())
    main(Job(join=not ns.pop("non_join"), die_before_save=not ns.pop("die_after_save"), **ns))
