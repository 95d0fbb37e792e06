"""The DeepSpeed engine that `odb_deepspeed.initialize` returns with ODB on: the plain loop is exact, or loud.

NOTE [ The plain DeepSpeed loop under ODB ]
A plain loop backpropagates the model's own loss: `loss = engine(**batch).loss; engine.backward(loss)`. That loss
is a mean over the micro-batch's supervised tokens, so with ODB's variable batches the step's gradient would be
off by each micro-batch's token share (the issue measured 2.2e-2 relative in its set-up; with the uneven data of
tests/test_deepspeed_zero.py at W = 2, G = 2, global planning, 9.4e-2 before this mixin existed). So `initialize` mixes
`ODBEngineMixin` into the engine instance it built (its class becomes `ODB<EngineClass>`, as odb_hf does with a
Trainer; nothing else changes, and a passthrough `initialize` returns DeepSpeed's engine untouched):
  * Who, when: `DeepSpeedODBLoader` hands the engine every batch it yields (`serve`), before the loop sees it.
  * forward: the first forward with that batch's `labels` (same shape; the loop may have copied the batch to the
    device) returns the token-weighted loss l = sum_CE * G * W / N (NOTE [ Loss scaling under DeepSpeed ] in
    loss.py) as `output.loss`: a model whose forward takes loss kwargs gets `num_items_in_batch = N / (G * W)` (no
    extra work), any other model is called as usual and `output["loss"]` is replaced by l computed from its logits.
    During the first optimizer step the loss is also checked against l from the logits (`weighting_error`): a
    model that takes loss kwargs but ignores `num_items_in_batch` raises, with the fix, instead of training wrong.
  * backward: the loss of a served batch must be that `output.loss`, or one the loop weighted itself
    (`token_weighted_loss`, or a loss times `loss_scale(batch.info, engine)`, which mark the batch). Anything
    else (a mean the loop computed, `output.loss * 2`) raises before DeepSpeed runs, naming the one-line fix; so
    does `scale_wrt_gas=False` (l already holds the factor G that DeepSpeed's default division cancels).
A backward with no served batch pending (the loop's own extra passes) goes to DeepSpeed unchecked. A served batch
that reaches no `engine.backward` (the loop called `loss.backward()` on the tensor, which DeepSpeed also accepts,
or skipped the batch) raises when the loop asks for the next batch, or at the end of the epoch.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from odb_core import ODBBatch, StepInfo
from odb_core.steps.loss import causal_lm_loss_sum, weighting_error
from odb_deepspeed.loss import weighting_factor

CHECK_TOLERANCE = 1e-3  # relative; a wrong normalisation is off by a micro-batch's token share or by W
_UNCHECKED: set[type] = set()  # model classes whose fused loss was trusted unchecked (said once)
logger = logging.getLogger(__name__)


class ODBLossError(RuntimeError):
    """The loss handed to `engine.backward` would make the step inexact; the message names the fix."""


@dataclass(slots=True)
class ServedBatch:
    """The batch the ODB loader yielded last, until its backward."""

    info: StepInfo
    labels_shape: tuple[int, ...] | None
    weighted: weakref.ref | None = None  # the output.loss the engine weighted for it
    user_scaled: bool = False  # loss_scale / token_weighted_loss ran for it


def accepts_loss_kwargs(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward passes `num_items_in_batch` to its loss (the HF Trainer's rule)."""
    declared = getattr(module, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    return _takes_var_keywords(type(module).forward)


@functools.cache
def _takes_var_keywords(forward: Any) -> bool:
    """Whether a forward function takes **kwargs (looked up once per model class: this runs every micro-batch)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())


def router_aux_loss(module: torch.nn.Module, output: Mapping[str, Any]) -> torch.Tensor | None:
    """NOTE [ Router losses under DeepSpeed ]
    An HF mixture-of-experts model (Mixtral, Qwen2-MoE, OLMoE, ...) run with `output_router_logits=True` adds
    `router_aux_loss_coef * aux_loss` to its token loss: a per-micro-batch term, which DeepSpeed's reduction then
    averages over the micro-batches as it would without ODB. The first step's check compares the token part alone:
    before, the whole loss was compared, and the term read as a weighting error once a micro-batch's share of its
    window's tokens was small (1.7e-3 relative at a share 4 times below average, a review measured), with a fix
    that dropped the term. For a model ODB computes the loss of (no loss kwargs), the term is added back to the
    token-weighted loss. Returns the term, or None where the output has no `aux_loss` (or no coefficient is known:
    then the loss is checked whole)."""
    aux = output.get("aux_loss")
    config = getattr(getattr(module, "get_base_model", lambda: module)(), "config", None)
    coefficient = getattr(config, "router_aux_loss_coef", None)
    if aux is None or coefficient is None:
        return None
    return coefficient * aux


class ODBEngineMixin:
    """Put first in the MRO of a DeepSpeed engine by `mix_into` (see the NOTE above)."""

    odb_served: ServedBatch | None = None

    def odb_serve(self, batch: ODBBatch) -> None:
        labels = batch.get("labels")
        self.odb_served = ServedBatch(info=batch.info, labels_shape=tuple(labels.shape) if labels is not None else None)

    def odb_require_backward(self) -> None:
        """When the loop asks for the next batch: the one served before must have gone through `engine.backward`."""
        served, self.odb_served = self.odb_served, None
        if served is not None:
            raise ODBLossError(
                f"the batch ODB served before (epoch {served.info.epoch}, step {served.info.step}) reached no "
                "engine.backward: a loss.backward() on the tensor itself bypasses ODB's weighting check, and a "
                "skipped micro-batch leaves the step's token weights wrong. Call engine.backward(loss) once for "
                "every batch the loader yields, IDLE ones included")

    def odb_mark_scaled(self, info: StepInfo) -> None:
        if self.odb_served is not None and self.odb_served.info is info:
            self.odb_served.user_scaled = True

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        served, labels = self.odb_served, kwargs.get("labels")
        if served is None or served.weighted is not None or labels is None or tuple(labels.shape) != served.labels_shape:
            return super().forward(*inputs, **kwargs)
        own = accepts_loss_kwargs(self.module)
        if own:
            kwargs["num_items_in_batch"] = 1.0 / weighting_factor(served.info, self)
        output = super().forward(*inputs, **kwargs)
        if not isinstance(output, Mapping):
            raise ODBLossError(f"ODB weights the loss of a model output that is a dict or a ModelOutput, got "
                               f"{type(output).__name__}; or pass odb_deepspeed.token_weighted_loss(output, batch, "
                               "engine) to engine.backward")
        logits, aux = output.get("logits"), router_aux_loss(self.module, output)  # NOTE [ Router losses ... ]
        if own and output.get("loss") is not None:
            if logits is not None:
                self._odb_check(output["loss"] - (aux if aux is not None else 0), logits, labels, served.info)
            elif type(self.module) not in _UNCHECKED:  # a fused loss (no logits in training): nothing to check with
                _UNCHECKED.add(type(self.module))
                logger.warning("ODB: %s returned a loss without logits, so ODB cannot check that it divides the "
                               "summed token loss by num_items_in_batch; it is trusted to", type(self.module).__name__)
        elif logits is None:
            raise ODBLossError(f"{type(self.module).__name__}'s forward takes no num_items_in_batch and returned no "
                               "logits, so ODB cannot weight its loss: let it take loss kwargs, or return logits")
        else:
            output["loss"] = causal_lm_loss_sum(logits, labels) * weighting_factor(served.info, self)
            if aux is not None:
                output["loss"] = output["loss"] + aux
        served.weighted = weakref.ref(output["loss"])
        return output

    def _odb_check(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, info: StepInfo) -> None:
        if info.step >= self.gradient_accumulation_steps() or info.local_tokens == 0:
            return
        error = weighting_error(loss, logits, labels, weighting_factor(info, self))
        if error > CHECK_TOLERANCE:
            raise ODBLossError(f"{type(self.module).__name__}'s forward takes num_items_in_batch but its loss does "
                               f"not divide the summed token loss by it (off by {error:.1%} relative): set "
                               f"{type(self.module).__name__}.accepts_loss_kwargs = False (ODB then computes the "
                               "loss from the logits) or fix the model's loss")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        served, self.odb_served = self.odb_served, None
        if served is not None:
            weighted = served.weighted() if served.weighted is not None else None
            if not (served.user_scaled or loss is weighted):
                raise ODBLossError(
                    f"engine.backward got a loss that ODB did not weight for the batch it served (epoch "
                    f"{served.info.epoch}, step {served.info.step}); a per-micro-batch mean makes the step's gradient "
                    "inexact. Pass the engine's output loss unchanged (loss = engine(**batch).loss), or "
                    "odb_deepspeed.token_weighted_loss(output, batch, engine), or your summed token loss times "
                    "odb_deepspeed.loss_scale(batch.info, engine)")
            if not scale_wrt_gas:
                raise ODBLossError("engine.backward(loss, scale_wrt_gas=False): ODB's loss holds the factor G that "
                                   "DeepSpeed's default division by gradient_accumulation_steps cancels; drop "
                                   "scale_wrt_gas=False")
        return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)


@functools.cache
def _odb_class(base: type) -> type:
    return type(f"ODB{base.__name__}", (ODBEngineMixin, base), {"__module__": __name__})


def mix_into(engine: Any) -> Any:
    """Mix `ODBEngineMixin` into this engine instance (its class and other engines are untouched)."""
    engine.__class__ = _odb_class(type(engine))
    return engine
