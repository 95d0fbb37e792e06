"""Time to quality, MLPerf-style: the training seconds each method needs to reach Standard's final eval loss.

`time_to_quality` computes the figure from two eval curves; `eval_clock` builds the HF Trainer callback that
records those curves (training seconds with the evaluations excluded, samples seen, eval loss), and
`CountingCollator` pads like ODB's and counts the real and padded tokens a rank trains on. Used by `make demo`
(benchmarks/demo.py), the MM-Mix-like benchmark's ranks (workers/mm_train_worker.py), the MM-Mix-like benchmark
(mm_bench.py) and the GPU script's quality part (gpu/quality.py).
"""

from __future__ import annotations

import time


class CountingCollator:
    """Pads like ODB's PadCollator and counts the real and padded tokens this rank trains on."""

    def __init__(self) -> None:
        from odb_core import PadCollator

        self.pad, self.real, self.padded, self.batches = PadCollator(), 0, 0, 0
        self.counting = True  # off while the Trainer evaluates (it collates the eval split with the same collator)

    def __call__(self, samples):
        batch = self.pad(samples)
        if not self.counting:
            return batch
        self.real += int(batch["attention_mask"].sum())
        self.padded += batch["input_ids"].numel()
        self.batches += 1
        return batch


class EvalClock:
    """Training seconds (evaluation time excluded) and samples seen at every evaluation. A TrainerCallback: build it
    with `eval_clock` (the base class is added there, so that this module imports without transformers). Samples
    seen: ODB's exact global count with an `ODBCallback`, else the Trainer's epoch (exact for fixed batches). With
    a `CountingCollator`, its counting is paused while the Trainer evaluates."""

    def __init__(self, odb, n_train: int, collator: CountingCollator | None) -> None:
        self.odb, self.n_train, self.collator, self.points = odb, n_train, collator, []
        self.start = self.step_end = time.perf_counter()
        self.eval_seconds = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.step_end = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_end = time.perf_counter()
        if self.collator is not None:
            self.collator.counting = not control.should_evaluate  # DefaultFlowCallback decided before this runs

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        seconds = self.step_end - self.start - self.eval_seconds
        samples = (self.odb.run.meter.seen.global_samples if self.odb is not None
                   else round(state.epoch * self.n_train))
        self.points.append({"step": state.global_step, "seconds": seconds, "samples": samples,
                            "eval_loss": float(metrics["eval_loss"])})
        self.eval_seconds += time.perf_counter() - self.step_end
        if self.collator is not None:
            self.collator.counting = True


def eval_clock(odb, n_train: int, collator: CountingCollator | None = None) -> EvalClock:
    """An `EvalClock` that is a `transformers.TrainerCallback`."""
    from transformers import TrainerCallback

    return type("Clock", (EvalClock, TrainerCallback), {})(odb, n_train, collator)


def time_to_quality(rows: dict[str, dict]) -> dict:
    """MLPerf-style: the target is Standard's final eval loss; each method's training seconds (evaluation
    excluded) at its first evaluation at or below it (None: never reached), and the ratio."""
    target = rows["standard"]["eval_loss"]
    out: dict = {"target_eval_loss": target}
    for method, row in rows.items():
        reached = next((p for p in row["eval_curve"] if p["eval_loss"] <= target), None)
        out[method] = {"seconds_to_target": reached["seconds"] if reached else None,
                       "samples_to_target": reached["samples"] if reached else None,
                       "final_eval_loss": row["eval_loss"], "train_seconds": row["seconds"]}
    odb, std = out["odb"]["seconds_to_target"], out["standard"]["seconds_to_target"]
    out["speedup"] = std / odb if odb else None
    # the same figure at the worse of the two final losses, which both methods reach
    common = max(row["eval_loss"] for row in rows.values())
    seconds = {m: next(p["seconds"] for p in row["eval_curve"] if p["eval_loss"] <= common) for m, row in rows.items()}
    out["common_target"] = {"eval_loss": common, **{f"{m}_seconds": v for m, v in seconds.items()},
                            "speedup": seconds["standard"] / seconds["odb"]}
    return out
