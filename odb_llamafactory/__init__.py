"""odb_llamafactory: Online Dynamic Batching in LLaMA-Factory SFT, switched on from the YAML.

    odb: true
    odb_token_budget: 8192

    $ odb-llamafactory train cfg.yaml            # instead of: llamafactory-cli train cfg.yaml

Modules: `settings` (the odb* keys, read by the core's settings parser; imports odb_core only), `launcher` (the
command, torchrun relaunch, and the `train(config, callbacks=..., observer=...)` Python API), `workflow`
(LLaMA-Factory's run with odb_hf's ODB trainer; imports LLaMA-Factory). This adapter builds on odb_hf by design
(LLaMA-Factory trains with the HF Trainer): it uses odb_hf's public API only. See docs/guides/llamafactory.md.
"""

from odb_core.settings.settings import ODBSettings
from odb_llamafactory.settings import ALLOWED_KEYS, ODBConfigError, pop_odb_settings

__all__ = ["ALLOWED_KEYS", "ODBConfigError", "ODBSettings", "pop_odb_settings"]
