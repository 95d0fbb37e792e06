"""Steps: what travels beside each yielded batch and what is derived from it. `StepInfo` / `ODBBatch`, the
gradient-accumulation window (optimizer steps released whole), the token-weighted loss, and the step metrics.
May import `odb_core.data`, `odb_core.planning`, `odb_core.settings`, torch; never `torch.distributed`."""
