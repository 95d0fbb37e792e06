"""The Trainer-log meter's moved-sample figures: per log, consistent across threads, no spike after a resume."""

from __future__ import annotations

from dataclasses import replace

from odb_core.config import ODBConfig
from odb_core.metrics import LoaderMetrics, StepMeter


def test_moves_are_reported_per_log_from_whole_rounds_and_not_as_a_restored_total():
    metrics = LoaderMetrics(token_budget=100, world_size=2)
    metrics.restore({"moved_samples": 500, "moved_bytes": 80_000_000, "local_samples": 1000})  # a resumed run
    meter = StepMeter(ODBConfig(token_budget=100), metrics)
    metrics.moved_samples, metrics.moved_bytes = 505, 80_000_100  # a round's moves, its samples not yet staged
    assert meter.flush()["odb/moved_bytes"] == 0.0  # not visible before the round is published whole
    metrics.counts = replace(metrics.counts, local_samples=1010)
    metrics.publish_moves()
    logs = meter.flush()
    assert logs["odb/moved_fraction"] == 0.5 and logs["odb/moved_bytes"] == 100.0
    assert "moves" not in metrics.snapshot()  # derived, not part of a saved state
