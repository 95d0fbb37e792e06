"""odb_deepspeed: DeepSpeed adapter for ODB, switched on by an `odb` section in the DeepSpeed config.

    engine, optimizer, loader, _ = odb_deepspeed.initialize(model=model, optimizer=optimizer,
                                                            training_data=dataset, config="zero2_odb.json")
    for batch in loader:                      # ODBBatch: model-ready, with .info (StepInfo)
        loss = engine(**batch).loss           # with ODB on: the token-weighted loss of the step
        engine.backward(loss)
        engine.step()

The engine weights the model's own loss; `token_weighted_loss(output, batch, engine)` and `loss_scale(info, engine)`
are for losses you compute yourself. A loss ODB did not weight raises `ODBLossError`. See docs/guides/deepspeed.md.
Importing this package does not import deepspeed (only `initialize()` does).
"""

from odb_core.settings.ds_section import load_ds_config, parse_odb_section, without_odb_section
from odb_core.settings.settings import ODBSettings
from odb_deepspeed.accounting import ConsumedCounts, DeepSpeedODBLoader
from odb_deepspeed.engine_mixin import ODBLossError
from odb_deepspeed.initialize import initialize
from odb_deepspeed.loss import loss_scale, token_weighted_loss

__all__ = [
    "ConsumedCounts", "DeepSpeedODBLoader", "ODBLossError", "ODBSettings", "initialize", "load_ds_config", "loss_scale",
    "parse_odb_section", "token_weighted_loss", "without_odb_section",
]
