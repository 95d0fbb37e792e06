"""A DataLoader worker leaves the objects it inherited from its rank to the rank: its collector never visits them
(NOTE [ A worker leaves its rank's objects to the rank ] in odb_core/epoch/lifeline.py).

Through a real loader and its forked workers: 40,000 objects the collector tracks, which the rank holds when the
workers start, are already out of the worker's collections when the user's `worker_init_fn` runs, and stay out
after the worker's own full collections; the worker's collector stays on and still collects the cycles the worker
makes itself. Under spawn the worker freezes what it holds at its start too.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.data import Dataset

from odb_core import ODBDataLoader

pytestmark = pytest.mark.timeout(120)

INHERITED = 40_000
AT_INIT: list[tuple[int, int]] = []  # in each worker, set by the user's init: (freeze count, marked objects seen)


class Marked:
    """An object the collector tracks (an instance with a `__dict__`), which a worker's collection would list."""

    def __init__(self, number: int) -> None:
        self.number = number


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def marked_in_collections() -> int:
    """How many `Marked` objects this process's collector would visit."""
    return sum(1 for obj in gc.get_objects() if type(obj) is Marked)


class Probe(Dataset):
    """Each sample reports from its worker: what its user's init saw, the marked objects a full collection there
    still visits, whether the collector is on, and whether a cycle the worker made was collected."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict:
        cycle = _Cycle()
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        frozen_at_init, marked_at_init = AT_INIT[-1]
        return {"input_ids": torch.arange(3 + index % 4), "frozen_at_init": frozen_at_init,
                "marked_at_init": marked_at_init, "marked_now": marked_in_collections(),
                "collector_on": int(gc.isenabled()), "cycle_collected": int(gone() is None)}


def _user_init(worker_id: int) -> None:
    AT_INIT.append((gc.get_freeze_count(), marked_in_collections()))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_never_visits_what_it_inherited_and_still_collects_its_own_cycles(context):
    inherited = [Marked(i) for i in range(INHERITED)]
    assert gc.is_tracked(inherited[0]) and marked_in_collections() >= INHERITED  # what a worker would visit
    loader = ODBDataLoader(Probe(), token_budget=12, num_workers=2, multiprocessing_context=context,
                           worker_init_fn=_user_init)
    batches = list(loader)
    loader.close()
    assert sum(len(batch.info.indices) for batch in batches) == len(Probe())
    field = {key: torch.cat([batch[key] for batch in batches])
             for key in ("frozen_at_init", "marked_at_init", "marked_now", "collector_on", "cycle_collected")}
    assert field["collector_on"].eq(1).all(), "a worker's collector was turned off"
    assert field["cycle_collected"].eq(1).all(), "a cycle the worker made itself was not collected"
    # under fork the worker inherits the marked objects; under spawn it never has them
    assert field["marked_at_init"].eq(0).all(), "the user's init ran before the inherited objects were frozen"
    assert field["marked_now"].eq(0).all(), "a worker's full collection still visits inherited objects"
    if context == "fork":
        assert field["frozen_at_init"].ge(INHERITED).all(), field["frozen_at_init"]
    else:  # a spawned worker freezes its imports and the unpickled dataset
        assert field["frozen_at_init"].gt(0).all(), field["frozen_at_init"]
    assert len(inherited) == INHERITED  # held by the rank until the workers are done
