"""Exact or loud under the HF Trainer: the refusals of `ODBTrainerMixin.compute_loss` (NOTE [ Exact loss under the
HF Trainer ] in trainer.py, NOTE [ Exact or loud ] in odb_core/steps/loss.py).

Each names whose loss it is (a `compute_loss` override, `compute_loss_func`, the model) and the fix. `override` is
the class below the mixin whose `compute_loss` runs under it (`trainer.compute_loss_below_odb`), None for the
Trainer's own.
"""

from __future__ import annotations

import torch
from transformers import Trainer

from odb_core.steps.loss import normalized_share
from odb_hf.arguments import ODBSetupError


def model_name(trainer: Trainer) -> str:
    """The class name of the trained model (the base model under PEFT)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return type(getattr(model, "get_base_model", lambda: model)()).__name__


def check_not_bypassed(trainer: Trainer, override: type | None, bypassed: tuple[type, ...]) -> None:
    """For a model without loss kwargs ODB computes the loss from the logits itself, so `override.compute_loss`
    would not run: refused unless the Trainer class declares it bypassed (`ODBTrainerTraits`)."""
    if override is None or override in bypassed:
        return
    raise ODBSetupError(f"{override.__name__}.compute_loss is overridden, but {model_name(trainer)}'s forward takes "
                        "no loss kwargs, so ODB computes the exact loss from the logits itself and "
                        f"{override.__name__}.compute_loss would not run: pass Trainer(..., "
                        "compute_loss_func=odb_hf.causal_lm_loss) to keep it, or remove the override")


def check_divided(trainer: Trainer, override: type | None, loss: torch.Tensor, normalizer: torch.Tensor) -> None:
    """During the first optimizer step: the loss must be divided by num_items_in_batch (its share of the loss
    within [0.5, 1.001]: auxiliary terms allowed)."""
    share = normalized_share(loss, normalizer)
    if 0.5 <= share <= 1.001:
        return
    if override is not None:
        whose, fix = f"{override.__name__}.compute_loss", ("divide the summed token loss by num_items_in_batch (as "
                                                           "Trainer.compute_loss does), or remove the override")
    elif trainer.compute_loss_func is not None:
        whose, fix = "compute_loss_func", "return the summed token loss divided by num_items_in_batch"
    else:
        name = model_name(trainer)
        whose, fix = f"{name}'s loss", (f"set {name}.accepts_loss_kwargs = False (ODB then computes the exact "
                                        "loss from the logits), or make its loss divide by num_items_in_batch")
    if share == 0.0 and loss.requires_grad:  # N is not in the loss's graph: divided by a number, or not at all
        untracked = (". If it does divide, but by num_items_in_batch.item(), float() or int(), divide by the "
                     "tensor itself: ODB checks the division through its gradient")
    else:
        untracked = ""
    raise ODBSetupError(f"{whose} is not divided by num_items_in_batch (share {share:.2f} of the loss, 1.00 "
                        "expected), e.g. a mean per micro-batch or per sequence: with ODB's variable batches the "
                        f"step's gradient would not be the per-token mean; {fix}{untracked}")
