"""Drives the reference release's grouping (`online-dynamic-batching`, package `odb`) on W virtual ranks.

Runs inside benchmarks/.venv-ref only (see setup_ref_env.sh), as `python -m benchmarks.reference.ref_driver` with
the repository root as working directory: `comparison/reference_peer.py` (and `reference_release.py --validate`)
launch it so, with JSON on stdin, and read JSON from stdout. .venv-ref has the release (package `odb`) and torch
but not odb's packages, so this module imports only the standard library, torch and the release, and the package
inits on its way are standard-library only (benchmarks/__init__.py NOTE [ Standard-library package inits ]).

Nothing of the release is copied here: its own `odb.grouping.grouping_data` forms and aligns the groups; this file
only feeds it, the way its collate process does (`odb/collate.py`):

  * each rank reads its stream one sample at a time; a round runs when the rank has read
    int(buffer_size x warm-up) new samples since the last one, the warm-up factor starting at 0 and growing by
    0.05 per round up to 1 (the release's default `no_warmup=False`);
  * `grouping_data(..., idx_budget=<new samples this round>, max_groups=buffer_size, join_mode=True at W > 1)`;
    its overflow goes back to the buffer; unless the round is skipped (then the new positions carry over to the
    next round's budget), the returned groups are shuffled with the collate process's
    `random.Random(seed)` and emitted as steps, at most one per new sample of the round (the rest are IDLE, which
    the release's iterator skips, so they are not steps);
  * at the end of the stream: a round with the unsent samples, then rounds with `is_finished=True` until the
    release reports every rank finished.
Default settings mean the release's defaults: buffer_size = prefetch_factor x num_workers = 2 x 4 = 8
(`ODBDataLoader` raises num_workers=0 to 4). W > 1 ranks are threads; the release's
`torch.distributed` calls (`get_world_size`, `get_rank`, `all_gather_into_tensor`) are answered by a thread
barrier instead of Gloo, so the same integers are exchanged. `--validate` checks this driver against the
release's real `ODBDataLoader` (worker processes + collate process) at W = 1.

stdin (`--serve`: one such request per line, one answer per line):
       {"lengths": [...], "streams": [[index, ...] per rank], "token_budget": L, "buffer_size": B or null,
        "seed": 67108, "patches": [...] (optional), "max_patches": P (optional, 0 = off, the release's default)}
With "patches", each sample carries `odb_n_patches` (the field the release reads its vision-patch count from) and
`grouping_data` gets `max_patches`, so that the release enforces its own patch cap.
stdout: {"steps": [[[index, ...] per step] per rank], "rounds": n, "gathered_ints_per_round": k, "seconds": t}
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

import torch

import odb
import odb.grouping as ref_grouping

DEFAULT_BUFFER = 2 * 4  # prefetch_factor x num_workers, the release's defaults
FIRST_SEED = 67108  # the release's first-iterator seed


class VirtualGroup:
    """Rank `rank` of W threads: answers the release's three torch.distributed calls."""

    def __init__(self, barrier: threading.Barrier, slots: list, rank: int) -> None:
        self.barrier, self.slots, self.rank = barrier, slots, rank


class DistShim:
    """Stands in for `torch.distributed` inside `odb.grouping` (only the calls it makes with a group)."""

    @staticmethod
    def get_world_size(group: VirtualGroup) -> int:
        return len(group.slots)

    @staticmethod
    def get_rank(group: VirtualGroup) -> int:
        return group.rank

    @staticmethod
    def all_gather_into_tensor(out: torch.Tensor, local: torch.Tensor, group: VirtualGroup) -> None:
        group.barrier.wait()
        group.slots[group.rank] = local.clone()
        group.barrier.wait()
        out.copy_(torch.cat(group.slots))
        group.barrier.wait()


def sample(index: int, length: int, patches: int = 0) -> dict:
    # a zero-stride tensor: the release reads only input_ids' length (and odb_n_patches, when given)
    out = {"input_ids": torch.zeros(1, dtype=torch.uint8).expand(length), "idx": index}
    if patches:
        out["odb_n_patches"] = patches
    return out


class RankFeeder:
    """One rank's side of the release's collate loop (see the module docstring)."""

    def __init__(self, stream: list[int], lengths: list[int], budget: int, buffer_size: int,
                 group: VirtualGroup | None, seed: int, patches: list[int] | None = None, max_patches: int = 0) -> None:
        self.stream, self.lengths, self.budget, self.buffer_size = stream, lengths, budget, buffer_size
        self.patches, self.max_patches = patches or [0] * len(lengths), max_patches
        self.group, self.rng, self.seed = group, random.Random(seed), seed
        self.new: list[int] = []  # positions read since the last round (the release's idx_buffer)
        self.buffer: list[list[dict]] = []  # its data_buffer
        self.steps: list[list[int]] = []
        self.rounds = 0

    def round(self, finished: bool) -> bool:
        budget = len(self.new)
        groups, overflow, all_finished, skip = ref_grouping.grouping_data(
            self.buffer, self.budget, self.group, is_finished=finished, idx_budget=budget,
            join_mode=self.group is not None, max_groups=self.buffer_size, max_patches=self.max_patches,
            random_seed=self.seed, grouping_round=self.rounds)
        self.rounds += 1
        self.buffer = [[s] for s in overflow]
        if skip or (self.group is not None and finished and budget == 0):
            return all_finished  # the release keeps its unsent positions for the next round
        self.rng.shuffle(groups)
        self.steps.extend([s["idx"] for s in g] for g in groups[:budget] if g)
        self.new = []
        return all_finished

    def run(self) -> None:
        warmup = 0.0
        done = False
        for position, index in enumerate(self.stream):
            self.new.append(position)
            self.buffer.append([sample(index, self.lengths[index], self.patches[index])])
            if len(self.new) >= int(self.buffer_size * warmup):
                done = self.round(finished=False)
                warmup = min(1.0, warmup + 0.05)
                if done:
                    return
        while not done:
            if self.new:
                done = self.round(finished=False)
            if not done:
                done = self.round(finished=True)


def drive(request: dict) -> dict:
    lengths, streams = request["lengths"], request["streams"]
    buffer_size = request.get("buffer_size") or DEFAULT_BUFFER
    seed = request.get("seed", FIRST_SEED)
    world = len(streams)
    ref_grouping.dist = DistShim if world > 1 else ref_grouping.dist
    barrier, slots = threading.Barrier(world, timeout=300), [None] * world
    feeders = [RankFeeder(streams[r], lengths, request["token_budget"], buffer_size,
                          VirtualGroup(barrier, slots, r) if world > 1 else None, seed, request.get("patches"),
                          request.get("max_patches", 0)) for r in range(world)]
    start = time.perf_counter()
    errors: list[BaseException] = []

    def main(feeder: RankFeeder) -> None:
        try:
            feeder.run()
        except BaseException as exc:  # reported to the caller; the barrier is broken so peers stop too
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=main, args=(f,)) for f in feeders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {"steps": [f.steps for f in feeders], "rounds": max(f.rounds for f in feeders),
            "gathered_ints_per_round": (2 + buffer_size) if world > 1 else 0,
            "buffer_size": buffer_size, "version": odb.__version__,
            "seconds": time.perf_counter() - start}


class _Lengths(torch.utils.data.Dataset):
    def __init__(self, lengths: list[int], patches: list[int] | None = None) -> None:
        self.lengths, self.patches = lengths, patches or [0] * len(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        return sample(index, self.lengths[index], self.patches[index])


def _collate_ids(batch: list[dict]) -> dict:
    return {"input_ids": torch.ones(1), "ids": [s["idx"] for s in batch]}


def validate(lengths: list[int], budget: int, buffer_size: int | None, patches: list[int] | None = None,
             max_patches: int = 0) -> dict:
    """The release's real ODBDataLoader (W = 1) against this driver on the same stream, same buffer setting (and,
    with `patches`, the same per-sample patch counts and `max_patches`)."""
    loader = odb.ODBDataLoader(_Lengths(lengths, patches), token_budget=budget, collate_fn=_collate_ids,
                               buffer_size=buffer_size, max_patches=max_patches or None)
    real = sorted(sorted(batch["ids"]) for batch in loader)
    driven = drive({"lengths": lengths, "streams": [list(range(len(lengths)))], "token_budget": budget,
                    "buffer_size": buffer_size, "patches": patches, "max_patches": max_patches})
    ours = sorted(sorted(step) for step in driven["steps"][0])
    return {"identical": real == ours, "real_steps": len(real), "driver_steps": len(ours),
            "real_samples": sum(map(len, real)), "samples": len(lengths)}


def _gloo_rank(rank: int, port: int, lengths: list[int], budget: int, buffer_size: int | None, folder: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sampler = torch.utils.data.DistributedSampler(_Lengths(lengths), num_replicas=2, rank=rank, shuffle=False)
    loader = odb.ODBDataLoader(_Lengths(lengths), token_budget=budget, collate_fn=_collate_ids,
                               buffer_size=buffer_size, sampler=sampler, multiprocessing_context="fork")
    batches = [batch["ids"] for batch in loader]
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(batches, f)
    # The release's shutdown can hang or crash at exit (its collate process may still wait in a collective of
    # the other rank); the batches are saved, so leave without running it.
    os._exit(0)


def validate_two_ranks(lengths: list[int], budget: int, buffer_size: int | None) -> dict:
    """The release's real ODBDataLoader on 2 Gloo ranks (DistributedSampler, no shuffle) against this driver."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    assert len(lengths) % 2 == 0, "DistributedSampler pads odd sizes; use an even count"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_gloo_rank, args=(port, lengths, budget, buffer_size, folder), nprocs=2, join=True)
        real = [json.load(open(f"{folder}/rank{r}.json")) for r in range(2)]
    streams = [list(range(len(lengths)))[r::2] for r in range(2)]
    driven = drive({"lengths": lengths, "streams": streams, "token_budget": budget, "buffer_size": buffer_size})
    same = all(sorted(map(sorted, real[r])) == sorted(map(sorted, driven["steps"][r])) for r in range(2))
    return {"identical": same, "real_steps": [len(real[r]) for r in range(2)],
            "driver_steps": [len(driven["steps"][r]) for r in range(2)],
            "real_samples": [sum(map(len, real[r])) for r in range(2)],
            "driver_samples": [sum(map(len, driven["steps"][r])) for r in range(2)],
            "real_batches": real, "driver_batches": driven["steps"]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "--serve" in sys.argv:  # one JSON request per line, one JSON answer per line (saves a start per call)
        for line in sys.stdin:
            print(json.dumps(drive(json.loads(line))), flush=True)
        sys.exit(0)
    payload = json.load(sys.stdin)
    if "--validate-two-ranks" in sys.argv:
        result = validate_two_ranks(payload["lengths"], payload["token_budget"], payload.get("buffer_size"))
    elif "--validate" in sys.argv:
        result = validate(payload["lengths"], payload["token_budget"], payload.get("buffer_size"),
                          payload.get("patches"), payload.get("max_patches", 0))
    else:
        result = drive(payload)
    json.dump(result, sys.stdout)
