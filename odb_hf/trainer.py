"""`ODBTrainerMixin`: ODB inside a `transformers.Trainer`, through the Trainer's documented override points.

NOTE [ Exact loss under the HF Trainer ]
The Trainer's own token-weighted path is kept: `get_batch_samples` returns `num_items_in_batch`, the model (or
`compute_loss_func`) returns sum(token CE) / num_items_in_batch, `compute_loss` multiplies by the number of
processes when `average_tokens_across_devices`, `training_step` does not divide by G, and DDP averages over W.
ODB only changes where num_items_in_batch comes from: `StepInfo.window_tokens`, the step's supervised tokens over
all ranks and all G micro-batches, computed by the loader. So no per-step all-reduce runs (transformers#35387:
ranks with different step counts hang in it) and nothing is normalised twice. A model whose forward takes no
loss kwargs gets the same sum / N x W from `odb_core.steps.loss` here (times G, which `training_step` divides out).
IDLE micro-batches have no supervised token: they add exactly zero to the token loss (not a term the model adds
without labels, e.g. an MoE router's balance loss), and every rank still runs forward/backward.
Under DeepSpeed the same holds: `engine.backward(loss, scale_wrt_gas=False)` and its "mean" reduction over W.
Exact or loud (NOTE [ Exact or loud ] in odb_core/steps/loss.py): during the first optimizer step the loss that
`compute_loss` returns must be divided by num_items_in_batch (`normalized_share`, its micro-batches run eagerly
under `torch.compile`: a compiled backward frees its buffers and refuses the check's `retain_graph`; skipped under
DeepSpeed, whose output hooks would start a backward pass, and under FSDP, whose mixed precision casts the check's
float count to bf16 or fp16, rounded or infinite: there the count is the Trainer's int64 tensor from the first
step), and a `compute_loss` override that ODB's own path would bypass is refused (unless the class lists it in
`ODBTrainerTraits.bypassed_compute_loss`); each refusal (loss.py) names whose loss it is (an override,
`compute_loss_func`, the model) and the fix.

NOTE [ Steps of a target size under the HF Trainer ]
With `samples_per_step` (or `tokens_per_step`) an optimizer step holds a variable number k of micro-batches (the
same on every rank; NOTE [ Steps of a target size ] in odb_core/steps/accumulation.py), but the Trainer pulls a fixed
`gradient_accumulation_steps` items per update. So the Trainer runs with gradient_accumulation_steps=1 and each
item it pulls is one `StepWindow` (the k micro-batches of one optimizer step); `training_step` runs forward and
backward over them in order, under the accelerator's `no_sync` for all but the last (DDP/FSDP synchronise once),
and under DeepSpeed with the gradient-accumulation boundary only at the last (`sync_gradients`). Every
micro-batch's loss is divided by the same N = `window_tokens`, so the step's gradient is the exact token mean.

NOTE [ The samples a run trained ]
The Trainer's closing `train_samples_per_second` divides a sample count it derives from its own batch size: in a
step-based run (`max_steps > 0`), `max_steps x per_device_train_batch_size x gradient_accumulation_steps x W`,
which ODB's variable steps do not have (a 5-step run of 29 samples reported 40, at the default batch size of 8).
So where the run is ODB's, `log` puts in the samples its meter counted (every rank's, in the micro-batches this
`train()` took) over the same `train_runtime`, in the Trainer's dict itself, which `train()` also returns as
`TrainOutput.metrics`. An epoch-based run counted the dataset once per epoch, which ODB's count equals for whole
epochs; after a resume ODB counts this `train()`'s samples only, as the runtime does. Likewise
`train_steps_per_second`, which the Trainer divides `max_steps` into: under an estimated epoch length that is the
schedule's bound, not the steps run (a run of 4 steps reported 20), so it becomes the optimizer steps this
`train()` took (`global_step` less the step it began at) over the runtime.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import RemoveColumnsCollator

from odb_core.data.collate import is_label_preserving, takes_id_arrays
from odb_core.epoch.epoch_length import EpochView
from odb_core.steps.accumulation import StepWindow, window_normalizer
from odb_core.steps.loss import TokenLossScale, causal_lm_loss_sum, logits_of
from odb_hf.arguments import ODBSetupError, check_collator_keeps_labels
from odb_hf.loss import check_divided, check_not_bypassed
from odb_hf.run import ODBRun, RunState

logger = logging.getLogger(__name__)


def _is_arrow_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


@dataclass(frozen=True, kw_only=True, slots=True)
class ODBTrainerTraits:
    """What a Trainer class tells ODB about itself: one class attribute, `odb_traits`, declared in its body.

        class MyTrainer(ODBTrainerMixin, Trainer):
            odb_traits = ODBTrainerTraits(owns_data=True, adapter="my framework")

    Args:
        owns_data: this class's own overrides of the data methods (`checks.OWNED_METHODS`) are ODB's. Read
            from the body of the class that defines the override (checks.py), never inherited: any other
            override is refused, since ODB builds the batches and would silently bypass it.
        bypassed_compute_loss: classes whose `compute_loss` ODB's own loss may skip, for a model without loss
            kwargs (NOTE [ Exact loss under the HF Trainer ]); any other skipped override is refused.
        adapter: who runs ODB, in the start line (`odb_core.settings.console`); None: "HF <Trainer class>".
    A subclass inherits its base's traits unless it declares its own (`dataclasses.replace(Base.odb_traits, ...)`).
    """

    owns_data: bool = False
    bypassed_compute_loss: tuple[type, ...] = ()
    adapter: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.owns_data, bool):
            raise ValueError(f"ODBTrainerTraits.owns_data={self.owns_data!r} is invalid: it must be True or False")
        bypassed = self.bypassed_compute_loss
        if not isinstance(bypassed, tuple) or not all(isinstance(c, type) for c in bypassed):
            raise ValueError(f"ODBTrainerTraits.bypassed_compute_loss={bypassed!r} is invalid: it must be a tuple of "
                             "Trainer classes")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise ValueError(f"ODBTrainerTraits.adapter={self.adapter!r} is invalid: it must be a name or None")


class ODBTrainerMixin:
    """Put first in the bases of a Trainer class (`class T(ODBTrainerMixin, SFTTrainer)`), with an `ODBCallback`.

    `ODBCallback` mixes this class in by itself; subclass it only to make the ODB trainer class explicit. ODB adds
    two names to a Trainer: `odb`, its `RunState` (run.py: the settings, the data position, the live `ODBRun`),
    and the class declaration `odb_traits`; every other method here overrides one of the Trainer's.
    """

    odb: RunState | None = None  # set on the instance when an ODBCallback attaches (attach.py)
    odb_traits = ODBTrainerTraits(owns_data=True)  # this class's get_train_dataloader is ODB's own

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        odb = _state(self)
        odb.start_train(self.args, resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            odb.close_run()  # NOTE [ A failed train() ends its loader ] in run.py
            raise
        finally:
            odb.end_train(self.args)

    def get_train_dataloader(self) -> EpochView:
        odb = _state(self)
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = self.train_dataset, self.data_collator
        if _is_arrow_dataset(dataset):  # the Trainer's own column handling, as in Trainer._get_dataloader
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = ColumnsRemoved.over(self._get_collator_with_removed_columns(collator, description="training"))
        check_collator_keeps_labels(collator, dataset)
        checks = 0 if self.is_deepspeed_enabled or self.is_fsdp_enabled else self.args.gradient_accumulation_steps
        return odb.new_run(self.args, dataset, collator, loss_checks=checks)

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device) -> tuple[list, torch.Tensor | None]:
        run = _live_run(self)
        if run is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = [batch for _, batch in zip(range(num_batches), epoch_iterator)]
        if not batches:
            return [], None
        windows = isinstance(batches[0], StepWindow)  # a step target: one item per optimizer step
        infos = list(batches[0].infos) if windows else [batch.info for batch in batches]
        if windows and len(batches) != 1:
            raise RuntimeError(f"with a step target the Trainer must pull one item per optimizer step, got "
                               f"{len(batches)}: set gradient_accumulation_steps=1")
        normalizer = window_normalizer(infos, None if windows else self.args.gradient_accumulation_steps)
        for info in infos:
            run.meter.add(info)
        if run.loss_checks_left:  # a leaf that records gradients: compute_loss checks the loss is divided by it
            return batches, torch.tensor(float(normalizer), device=device, requires_grad=True)
        return batches, torch.tensor(normalizer, device=device)

    def training_step(self, model: torch.nn.Module, inputs: Any,
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch, or the micro-batches of one `StepWindow` (NOTE [ Steps of a target size under the HF
        Trainer ]): the summed loss of the step, as the Trainer sums its micro-batches' losses."""
        if not isinstance(inputs, StepWindow):
            return super().training_step(model, inputs, num_items_in_batch)
        state, total = self.accelerator.gradient_state, None
        for k, batch in enumerate(inputs.batches):
            last = k == len(inputs.batches) - 1
            state._set_sync_gradients(last)  # DeepSpeed: the accumulation boundary (the Trainer sets it the same way)
            sync = contextlib.nullcontext() if last or self.is_deepspeed_enabled else self.accelerator.no_sync(model)
            with sync:
                loss = super().training_step(model, batch, num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def floating_point_ops(self, inputs: Any) -> int:
        if isinstance(inputs, StepWindow):
            return sum(super(ODBTrainerMixin, self).floating_point_ops(batch) for batch in inputs.batches)
        return super().floating_point_ops(inputs)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        run = _live_run(self)
        if run is None or not model.training or num_items_in_batch is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if "labels" not in inputs:
            raise ODBSetupError(f"a training batch has no 'labels' (keys {sorted(inputs)}); ODB's exact loss "
                                "needs them: use a collator that keeps or creates labels")
        if self.model_accepts_loss_kwargs or self.compute_loss_func is not None:
            if not run.take_loss_check():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with torch.compiler.set_stance("force_eager"):  # during the first optimizer step (see the NOTE)
                result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            check_divided(self, compute_loss_below_odb(type(self)), result[0] if return_outputs else result,
                          num_items_in_batch)
            return result
        check_not_bypassed(self, compute_loss_below_odb(type(self)), self.odb_traits.bypassed_compute_loss)
        run.take_loss_check()  # nothing to check here (ODB's own loss), but the count ends with the first step: before,
        # every step got the checks' float32 leaf, which rounds a count past 2^24 tokens (NOTE [ Exact or loud ])
        outputs = model(**{key: value for key, value in inputs.items() if key != "labels"})
        scale = TokenLossScale(window_tokens=int(num_items_in_batch), world_size=self.accelerator.num_processes,
                               micro_batch_divisor=self.current_gradient_accumulation_steps)
        loss = scale.apply(causal_lm_loss_sum(logits_of(outputs), inputs["labels"]))
        return (loss, outputs) if return_outputs else loss

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        run = _live_run(self)
        planned = run.view.plan.planned_steps if run is not None else None
        if planned is not None and self.lr_scheduler is None:
            logger.info(f"ODB: LR schedule over the estimated {planned} optimizer steps (the Trainer's "
                        f"{num_training_steps} assumes the epoch-length bound)")
            num_training_steps = planned
        return super().create_scheduler(num_training_steps, optimizer)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        run = _live_run(self)
        if run is not None and "loss" in logs:
            logs = {**logs, **run.meter.flush()}
        if run is not None and "train_samples_per_second" in logs and "train_runtime" in logs:
            runtime = max(logs["train_runtime"], 1e-9)  # NOTE [ The samples a run trained ]
            logs["train_samples_per_second"] = round(run.meter.seen.global_samples / runtime, 3)
            if "train_steps_per_second" in logs and run.first_step is not None:
                logs["train_steps_per_second"] = round((self.state.global_step - run.first_step) / runtime, 3)
        super().log(logs, *args, **kwargs)


class ODBTrainer(ODBTrainerMixin, Trainer):
    """A `transformers.Trainer` with ODB: `ODBTrainer(..., callbacks=[ODBCallback(token_budget=16384)])`."""


class ColumnsRemoved:
    """HF's `RemoveColumnsCollator` over a label-preserving collator (`PadCollator`), as one label-preserving
    collator. The Trainer wraps its collator so when the dataset is not an Arrow one; the wrapper removes only
    the columns the model's forward does not take, never `input_ids` or the label columns, so the batches keep
    `PadCollator`'s layout and ODB may count a step from its samples and collate it when it is taken (NOTE [ A
    step is collated when it is taken ] in odb_core/epoch/collation.py) and give the collator's reused memory back
    at the epoch's end (NOTE [ Reused collation memory ]). Hidden by the wrapper, a round's batches were all
    collated at plan time and held until taken, and the memory was kept."""

    preserves_labels = True

    def __init__(self, removing: RemoveColumnsCollator) -> None:
        self.removing = removing

    @staticmethod
    def over(collator: Any) -> Any:
        """`collator` as a `ColumnsRemoved` where it qualifies, else itself."""
        if (isinstance(collator, RemoveColumnsCollator) and is_label_preserving(collator.data_collator)
                and {"input_ids", "labels"} <= set(collator.signature_columns or ())):
            return ColumnsRemoved(collator)
        return collator

    @property
    def takes_id_arrays(self) -> bool:
        """Ids compacted into arrays (NOTE [ Compact buffered samples ]) reach `PadCollator` through the remover,
        which only drops keys."""
        return takes_id_arrays(self.removing.data_collator)

    def __call__(self, features: list[dict]) -> Any:
        return self.removing(features)

    def release_memory(self) -> None:
        release = getattr(self.removing.data_collator, "release_memory", None)
        if callable(release):
            release()


def _state(trainer: ODBTrainerMixin) -> RunState:
    if trainer.odb is None:
        raise ODBSetupError(f"{type(trainer).__name__} mixes in ODB but has no ODBCallback; pass "
                            "callbacks=[ODBCallback(token_budget=...)] to the Trainer")
    return trainer.odb


def _live_run(trainer: ODBTrainerMixin) -> ODBRun | None:
    return trainer.odb.run if trainer.odb is not None else None


def compute_loss_below_odb(trainer_class: type) -> type | None:
    """The class below ODBTrainerMixin whose `compute_loss` runs under it, or None for Trainer's own."""
    mro = trainer_class.__mro__
    owner = next(c for c in mro[mro.index(ODBTrainerMixin) + 1:] if "compute_loss" in vars(c))
    return None if owner is Trainer else owner
