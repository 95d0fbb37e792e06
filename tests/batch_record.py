"""Recorded batch sequences: the real `ODBDataLoader` on fixed cases, reduced to one digest per case.

A refactor that must not change behaviour (same seed, world size, data and config give the same batches) is
checked against digests recorded before it (tests/test_recorded_batches.py). A digest covers, for every yielded
batch in order and on every rank: the full `StepInfo`, every key of the batch and every tensor's dtype, shape and
bytes; cases with a resume point also cover the saved states' continuation in a fresh loader, and the loader's
metrics counters at the end (without the metadata traffic, which is not a property of the batches). Ranks W > 1
run as threads over a `VirtualHub` (`run_virtual_ranks`: the loader's own collectives).

    python tests/batch_record.py            # print the digests of every case (to re-record after a deliberate change)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from conftest import LengthDataset, lognormal_lengths  # noqa: E402
from odb_core import ODBDataLoader, StepInfo, run_virtual_ranks  # noqa: E402
from odb_core.resume.resume import merge_states  # noqa: E402

DATA = LengthDataset(lognormal_lengths(260, cv=1.0, mean=96, seed=11, hi=900))
SMALL = LengthDataset(lognormal_lengths(37, cv=0.6, mean=60, seed=4, hi=400))


class LengthStream(torch.utils.data.IterableDataset):
    """An iterable over `LengthDataset` samples in index order."""

    def __init__(self, dataset: LengthDataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        return (self.dataset[i] for i in range(len(self.dataset)))


@dataclass(frozen=True)
class Case:
    """One recorded run (the W > 1 cases recorded before global planning existed name `planning="local"`).
    `stop` > 0: every rank saves its state after `stop` steps of epoch `stop_epoch`, and a
    fresh loader (at `resume_world` ranks from the merged states when it differs) continues from it."""

    world: int
    options: dict[str, Any]
    dataset: str = "data"
    epochs: int = 2
    stop: int = 0
    resume_world: int = 0
    merged: bool = False
    workers: int = 0
    loader_kw: dict[str, Any] = field(default_factory=dict)


CASES: dict[str, Case] = {
    "w1_padded_shuffle": Case(1, dict(token_budget=1024, window=64, shuffle=True, seed=3)),
    "w1_ga3_tokens": Case(1, dict(token_budget=900, cost="tokens", window=48, shuffle=True, seed=1,
                                  accumulation_steps=3)),
    "w1_workers2_inline": Case(1, dict(token_budget=1024, window=40, shuffle=True, prefetch_steps=0), workers=2),
    "w2_join": Case(2, dict(planning="local", token_budget=1024, window=48, shuffle=True, seed=7)),
    "w2_non_join_ga2": Case(2, dict(planning="local", token_budget=800, window=32, shuffle=True, join=False,
                                    accumulation_steps=2)),
    "w3_small_uneven": Case(3, dict(planning="local", token_budget=512, window=8, shuffle=False, max_batch_size=4),
                            dataset="small"),
    "w2_attention": Case(2, dict(planning="local", token_budget=2048, cost="attention", attention_alpha=0.002,
                                 window=64, shuffle=True, seed=2)),
    "w2_stream": Case(2, dict(planning="local", token_budget=1024, window=32), dataset="stream", epochs=1),
    "w2_resume_mid_round": Case(2, dict(planning="local", token_budget=1024, window=48, shuffle=True, seed=7), stop=5),
    "w2_resume_ga2": Case(2, dict(planning="local", token_budget=800, window=32, shuffle=True, accumulation_steps=2),
                          stop=7),
    "w2_resume_non_join": Case(2, dict(planning="local", token_budget=800, window=32, shuffle=True, join=False),
                               stop=4),
    "w2_resume_stream": Case(2, dict(planning="local", token_budget=1024, window=32), dataset="stream", epochs=1,
                             stop=6),
    "w2_merged_same_world": Case(2, dict(planning="local", token_budget=1024, window=48, shuffle=True), stop=6,
                                 merged=True),
    "w2_elastic_to_3": Case(2, dict(planning="local", token_budget=1024, window=48, shuffle=True), stop=6,
                            resume_world=3),
    "w3_elastic_to_1": Case(3, dict(planning="local", token_budget=1024, window=24, shuffle=True,
                                    accumulation_steps=2), stop=4, resume_world=1),
    # global planning (the default at W > 1), recorded when it landed
    "global_w2_join": Case(2, dict(token_budget=1024, window=48, shuffle=True, seed=7)),
    "global_w2_join_fetch": Case(2, dict(token_budget=1024, window=48, shuffle=True, seed=7, move="fetch")),
    "global_w3_non_join_ga2": Case(3, dict(token_budget=800, window=32, shuffle=True, join=False,
                                           accumulation_steps=2)),
    "global_w4_small_tokens": Case(4, dict(token_budget=512, cost="tokens", window=8, max_batch_size=4),
                                   dataset="small"),
    "global_w2_stream": Case(2, dict(token_budget=1024, window=32), dataset="stream", epochs=1),
    "global_w2_resume_mid_round": Case(2, dict(token_budget=1024, window=48, shuffle=True, seed=7), stop=5),
    "global_w3_resume_ga2_workers": Case(3, dict(token_budget=800, window=32, shuffle=True, accumulation_steps=2),
                                         stop=7, workers=1),
    "global_w2_resume_stream": Case(2, dict(token_budget=1024, window=32), dataset="stream", epochs=1, stop=6),
    "global_w2_elastic_to_3": Case(2, dict(token_budget=1024, window=48, shuffle=True), stop=6, resume_world=3),
}


def saved_before_round_sizes(case: Case) -> Case:
    """`case` with the settings of every state saved before `min_window` and `max_buffer_bytes` existed (the
    version-2 states of tests/data/v2_states.json): `LEGACY_FINGERPRINT` reads their config that way."""
    return dataclasses.replace(case, options={**case.options, "min_window": None, "max_buffer_bytes": None})


def _dataset(name: str) -> Any:
    return {"data": DATA, "small": SMALL, "stream": LengthStream(DATA)}[name]


def _hash_batch(h: Any, batch: Any) -> None:
    info: StepInfo = batch.info
    h.update(repr([(name, getattr(info, name)) for name in STEP_FIELDS]).encode())
    for key in sorted(batch):
        value = batch[key]
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.contiguous().numpy().tobytes())
        else:
            h.update(repr(value).encode())


STEP_FIELDS = ("epoch", "step", "round", "indices", "is_idle", "local_samples", "global_samples", "local_tokens",
               "global_tokens", "local_input_tokens", "global_input_tokens", "padded_tokens", "cost",
               "rank_imbalance", "window_tokens", "local_patches", "global_patches")  # StepInfo when recorded
COUNTERS = ("budget_utilization", "global_input_tokens", "global_patches", "global_samples", "global_supervised_tokens",
            "idle_steps", "local_input_tokens", "local_samples", "mean_rank_imbalance", "oversize_samples",
            "padded_tokens", "padding_ratio", "patch_budget", "patch_utilization", "pushed_back_groups", "rounds",
            "splits", "steps", "token_budget", "world_size")


def _counters(loader: ODBDataLoader) -> dict[str, Any]:
    """The loader's metrics that existed when the digests were recorded, without the transport's traffic and
    timing (not a property of the batches)."""
    summary = loader.metrics.summary()
    return {k: summary[k] for k in COUNTERS}


def _loader(case: Case, transport: Any) -> ODBDataLoader:
    return ODBDataLoader(_dataset(case.dataset), transport=transport, num_workers=case.workers,
                         **case.options, **case.loader_kw)


def _run_full(case: Case) -> list[str]:
    def rank_main(rank: int, transport: Any) -> str:
        h = hashlib.sha256()
        loader = _loader(case, transport)
        for _ in range(case.epochs):
            for batch in loader:
                _hash_batch(h, batch)
            report = loader.last_report
            h.update(repr((report.steps, report.rounds, sorted(report.not_emitted))).encode())
        h.update(json.dumps(_counters(loader), sort_keys=True).encode())
        loader.close()
        return h.hexdigest()
    return run_virtual_ranks(rank_main, case.world, timeout_s=120)


def _run_resumed(case: Case) -> list[str]:
    def stop(rank: int, transport: Any) -> dict:
        loader = _loader(case, transport)
        it = iter(loader)
        for _ in range(case.stop):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        return state
    states = run_virtual_ranks(stop, case.world, timeout_s=120)
    new_world = case.resume_world or case.world
    merged = merge_states(states) if (case.merged or new_world != case.world) else None

    def resume(rank: int, transport: Any) -> str:
        h = hashlib.sha256()
        loader = _loader(case, transport)
        loader.load_state_dict(merged if merged is not None else states[rank])
        for _ in range(case.epochs):
            for batch in loader:
                _hash_batch(h, batch)
        h.update(json.dumps(_counters(loader), sort_keys=True).encode())
        loader.close()
        return h.hexdigest()
    return run_virtual_ranks(resume, new_world, timeout_s=120)


def digest(name: str) -> str:
    """One sha256 over every rank's digest of the case."""
    case = CASES[name]
    per_rank = _run_resumed(case) if case.stop else _run_full(case)
    return hashlib.sha256("".join(per_rank).encode()).hexdigest()


if __name__ == "__main__":
    for case_name in CASES:
        print(f'    "{case_name}": "{digest(case_name)}",', flush=True)
